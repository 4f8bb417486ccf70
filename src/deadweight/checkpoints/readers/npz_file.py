"""numpy `.npz` archives: one entry per member, streamed out of the zip chunk by chunk.

`np.load(allow_pickle=False)` would read each member whole (an npz member cannot be memory-mapped),
so we read only each member's .npy header up front, with numpy's own format parser, and then
stream its data through a reusable buffer: memory stays bounded whether the member is stored or
deflated. Pickled (object) members are refused, as `allow_pickle=False` would, and so is an
archive where two members name one tensor (`a.npy` and `a`: numpy reads one of them).

A Fortran-order member is reordered to C order in memory up to FORTRAN_IN_MEMORY_BYTES; a
larger one is streamed as stored (a `StorageOrderEntry`: its statistics are exact, its
quantization risk and an element-wise diff are not measured, and a note says so). Reordering
it in bounded memory would take one pass over the deflated data per chunk of output.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from deadweight.checkpoints.readers.base import (
    DEFAULT_CHUNK_BYTES,
    MAX_LISTED_PROBLEMS,
    PASS_THROUGH,
    CheckpointError,
    ReaderBase,
    StorageOrderEntry,
    TensorEntry,
    elements_per_chunk,
    open_regular,
    quoted,
    shorten,
    widen,
)
from deadweight.checkpoints.readers.notes import note


def _read_npy_header(stream: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(stream)
    return np.lib.format.read_array_header_2_0(stream)


# The largest Fortran-order member reordered in memory (it is held twice meanwhile): the
# readers' usual chunk.
FORTRAN_IN_MEMORY_BYTES = DEFAULT_CHUNK_BYTES
# deflate's largest compression ratio: a 258-byte match coded in about 2 bits, 1032:1. A
# deflated member claiming more data than that per stored byte does not hold it.
MAX_DEFLATE_RATIO = 1032


def _stored_bound(info: zipfile.ZipInfo, archive_size: int) -> int | None:
    """The most bytes `info` can decompress to, from the bytes the archive really stores
    for it; None for a compression numpy never writes."""
    stored = min(info.compress_size, max(0, archive_size - info.header_offset))
    if info.compress_type == zipfile.ZIP_STORED:
        return stored
    if info.compress_type == zipfile.ZIP_DEFLATED:
        return stored * MAX_DEFLATE_RATIO
    return None


def _checked_shape(shape: object) -> tuple[int, ...] | str:
    """`shape` as a tuple of sizes, or what is wrong with it (a hostile header can claim
    negative sizes, or ones of thousands of digits that cannot even be printed)."""
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        return f"shape {quoted(shape)} is not a tuple of integers"
    if any(d < 0 for d in shape):
        return f"shape {quoted(shape)} has a negative size"
    # 2**63: numpy's own limit on a size (npy_intp), far past any file's.
    if any(d >= 1 << 63 for d in shape):
        return "shape has a size of 2**63 or more"
    return shape


class NpzFile(ReaderBase):
    def __init__(self, path: str) -> None:
        self.path = path
        self.optimizer = None
        self._fh = open_regular(path)  # a FIFO or device is refused, never waited on
        try:
            archive_size = os.fstat(self._fh.fileno()).st_size
            try:
                self._zip = zipfile.ZipFile(self._fh)
            except (zipfile.BadZipFile, ValueError, EOFError) as exc:
                raise CheckpointError(path, f"not an .npz (zip) archive ({exc})") from None
            except OSError as exc:
                raise CheckpointError(path, f"cannot read ({exc.strerror or exc})") from None
            try:
                self._read_members(archive_size)
            except BaseException:
                self._zip.close()
                raise
        except BaseException:
            self._fh.close()
            raise

    def _read_members(self, archive_size: int) -> None:
        path = self.path
        problems: list[str] = []
        self._entries: list[TensorEntry] = []
        self._members: dict[str, tuple[zipfile.ZipInfo, np.dtype[Any], bool]] = {}
        self.notes: list[str] = []
        holders: dict[str, list[str]] = {}  # tensor name -> the members that name it
        for info in self._zip.infolist():
            holders.setdefault(info.filename.removesuffix(".npy"), []).append(info.filename)
        twice = {n: m for n, m in holders.items() if len(m) > 1}
        if twice:
            shown = [
                f"{shorten(n)!r} ({' and '.join(shorten(x) for x in m[:3])})"
                for n, m in list(twice.items())[:5]
            ]
            raise CheckpointError(
                path,
                f"{len(twice)} tensor name(s) are held by more than one member: "
                f"{', '.join(shown)}; numpy would read only one of each, so which values "
                "the archive holds is ambiguous (not an archive numpy writes)",
            )
        for info in self._zip.infolist():
            if len(problems) >= MAX_LISTED_PROBLEMS:
                problems.append("and more (the archive was read no further)")
                break
            member = info.filename
            label = shorten(member)
            name = member.removesuffix(".npy")
            bound = _stored_bound(info, archive_size)
            if bound is None:
                problems.append(
                    f"{label}: compressed with zip method {info.compress_type}; numpy writes stored or deflated members"
                )
                continue
            try:
                with self._zip.open(info) as stream:
                    shape, fortran, dtype = _read_npy_header(stream)
                    header_bytes = stream.tell()
            except PASS_THROUGH:
                raise
            except BaseException as exc:  # numpy raises ValueError; a damaged zip, zlib errors
                problems.append(f"{label}: not a readable .npy member ({_first_line(exc)})")
                continue
            if dtype.hasobject:
                problems.append(f"{label}: holds Python objects (a pickle), which are not loaded")
                continue
            checked = _checked_shape(shape)
            if isinstance(checked, str):
                problems.append(f"{label}: {checked}")
                continue
            numel = 1
            for d in checked:
                numel *= d
            nbytes = numel * dtype.itemsize
            # What the member says it holds, and at most what the archive can store for it:
            # a claimed shape is never believed past that, so no read or buffer is sized by it.
            if header_bytes + nbytes != info.file_size or info.file_size > bound:
                problems.append(
                    f"{label}: shape {quoted(checked)} of {dtype} needs {nbytes} bytes, but the "
                    f"member holds {max(0, info.file_size - header_bytes)}"
                    + ("" if info.file_size <= bound else f" of which at most {bound} are stored")
                )
                continue
            canonical = "bool" if dtype.kind == "b" else dtype.name
            # A one-dimensional (or empty) array is the same in either order.
            fortran = fortran and len(checked) > 1 and numel > 0
            self._members[name] = (info, dtype, fortran)
            if fortran and nbytes > FORTRAN_IN_MEMORY_BYTES:
                text = (
                    f"{path}: {label}: stored in Fortran order, {nbytes} bytes: its statistics "
                    "are read as stored; its quantization risk and element-wise changes are "
                    "not measured (save it with np.ascontiguousarray to have them)"
                )
                self.notes.append(text)
                note(text)
                self._entries.append(StorageOrderEntry(name, checked, canonical, path, nbytes))
            else:
                self._entries.append(TensorEntry(name, checked, canonical, path, nbytes))
        if problems:
            raise CheckpointError(path, "; ".join(problems))

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        member, dtype, fortran = self._members[entry.name]
        with self._zip.open(member) as stream:
            _read_npy_header(stream)
            if fortran and not isinstance(entry, StorageOrderEntry):
                # Fortran order on disk has no C-order prefix; one copy of the tensor is the
                # price, read in pieces so that memory follows the bytes that really arrive.
                data = np.frombuffer(_read_all(stream, entry.nbytes, self.path), dtype=dtype)
                flat = data.reshape(entry.shape[::-1]).transpose().reshape(-1)
                per_chunk = elements_per_chunk(entry.dtype, max_bytes)
                for start in range(0, flat.size, per_chunk):
                    yield widen(flat[start : start + per_chunk], entry.dtype)
                return
            per_chunk = min(elements_per_chunk(entry.dtype, max_bytes), entry.numel)
            if per_chunk == 0:
                return
            buffer = np.empty(per_chunk, dtype=dtype)
            remaining = entry.numel
            while remaining:
                n = min(per_chunk, remaining)
                view = buffer[:n]
                _readinto_all(stream, view.view(np.uint8).data, self.path)
                remaining -= n
                yield widen(view, entry.dtype)

    def close(self) -> None:
        self._zip.close()
        self._fh.close()


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return shorten(text or type(exc).__name__, 200)


# _read_all grows its buffer by at most this much per read: a member that claims more than
# it holds fails at its end with this much extra memory, not with the claimed size.
_READ_PIECE = 64 << 20


def _read_all(stream: IO[bytes], n: int, path: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        piece = stream.read(min(n - len(buf), _READ_PIECE))
        if not piece:
            raise CheckpointError(path, "a member ended before its data did (truncated archive?)")
        buf += piece
    return bytes(buf)


def _readinto_all(stream: IO[bytes], view: memoryview, path: str) -> None:
    done = 0
    while done < len(view):
        got = stream.readinto(view[done:])  # type: ignore[attr-defined]
        if not got:
            raise CheckpointError(path, "a member ended before its data did (truncated archive?)")
        done += got
