"""The elementwise propagators' fast paths against slow references.

`_combine` hands a shift on one side of a sum on without a call per effect, and
`_aligned` hands a same-rank operand's carrier on as it is when no dim of it drops
out; both must give what sending every facet through `_combine_facet` and
`map_carrier` gives, on random carriers (tags compared up to renaming of the fresh
ones, with the cancellations they record).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from deadweight.checking.carrier_algebra import (
    EMPTY,
    SHIFT,
    Carrier,
    Facet,
    finish,
    map_carrier,
    merge_general,
    new_tag,
    nontrivial,
)
from deadweight.checking.op_propagation import (
    _CANCELLED,
    OpCall,
    _aligned,
    _combine,
    _combine_facet,
)
from tests.checking.test_carrier_algebra import random_carrier


class Tracker:
    """What a propagator asks of the tracker, recorded."""

    def __init__(self, carriers: dict[int, Carrier]) -> None:
        self.carriers = carriers
        self.absorbed: list[tuple[int, str, bool]] = []
        self.free: set[int] = set()

    def carrier(self, value: object) -> Carrier:
        return self.carriers.get(id(value), EMPTY) if isinstance(value, torch.Tensor) else EMPTY

    def absorb(
        self, ctx: OpCall, entity: int, facet: Facet, op: str, dims: Any, full: bool
    ) -> None:
        if facet.kind == SHIFT and not full:
            self.free.add(entity)
            return
        self.absorbed.append((entity, op, full))
        ctx.absorbed = True

    def free_means(self, entities: Any) -> None:
        self.free.update(entities)


def aligned_reference(value: Any, c: Carrier, out_shape: list[int]) -> Carrier:
    if not c.pure or not isinstance(value, torch.Tensor):
        return c
    offset = len(out_shape) - value.dim()
    return map_carrier(c, lambda d: nontrivial(out_shape, [x + offset for x in d]))


def combine_reference(
    ctx: OpCall, op: str, a: Any, b: Any, out_shape: list[int], alpha: Any
) -> Carrier:
    """Every effect through `_combine_facet`, one call each."""
    ca = aligned_reference(a, ctx.c(a), out_shape)
    cb = aligned_reference(b, ctx.c(b), out_shape)
    lost, partial = merge_general([ca, cb])
    pure = {}
    for e in set(ca.pure) | set(cb.pure):
        if lost >> e & 1:
            continue
        f = _combine_facet(ctx, op, e, ca.pure.get(e), cb.pure.get(e), a, b, out_shape, alpha)
        if f is None:
            lost |= 1 << e
        elif f is not _CANCELLED:
            pure[e] = f
    return finish(lost, partial, pure)


def canonical(c: Carrier, fresh_from: int) -> tuple[Any, ...]:
    """The carrier with the tags made after `fresh_from` renamed in entity order."""
    names: dict[int, int] = {}
    facets = []
    for e in sorted(c.pure):
        f = c.pure[e]
        tag = f.tag if f.tag <= fresh_from else -names.setdefault(f.tag, len(names) + 1)
        facets.append((e, f.kind, f.full, f.uniform, f.degree, f.approx, tag))
    return c.lost, c.partial, tuple(facets)


def operand(rng: random.Random, out_shape: list[int]) -> torch.Tensor | float:
    """A tensor broadcasting to `out_shape` (same rank or fewer dims, some of size 1),
    or a plain number."""
    if rng.random() < 0.1:
        return rng.choice((1e-5, 2.0))
    rank = rng.randint(max(len(out_shape) - 2, 0), len(out_shape))
    shape = [s if rng.random() < 0.7 else 1 for s in out_shape[len(out_shape) - rank :]]
    return torch.zeros(shape)


def test_combine_matches_one_call_per_effect() -> None:
    rng = random.Random(0)
    kept_shifts = 0
    for trial in range(600):
        out_shape = [rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 4))]
        a, b = operand(rng, out_shape), operand(rng, out_shape)
        tags = [new_tag() for _ in range(4)]  # the inputs' shifts share a few terms
        fresh_from = new_tag()
        carriers = {}
        for v in (a, b):
            if isinstance(v, torch.Tensor):
                carriers[id(v)] = random_carrier(rng, v.dim(), tags)
        op = rng.choice(("add", "sub", "mul", "div"))
        alpha = rng.choice((None, 1, 2.0)) if op in ("add", "sub") else None
        results = []
        for combine in (_combine, combine_reference):
            tracker = Tracker(carriers)
            ctx = OpCall(tracker, f"Tensor.{op}", trial, (a, b), {}, torch.zeros(out_shape))
            out = combine(ctx, op, a, b, out_shape, alpha)
            results.append((canonical(out, fresh_from), tracker.absorbed, tracker.free))
        assert results[0] == results[1], (op, alpha, out_shape)
        if op in ("add", "sub"):
            kept_shifts += sum(f.kind == SHIFT and f.tag <= fresh_from for f in out.pure.values())
    assert kept_shifts > 100  # the fast path was taken, and often


def test_aligned_keeps_a_same_rank_carrier_only_when_no_dim_drops_out() -> None:
    rng = random.Random(1)
    kept = 0
    for _ in range(400):
        out_shape = [rng.choice((1, 2, 3)) for _ in range(rng.randint(1, 4))]
        value = operand(rng, out_shape)
        if not isinstance(value, torch.Tensor):
            continue
        c = random_carrier(rng, value.dim())
        fast = _aligned(value, c, out_shape)
        assert fast == aligned_reference(value, c, out_shape)
        kept += fast is c and bool(c.pure)
    assert kept > 20
