"""One pass over a checkpoint tensor with the native kernels, on every core.

Each tensor is streamed in chunks of its stored bytes (zero-copy windows of the file for
safetensors; bf16 and fp16 are converted inside the kernel, not into a buffer). Each chunk
is cut into pieces (at least one per thread), which the calling thread and the pool's take
as they come free, inside one call into the kernels each (`dw_run_pieces`, with the GIL
released: no thread comes back to Python between pieces, and each drops the file pages of
the pieces it read); the pieces' results are merged in order. The same pass also measures
the default quantization scheme (symmetric, per group of fewer than 1 / (1 - bulk
quantile) elements) when asked; other schemes are measured in bounded chunks by
`quant_stream`.

`scan_tensor` returns None whenever this path does not apply (no kernels, an element type
they do not read, a layout they do not cover); the caller then uses the numpy/torch path,
which gives the same results.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import math
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from deadweight.checkpoints.native_reduce import Groups, Kernels, Moments, Piece
from deadweight.checkpoints.quantization import (
    QuantRisk,
    Scheme,
    block_measure,
    risk_of_worst_block,
)
from deadweight.checkpoints.readers import Checkpoint, TensorEntry
from deadweight.checkpoints.readers.base import ITEMSIZE, fp8_table, widen
from deadweight.checkpoints.tensor_stats import TensorStats

# Elements per chunk of 4-byte elements: 64 MB, the readers' usual window. Elements the
# kernels read as 2 bytes (bf16, fp16) go twice as many to a chunk, 8-byte ones half as
# many: the same window, and half the hand-offs between threads for bf16 (measured here:
# bf16's default scan 5.6% faster, median of 11 paired runs, peak RSS 260 -> 290 MB).
CHUNK_ELEMENTS = 16 << 20
# A chunk is split among threads only when each piece keeps this many elements: below it
# the hand-off costs more than the reduction.
MIN_PIECE = 1 << 18
# A chunk goes to the threads in pieces of about this many elements, each taken by the
# next thread free, so that one thread slower than the other waits for at most one piece.
# Smaller pieces leave more huge pages at their edges for the chunk's end to drop (see
# SafetensorsFile._drop): a whole scan of 2.15 GB took 4.4% (bf16) and 5.8% (float32)
# less with 8M elements than with 4M, and no less with 16M (median of 13 paired scans);
# splitting a chunk's last pieces smaller made it 6% slower.
PIECE_ELEMENTS = 1 << 23
# Elements whose mean sets the shift the squares are taken about (see tensor_stats).
SHIFT_SAMPLE = 4096
BULK_QUANTILE = 0.999


def chunk_elements(entry: TensorEntry) -> int:
    """Elements per chunk of `entry`, as the kernels read them (fp8 is widened to float32)."""
    size = ITEMSIZE.get(entry.dtype, 4)
    return CHUNK_ELEMENTS * 4 // (4 if size == 1 else size)


def default_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    # Memory bandwidth, not arithmetic, bounds the pass beyond a few cores.
    return max(1, min(cores, 8))


@dataclass(frozen=True)
class GroupPlan:
    """Where the groups of a symmetric per-group scheme fall in the flat tensor.

    When every row is whole groups (the usual case), each group is given to the kernels as a
    row of its own: block numbers are unchanged (row-major), any chunk of whole groups can be
    cut anywhere, and the blocks of the tensor put behind a layer scalar (`joint_risk`) can
    be measured in the same pass."""

    cols: int  # elements per row as the kernels see it
    group: int
    qmax: int
    joint: bool  # the scalar-in-front layout has the same group size and can be measured
    tail: int = 0  # a 1-D tensor's last, shorter group

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
    if group * (1.0 - BULK_QUANTILE) >= 1.0 - 1e-9:
        return None
    qmax = 2 ** (scheme.bits - 1) - 1
    if cols % group == 0:
        return GroupPlan(group, group, qmax, joint=group == scheme.group_size)
    if len(entry.shape) <= 1:  # one row: whole groups, then the short one
        return GroupPlan(group, group, qmax, joint=False, tail=cols % group)
    if cols > chunk_elements(entry):
        return None
    return GroupPlan(cols, group, qmax, joint=False)


@dataclass
class PassResult:
    stats: TensorStats
    risk: QuantRisk | None = None
    # scalar name -> the risk of this tensor quantized as one row behind that scalar
    joint: dict[str, QuantRisk] | None = None


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
    mean = float(values.sum(dtype=np.float64)) / max(values.size, 1)
    if not math.isfinite(mean):  # NaN/Inf in the sample: the mean of the others
        finite = values[np.isfinite(values)].astype(np.float64)
        mean = float(finite.mean()) if finite.size else 0.0
    # The kernel subtracts the shift in the element type: use exactly that value.
    return mean if kind == "f64" else float(np.float32(mean))


def _pieces(n: int, threads: int, unit: int) -> list[tuple[int, int]]:
    """Split n elements into ranges of whole `unit`s: at least one per thread and about
    PIECE_ELEMENTS each, none under MIN_PIECE (one range when n is that small)."""
    units = n // unit
    wanted = max(threads, -(-n // PIECE_ELEMENTS)) if threads > 1 else 1
    count = max(1, min(wanted, units * unit // MIN_PIECE))
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
    scalars: Sequence[tuple[str, float]] = (),
) -> PassResult | None:
    """Statistics (and, for a group plan, the quantization risk, also behind each of
    `scalars`) of one floating tensor in one pass; None when the kernels cannot take it."""
    plan = group_plan(entry, scheme)
    joint = plan is not None and plan.joint and bool(scalars)
    unit = plan.cols if plan else 1
    per_chunk = max(unit, chunk_elements(entry) // unit * unit)
    moments, groups, behind = Moments.empty(), Groups.empty(), Groups.empty()
    worst: np.ndarray | None = None
    worst_behind: np.ndarray | None = None
    head: np.ndarray | None = None  # the first group, raw: the scalar's group is built from it
    previous: np.ndarray | None = None  # the last element of the previous chunk, raw
    shift: float | None = None
    done = 0
    table = (
        kernels.grid_table(plan.qmax) if plan is not None and entry.dtype == "bfloat16" else None
    )
    for raw_chunk in ckpt.raw_chunks(entry, per_chunk):
        raw = raw_chunk.reshape(-1)
        prepared = _as_kernel_input(entry, raw)
        last = done + raw.size == entry.numel
        tail = plan.tail if plan is not None and last else 0
        if prepared is None or (raw.size - tail) % unit:
            return None  # a reader that converts to a type the kernels lack, or cuts rows
        kind, data = prepared
        if data.dtype != raw.dtype:
            joint = False  # converted here (fp8): the element before a piece is not raw
        if shift is None:
            shift = _shift(entry, kind, data)
            head = raw[:unit].copy()
        first_block = done // unit * (plan.per_row if plan else 0)
        pieces = _pieces(data.size - tail, threads, unit)
        chunk = _Chunk(ckpt, entry, data, plan, first_block, joint, previous)
        results = chunk.run(kernels, kind, pieces, tail, shift, table, pool, threads)
        old, old_behind = groups.worst_block, behind.worst_block
        for m, g, gj in results:
            moments.merge(m)
            groups.merge(g)
            behind.merge(gj)
        if plan is not None and groups.worst_block != old:
            # The worst block so far is in this chunk: keep its values for the error measurement.
            worst = widen(
                raw[plan.block_slice(groups.worst_block - first_block)].copy(), entry.dtype
            )
        if joint and behind.worst_block != old_behind:
            start = (behind.worst_block - first_block) * unit  # the own block it overlaps
            before_values = raw[start - 1 : start] if start else previous
            assert before_values is not None
            values = np.concatenate([before_values, raw[start : start + unit - 1]])
            worst_behind = widen(values, entry.dtype)
        previous = raw[-1:].copy()
        done += raw.size
    if shift is None or done != entry.numel:
        return None
    result = PassResult(_stats(entry, moments, shift))
    if plan is None or moments.nonfinite or worst is None:
        return result
    assert scheme is not None
    nonzero = moments.count - moments.zeros
    result.risk = risk_of_worst_block(
        scheme, worst, groups.worst_ratio, groups.worst_block, groups.zero_rounded, nonzero,
        bulk_quantile=BULK_QUANTILE,
    )  # fmt: skip
    if joint and head is not None and previous is not None:
        result.joint = {
            name: _behind_scalar(
                scheme, entry, value, head, previous, groups, behind, worst_behind, nonzero
            )
            for name, value in scalars
        }
    return result


def _behind_scalar(
    scheme: Scheme,
    entry: TensorEntry,
    scalar: float,
    head: np.ndarray,
    last: np.ndarray,
    groups: Groups,
    behind: Groups,
    worst_behind: np.ndarray | None,
    nonzero: int,
) -> QuantRisk:
    """`joint_risk(scalar, tensor, scheme)` from the pass: the scalar's group and the last
    element's group measured here, the groups between them by the kernels."""
    own_first = widen(head, entry.dtype)
    first = np.concatenate([np.asarray([scalar], dtype=own_first.dtype), own_first[:-1]])
    ratio_first, zeros_first = block_measure(first, scheme, bulk_quantile=BULK_QUANTILE)
    _, zeros_own_first = block_measure(own_first, scheme, bulk_quantile=BULK_QUANTILE)
    final = widen(last, entry.dtype)  # the tensor's last element, a group of its own
    _, zeros_final = block_measure(final, scheme, bulk_quantile=BULK_QUANTILE)
    # Groups 1 .. k-1 are the own groups, each one element earlier: the kernels added the
    # difference in zero-rounded elements to the own groups' count.
    zero_rounded = (
        groups.zero_rounded - zeros_own_first + behind.zero_rounded + zeros_first + zeros_final
    )
    candidates = [(ratio_first, 0, first), (1.0, entry.numel // head.size, final)]
    if behind.worst_block >= 0 and worst_behind is not None:
        candidates.append((behind.worst_ratio, behind.worst_block, worst_behind))
    ratio, index, values = max(candidates, key=lambda c: (c[0], -c[1]))
    return risk_of_worst_block(
        scheme, values, ratio, index, zero_rounded, nonzero + (scalar != 0),
        bulk_quantile=BULK_QUANTILE,
    )  # fmt: skip


@dataclass
class _Chunk:
    """One chunk of a tensor as the kernels take it, cut into pieces."""

    ckpt: Checkpoint
    entry: TensorEntry
    data: np.ndarray  # flat, contiguous
    plan: GroupPlan | None
    first_block: int  # the chunk's first block in the tensor
    joint: bool
    previous: np.ndarray | None  # the element before the chunk (raw), None at the start
    address: int = field(init=False)  # of data, and of previous (None without it)
    previous_address: int | None = field(init=False)

    def __post_init__(self) -> None:
        self.address = self.data.ctypes.data
        self.previous_address = None if self.previous is None else self.previous.ctypes.data

    def run(
        self,
        kernels: Kernels,
        kind: str,
        spans: list[tuple[int, int]],
        tail: int,
        shift: float,
        table: np.ndarray | None,
        pool: Executor | None,
        threads: int,
    ) -> list[tuple[Moments, Groups, Groups]]:
        """The moments and groups of each span of whole rows (in order), then of the
        `tail` elements after them, a short last group; this thread and up to threads - 1
        of the pool's take the spans one by one, each dropping the pages of those it read."""
        pieces = (Piece * (len(spans) + bool(tail)))()
        results = [(Moments.empty(), Groups.empty(), Groups.empty()) for _ in pieces]
        for piece, (lo, hi), (m, g, gj) in zip(pieces, spans, results, strict=False):
            self._fill(piece, lo, hi, m, g, gj)
        if tail:
            assert self.plan is not None
            body = self.data.size - tail
            m, g, _ = results[-1]
            pieces[-1] = Piece(
                self.address + body * self.data.itemsize, 1, tail, tail,
                self.first_block + body // self.plan.cols * self.plan.per_row, None,
                ctypes.addressof(m), ctypes.addressof(g), None, None, 0,
            )  # fmt: skip
        qmax = self.plan.qmax if self.plan is not None else 0
        taken = ctypes.c_int64(0)
        work = functools.partial(kernels.run_pieces, kind, pieces, taken, qmax, shift, table)
        helpers = (
            [] if pool is None else [pool.submit(work) for _ in range(min(threads, len(spans)) - 1)]
        )
        try:
            work()
        finally:
            for helper in helpers:
                helper.result()  # waits for each, and raises its error
        return results

    def _fill(self, piece: Piece, lo: int, hi: int, m: Moments, g: Groups, gj: Groups) -> None:
        size = self.data.itemsize
        piece.x = self.address + lo * size
        piece.m = ctypes.addressof(m)
        plan = self.plan
        if plan is None:
            piece.rows, piece.cols = hi - lo, 1  # group 0: moments only
        else:
            piece.rows, piece.cols, piece.group = (hi - lo) // plan.cols, plan.cols, plan.group
            piece.first_block = self.first_block + lo // plan.cols * plan.per_row
            piece.g = ctypes.addressof(g)
            if self.joint:
                before = self.address + (lo - 1) * size if lo else self.previous_address
                piece.joint_prev = before
                piece.gj = ctypes.addressof(gj)
        span = self.ckpt.droppable(self.entry, piece.x, (hi - lo) * size)
        if span is not None:
            piece.drop, piece.drop_len = span


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
