"""The loss curve of a watched run, and where it plateaus, for the HTML report.

The watch log holds every recorded loss with the optimizer step it belongs to
(`Watch.log_loss`, or the loss `deadweight run` sees at `.backward()`); several per
step (gradient accumulation) are averaged here. When parameters never moved (DW301)
the report marks the plateau: the loss went on as if nothing was wrong, and the
plateau is where the part of the model that does learn ran out of room.

The plateau is the stretch at the end of the run where the smoothed loss stays within
a tolerance of its final level:

* final level: the mean of the last `TAIL_SHARE` of the records;
* smoothed: a centred moving mean over `SMOOTH_SHARE` of the records;
* tolerance: `PLATEAU_FALL` of the final level, or four standard errors of a
  smoothed point (from the spread of the loss in the tail) when the loss is noisier
  than that, so minibatch noise alone never ends a plateau;
* it starts right after the last record outside the tolerance, and counts only when
  it covers at least `MIN_PLATEAU_SHARE` of the steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Smoothing over 2% of the records: 20 steps of the first incident's 1000, enough to
# average out per-batch noise while a fall that takes a tenth of the run keeps its shape.
SMOOTH_SHARE = 0.02
TAIL_SHARE = 0.1  # the final level: the mean loss over the last tenth of the run
# Within 1% of the final level: a language model's loss, falling as t^-0.05, is still
# more than 1% above its final level everywhere but its last ~22% of steps ...
PLATEAU_FALL = 0.01
# ... which is why a plateau must cover 30% of the run: a shorter flat tail is the end
# of a slow fall, not a plateau.
MIN_PLATEAU_SHARE = 0.3
# A smoothed point this many standard errors off is not noise: a run has about 50
# independent smoothing windows (1 / SMOOTH_SHARE), and 4 sigma (p = 6e-5 each) keeps the
# chance that noise alone ends a plateau early under 1%.
NOISE_SIGMAS = 4.0
MIN_RECORDS = 20  # fewer losses than this say nothing about a plateau


@dataclass(frozen=True)
class LossCurve:
    steps: np.ndarray  # ascending, one per step with a finite loss
    values: np.ndarray  # the mean of that step's finite losses
    averaged_steps: int  # steps with several losses (averaged)
    nonfinite: int  # NaN/Inf losses (left out)


@dataclass(frozen=True)
class Plateau:
    start_step: int
    end_step: int
    level: float  # the final level
    tolerance: float


def per_step(steps: Sequence[int], values: Sequence[float | None]) -> LossCurve:
    """The mean finite loss of each step, steps ascending."""
    s = np.asarray(steps, dtype=np.int64)
    v = np.array([math.nan if x is None else x for x in values], dtype=np.float64)
    finite = np.isfinite(v)
    nonfinite = int((~finite).sum())
    s, v = s[finite], v[finite]
    if not len(s):
        return LossCurve(s, v, 0, nonfinite)
    unique, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    means = np.bincount(inverse, weights=v) / counts
    return LossCurve(unique, means, int((counts > 1).sum()), nonfinite)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving mean; the window shrinks at the ends."""
    n = len(values)
    if window <= 1 or n == 0:
        return values.astype(np.float64, copy=True)
    csum = np.concatenate(([0.0], np.cumsum(values, dtype=np.float64)))
    half = window // 2
    idx = np.arange(n)
    lo = np.clip(idx - half, 0, n)
    hi = np.clip(idx + (window - half), 0, n)
    return (csum[hi] - csum[lo]) / (hi - lo)


def smoothing_window(records: int) -> int:
    return max(1, round(records * SMOOTH_SHARE))


def find_plateau(curve: LossCurve) -> Plateau | None:
    """The plateau at the end of the run, or None (too short, or still moving)."""
    steps, values = curve.steps, curve.values
    n = len(values)
    if n < MIN_RECORDS:
        return None
    window = smoothing_window(n)
    smoothed = smooth(values, window)
    tail = values[-max(window, math.ceil(n * TAIL_SHARE)) :]
    level = float(tail.mean())
    noise = float(tail.std()) / math.sqrt(window)
    tolerance = max(PLATEAU_FALL * abs(level), NOISE_SIGMAS * noise)
    outside = np.flatnonzero(np.abs(smoothed - level) > tolerance)
    start = int(outside[-1]) + 1 if len(outside) else 0
    if start >= n:
        return None
    span = int(steps[-1] - steps[0])
    if span <= 0 or (steps[-1] - steps[start]) < MIN_PLATEAU_SHARE * span:
        return None
    return Plateau(int(steps[start]), int(steps[-1]), level, tolerance)
