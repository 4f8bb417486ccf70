"""`quant_risk` and `joint_risk` of a tensor read in bounded chunks, for every scheme.

The native kernels (tensor_pass) measure the default scheme in one pass; every other
scheme used to need the whole tensor in memory, plus numpy temporaries several times
its size. Here the tensor is read as a stream of flat chunks, as many times as needed,
and memory stays at a few chunks whatever the tensor's size.

Blocks (quantization.py's docstring) are contiguous runs of the flat tensor: the groups
of row 0, then those of row 1, ... (a channel is a row, the tensor is one run).

- Blocks of at most `CHUNK_ELEMENTS` elements are measured in batches of whole blocks by
  the very code `quant_risk` runs (block_bounds, fake_quantize_blocks), so every number is
  bitwise the same; a copy of the worst block so far is kept, and `risk_of_worst_block`
  finishes it.
- A larger block (per-tensor, or a channel row larger than a chunk) gets its bulk
  quantile by radix selection over the order-preserving integer keys of its floats:
  a histogram of the top 16 bits finds the bucket holding the wanted rank, the next
  pass the next 16 bits within that bucket (or, once the bucket holds at most a chunk
  of elements, collects them and partitions), until the element is the one
  `np.partition` would give. The same passes count the elements that round to zero
  (the grid needs only the block's range, known after the first pass), and a last pass
  over the worst block, when it is one of these, sums its bulk's squared error in
  float64: `measured_error` may differ from `quant_risk`'s float32 sums in the last
  bits, every other field is exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deadweight.checkpoints.quantization import (
    Bounds,
    QuantRisk,
    Scheme,
    as_measured,
    block_bounds,
    bounds_ratio,
    bulk_rank,
    central_ranks,
    fake_quantize_blocks,
    is_tiny,
    range_bounds,
    risk_from_measures,
    risk_of_worst_block,
)
from deadweight.checkpoints.readers import Checkpoint, TensorEntry
from deadweight.checkpoints.readers.base import output_dtype

__all__ = [
    "CHUNK_ELEMENTS",
    "MAX_BLOCKS",
    "PIECE_ELEMENTS",
    "Source",
    "array_source",
    "checkpoint_source",
    "stream_joint_risk",
    "stream_quant_risk",
]

# Elements measured at once: 16 MB of float32. A batch costs about five times that in
# numpy temporaries (|x|, the partitioned copy, the fake-quantized copy, masks).
CHUNK_ELEMENTS = 1 << 22
# Blocks measured at once: each has a dozen numbers of its own in a batch (bounds, ratio,
# scale, zero point, in float64), which for blocks of one element (per-channel on a 1-D
# tensor: a layer scalar quantized with its weights) would be ten times the elements.
MAX_BLOCKS = 1 << 18
# Elements of a block too large to hold handled at once: its passes make a few
# temporaries of this size (keys, digits, the fake-quantized piece, float64 errors),
# kept to a few MB so that they add little to the chunk the reader holds.
PIECE_ELEMENTS = 1 << 20
# Bits of the key resolved per selection pass: a 65536-bucket histogram (512 KB).
_RADIX_BITS = 16
_RADIX_MASK = (1 << _RADIX_BITS) - 1

# A fresh pass over the tensor's elements, flat in C order, in chunks of any size (a
# chunk may be a buffer the source reuses for the next one).
Source = Callable[[], Iterable[np.ndarray]]


def checkpoint_source(ckpt: Checkpoint, entry: TensorEntry) -> Source:
    """`entry`'s elements from `ckpt`, a chunk of about CHUNK_ELEMENTS at a time."""
    max_bytes = CHUNK_ELEMENTS * output_dtype(entry.dtype).itemsize
    return lambda: ckpt.chunks(entry, max_bytes)


def array_source(values: np.ndarray, chunk_elements: int | None = None) -> Source:
    """An in-memory array as a source (tests, callers holding the array anyway)."""
    flat = np.asarray(values).reshape(-1)
    step = max(1, chunk_elements or CHUNK_ELEMENTS)
    return lambda: (flat[i : i + step] for i in range(0, flat.size, step))


def stream_quant_risk(
    source: Source, shape: tuple[int, ...], scheme: Scheme, *, bulk_quantile: float = 0.999
) -> QuantRisk:
    """`quant_risk(values, scheme)` of the tensor of `shape` that `source` streams."""
    if not 0.0 < bulk_quantile < 1.0:
        raise ValueError(f"bulk_quantile must be in (0, 1), got {bulk_quantile}")
    numel = math.prod(shape)
    if numel == 0:
        return QuantRisk(str(scheme), float(scheme.bits), 0.0, None, 1.0, "ok", 0.0, 0)
    return _measure(source, _layout_of(shape, scheme), scheme, bulk_quantile)


def stream_joint_risk(
    scalar: float, source: Source, numel: int, scheme: Scheme, *, bulk_quantile: float = 0.999
) -> QuantRisk:
    """`joint_risk(scalar, values, scheme)`: the scalar first, then the `numel` streamed
    weights, as one 1-D tensor (the scalar takes the weights' measured dtype)."""

    def joined() -> Iterator[np.ndarray]:
        chunks = iter(source())
        first = next(chunks, None)
        head = as_measured(np.empty(0) if first is None else first)
        yield np.asarray([scalar], dtype=head.dtype)
        yield head
        yield from chunks

    return stream_quant_risk(joined, (numel + 1,), scheme, bulk_quantile=bulk_quantile)


# --- layout: blocks as runs of the flat stream ------------------------------------


@dataclass(frozen=True)
class _Layout:
    """`rows` rows of `cols` elements, each cut into groups of `group` (the last shorter)."""

    rows: int
    cols: int
    group: int

    @property
    def per_row(self) -> int:
        return -(-self.cols // self.group)

    def length(self, j: int) -> int:
        """Elements of a row's j-th block."""
        return min(self.group, self.cols - j * self.group)


def _layout_of(shape: tuple[int, ...], scheme: Scheme) -> _Layout:
    """The same blocks as quantization._layout, by position in the flat tensor."""
    numel = math.prod(shape)
    if scheme.granularity == "tensor":
        return _Layout(1, numel, numel)
    rows = 1 if len(shape) <= 1 else shape[0]
    if scheme.granularity == "channel":
        rows = numel if len(shape) <= 1 else rows
        return _Layout(rows, numel // rows, numel // rows)
    assert scheme.group_size is not None
    cols = numel // rows
    return _Layout(rows, cols, min(scheme.group_size, cols))


@dataclass(frozen=True)
class _Batch:
    """Whole blocks: `rows` rows of `cols` elements (a part of one row when rows == 1),
    the first block numbered `first`."""

    first: int
    rows: int
    cols: int


@dataclass(frozen=True)
class _Piece:
    """Up to a chunk of elements of block `block`, too large to hold, from `offset`."""

    block: int
    offset: int
    size: int
    length: int  # the whole block's


def _steps(layout: _Layout, limit: int, q: float) -> Iterator[_Batch | _Piece]:
    """The stream cut into batches of whole small blocks and pieces of large ones."""

    def large(n: int) -> bool:
        # A tiny block (quantization.is_tiny, under 1 / (1 - q) elements) is always held.
        return n > limit and not is_tiny(n, q)

    rows, cols, group, per_row = layout.rows, layout.cols, layout.group, layout.per_row
    if not large(group):
        if cols <= limit:
            step = max(1, min(limit // cols, MAX_BLOCKS // per_row))
            for r in range(0, rows, step):
                yield _Batch(r * per_row, min(step, rows - r), cols)
            return
        step = max(1, min(limit // group, MAX_BLOCKS))
        for r in range(rows):
            for j in range(0, per_row, step):
                end = min(cols, (j + step) * group)
                yield _Batch(r * per_row + j, 1, end - j * group)
        return
    for r in range(rows):
        for j in range(per_row):
            block, n = r * per_row + j, layout.length(j)
            if not large(n):
                yield _Batch(block, 1, n)
                continue
            piece = min(limit, PIECE_ELEMENTS)
            for offset in range(0, n, piece):
                yield _Piece(block, offset, min(piece, n - offset), n)


# --- reading: the stream re-cut to the steps --------------------------------------


class _Reader:
    """Takes consecutive runs of elements out of a stream of chunks of any size.

    A run returned by `take` may be a view of the source's buffer: it is valid until the
    next call. What is left of a chunk is copied before the next chunk is asked for."""

    def __init__(self, chunks: Iterable[np.ndarray]) -> None:
        self._chunks = iter(chunks)
        self._buf: np.ndarray = np.empty(0)
        self._pos = 0

    def _next(self) -> np.ndarray:
        chunk = next(self._chunks, None)
        if chunk is None:
            raise ValueError("the source ended before the tensor's last element")
        return as_measured(chunk).reshape(-1)

    def take(self, n: int) -> np.ndarray:
        if self._buf.size - self._pos >= n:
            self._pos += n
            return self._buf[self._pos - n : self._pos]
        if self._pos == self._buf.size:  # nothing left over: a view of the next chunk
            self._buf, self._pos = self._next(), 0
            if self._buf.size >= n:
                self._pos = n
                return self._buf[:n]
        left = self._buf[self._pos :]
        out = np.empty(n, dtype=left.dtype)
        have = left.size
        out[:have] = left
        while have < n:
            chunk = self._next()
            used = min(n - have, chunk.size)
            out[have : have + used] = chunk[:used]
            have += used
            self._buf, self._pos = chunk, used
        return out

    def skip(self, n: int) -> None:
        while self._buf.size - self._pos < n:
            n -= self._buf.size - self._pos
            self._buf, self._pos = self._next(), 0
        self._pos += n


# --- the worst block ----------------------------------------------------------------


@dataclass
class _Worst:
    """The largest ratio so far; among equals the lowest block number (np.argmax's)."""

    ratio: float = -math.inf
    block: int = -1
    values: np.ndarray | None = None  # a copy, for a held block

    def offer(self, ratio: float, block: int, values: np.ndarray | None) -> None:
        if ratio > self.ratio or (ratio == self.ratio and block < self.block):
            self.ratio, self.block = ratio, block
            self.values = None if values is None else values.copy()


# --- blocks held in memory ----------------------------------------------------------


@dataclass
class _Counts:
    zero_rounded: int = 0
    nonzero: int = 0


def _measure_batch(
    data: np.ndarray,
    batch: _Batch,
    layout: _Layout,
    scheme: Scheme,
    q: float,
    counts: _Counts,
    worst: _Worst,
) -> None:
    """quant_risk's per-block measurement of a batch of whole blocks."""
    view = data.reshape(batch.rows, batch.cols)
    full, rest = divmod(batch.cols, layout.group)
    row_first = batch.first + np.arange(batch.rows) * layout.per_row
    families: list[tuple[np.ndarray, np.ndarray]] = []
    if full:
        blocks = view[:, : full * layout.group].reshape(batch.rows * full, layout.group)
        families.append((blocks, (row_first[:, None] + np.arange(full)).reshape(-1)))
    if rest:
        families.append((view[:, full * layout.group :], row_first + full))
    for blocks, ids in families:
        bounds = block_bounds(blocks, scheme.symmetric, q)
        ratios = bounds_ratio(bounds)
        fq = fake_quantize_blocks(blocks, bounds, scheme)
        counts.nonzero += int(np.count_nonzero(blocks))
        counts.zero_rounded += int(np.count_nonzero((fq == 0) & (blocks != 0)))
        best = int(np.argmax(ratios))
        worst.offer(float(ratios[best]), int(ids[best]), blocks[best])


# --- blocks too large to hold: radix selection ----------------------------------------


def _keys(values: np.ndarray, symmetric: bool) -> np.ndarray:
    """Unsigned integer keys ordered as |x| (symmetric) or x (asymmetric)."""
    width = values.dtype.itemsize * 8
    signed = values.view(np.int32 if width == 32 else np.int64)
    if symmetric:  # the magnitude's bits: non-negative floats order as integers
        return (signed & ((1 << (width - 1)) - 1)).view(signed.dtype.str.replace("i", "u"))
    # negative: flip every bit; non-negative: set the sign bit (-0.0 and 0.0 are adjacent)
    mask = signed >> (width - 1)
    mask |= np.iinfo(signed.dtype).min
    mask ^= signed
    return mask.view(signed.dtype.str.replace("i", "u"))


def _value_of(key: int, dtype: np.dtype[Any], symmetric: bool) -> np.ndarray:
    """The one-element array of `dtype` whose key is `key`."""
    width = dtype.itemsize * 8
    sign = 1 << (width - 1)
    if not symmetric:
        key = key & (sign - 1) if key & sign else ~key & ((1 << width) - 1)
    return np.array([key], dtype=np.uint32 if width == 32 else np.uint64).view(dtype)


@dataclass
class _Rank:
    """One order statistic of a large block, resolved 16 bits of its key per pass."""

    rank: int  # within the elements whose key starts with `prefix`
    width: int  # bits of the key
    prefix: int = 0
    level: int = 0  # 16-bit digits of `prefix`
    collect: bool = False  # this pass keeps the bucket's keys instead of a histogram
    key: int | None = None
    hist: np.ndarray | None = None
    kept: list[np.ndarray] = field(default_factory=list)

    def add(self, keys: np.ndarray) -> None:
        if self.level:
            keys = keys[(keys >> (self.width - _RADIX_BITS * self.level)) == self.prefix]
        if self.collect:
            self.kept.append(keys.copy())
            return
        shift = self.width - _RADIX_BITS * (self.level + 1)
        digits = ((keys >> shift) & _RADIX_MASK).astype(np.uint16)
        counts = np.bincount(digits, minlength=1 << _RADIX_BITS)
        self.hist = counts if self.hist is None else self.hist + counts

    def resolve(self, collect_limit: int) -> None:
        """End of a pass over the block: narrow the prefix, or find the key."""
        if self.collect:
            keys = np.concatenate(self.kept)
            self.key = int(np.partition(keys, self.rank)[self.rank])
            self.kept = []
            return
        assert self.hist is not None
        below = np.cumsum(self.hist)
        digit = int(np.searchsorted(below, self.rank, side="right"))
        self.rank -= int(below[digit - 1]) if digit else 0
        self.prefix = (self.prefix << _RADIX_BITS) | digit
        self.level += 1
        self.collect = int(self.hist[digit]) <= collect_limit
        self.hist = None
        if self.level * _RADIX_BITS == self.width:
            self.key = self.prefix


@dataclass
class _LargeBlock:
    """What the passes learn about one block too large to hold."""

    index: int
    length: int
    ranks: list[_Rank] = field(default_factory=list)
    low: float = math.inf  # x min, or unused when symmetric
    high: float = -math.inf  # x max, or |x| max when symmetric
    nonzero: int = 0
    zero_rounded: int | None = None
    counting: int = 0  # zero-rounded elements counted so far in the counting pass
    dtype: np.dtype[Any] | None = None
    grid: Bounds | None = None
    bounds: Bounds | None = None

    @property
    def resolved(self) -> bool:
        return all(r.key is not None for r in self.ranks) and self.zero_rounded is not None


def _first_pass_piece(block: _LargeBlock, data: np.ndarray, symmetric: bool) -> None:
    block.dtype = data.dtype
    if symmetric:
        block.high = max(block.high, float(data.max()), -float(data.min()))
    else:
        block.low = min(block.low, float(data.min()))
        block.high = max(block.high, float(data.max()))
    block.nonzero += int(np.count_nonzero(data))
    keys = _keys(data, symmetric)
    for rank in block.ranks:
        rank.add(keys)


def _grid_of(block: _LargeBlock, symmetric: bool) -> Bounds:
    """The block's grid bounds, as block_bounds gives them (bulk = whole range)."""
    assert block.dtype is not None
    low, high = (np.array([v], dtype=block.dtype) for v in (block.low, block.high))
    return range_bounds(low, high, symmetric)


def _bounds_of(block: _LargeBlock, symmetric: bool) -> Bounds:
    assert block.grid is not None and block.dtype is not None
    values = [_value_of(r.key, block.dtype, symmetric) for r in block.ranks if r.key is not None]
    if symmetric:
        (bulk,) = values
        return Bounds(block.grid.lo, block.grid.hi, -bulk, bulk)
    bulk_lo, bulk_hi = values
    return Bounds(block.grid.lo, block.grid.hi, bulk_lo, bulk_hi)


def _new_large(piece: _Piece, width: int, symmetric: bool, q: float) -> _LargeBlock:
    n = piece.length
    ranks = [bulk_rank(n, q)] if symmetric else list(central_ranks(n, q))
    return _LargeBlock(piece.block, piece.length, [_Rank(k, width) for k in ranks])


# --- the passes -------------------------------------------------------------------


def _measure(source: Source, layout: _Layout, scheme: Scheme, q: float) -> QuantRisk:
    limit = CHUNK_ELEMENTS
    counts, worst = _Counts(), _Worst()
    large: dict[int, _LargeBlock] = {}
    symmetric = scheme.symmetric

    # Pass 1: every held block measured; the large blocks' ranges, non-zero counts and
    # top-16-bit histograms.
    reader = _Reader(source())
    for step in _steps(layout, limit, q):
        data = reader.take(step.rows * step.cols if isinstance(step, _Batch) else step.size)
        if isinstance(step, _Batch):
            _measure_batch(data, step, layout, scheme, q, counts, worst)
            continue
        if step.offset == 0:
            large[step.block] = _new_large(step, data.dtype.itemsize * 8, symmetric, q)
        block = large[step.block]
        _first_pass_piece(block, data, symmetric)
        if step.offset + step.size == step.length:
            for rank in block.ranks:
                rank.resolve(limit)
            block.grid = _grid_of(block, symmetric)

    # Passes 2...: the large blocks' zero-rounded counts and the next digits of each rank.
    while not all(b.resolved for b in large.values()):
        _pass_over_large(source, layout, scheme, q, large, limit)

    for block in large.values():
        block.bounds = _bounds_of(block, symmetric)
        assert block.zero_rounded is not None
        counts.zero_rounded += block.zero_rounded
        counts.nonzero += block.nonzero
        worst.offer(float(bounds_ratio(block.bounds)[0]), block.index, None)

    if worst.values is not None:
        return risk_of_worst_block(
            scheme, worst.values, worst.ratio, worst.block, counts.zero_rounded,
            counts.nonzero, bulk_quantile=q,
        )  # fmt: skip
    measured, outliers = _error_of(source, layout, scheme, q, large[worst.block], limit)
    return risk_from_measures(
        scheme, worst.ratio, worst.block, counts.zero_rounded, counts.nonzero, measured, outliers
    )


def _large_pieces(
    source: Source, layout: _Layout, q: float, limit: int, wanted: set[int]
) -> Iterator[tuple[_Piece, np.ndarray]]:
    """The pieces of the `wanted` large blocks, read in one pass; the rest skipped."""
    reader = _Reader(source())
    last = max(wanted)
    for step in _steps(layout, limit, q):
        if isinstance(step, _Batch):
            reader.skip(step.rows * step.cols)
        elif step.block not in wanted:
            reader.skip(step.size)
        else:
            yield step, reader.take(step.size)
            if step.block == last and step.offset + step.size == step.length:
                return  # nothing further is needed: the rest is not read


def _pass_over_large(
    source: Source,
    layout: _Layout,
    scheme: Scheme,
    q: float,
    large: dict[int, _LargeBlock],
    limit: int,
) -> None:
    symmetric = scheme.symmetric
    pending = {i for i, b in large.items() if not b.resolved}
    for piece, data in _large_pieces(source, layout, q, limit, pending):
        block = large[piece.block]
        if block.zero_rounded is None:
            assert block.grid is not None
            fq = fake_quantize_blocks(data[None, :], block.grid, scheme)[0]
            block.counting += int(np.count_nonzero((fq == 0) & (data != 0)))
        open_ranks = [r for r in block.ranks if r.key is None]
        if open_ranks:
            keys = _keys(data, symmetric)
            for rank in open_ranks:
                rank.add(keys)
        if piece.offset + piece.size == piece.length:
            block.zero_rounded = block.counting
            for rank in open_ranks:
                rank.resolve(limit)


def _error_of(
    source: Source, layout: _Layout, scheme: Scheme, q: float, block: _LargeBlock, limit: int
) -> tuple[float, int]:
    """risk_of_worst_block's measured error and outliers of a large block, summed in float64."""
    bounds = block.bounds
    assert bounds is not None
    err_sq = power = 0.0
    outliers = 0
    for _, data in _large_pieces(source, layout, q, limit, {block.index}):
        fq = fake_quantize_blocks(data[None, :], bounds, scheme)[0]
        in_bulk = (data >= bounds.bulk_lo[0]) & (data <= bounds.bulk_hi[0])
        bulk = data[in_bulk]
        err = (fq[in_bulk] - bulk).astype(np.float64)
        # An exact zero is on every grid: no error. (Where the float inverse of the scale
        # overflows, all values below ~1e-37, fake quantization makes it 0 * inf = NaN.)
        err[bulk == 0] = 0.0
        wide = bulk.astype(np.float64)
        err_sq += float(np.dot(err, err))
        power += float(np.dot(wide, wide))
        outliers += int(data.size - np.count_nonzero(in_bulk))
    return (math.sqrt(err_sq / power) if power > 0 else 0.0), outliers
