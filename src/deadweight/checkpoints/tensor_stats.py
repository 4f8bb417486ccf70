"""Per-tensor statistics from a stream of chunks, in bounded memory.

Each chunk (64 MB from a reader) is reduced in cache-sized slices: the first pass
over a slice brings it from memory, the other reductions find it in cache, so the
cost stays close to one read of the bytes. NaN/Inf are rare: a slice is filtered
only when its min, max or sum of squares says it holds some.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

# Elements per slice: 256k float32 = 1 MB, a typical L2 cache.
SLICE = 1 << 18


@dataclass(frozen=True)
class TensorStats:
    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    analysed: bool  # floating point: statistics below; int/bool tensors are only listed
    min: float = math.nan
    max: float = math.nan
    mean: float = math.nan
    std: float = math.nan
    zeros: int = 0
    nonfinite: int = 0

    @property
    def absmax(self) -> float:
        return max(abs(self.min), abs(self.max)) if self.finite_count else math.nan

    @property
    def finite_count(self) -> int:
        return self.numel - self.nonfinite

    @property
    def value(self) -> float | None:
        """The value of a single-element tensor (a layer scalar)."""
        return self.min if self.numel == 1 and self.analysed else None

    @property
    def rms(self) -> float:
        return math.sqrt(self.mean**2 + self.std**2) if self.finite_count else math.nan

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "numel": self.numel,
            "analysed": self.analysed,
            "min": self.min,
            "max": self.max,
            "absmax": self.absmax,
            "mean": self.mean,
            "std": self.std,
            "zeros": self.zeros,
            "nonfinite": self.nonfinite,
        }


class _Accumulator:
    def __init__(self) -> None:
        self.count = 0  # finite elements
        self.nonfinite = 0
        self.zeros = 0
        self.min = math.inf
        self.max = -math.inf
        self.total = 0.0
        # Sum of (x - shift)^2. With the shift near the mean, a norm gain of 1.0 +- 1e-4
        # keeps its std; E[x^2] - mean^2 in float would cancel it away.
        self.shift: float | None = None
        self.squares = 0.0

    def add(self, chunk: np.ndarray) -> None:
        import torch  # here, not at the top: the rules read this module's TensorStats

        with warnings.catch_warnings():  # a read-only buffer is fine: nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.from_numpy(chunk)
        for start in range(0, whole.numel(), SLICE):
            part = whole[start : start + SLICE]
            # torch reduces a cache-resident slice several times faster than numpy:
            # min/max in one pass, sums (float64 for the plain sum; the float32 dot of a
            # 1 MB slice is exact to ~1e-7 and slices are added in float64).
            low, high = torch.aminmax(part)
            lo, hi = float(low), float(high)
            total = float(torch.sum(part, dtype=torch.float64))
            if not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(total)):
                self._add_with_nonfinite(part.numpy())
                continue
            if self.shift is None:  # squares about a value near the mean: no cancellation
                self.shift = total / part.numel()
            centred = part - self.shift
            squares = float(torch.dot(centred, centred))
            if not math.isfinite(squares):  # beyond float32: the float64 path
                self._add_with_nonfinite(part.numpy())
                continue
            self.count += part.numel()
            self.zeros += part.numel() - int(torch.count_nonzero(part))
            self.min = min(self.min, lo)
            self.max = max(self.max, hi)
            self.total += total
            self.squares += squares

    def _add_with_nonfinite(self, part: np.ndarray) -> None:
        """The slow path, only for slices holding NaN/Inf (or squares beyond float32)."""
        finite = np.isfinite(part)
        self.nonfinite += part.size - int(np.count_nonzero(finite))
        part = part[finite]
        if not part.size:
            return
        if self.shift is None:
            self.shift = float(part.astype(np.float64).mean())
        wide = part.astype(np.float64) - self.shift
        self.count += part.size
        self.zeros += part.size - int(np.count_nonzero(part))
        self.min = min(self.min, float(part.min()))
        self.max = max(self.max, float(part.max()))
        self.total += float(part.astype(np.float64).sum())
        self.squares += float(np.dot(wide, wide))


def tensor_stats(
    name: str, shape: tuple[int, ...], dtype: str, numel: int, chunks: Iterable[np.ndarray] | None
) -> TensorStats:
    """Statistics of one tensor; `chunks` None for a tensor that is only listed."""
    if chunks is None:
        return TensorStats(name, shape, dtype, numel, analysed=False)
    acc = _Accumulator()
    for chunk in chunks:
        acc.add(chunk.reshape(-1))
    if not acc.count:
        return TensorStats(name, shape, dtype, numel, True, nonfinite=acc.nonfinite)
    mean = acc.total / acc.count
    offset = mean - (acc.shift or 0.0)
    variance = max(0.0, acc.squares / acc.count - offset * offset)
    return TensorStats(
        name, shape, dtype, numel, True, acc.min, acc.max, mean, math.sqrt(variance),
        acc.zeros, acc.nonfinite,
    )  # fmt: skip
