"""One pass over a checkpoint tensor with the native kernels, on every core.

Each tensor is streamed in chunks of its stored bytes (zero-copy windows of the file for
safetensors; bf16 and fp16 are converted inside the kernel, not into a buffer). Each chunk
is cut into one piece per thread; ctypes releases the GIL, so the pieces are reduced in
parallel. The same pass also measures the default quantization scheme (symmetric, per group
of fewer than 1 / (1 - bulk quantile) elements) when asked; other schemes need the whole
tensor and stay with `quant_risk`.

`scan_tensor` returns None whenever this path does not apply (no kernels, an element type
they do not read, a layout they do not cover); the caller then uses the numpy/torch path,
which gives the same results.
"""

from __future__ import annotations

import itertools
import math
import os
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from deadweight.probes.native_reduce import Groups, Kernels, Moments
from deadweight.probes.quantization import QuantRisk, Scheme, risk_of_worst_block
from deadweight.probes.tensor_stats import TensorStats
from deadweight.readers import Checkpoint, TensorEntry
from deadweight.readers.base import fp8_table, widen

# Elements per chunk: 64 MB of float32, the readers' usual window.
CHUNK_ELEMENTS = 16 << 20
# A chunk is split among threads only when each piece keeps this many elements: below it
# the hand-off costs more than the reduction.
MIN_PIECE = 1 << 18
# Elements whose mean sets the shift the squares are taken about (see tensor_stats).
SHIFT_SAMPLE = 4096
BULK_QUANTILE = 0.999


def default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    # Memory bandwidth, not arithmetic, bounds the pass beyond a few cores.
    return max(1, min(cores, 8))


@dataclass(frozen=True)
class GroupPlan:
    """Where the groups of a symmetric per-group scheme fall in the flat tensor."""

    cols: int  # elements per row of the (shape[0], -1) view; 1-D tensors are one row
    group: int
    qmax: int

    @property
    def per_row(self) -> int:
        return -(-self.cols // self.group)

    def block_slice(self, block: int) -> slice:
        row, j = divmod(block, self.per_row)
        start = row * self.cols + j * self.group
        return slice(start, start + min(self.group, self.cols - j * self.group))


def group_plan(entry: TensorEntry, scheme: Scheme | None) -> GroupPlan | None:
    """The plan when the kernels can measure `scheme` for this tensor, else None."""
    if scheme is None or entry.numel <= 1:
        return None
    if scheme.granularity != "group" or not scheme.symmetric or scheme.group_size is None:
        return None
    cols = entry.numel if len(entry.shape) <= 1 else entry.numel // entry.shape[0]
    group = min(scheme.group_size, cols)
    # Only groups too small for the bulk quantile to exclude anything (quantization.py's
    # tiny blocks): their bulk needs the two largest magnitudes, nothing more.
    if group * (1.0 - BULK_QUANTILE) >= 1.0 - 1e-9 or cols > CHUNK_ELEMENTS:
        return None
    return GroupPlan(cols, group, 2 ** (scheme.bits - 1) - 1)


def _kind(entry: TensorEntry, raw: np.ndarray) -> str | None:
    if raw.dtype == np.float32:
        return "f32"
    if raw.dtype == np.float64:
        return "f64"
    if raw.dtype == np.float16:
        return "f16"
    if raw.dtype == np.uint16 and entry.dtype == "bfloat16":
        return "bf16"
    return None


def _as_kernel_input(entry: TensorEntry, raw: np.ndarray) -> tuple[str, np.ndarray] | None:
    kind = _kind(entry, raw)
    if kind is not None:
        return kind, np.ascontiguousarray(raw)
    if raw.dtype == np.uint8 and entry.dtype in ("float8_e4m3fn", "float8_e5m2"):
        return "f32", np.take(fp8_table(entry.dtype), raw)
    return None


def _shift(entry: TensorEntry, kind: str, data: np.ndarray) -> float:
    """A value near the mean: squares about it keep a small spread around a large mean."""
    head = data[:SHIFT_SAMPLE]
    values = head if kind in ("f32", "f64") else widen(head, entry.dtype)
    finite = values[np.isfinite(values)].astype(np.float64)
    mean = float(finite.mean()) if finite.size else 0.0
    # The kernel subtracts the shift in the element type: use exactly that value.
    return mean if kind == "f64" else float(np.float32(mean))


def _pieces(n: int, threads: int, unit: int) -> list[tuple[int, int]]:
    """Split n elements into up to `threads` ranges of whole `unit`s."""
    units = n // unit
    count = max(1, min(threads, units * unit // MIN_PIECE))
    bounds = [round(units * k / count) * unit for k in range(count + 1)]
    bounds[-1] = n
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def scan_tensor(
    ckpt: Checkpoint,
    entry: TensorEntry,
    kernels: Kernels,
    pool: Executor | None,
    threads: int,
    scheme: Scheme | None = None,
) -> tuple[TensorStats, QuantRisk | None] | None:
    """Statistics (and, for a group plan, the quantization risk) of one floating tensor in
    one pass; None when the kernels cannot take it."""
    plan = group_plan(entry, scheme)
    unit = plan.cols if plan else 1
    per_chunk = max(unit, CHUNK_ELEMENTS // unit * unit)
    moments, groups = Moments.empty(), Groups.empty()
    worst_values: np.ndarray | None = None
    shift: float | None = None
    done = 0
    for raw in ckpt.raw_chunks(entry, per_chunk):
        prepared = _as_kernel_input(entry, raw.reshape(-1))
        if prepared is None or raw.size % unit:
            return None  # a reader that converts to a type the kernels lack, or cuts rows
        kind, data = prepared
        if shift is None:
            shift = _shift(entry, kind, data)
        first_block = done // unit * (plan.per_row if plan else 0)
        parts = _pieces(data.size, threads, unit)
        jobs = [(kernels, kind, data[lo:hi], plan, shift, first_block, lo) for lo, hi in parts]
        if pool is None or len(jobs) == 1:
            results = [_reduce(*job) for job in jobs]
        else:
            results = [f.result() for f in [pool.submit(_reduce, *job) for job in jobs]]
        before = groups.worst_block
        for m, g in results:
            moments.merge(m)
            groups.merge(g)
        if plan is not None and groups.worst_block != before:
            # The worst block so far is in this chunk: keep its values for the error measurement.
            local = plan.block_slice(groups.worst_block - first_block)
            worst_values = widen(raw.reshape(-1)[local].copy(), entry.dtype)
        done += raw.size
    if shift is None or done != entry.numel:
        return None
    stats = _stats(entry, moments, shift)
    if plan is None or moments.nonfinite or worst_values is None:
        return stats, None
    assert scheme is not None
    risk = risk_of_worst_block(
        scheme, worst_values, groups.worst_ratio, groups.worst_block, groups.zero_rounded,
        moments.count - moments.zeros, bulk_quantile=BULK_QUANTILE,
    )  # fmt: skip
    return stats, risk


def _reduce(
    kernels: Kernels,
    kind: str,
    data: np.ndarray,
    plan: GroupPlan | None,
    shift: float,
    first_block: int,
    offset: int,
) -> tuple[Moments, Groups]:
    """One thread's piece of a chunk: `offset` elements into the chunk, whole rows."""
    m, g = Moments.empty(), Groups.empty()
    if plan is None:
        kernels.moments(kind, data, shift, m)
    else:
        first = first_block + offset // plan.cols * plan.per_row
        kernels.groups(kind, data, plan.cols, plan.group, plan.qmax, first, shift, m, g)
    return m, g


def _stats(entry: TensorEntry, m: Moments, shift: float) -> TensorStats:
    if not m.count:
        return TensorStats(
            entry.name, entry.shape, entry.dtype, entry.numel, True, nonfinite=m.nonfinite
        )
    mean = m.sum / m.count
    offset = mean - shift
    variance = max(0.0, m.squares / m.count - offset * offset)
    return TensorStats(
        entry.name, entry.shape, entry.dtype, entry.numel, True, m.min, m.max, mean,
        math.sqrt(variance), m.zeros, m.nonfinite,
    )  # fmt: skip
