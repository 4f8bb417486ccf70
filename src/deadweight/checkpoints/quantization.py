"""How many bits does a weight tensor keep under a quantization scheme? Outlier-driven range.

A round-to-nearest quantizer sets its scale from the extreme values of each block,
so one outlier (a layer scalar that drifted to 56.25, next to weights in [-2, 2])
stretches the grid and leaves the ordinary weights with a few levels, or none. This
module measures that from numpy arrays alone (no torch at runtime) and fake-quantizes
to check the measurement.

Definitions
-----------
Scheme. ``bits`` (2..16), a granularity and symmetry, written ``int4``, ``int8-channel``,
``int4-group128``, ``int8-tensor-asym`` (see ``Scheme.parse``).

- symmetric: scale = absmax / (2^(bits-1) - 1), zero point 0, integers clamped to
  [-(2^(bits-1) - 1), 2^(bits-1) - 1].
- asymmetric: the grid covers [min(x_min, 0), max(x_max, 0)], so that 0 is exactly
  representable as real quantizers require (torch's observers, GPTQ's ``find_params``):
  scale = (hi - lo) / (2^bits - 1), integer zero point round(-lo / scale) in
  [0, 2^bits - 1], integers clamped to that range.

Block. What one scale is set from:

- per-tensor: the whole tensor;
- per-channel: one output channel, i.e. one index along axis 0 (a tensor of 3 or more
  dimensions is flattened to (shape[0], -1) as GPTQ does with conv weights). A 1-D
  tensor's channels are its elements, so every element is its own block and a
  per-channel scheme can never lose bits on it;
- per-group: contiguous runs of ``group_size`` elements along the last (input) axis of
  each row of that (shape[0], -1) layout, as GPTQ and AWQ group; the last group of a row
  may be shorter. A 1-D tensor is one row. Blocks are numbered row-major (row r, group j
  -> r * groups_per_row + j).

Block range. The statistic the scale is set from: absmax (symmetric) or
max(x_max, 0) - min(x_min, 0) (asymmetric).

Bulk range. The same statistic without the outliers:

- symmetric: the ``bulk_quantile`` quantile of |x| in the block (the element at sorted
  index floor(q * (n - 1))); the bulk is |x| <= that value;
- asymmetric: the central ``bulk_quantile`` range, [x at index ceil((1-q)/2 * (n-1)),
  x at index n - 1 - that], widened to include 0 like the block range;
- a block too small for that quantile to exclude anything (n < 1 / (1 - q) elements,
  e.g. a group of 128 at q = 0.999) loses at most its single most extreme element: the
  one whose removal shrinks the range most, removed only when the range without it is
  less than half the block range. So a block of one scalar has ratio 1, and a group of
  ordinary weights too; a group holding a scalar 28x its neighbours does not.

A bulk range of 0 (the bulk is all zeros, e.g. a pruned row) counts as ratio 1: zero is
exact on both grids, so the bulk loses nothing.

range_ratio = block range / bulk range (>= 1). effective_bits = bits - log2(range_ratio):
the incident's formula (4 - log2(56.25 / 2) = -0.81), and it can be negative. A
QuantRisk reports the worst block (largest ratio, fewest bits).

zero_fraction: over the whole tensor, the fraction of non-zero elements whose
fake-quantized value is exactly 0.

measured_error: fake-quantize the tensor, then in the worst block take the RMS error
over its bulk elements divided by the RMS of those elements. A uniform-rounding model
predicts it proportional to 2^-effective_bits (the tests check that); it tends to 1
once the bulk rounds to 0. outliers: the worst block's elements outside its bulk range.

Non-finite values make the risk undefined and raise ValueError.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BROKEN_BELOW_BITS",
    "DEGRADED_LOSS_BITS",
    "ENOUGH_BITS",
    "Bounds",
    "QuantRisk",
    "Scheme",
    "as_measured",
    "block_bounds",
    "block_measure",
    "bounds_ratio",
    "bulk_rank",
    "central_ranks",
    "fake_quantize",
    "fake_quantize_blocks",
    "is_tiny",
    "joint_risk",
    "quant_risk",
    "range_bounds",
    "risk_from_measures",
    "risk_of_worst_block",
    "verdict_for",
]

# Verdict thresholds, on the worst block's effective bits.
# Below 1 bit the bulk's absmax is under one quantization step of the symmetric grid
# (bulk / step = (2^(bits-1) - 1) / 2^(bits - effective_bits) < 1), so the bulk rounds
# to {-1, 0, 1} and mostly to 0: the layer's weights are gone.
BROKEN_BELOW_BITS = 1.0
# Losing more than 2 bits multiplies the rounding error by more than 4 (12 dB of SQNR).
# Ordinary Gaussian weights lose about 0.3 (per-channel, max / q0.999 of 4096 samples
# ~ 3.9 / 3.3 sigma) to 0.8 bits (per-tensor over 16M samples, ~ 5.6 / 3.3 sigma), so
# 2 bits flags a real outlier without flagging the scheme's normal cost.
DEGRADED_LOSS_BITS = 2.0
# ...but 8 effective bits is plenty for any weight (int8 weight-only quantization is
# treated as near-lossless, e.g. LLM.int8()), so a 16-bit grid losing 3 bits is "ok".
ENOUGH_BITS = 8.0

# Relative slack for floating-point index arithmetic (q * (n - 1) landing a hair below
# an integer); far below any meaningful quantile step.
_INDEX_EPS = 1e-9
# A tiny block's extreme element is dropped when it more than doubles the range
# (the brief's "more than 2x the next one").
_TINY_DROP_FACTOR = 2.0

_GRANULARITIES = ("tensor", "channel", "group")
_SCHEME_RE = re.compile(r"int(\d+)(?:-(tensor|channel|group(\d+)))?(?:-(sym|asym))?")
_ACCEPTED = (
    "int<bits>[-tensor|-channel|-group<size>][-sym|-asym], bits 2..16, "
    "e.g. int4, int8, int4-channel, int4-group128, int8-tensor-asym, int4-group64-sym"
)


@dataclass(frozen=True)
class Scheme:
    """A round-to-nearest weight quantization scheme (see the module docstring)."""

    bits: int
    granularity: str
    group_size: int | None
    symmetric: bool

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 16:
            raise ValueError(f"bits must be in 2..16, got {self.bits}")
        if self.granularity not in _GRANULARITIES:
            raise ValueError(
                f"granularity must be one of {_GRANULARITIES}, got {self.granularity!r}"
            )
        if self.granularity == "group":
            if self.group_size is None or self.group_size < 1:
                raise ValueError(f"a group scheme needs group_size >= 1, got {self.group_size}")
        elif self.group_size is not None:
            raise ValueError(f"group_size is only for group schemes, got {self.group_size}")

    @classmethod
    def parse(cls, text: str) -> Scheme:
        """Parse ``int4``, ``int8-channel``, ``int4-group128``, ``int8-tensor-asym`` ..."""
        match = _SCHEME_RE.fullmatch(text.strip().lower())
        if match is None:
            raise ValueError(f"unknown quantization scheme {text!r}; accepted: {_ACCEPTED}")
        bits_text, gran_text, group_text, sym_text = match.groups()
        granularity = "tensor" if gran_text is None else gran_text
        group_size = None
        if group_text is not None:
            granularity, group_size = "group", int(group_text)
        try:
            return cls(int(bits_text), granularity, group_size, sym_text != "asym")
        except ValueError as exc:
            raise ValueError(
                f"bad quantization scheme {text!r}: {exc}; accepted: {_ACCEPTED}"
            ) from None

    def __str__(self) -> str:
        text = f"int{self.bits}"
        if self.granularity == "channel":
            text += "-channel"
        elif self.granularity == "group":
            text += f"-group{self.group_size}"
        return text if self.symmetric else text + "-asym"


@dataclass(frozen=True)
class QuantRisk:
    """The worst block's loss of precision under one scheme (see the module docstring)."""

    scheme: str
    effective_bits: float
    zero_fraction: float
    worst_block: int | None
    range_ratio: float
    verdict: str
    measured_error: float
    outliers: int


def verdict_for(effective_bits: float, bits: int) -> str:
    """ "ok" | "degraded" | "broken" from the thresholds above."""
    if effective_bits < BROKEN_BELOW_BITS:
        return "broken"
    if effective_bits < min(bits - DEGRADED_LOSS_BITS, ENOUGH_BITS):
        return "degraded"
    return "ok"


# --- block layout -------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """A tensor cut into at most two families of equal-length blocks (one block a row).

    Per-group with a ragged last group is the only case with two families: the full
    groups, and the short last group of every row. Everything is vectorised per family.
    """

    shape: tuple[int, ...]
    rows: int  # rows of the (rows, cols) view the families are cut from
    cols: int
    group: int  # columns per block in the first family
    families: tuple[np.ndarray, ...]  # each (n_blocks_i, block_len_i)
    block_ids: tuple[np.ndarray, ...]  # global block index of each family row

    def restore(self, families: list[np.ndarray]) -> np.ndarray:
        full = families[0].reshape(self.rows, -1)
        flat = full if len(families) == 1 else np.concatenate([full, families[1]], axis=1)
        return flat.reshape(self.shape)


def _layout(values: np.ndarray, scheme: Scheme) -> _Layout:
    shape = values.shape
    if scheme.granularity == "tensor":
        flat = values.reshape(1, -1)
    elif scheme.granularity == "channel":
        flat = values.reshape(-1, 1) if values.ndim <= 1 else values.reshape(shape[0], -1)
    else:
        flat = values.reshape(1, -1) if values.ndim <= 1 else values.reshape(shape[0], -1)
    rows, cols = flat.shape
    if scheme.granularity != "group":
        return _Layout(shape, rows, cols, cols, (flat,), (np.arange(rows),))
    assert scheme.group_size is not None
    group = min(scheme.group_size, cols)
    n_full, rest = divmod(cols, group)
    per_row = n_full + (1 if rest else 0)
    ids = np.arange(rows * per_row).reshape(rows, per_row)
    full = flat[:, : n_full * group].reshape(rows * n_full, group)
    if not rest:
        return _Layout(shape, rows, cols, group, (full,), (ids.reshape(-1),))
    tail = flat[:, n_full * group :]
    return _Layout(
        shape, rows, cols, group, (full, tail), (ids[:, :n_full].reshape(-1), ids[:, n_full])
    )


# --- per-block statistics -----------------------------------------------------------


def is_tiny(n: int, q: float) -> bool:
    """Whether a block of n elements is too small for the quantile to exclude anything."""
    return n * (1.0 - q) < 1.0 - _INDEX_EPS


def bulk_rank(n: int, q: float) -> int:
    """Sorted index of a symmetric block's bulk |x| (a block that is not tiny)."""
    return math.floor(q * (n - 1) + _INDEX_EPS)


def central_ranks(n: int, q: float) -> tuple[int, int]:
    """Sorted indices of an asymmetric block's bulk ends (a block that is not tiny)."""
    klo = math.ceil((1.0 - q) / 2.0 * (n - 1) - _INDEX_EPS)
    return klo, n - 1 - klo


@dataclass(frozen=True)
class Bounds:
    """Per-block grid bounds and bulk bounds: lo <= x <= hi (lo = -hi when symmetric)."""

    lo: np.ndarray
    hi: np.ndarray
    bulk_lo: np.ndarray
    bulk_hi: np.ndarray


def block_bounds(blocks: np.ndarray, symmetric: bool, q: float) -> Bounds:
    n = blocks.shape[1]
    if symmetric:
        mag = np.abs(blocks)
        if is_tiny(n, q):
            if n == 1:
                bulk = top = mag[:, 0]
            else:
                part = np.partition(mag, n - 2, axis=1)
                second, top = part[:, n - 2], part[:, n - 1]
                bulk = np.where(top > _TINY_DROP_FACTOR * second, second, top)
        else:
            k = bulk_rank(n, q)
            part = np.partition(mag, [k, n - 1], axis=1)
            bulk, top = part[:, k], part[:, n - 1]
        return Bounds(-top, top, -bulk, bulk)
    if is_tiny(n, q):
        lo, hi = blocks.min(axis=1), blocks.max(axis=1)
        if n == 1:
            return Bounds(np.minimum(lo, 0), np.maximum(hi, 0), lo, hi)
        part = np.partition(blocks, sorted({1, n - 2}), axis=1)
        second_lo, second_hi = part[:, 1], part[:, n - 2]
        drop_hi = np.maximum(second_hi, 0) - np.minimum(lo, 0)  # range without the max
        drop_lo = np.maximum(hi, 0) - np.minimum(second_lo, 0)  # range without the min
        full = np.maximum(hi, 0) - np.minimum(lo, 0)
        drop = np.minimum(drop_hi, drop_lo) * _TINY_DROP_FACTOR < full
        bulk_hi = np.where(drop & (drop_hi <= drop_lo), second_hi, hi)
        bulk_lo = np.where(drop & (drop_hi > drop_lo), second_lo, lo)
    else:
        klo, khi = central_ranks(n, q)
        part = np.partition(blocks, sorted({0, klo, khi, n - 1}), axis=1)
        lo, hi = part[:, 0], part[:, n - 1]
        bulk_lo, bulk_hi = part[:, klo], part[:, khi]
    return Bounds(np.minimum(lo, 0), np.maximum(hi, 0), bulk_lo, bulk_hi)


def _range_bounds(blocks: np.ndarray, symmetric: bool) -> Bounds:
    """The grid's bounds alone (bulk = whole block): all fake_quantize needs."""
    if symmetric:
        top = np.abs(blocks).max(axis=1)
        return range_bounds(top, top, True)
    return range_bounds(blocks.min(axis=1), blocks.max(axis=1), False)


def range_bounds(low: np.ndarray, high: np.ndarray, symmetric: bool) -> Bounds:
    """Grid bounds with the bulk = the whole block, from each block's smallest and largest
    value (asymmetric: the grid is widened to hold 0), or its largest magnitude `high`
    (symmetric: `low` is not used)."""
    if symmetric:
        return Bounds(-high, high, -high, high)
    lo, hi = np.minimum(low, 0), np.maximum(high, 0)
    return Bounds(lo, hi, lo, hi)


def bounds_ratio(bounds: Bounds) -> np.ndarray:
    full = bounds.hi.astype(np.float64) - bounds.lo
    bulk = np.maximum(bounds.bulk_hi.astype(np.float64), 0) - np.minimum(bounds.bulk_lo, 0)
    safe = np.where(bulk > 0, bulk, 1.0)
    return np.where(bulk > 0, np.maximum(full / safe, 1.0), 1.0)


def _grid(bounds: Bounds, bits: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Per-block scale and zero point, and the integer range."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = bounds.hi.astype(np.float64) / qmax
        zero = np.zeros_like(scale)
        qmin = -qmax
    else:
        qmin, qmax = 0, 2**bits - 1
        scale = (bounds.hi.astype(np.float64) - bounds.lo) / qmax
        # An all-zero block has scale 0; any scale reproduces its zeros.
        scale = np.where(scale > 0, scale, 1.0)
        zero = np.clip(np.round(-bounds.lo / scale), qmin, qmax)
    scale = np.where(scale > 0, scale, 1.0)
    return scale, zero, qmin, qmax


def fake_quantize_blocks(blocks: np.ndarray, bounds: Bounds, scheme: Scheme) -> np.ndarray:
    scale, zero, qmin, qmax = _grid(bounds, scheme.bits, scheme.symmetric)
    dtype = blocks.dtype
    # Multiply by the reciprocal and add the zero point before rounding, as torch's
    # fake_quantize kernels do, so the two agree element for element (round half to even
    # in both: np.round and nearbyint).
    inv = (1.0 / scale).astype(dtype)[:, None]
    zp = zero.astype(dtype)[:, None]
    # In place on one temporary: this runs over every element of a 4096 x 4096 tensor.
    q = blocks * inv
    q += zp
    np.round(q, out=q)
    np.clip(q, qmin, qmax, out=q)
    q -= zp
    q *= scale.astype(dtype)[:, None]
    return q


# --- public API ---------------------------------------------------------------------


def as_measured(values: np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype != np.float32 and arr.dtype != np.float64:
        if not np.issubdtype(arr.dtype, np.floating):
            arr = arr.astype(np.float64)
        elif arr.dtype.itemsize < 4:
            arr = arr.astype(np.float32)  # float16 arithmetic would add its own rounding
    bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
    if bad:
        raise ValueError(f"{bad} non-finite values; quantization risk is undefined")
    return arr


def fake_quantize(values: np.ndarray, scheme: Scheme) -> np.ndarray:
    """Quantize then dequantize ``values`` under ``scheme``; same shape (float32 or float64)."""
    arr = as_measured(values)
    if arr.size == 0:
        return arr.copy()
    layout = _layout(arr, scheme)
    out = [
        fake_quantize_blocks(blocks, _range_bounds(blocks, scheme.symmetric), scheme)
        for blocks in layout.families
    ]
    return layout.restore(out)


def quant_risk(values: np.ndarray, scheme: Scheme, *, bulk_quantile: float = 0.999) -> QuantRisk:
    """The precision ``values`` keep under ``scheme``, set by its worst block."""
    if not 0.0 < bulk_quantile < 1.0:
        raise ValueError(f"bulk_quantile must be in (0, 1), got {bulk_quantile}")
    arr = as_measured(values)
    if arr.size == 0:
        return QuantRisk(str(scheme), float(scheme.bits), 0.0, None, 1.0, "ok", 0.0, 0)
    layout = _layout(arr, scheme)
    # At most two families (see _Layout): the loops below are over those, not blocks.
    bounds = [block_bounds(b, scheme.symmetric, bulk_quantile) for b in layout.families]
    n_blocks = sum(len(ids) for ids in layout.block_ids)
    ratio_of = np.empty(n_blocks)
    family_of = np.empty(n_blocks, dtype=np.intp)
    row_of = np.empty(n_blocks, dtype=np.intp)
    for f, (bnd, ids) in enumerate(zip(bounds, layout.block_ids, strict=True)):
        ratio_of[ids] = bounds_ratio(bnd)
        family_of[ids] = f
        row_of[ids] = np.arange(len(ids))
    worst_id = int(np.argmax(ratio_of))  # the first of equals: the lowest block index
    best_family, best_row = int(family_of[worst_id]), int(row_of[worst_id])

    zeros = nonzero = 0
    for blocks, bnd in zip(layout.families, bounds, strict=True):
        fq = fake_quantize_blocks(blocks, bnd, scheme)
        nonzero += int(np.count_nonzero(blocks))
        zeros += int(np.count_nonzero((fq == 0) & (blocks != 0)))
    return risk_of_worst_block(
        scheme,
        layout.families[best_family][best_row],
        float(ratio_of[worst_id]),
        worst_id,
        zeros,
        nonzero,
        bulk_quantile=bulk_quantile,
    )


def block_measure(
    values: np.ndarray, scheme: Scheme, *, bulk_quantile: float = 0.999
) -> tuple[float, int]:
    """One block's range ratio and how many of its non-zero elements quantize to 0."""
    block = as_measured(values).reshape(1, -1)
    lean = _tiny_symmetric(block[0], scheme, bulk_quantile)
    if lean is not None:
        top, bulk, fq, _ = lean
        full = float(top) - float(-top)
        spread = max(float(bulk), 0.0) - min(float(-bulk), 0.0)
        ratio = max(full / spread, 1.0) if spread > 0 else 1.0
        return ratio, int(np.count_nonzero((fq == 0) & (block[0] != 0)))
    bnd = block_bounds(block, scheme.symmetric, bulk_quantile)
    fq = fake_quantize_blocks(block, bnd, scheme)
    return float(bounds_ratio(bnd)[0]), int(np.count_nonzero((fq == 0) & (block != 0)))


def _tiny_symmetric(
    row: np.ndarray, scheme: Scheme, q: float
) -> tuple[np.floating, np.floating, np.ndarray, np.ndarray] | None:
    """For one block of a symmetric scheme too small for the bulk quantile (a group of 128,
    the default): its largest magnitude, its bulk magnitude, its fake-quantized values and
    its magnitudes, the numbers of block_bounds and fake_quantize_blocks (a zero's sign
    aside), without their machinery for many blocks (a tenth of a millisecond per block,
    for every tensor a checkpoint scan measures). None for any other block."""
    n = row.size
    if not scheme.symmetric or not n or not is_tiny(n, q):
        return None
    mag = np.abs(row)
    if n == 1:
        top = bulk = mag[0]
    else:
        part = np.partition(mag, n - 2)
        second, top = part[n - 2], part[n - 1]
        bulk = second if top > _TINY_DROP_FACTOR * second else top
    qmax = 2 ** (scheme.bits - 1) - 1
    scale = np.float64(top) / qmax
    scale = scale if scale > 0 else np.float64(1.0)
    dtype = row.dtype.type
    # The zero point (0) is not added and taken away: that only turns -0.0 into 0.0, which
    # no count or error sees; clipping is a minimum and a maximum (the values are finite).
    fq = row * dtype(1.0 / scale)
    np.round(fq, out=fq)
    np.minimum(fq, qmax, out=fq)
    np.maximum(fq, -qmax, out=fq)
    fq *= dtype(scale)
    return top, bulk, fq, mag


def risk_of_worst_block(
    scheme: Scheme,
    block: np.ndarray,
    range_ratio: float,
    block_index: int,
    zero_rounded: int,
    nonzero: int,
    *,
    bulk_quantile: float = 0.999,
) -> QuantRisk:
    """The QuantRisk of a tensor whose blocks were measured elsewhere (one streaming pass):
    its worst block's values, range ratio and index, and over the whole tensor the non-zero
    elements and how many of them quantize to zero. The worst block is fake-quantized here
    for the measured error, as `quant_risk` does."""
    values = as_measured(block).reshape(1, -1)
    row = values[0]
    lean = _tiny_symmetric(row, scheme, bulk_quantile)
    if lean is not None:
        _, high, fq, mag = lean
        in_bulk = mag <= high  # -high <= row <= high
    else:
        bnd = block_bounds(values, scheme.symmetric, bulk_quantile)
        fq = fake_quantize_blocks(values, bnd, scheme)[0]
        in_bulk = (row >= bnd.bulk_lo[0]) & (row <= bnd.bulk_hi[0])
    bulk = row[in_bulk]
    err = fq[in_bulk] - bulk
    bulk_power = float(np.dot(bulk, bulk))
    measured = math.sqrt(float(np.dot(err, err)) / bulk_power) if bulk_power > 0 else 0.0
    outliers = int(row.size - np.count_nonzero(in_bulk))
    return risk_from_measures(
        scheme, range_ratio, block_index, zero_rounded, nonzero, measured, outliers
    )


def risk_from_measures(
    scheme: Scheme,
    range_ratio: float,
    block_index: int,
    zero_rounded: int,
    nonzero: int,
    measured_error: float,
    outliers: int,
) -> QuantRisk:
    """The QuantRisk of a tensor measured elsewhere, worst block's error included."""
    effective = scheme.bits - math.log2(range_ratio)
    return QuantRisk(
        scheme=str(scheme),
        effective_bits=effective,
        zero_fraction=zero_rounded / nonzero if nonzero else 0.0,
        worst_block=None if scheme.granularity == "tensor" else block_index,
        range_ratio=range_ratio,
        verdict=verdict_for(effective, scheme.bits),
        measured_error=measured_error,
        outliers=outliers,
    )


def joint_risk(scalar: float, weights: np.ndarray, scheme: Scheme) -> QuantRisk:
    """Risk of a shape-[1] scalar quantized together with ``weights``.

    The scalar is put first, followed by the flattened weights, and the 1-D result is
    analysed under ``scheme``: per-tensor, it shares the weights' one scale (the
    incident: 56.25 next to weights in [-2, 2] leaves int4 4 - log2(56.25/2) = -0.81
    bits); per-group, it shares the first group with its neighbours, the first
    group_size - 1 weights; per-channel, a 1-D tensor's channels are its elements, so
    the scalar gets its own scale and nothing is lost (the write-up's "the scalar owns
    its group"). Block 0 is the scalar's.
    """
    flat = as_measured(weights).reshape(-1)
    joined = np.concatenate([np.asarray([scalar], dtype=flat.dtype), flat])
    return quant_risk(joined, scheme)
