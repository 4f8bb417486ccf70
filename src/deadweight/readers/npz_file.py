"""numpy `.npz` archives: one entry per member, streamed out of the zip chunk by chunk.

`np.load(allow_pickle=False)` would read each member whole (an npz member cannot be memory-mapped),
so we read only each member's .npy header up front, with numpy's own format parser, and then
stream its data through a reusable buffer: memory stays bounded whether the member is stored or
deflated. Pickled (object) members are refused, as `allow_pickle=False` would.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from typing import IO, Any

import numpy as np

from deadweight.readers.base import (
    DEFAULT_CHUNK_BYTES,
    CheckpointError,
    ReaderBase,
    TensorEntry,
    elements_per_chunk,
    widen,
)


def _read_npy_header(stream: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype[Any]]:
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(stream)
    return np.lib.format.read_array_header_2_0(stream)


class NpzFile(ReaderBase):
    def __init__(self, path: str) -> None:
        self.path = path
        self.optimizer = None
        try:
            self._zip = zipfile.ZipFile(path)
        except OSError as exc:
            raise CheckpointError(path, f"cannot open ({exc.strerror})") from None
        except (zipfile.BadZipFile, ValueError) as exc:
            raise CheckpointError(path, f"not an .npz (zip) archive ({exc})") from None
        problems: list[str] = []
        self._entries: list[TensorEntry] = []
        self._members: dict[str, tuple[str, np.dtype[Any], bool]] = {}
        for member in self._zip.namelist():
            name = member.removesuffix(".npy")
            try:
                with self._zip.open(member) as stream:
                    shape, fortran, dtype = _read_npy_header(stream)
            except (
                Exception
            ) as exc:  # numpy raises ValueError; a damaged zip raises zlib/zip errors
                problems.append(f"{member}: not a readable .npy member ({exc})")
                continue
            if dtype.hasobject:
                problems.append(f"{member}: holds Python objects (a pickle), which are not loaded")
                continue
            canonical = "bool" if dtype.kind == "b" else dtype.name
            self._members[name] = (member, dtype, fortran)
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            self._entries.append(
                TensorEntry(name, tuple(shape), canonical, path, numel * dtype.itemsize)
            )
        if problems:
            self._zip.close()
            raise CheckpointError.listing(path, problems)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        member, dtype, fortran = self._members[entry.name]
        with self._zip.open(member) as stream:
            _read_npy_header(stream)
            if fortran:
                # Fortran order on disk has no C-order prefix; one copy of the tensor is the price.
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


def _read_all(stream: IO[bytes], n: int, path: str) -> bytes:
    buf = bytearray(n)
    _readinto_all(stream, memoryview(buf), path)
    return bytes(buf)


def _readinto_all(stream: IO[bytes], view: memoryview, path: str) -> None:
    done = 0
    while done < len(view):
        got = stream.readinto(view[done:])  # type: ignore[attr-defined]
        if not got:
            raise CheckpointError(path, "a member ended before its data did (truncated archive?)")
        done += got
