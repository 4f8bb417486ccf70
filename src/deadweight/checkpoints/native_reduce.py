"""The C kernels of `native_reduce.c`: compiled on first use, loaded with ctypes.

`inspect` spends its time reducing tensors. Separate numpy/torch reductions read every
element once per statistic; the C kernels compute all statistics (and the per-group
quantization range) in one pass at close to memory speed. They are compiled with the
system C compiler the first time they are needed, into a cache directory outside the
checkpoints (`$DEADWEIGHT_CACHE_DIR`, else `$XDG_CACHE_HOME/deadweight`, else
`~/.cache/deadweight`), and reused afterwards. Without a compiler, or with
`DEADWEIGHT_NATIVE=0`, `kernels()` returns None and callers use their numpy/torch path,
which gives the same statistics more slowly.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from importlib import resources

import numpy as np

ABI_VERSION = 5
# Seconds one compiler call may take; the file compiles in well under one.
COMPILE_TIMEOUT = 120
# Flag sets tried in order: the first one the compiler accepts is used. Native tuning picks
# the widest vector registers the machine has (the kernel is written for any width).
FLAG_SETS = (
    ("-O3", "-march=native"),
    ("-O3", "-mcpu=native"),
    ("-O3",),
)

# The element kinds the kernels read, by the numpy dtype of the raw array and the
# checkpoint's dtype name.
KINDS = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16"}
# dw_run_pieces' number for each kind.
KIND_CODES = {"f32": 0, "bf16": 1, "f16": 2, "f64": 3}


class Moments(ctypes.Structure):
    sum: float
    squares: float
    min: float
    max: float
    count: int
    zeros: int
    nonfinite: int
    _fields_ = [
        ("sum", ctypes.c_double),
        ("squares", ctypes.c_double),
        ("min", ctypes.c_double),
        ("max", ctypes.c_double),
        ("count", ctypes.c_int64),
        ("zeros", ctypes.c_int64),
        ("nonfinite", ctypes.c_int64),
    ]

    @classmethod
    def empty(cls) -> Moments:
        return cls(0.0, 0.0, float("inf"), float("-inf"), 0, 0, 0)

    def merge(self, other: Moments) -> None:
        self.sum += other.sum
        self.squares += other.squares
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.count += other.count
        self.zeros += other.zeros
        self.nonfinite += other.nonfinite


class Groups(ctypes.Structure):
    worst_ratio: float
    worst_block: int
    zero_rounded: int
    _fields_ = [
        ("worst_ratio", ctypes.c_double),
        ("worst_block", ctypes.c_int64),
        ("zero_rounded", ctypes.c_int64),
    ]

    @classmethod
    def empty(cls) -> Groups:
        return cls(1.0, -1, 0)

    def merge(self, other: Groups) -> None:
        """Keep the worse block; of equal ratios the lower index, as argmax would."""
        if other.worst_block >= 0 and (
            self.worst_block < 0
            or other.worst_ratio > self.worst_ratio
            or (other.worst_ratio == self.worst_ratio and other.worst_block < self.worst_block)
        ):
            self.worst_ratio = other.worst_ratio
            self.worst_block = other.worst_block
        self.zero_rounded += other.zero_rounded


class Piece(ctypes.Structure):
    """One piece of a chunk for `dw_run_pieces` (see native_reduce.c): whole rows of
    `cols` elements from `x`, reduced into the Moments and Groups at addresses `m`, `g` and
    `gj` (group 0: moments only; gj NULL: no joint groups), then `drop_len` bytes from
    `drop` dropped from the process (NULL: none)."""

    _fields_ = [
        ("x", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("first_block", ctypes.c_int64),
        ("joint_prev", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("gj", ctypes.c_void_p),
        ("drop", ctypes.c_void_p),
        ("drop_len", ctypes.c_int64),
    ]


@dataclass(frozen=True)
class Kernels:
    lib: ctypes.CDLL
    path: str

    def moments(self, kind: str, data: np.ndarray, shift: float, out: Moments) -> None:
        """Add the moments of the flat, contiguous `data` into `out`."""
        fn = getattr(self.lib, f"dw_moments_{kind}")
        fn(_pointer(data), ctypes.c_int64(data.size), ctypes.c_double(shift), ctypes.byref(out))

    def groups(
        self,
        kind: str,
        data: np.ndarray,
        cols: int,
        group: int,
        qmax: int,
        first_block: int,
        shift: float,
        moments: Moments,
        groups: Groups,
        joint_prev: np.ndarray | None = None,
        joint: Groups | None = None,
        fast: bool = True,
    ) -> None:
        """Moments and symmetric per-group quantization of whole rows of `cols` elements.

        With `joint` (only when cols == group), also the groups of the tensor put behind a
        scalar: each starts one element earlier, `joint_prev` holding the element before
        `data` (None at the start of the tensor, whose group holds the scalar). `fast`
        False keeps bf16 off its dot-product loop (`fast_groups_bf16`), for comparisons."""
        if joint is not None and cols != group:
            raise ValueError("the joint groups need one group per row")
        rows, rest = divmod(data.size, cols)
        if rest:
            raise ValueError(f"{data.size} elements are not whole rows of {cols}")
        fn = getattr(self.lib, f"dw_groups_{kind}")
        table = _pointer(self.grid_table(qmax)) if kind == "bf16" and fast else None
        fn(
            _pointer(data), ctypes.c_int64(rows), ctypes.c_int64(cols), ctypes.c_int64(group),
            ctypes.c_double(qmax), ctypes.c_int64(first_block), ctypes.c_double(shift),
            ctypes.byref(moments), ctypes.byref(groups),
            None if joint_prev is None else _pointer(joint_prev),
            None if joint is None else ctypes.byref(joint),
            table,
        )  # fmt: skip

    def run_pieces(
        self,
        kind: str,
        pieces: ctypes.Array[Piece],
        taken: ctypes.c_int64,
        qmax: int,
        shift: float,
        table: np.ndarray | None,
    ) -> None:
        """Reduce the pieces not yet taken, one by one, with every other thread that runs
        the same `pieces` with the same `taken` counter (which starts at 0). The GIL is
        released throughout."""
        self.lib.dw_run_pieces(
            KIND_CODES[kind], pieces, ctypes.c_int64(len(pieces)), ctypes.byref(taken),
            ctypes.c_double(qmax), ctypes.c_double(shift),
            None if table is None else _pointer(table),
        )  # fmt: skip

    @property
    def fast_bf16(self) -> bool:
        """Whether this build sums bf16 groups with the CPU's bf16 dot product (AVX512-BF16)."""
        return bool(self.lib.dw_fast_bf16())

    @cache  # noqa: B019 - a few qmax values per process, kept as long as the library
    def grid_table(self, qmax: int) -> np.ndarray:
        """The grid of every bf16 magnitude for `qmax` (256 KB), which the bf16 group
        kernel looks up instead of computing each group's."""
        table = np.empty(2 << 15, dtype=np.uint32)
        self.lib.dw_grid_table_bf16(ctypes.c_double(qmax), _pointer(table))
        return table


def _pointer(data: np.ndarray) -> ctypes.c_void_p:
    if not data.flags.c_contiguous:
        raise ValueError("the kernels read contiguous arrays only")
    return ctypes.c_void_p(data.ctypes.data)


def source() -> bytes:
    return resources.files("deadweight.checkpoints").joinpath("native_reduce.c").read_bytes()


def cache_dir() -> str:
    explicit = os.environ.get("DEADWEIGHT_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deadweight")


def compiler() -> list[str] | None:
    """The C compiler: $CC, the one Python was built with, or cc / gcc / clang on PATH."""
    candidates = [os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"]
    for candidate in candidates:
        if not candidate:
            continue
        words = shlex.split(candidate)
        if words and shutil.which(words[0]):
            return words
    return None


def _machine_key() -> str:
    """What a native build depends on besides the source: compiled for this CPU's features,
    it must not be reused on another machine sharing the cache directory."""
    flags = ""
    with (
        contextlib.suppress(OSError),
        open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info,
    ):
        for line in info:
            if line.startswith(("flags", "Features")):
                flags = line
                break
    return f"{platform.machine()}|{platform.system()}|{sys.platform}|{flags}"


_lock = threading.Lock()


@cache
def kernels() -> Kernels | None:
    """The loaded kernels, or None (disabled, no compiler, or the build failed)."""
    if os.environ.get("DEADWEIGHT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    with _lock:
        try:
            path = _build()
        except (OSError, subprocess.SubprocessError):
            return None
        if path is None:
            return None
        try:
            lib = ctypes.CDLL(path)
            if lib.dw_abi_version() != ABI_VERSION:
                return None
        except (OSError, AttributeError):
            return None
        for kind in KINDS.values():
            getattr(lib, f"dw_moments_{kind}").restype = None
            getattr(lib, f"dw_groups_{kind}").restype = None
        lib.dw_run_pieces.restype = None
        return Kernels(lib, path)


def _build() -> str | None:
    cc = compiler()
    if cc is None:
        return None
    text = source()
    suffix = sysconfig.get_config_var("SHLIB_SUFFIX") or ".so"
    for flags in FLAG_SETS:
        key = hashlib.sha256(
            text + repr((cc, flags, ABI_VERSION, _machine_key())).encode()
        ).hexdigest()[:20]
        name = f"native_reduce-{key}{suffix}"
        private = f"deadweight-{getattr(os, 'getuid', lambda: 'user')()}"
        for directory in (cache_dir(), os.path.join(tempfile.gettempdir(), private)):
            target = os.path.join(directory, name)
            if os.path.isfile(target):
                if _trusted(directory) and _trusted(target):
                    return target
                continue  # someone else could have put it there: never load it
            built = _compile(cc, flags, text, directory, target)
            if built == "flags":
                break  # this compiler rejects these flags: try the next set
            if built == "ok":
                return target
            # "dir": the directory is not writable; try the next one
    return None


def _trusted(path: str) -> bool:
    """Ours, and writable by nobody else: a library loaded from here runs as this user."""
    if not hasattr(os, "getuid"):
        return True  # no POSIX ownership to check (Windows): the user's own cache
    try:
        info = os.stat(path)
    except OSError:
        return False
    return info.st_uid == os.getuid() and not info.st_mode & 0o022


def _compile(
    cc: list[str], flags: tuple[str, ...], text: bytes, directory: str, target: str
) -> str:
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        if not _trusted(directory):
            return "dir"  # shared or someone else's (a planted /tmp directory): not here
        work = tempfile.mkdtemp(prefix="build-", dir=directory)
    except OSError:
        return "dir"
    try:
        src = os.path.join(work, "native_reduce.c")
        with open(src, "wb") as fh:
            fh.write(text)
        out = os.path.join(work, "native_reduce" + os.path.splitext(target)[1])
        done = subprocess.run(
            [*cc, *flags, "-shared", "-fPIC", "-o", out, src],
            capture_output=True,
            timeout=COMPILE_TIMEOUT,
            check=False,
        )
        if done.returncode != 0 or not os.path.isfile(out):
            return "flags"
        os.replace(out, target)  # atomic: a concurrent build of the same key is harmless
        return "ok"
    except OSError:
        return "dir"
    finally:
        shutil.rmtree(work, ignore_errors=True)
