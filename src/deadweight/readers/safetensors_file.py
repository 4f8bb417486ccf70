"""Single `.safetensors` files: our own header parser, chunks read as windows of a read-only map.

We parse the header ourselves instead of using `safe_open` because the data is read in bounded
chunks (a whole-file `np.memmap` makes RSS grow to the file size: FACTS) and because a broken
file should produce one message listing every problem. Each chunk is a zero-copy window of a
read-only map whose pages are dropped from the process (MADV_DONTNEED) once the next chunk is
asked for, so resident memory stays at about one chunk.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np

from deadweight.readers.base import (
    DEFAULT_CHUNK_BYTES,
    ITEMSIZE,
    CheckpointError,
    ReaderBase,
    TensorEntry,
    elements_per_chunk,
    output_dtype,
    widen,
)

# Pages are dropped from the process in whole pieces of this size (see _drop): the size a
# page-table entry of the middle level maps on x86-64 and arm64 with 4 KB pages.
HUGE_PAGE = 2 << 20

# safetensors' dtype strings -> our canonical names.
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
# How each canonical dtype sits on disk (little-endian); 16/8-bit floats numpy lacks are read as
# same-width unsigned ints and widened.
RAW_DTYPES = {
    "float64": "<f8",
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "float8_e4m3fn": "u1",
    "float8_e5m2": "u1",
    "int64": "<i8",
    "int32": "<i4",
    "int16": "<i2",
    "int8": "i1",
    "uint64": "<u8",
    "uint32": "<u4",
    "uint16": "<u2",
    "uint8": "u1",
    "bool": "?",
}
# safetensors itself refuses headers over 100 MB; a larger length field means a corrupt or
# non-safetensors file, and reading it would allocate that much.
MAX_HEADER_BYTES = 100_000_000
_HEADER_LEN = struct.Struct("<Q")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header(
    path: str, file_size: int, head: bytes
) -> tuple[list[TensorEntry], dict[str, int], dict[str, Any]]:
    """Validate a header; return entries in file order, each entry's data start, and __metadata__.

    `head` is the file's first 8 bytes plus the header. Raises one CheckpointError with every
    problem found.
    """
    if file_size == 0:
        raise CheckpointError(path, "the file is empty (not a safetensors file)")
    if file_size < 8:
        raise CheckpointError(
            path,
            f"the file is {file_size} bytes, shorter than the 8-byte header length (truncated?)",
        )
    (header_len,) = _HEADER_LEN.unpack_from(head)
    if header_len > MAX_HEADER_BYTES:
        raise CheckpointError(
            path,
            f"header length {header_len} is over the 100 MB safetensors allows (corrupt, or not a safetensors file)",
        )
    if 8 + header_len > file_size:
        raise CheckpointError(
            path,
            f"header length {header_len} runs past the end of the {file_size}-byte file (truncated?)",
        )
    try:
        header = json.loads(
            head[8 : 8 + header_len].decode("utf-8"), object_pairs_hook=_reject_duplicates
        )
    except (
        ValueError,
        RecursionError,
    ) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(
            path, f"the header is not valid JSON ({exc}); not a safetensors file?"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(path, f"the header is a JSON {type(header).__name__}, not an object")

    data_size = file_size - 8 - header_len
    problems: list[str] = []
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict):
        problems.append("__metadata__ is not a JSON object")
        metadata = {}
    spans: list[tuple[int, int, str]] = []
    entries: list[tuple[int, TensorEntry]] = []
    for name, info in header.items():
        if not isinstance(info, dict):
            problems.append(f"{name}: entry is not an object")
            continue
        raw_dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dtype = SAFETENSORS_DTYPES.get(raw_dtype) if isinstance(raw_dtype, str) else None
        if dtype is None:
            problems.append(
                f"{name}: unknown dtype {raw_dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})"
            )
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            problems.append(f"{name}: shape {shape!r} is not a list of non-negative integers")
            shape = None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            problems.append(
                f"{name}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end"
            )
            offsets = None
        if dtype is None or shape is None or offsets is None:
            continue
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * ITEMSIZE[dtype]
        if end - begin != nbytes:
            problems.append(
                f"{name}: shape {shape} of {dtype} needs {nbytes} bytes but data_offsets {offsets} span {end - begin}"
            )
            continue
        if end > data_size:
            problems.append(
                f"{name}: data_offsets {offsets} run past the {data_size}-byte data section (truncated?)"
            )
            continue
        spans.append((begin, end, name))
        entries.append((begin, TensorEntry(name, tuple(shape), dtype, path, nbytes)))

    # safetensors requires the tensors to tile the data section exactly: no overlap, no gap.
    spans.sort()
    covered = 0
    previous = ""
    for begin, end, name in spans:
        if begin < covered:
            problems.append(f"{name}: bytes {begin}..{end} overlap {previous}")
        elif begin > covered:
            problems.append(
                f"bytes {covered}..{begin} of the data section are not covered by any tensor"
            )
        if end >= covered:
            covered, previous = end, name
    if not problems and covered != data_size:
        problems.append(
            f"bytes {covered}..{data_size} of the data section are not covered by any tensor (trailing data)"
        )
    if problems:
        raise CheckpointError.listing(path, problems)
    entries.sort(key=lambda item: item[0])
    starts = {entry.name: 8 + header_len + begin for begin, entry in entries}
    return [entry for _, entry in entries], starts, metadata


class SafetensorsFile(ReaderBase):
    """One `.safetensors` file; the header is validated in full before any data is read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.optimizer = None
        try:
            self._fh = open(path, "rb", buffering=0)  # noqa: SIM115 -- closed by close()
            self._mm: mmap.mmap | None = None
            self._base = 0  # the map's address
        except OSError as exc:
            raise CheckpointError(path, f"cannot open ({exc.strerror})") from None
        try:
            file_size = os.fstat(self._fh.fileno()).st_size
            head = self._fh.read(8) if file_size >= 8 else b""
            if len(head) == 8:
                (header_len,) = _HEADER_LEN.unpack_from(head)
                # Cap the read by the file size: the length field itself is untrusted.
                if header_len <= min(MAX_HEADER_BYTES, file_size - 8):
                    head += _read_exactly(self._fh, header_len, path)
            self._entries, self._starts, self.metadata = parse_header(path, file_size, head)
        except BaseException:
            self._fh.close()
            raise
        self._by_name = {e.name: e for e in self._entries}

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        per_chunk = min(elements_per_chunk(entry.dtype, max_bytes), entry.numel)
        raw_dtype = np.dtype(RAW_DTYPES[entry.dtype])
        # fp8 lookups and bf16 widening write into one reusable output buffer.
        out = (
            np.empty(per_chunk, dtype=output_dtype(entry.dtype))
            if (raw_dtype.itemsize == 1 and entry.is_float) or entry.dtype == "bfloat16"
            else None
        )
        for view in self.raw_chunks(entry, per_chunk):
            yield widen(view, entry.dtype, out)

    def raw_chunks(self, entry: TensorEntry, max_elements: int) -> Iterator[np.ndarray]:
        """Zero-copy windows of the map, in the stored dtype (bf16 as uint16 bits)."""
        if self._by_name.get(entry.name) != entry:
            raise KeyError(f"{entry.name} is not a tensor of {self.path}")
        raw_dtype = np.dtype(RAW_DTYPES[entry.dtype])
        per_chunk = min(max(1, max_elements), entry.numel)
        if per_chunk == 0:
            return
        mapped = self._mapping()
        position = self._starts[entry.name]
        remaining = entry.numel
        while remaining:
            n = min(per_chunk, remaining)
            end = position + n * raw_dtype.itemsize
            # A file cut short after it was opened would fault the map: check first.
            if end > len(mapped) or end > os.fstat(self._fh.fileno()).st_size:
                raise CheckpointError(
                    self.path, "the file ended early (did it change while being read?)"
                )
            try:
                # Zero-copy from the page cache: about 1.5x faster than readinto() a buffer.
                yield np.frombuffer(mapped, dtype=raw_dtype, count=n, offset=position)
            finally:
                # The consumer is done with the window, or stopped reading (a closed or
                # dropped generator): drop its pages from this process (they stay in the
                # page cache), so resident memory stays at one window per open read. The
                # huge page it starts in goes too (what came before it is read); the one it
                # ends in stays for the next window, which starts there.
                self._drop(position // HUGE_PAGE * HUGE_PAGE, end, whole=True)
            position = end
            remaining -= n

    def droppable(self, entry: TensorEntry, address: int, nbytes: int) -> tuple[int, int] | None:
        # Only the huge pages wholly inside the piece: its neighbours may still be read by
        # another thread. raw_chunks drops the rest of the chunk when it moves on. Dropping
        # as each piece is done, in parallel, took 15% of a two-thread scan off the main
        # thread.
        mapped = self._droppable_map() if nbytes >= HUGE_PAGE else None
        if mapped is None:
            return None  # too small to hold a whole huge page, or nothing to drop from
        start = address - self._base
        end = start + nbytes
        if start < 0 or end > len(mapped):
            return None  # not a view of this map (a copy)
        first, last = self._huge_span(start, end, whole=False)
        return (self._base + first, last - first) if last > first else None

    def _drop(self, start: int, end: int, *, whole: bool) -> None:
        """Drops the map's pages between offsets start and end from this process, in whole
        2 MB pieces of the address space (see _huge_span).

        A freshly written file sits in the page cache in 2 MB folios, which the kernel maps
        whole (one entry of the page table's middle level); dropping part of one splits that
        entry into 512 (a TLB shootdown across cores, then a fault for each 64 KB read after
        it). On a freshly written 2.15 GB bf16 file, one scan split 320-336 such entries
        when dropping page by page and none this way; its system time fell from 15-26 ms to
        14 ms. Elsewhere (4 KB pages) the rounding only delays a few pages to the next drop."""
        mapped = self._droppable_map()
        if mapped is None:
            return
        first, last = self._huge_span(start, end, whole=whole)
        if last > first:
            mapped.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _droppable_map(self) -> mmap.mmap | None:
        """The map, when it is open and can drop pages (madvise: not on Windows)."""
        mapped = self._mm
        if mapped is None or mapped.closed or not hasattr(mapped, "madvise"):
            return None
        return mapped

    def _huge_span(self, start: int, end: int, *, whole: bool) -> tuple[int, int]:
        """The offsets of the whole 2 MB pieces of the address space in [start, end) of the
        map: `end` rounded down to one, `start` down (`whole`: what precedes it is read) or
        up."""
        assert self._mm is not None
        base = self._base
        first = (base + start) // HUGE_PAGE * HUGE_PAGE
        if not whole and first < base + start:
            first += HUGE_PAGE
        last = min((base + end) // HUGE_PAGE * HUGE_PAGE - base, len(self._mm))
        return max(first - base, 0), last

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._base = np.frombuffer(self._mm, dtype=np.uint8, count=1).ctypes.data
        return self._mm

    def close(self) -> None:
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a caller holds a chunk: it keeps the map
                self._mm.close()
            self._mm = None
        self._fh.close()


def _read_exactly(fh: Any, n: int, path: str) -> bytes:
    buf = bytearray(n)
    _readinto_exactly(fh, memoryview(buf), path)
    return bytes(buf)


def _readinto_exactly(fh: Any, view: memoryview, path: str) -> None:
    done = 0
    while done < len(view):
        got = fh.readinto(view[done:])
        if not got:
            raise CheckpointError(path, "the file ended early (did it change while being read?)")
        done += got
