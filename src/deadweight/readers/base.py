"""What every checkpoint reader shares: the error, the entry, the reader protocol, dtype handling."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np

from deadweight.errors import InputError

# Floating dtypes are analysed as weights; everything else (int, bool, ...) is only listed.
FLOAT_DTYPES = frozenset(
    {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
)
# Bytes per element of every dtype a reader can name; chunk sizes and nbytes come from here.
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}
DEFAULT_CHUNK_BYTES = 64 << 20
# An error message lists at most this many problems: a hostile header can hold millions.
MAX_LISTED_PROBLEMS = 20


class CheckpointError(InputError):
    """A checkpoint cannot be read; the message names the file and what is wrong with it."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem

    @classmethod
    def listing(cls, path: str, problems: list[str]) -> CheckpointError:
        """One error for every problem found, so a user fixes them in one round."""
        shown = problems[:MAX_LISTED_PROBLEMS]
        more = len(problems) - len(shown)
        text = "; ".join(shown) + (f"; and {more} more problem(s)" if more else "")
        return cls(path, text)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    file: str
    nbytes: int

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES or self.dtype.startswith("float")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@runtime_checkable
class Checkpoint(Protocol):
    """What `open_checkpoint` returns, whatever the format.

    `chunks()` yields the tensor flat in C order, in consecutive arrays of at most about
    `max_bytes` of output. A chunk may be a view of a buffer the reader reuses for the next
    one: use it (reduce it) before asking for the next, or copy it.
    """

    path: str
    optimizer: dict[str, Any] | None

    def entries(self) -> list[TensorEntry]: ...

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]: ...

    def raw_chunks(self, entry: TensorEntry, max_elements: int) -> Iterator[np.ndarray]: ...

    def droppable(
        self, entry: TensorEntry, address: int, nbytes: int
    ) -> tuple[int, int] | None: ...

    def array(self, entry: TensorEntry) -> np.ndarray: ...

    def close(self) -> None: ...

    def __enter__(self) -> Checkpoint: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


_R = TypeVar("_R", bound="ReaderBase")


class ReaderBase:
    """Context-manager plumbing and `array()` built on `chunks()`, shared by the readers."""

    path: str
    optimizer: dict[str, Any] | None = None

    def entries(self) -> list[TensorEntry]:
        raise NotImplementedError

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def raw_chunks(self, entry: TensorEntry, max_elements: int) -> Iterator[np.ndarray]:
        """Like `chunks()`, in chunks of exactly `max_elements` (the last may be shorter), as
        the elements are stored where the reader can hand them over without converting them:
        bf16 as uint16 bits, fp8 as uint8 bits, the rest in their own numpy dtype. Readers
        that convert anyway yield their converted chunks."""
        return self.chunks(entry, max_elements * output_dtype(entry.dtype).itemsize)

    def droppable(self, entry: TensorEntry, address: int, nbytes: int) -> tuple[int, int] | None:
        """Where the `nbytes` at `address`, a piece of a raw chunk of `entry`, may be
        dropped from the process (madvise MADV_DONTNEED) once the caller is done with them:
        the address and length of whole pages of a file map inside them, for a reader that
        maps the file, so that the thread that read the piece drops it rather than waiting
        for the next chunk. None when nothing may be dropped (a reader that does not map, or
        memory that is not its map). Safe to call from several threads at once."""
        return None

    def array(self, entry: TensorEntry) -> np.ndarray:
        return assemble(entry, self.chunks(entry))

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def output_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype chunks of `dtype` come out as: float64 stays, other floats widen to float32."""
    if dtype == "float64":
        return np.dtype(np.float64)
    if dtype in FLOAT_DTYPES or dtype.startswith("float"):
        return np.dtype(np.float32)
    return np.dtype(dtype)


def elements_per_chunk(dtype: str, max_bytes: int) -> int:
    return max(1, max_bytes // output_dtype(dtype).itemsize)


def assemble(entry: TensorEntry, chunks: Iterable[np.ndarray]) -> np.ndarray:
    """The whole tensor, shaped; copies each chunk out because readers reuse their buffers."""
    out = np.empty(entry.numel, dtype=output_dtype(entry.dtype))
    pos = 0
    for chunk in chunks:
        out[pos : pos + chunk.size] = chunk
        pos += chunk.size
    if pos != out.size:
        raise CheckpointError(entry.file, f"{entry.name}: read {pos} of {out.size} elements")
    return out.reshape(entry.shape)


@cache
def fp8_table(dtype: str) -> np.ndarray:
    """float32 value of each of the 256 fp8 bit patterns; torch defines the formats, so ask it once."""
    import torch

    torch_dtype = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[dtype]
    table = torch.arange(256, dtype=torch.uint8).view(torch_dtype).float().numpy().copy()
    table.flags.writeable = False
    return table


def widen(raw: np.ndarray, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """Raw little-endian element storage of `dtype` (as its same-width integer or native view)
    converted to the output dtype. `out`, when given, is reused for the result."""
    if dtype == "bfloat16":
        # bf16 is the top half of an fp32: shifting the bits back is exact, and numpy has no bf16.
        if out is not None and out.size >= raw.size:  # in place: no temporaries per chunk
            bits = out[: raw.size].view(np.uint32)
            np.copyto(bits, raw.view(np.uint16), casting="safe")
            np.left_shift(bits, 16, out=bits)
            return bits.view(np.float32)
        widened = raw.view(np.uint16).astype(np.uint32) << 16
        return widened.view(np.float32)
    if dtype in ("float8_e4m3fn", "float8_e5m2"):
        table = fp8_table(dtype)
        if out is not None and out.size >= raw.size:
            return np.take(table, raw.view(np.uint8), out=out[: raw.size])
        return table[raw.view(np.uint8)]
    target = output_dtype(dtype)
    if raw.dtype == target and raw.dtype.isnative:
        return raw
    return raw.astype(target)
