"""Per-tensor statistics from a stream of chunks, in bounded memory.

Each chunk (64 MB from a reader) is reduced in cache-sized slices: the first pass
over a slice brings it from memory, the other reductions find it in cache, so the
cost stays close to one read of the bytes.
"""

from __future__ import annotations

import math
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
        self.squares = 0.0

    def add(self, chunk: np.ndarray) -> None:
        for start in range(0, chunk.size, SLICE):
            part = chunk[start : start + SLICE]
            finite = np.isfinite(part)
            bad = part.size - int(np.count_nonzero(finite))
            if bad:
                self.nonfinite += bad
                part = part[finite]
                if not part.size:
                    continue
            self.count += part.size
            self.zeros += part.size - int(np.count_nonzero(part))
            self.min = min(self.min, float(part.min()))
            self.max = max(self.max, float(part.max()))
            # float64 accumulation: a float32 sum of millions of squares loses digits
            self.total += float(part.sum(dtype=np.float64))
            wide = part.astype(np.float64, copy=False)
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
    variance = max(0.0, acc.squares / acc.count - mean * mean)
    return TensorStats(
        name, shape, dtype, numel, True, acc.min, acc.max, mean, math.sqrt(variance),
        acc.zeros, acc.nonfinite,
    )  # fmt: skip
