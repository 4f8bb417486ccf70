"""What every checkpoint reader shares: the error, the entry, the reader protocol, dtype handling."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from types import TracebackType
from typing import IO, Any, Protocol, TypeVar, runtime_checkable

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
# A value quoted in an error message (a shape, a name) is cut to this many characters: the
# message names what is wrong, and a hostile file's values can be megabytes long.
QUOTED_CHARS = 80
# The longest integer literal a header may hold: 2**64 - 1, the largest size or offset any
# format here can store (safetensors reads them as u64), has 20 digits. Python's own limit
# (4300 digits) still lets a header of 1000 such integers take minutes to multiply out.
MAX_INT_DIGITS = 20
# Linux's PATH_MAX: no longer name can be opened, so none is worth resolving.
MAX_PATH_CHARS = 4096
# Exceptions that are not a file's fault: an interrupt, an exit, a generator being closed.
PASS_THROUGH = (KeyboardInterrupt, SystemExit, GeneratorExit)


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


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def shorten(text: str, limit: int = QUOTED_CHARS) -> str:
    """`text` for an error message: on one line (control characters escaped, a newline as
    \\n), cut to `limit` characters with an ellipsis when longer."""
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def quoted(value: object, limit: int = QUOTED_CHARS) -> str:
    """repr(value) for an error message, cut to `limit` characters."""
    try:
        return shorten(repr(value), limit)
    except ValueError:  # an int past Python's 4300-digit str() limit
        return "<a value too large to print>"


def bounded_int(literal: str) -> int:
    """json's parse_int hook: an integer literal of at most MAX_INT_DIGITS digits."""
    digits = len(literal) - literal.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"an integer literal of {digits} digits (sizes fit in {MAX_INT_DIGITS})")
    return int(literal)


def reading_error(path: str, exc: BaseException) -> CheckpointError:
    """The CheckpointError for anything else a reader raised: one line naming the file."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, MemoryError):
        problem = "needs more memory than is available to read"
    elif isinstance(exc, RecursionError):
        problem = "is nested too deeply to read"
    else:
        text = " ".join(str(exc).split())  # one line: some exceptions carry tracebacks
        problem = f"cannot be read ({type(exc).__name__}{': ' if text else ''}{shorten(text, 300)})"
    return CheckpointError(path, problem)


def open_regular(path: str) -> IO[bytes]:
    """`path` opened for binary reading, unbuffered, if it is a regular file (a link to one
    included). A FIFO would block open() until a writer came, and a device such as
    /dev/zero never ends: O_NONBLOCK opens either at once, and fstat refuses them."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as exc:
        raise CheckpointError(path, f"cannot open ({exc.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CheckpointError(path, not_regular(mode))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def plain_path(named: object) -> str | None:
    """`named`, a path that came out of a file, as a plain str; None when it is none.

    A pickle can hold any object where a path belongs, a pathlib object whose cached
    string is not its path among them: what the caller checks and then opens must be
    this str, never the object."""
    text = os.fspath(named) if isinstance(named, (str, os.PathLike)) else None
    if type(text) is not str or not text or "\0" in text:
        return None
    return text


def inside_folder(folder: str, name: str) -> str | None:
    """`name` joined to `folder` when the file it names stays inside the folder, else None.

    Refused: an absolute path, a `..`, and a name that resolves (every symbolic link on
    the way followed) outside the folder or to the folder itself, and one longer than
    any path the system opens (resolving a name of a million parts would take seconds)."""
    if (
        len(name) > MAX_PATH_CHARS
        or os.path.isabs(name)
        or ".." in name.replace("\\", "/").split("/")
    ):
        return None
    root = os.path.realpath(folder)
    joined = os.path.join(folder, name)
    resolved = os.path.realpath(joined)
    if resolved == root or os.path.commonpath([root, resolved]) != root:
        return None
    return joined


def physical_file(path: str) -> tuple[int, int] | None:
    """(device, inode) of the file `path` names, links followed: one key however many
    names lead to it; None when it cannot be had."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    return info.st_dev, info.st_ino


def not_regular(mode: int) -> str:
    kind = (
        "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "not a file"
    )
    return f"is not a regular file ({kind}); only regular files are read"


# slots: a header may describe millions of tensors; this keeps each entry at ~100 bytes.
@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class StorageOrderEntry(TensorEntry):
    """A tensor whose chunks come in the order its file stores the elements, not in C
    order: a Fortran-order `.npz` member too large to reorder in memory. Statistics over
    all its elements hold; what depends on positions (quantization blocks, an element-wise
    comparison with a C-order tensor) is not measured."""


@runtime_checkable
class Checkpoint(Protocol):
    """What `open_checkpoint` returns, whatever the format.

    `chunks()` yields the tensor flat in C order (a `StorageOrderEntry`'s in the order its
    file stores them), in consecutive arrays of at most about
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
_T = TypeVar("_T")


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


class GuardedCheckpoint:
    """A reader whose every method turns what it raises into a CheckpointError naming the
    file (see reading_error); what `open_checkpoint` returns."""

    def __init__(self, reader: Checkpoint) -> None:
        self._reader = reader
        self.path = reader.path
        self.optimizer: dict[str, Any] | None = reader.optimizer  # read when the file opens

    def __getattr__(self, name: str) -> Any:  # a reader's own extras (safetensors' metadata)
        return getattr(self._reader, name)

    def _call(self, method: Callable[..., _T], *args: Any) -> _T:
        try:
            return method(*args)
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            raise reading_error(self.path, exc) from None

    def entries(self) -> list[TensorEntry]:
        return self._call(self._reader.entries)

    def chunks(self, entry: TensorEntry, max_bytes: int | None = None) -> Iterator[np.ndarray]:
        # None leaves the chunk size to the reader's own default.
        if max_bytes is None:
            return self._guard(lambda: self._reader.chunks(entry))
        return self._guard(lambda: self._reader.chunks(entry, max_bytes))

    def raw_chunks(self, entry: TensorEntry, max_elements: int) -> Iterator[np.ndarray]:
        return self._guard(lambda: self._reader.raw_chunks(entry, max_elements))

    def _guard(self, start: Any) -> Iterator[np.ndarray]:
        try:
            yield from start()
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            raise reading_error(self.path, exc) from None

    def droppable(self, entry: TensorEntry, address: int, nbytes: int) -> tuple[int, int] | None:
        return self._reader.droppable(entry, address, nbytes)

    def array(self, entry: TensorEntry) -> np.ndarray:
        return self._call(self._reader.array, entry)

    def close(self) -> None:
        self._call(self._reader.close)

    def __enter__(self) -> GuardedCheckpoint:
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
