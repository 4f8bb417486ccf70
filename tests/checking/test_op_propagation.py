"""The propagators' fast paths against slow references.

`_combine` hands a shift on one side of a sum on without a call per effect, and
`_aligned` hands a same-rank operand's carrier on as it is when no dim of it drops
out; both must give what sending every facet through `_combine_facet` and
`map_carrier` gives, on random carriers (tags compared up to renaming of the fresh
ones, with the cancellations they record). Reshapes, permutations and matmuls map a
facet's dims through maps remembered per shape (`dim_map`, `_matmul_maps`); they
must give what the maps made afresh for the call give.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch

from deadweight.checking import carrier_algebra
from deadweight.checking.carrier_algebra import (
    EMPTY,
    SCALE,
    SHIFT,
    Carrier,
    Facet,
    finish,
    general,
    map_carrier,
    merge_general,
    new_tag,
    nontrivial,
    reshape_dims,
)
from deadweight.checking.op_propagation import (
    _CANCELLED,
    OpCall,
    _aligned,
    _combine,
    _combine_facet,
    _matmul_carrier,
    _permutation,
    propagate_permute,
    propagate_reshape,
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


def reshape_reference(ctx: OpCall) -> Carrier:
    """The reshape's maps made for the call, as before they were remembered."""
    c = ctx.c(ctx.args[0])
    if not c.pure:
        return c
    i, o = list(ctx.args[0].shape), list(ctx.out.shape)
    if math.prod(i) == math.prod(o):
        return map_carrier(c, lambda d: reshape_dims(i, o, d))
    offset = len(o) - len(i)
    return map_carrier(c, lambda d: nontrivial(o, (x + offset for x in d)))


def permute_reference(ctx: OpCall) -> Carrier:
    x = ctx.args[0]
    c = ctx.c(x)
    perm = _permutation(ctx, x.dim())
    if perm is None or sorted(perm) != list(range(x.dim())):
        return general([c])
    where = {src: dst for dst, src in enumerate(perm)}
    return map_carrier(c, lambda d: frozenset(where[x] for x in d))


def test_reshape_and_permute_match_their_maps_made_afresh() -> None:
    rng = random.Random(4)
    mapped = 0
    for trial in range(300):
        shape = [rng.choice((1, 2, 3, 4)) for _ in range(rng.randint(1, 4))]
        x = torch.zeros(shape)
        c = random_carrier(rng, len(shape))
        calls: list[tuple[str, tuple[Any, ...], dict[str, Any], torch.Tensor]] = [
            ("Tensor.view", (x, -1), {}, x.view(-1)),
            ("Tensor.reshape", (x, 1, *shape), {}, x.reshape(1, *shape)),
            ("Tensor.expand", (x, 2, *shape), {}, x.expand(2, *shape)),
        ]
        if len(shape) >= 2:
            a, b = rng.sample(range(len(shape)), 2)
            perm = list(range(len(shape)))
            rng.shuffle(perm)
            calls += [
                ("Tensor.transpose", (x, a, b), {}, x.transpose(a, b)),
                ("Tensor.transpose", (x,), {"dim0": a, "dim1": b}, x.transpose(a, b)),
                ("Tensor.permute", (x, *perm), {}, x.permute(*perm)),
                ("Tensor.permute", (x, perm), {}, x.permute(perm)),  # a list: unhashable
                ("Tensor.permute", (x, tuple(perm)), {}, x.permute(tuple(perm))),
                ("Tensor.transpose", (x, a, a), {}, x.transpose(a, a)),
                ("Tensor.transpose", (x, torch.tensor(a), b), {}, x),  # unreadable
                # equal to ints, but not read as dims: never answered from an int's map
                ("Tensor.transpose", (x, np.int64(a), b), {}, x.transpose(a, b)),
                ("Tensor.transpose", (x, bool(a), b), {}, x.transpose(int(bool(a)), b)),
            ]
        for name, args, kwargs, out in calls:
            tracker = Tracker({id(x): c})
            ctx = OpCall(tracker, name, trial, args, kwargs, out)
            fast = (
                propagate_reshape
                if name in ("Tensor.view", "Tensor.reshape", "Tensor.expand")
                else propagate_permute
            )
            slow = reshape_reference if fast is propagate_reshape else permute_reference
            got, expected = fast(ctx), slow(OpCall(tracker, name, trial, args, kwargs, out))
            assert got == expected, (name, shape, args[1:], kwargs)
            mapped += got is not c
    assert mapped > 300
    # a permutation's map is remembered by plain int dims only (a tensor in a key would
    # be held, and a numpy int or a bool would answer for the int it equals)
    keys = [key for key in carrier_algebra._DIM_MAPS if key[0] == "permute"]
    assert keys and all(type(d) is int for key in keys for d in key[3]), keys


def matmul_reference(
    ctx: OpCall, a: torch.Tensor, b: torch.Tensor, out_shape: list[int], transposed: bool
) -> Carrier:
    """a @ b's carrier with its dim maps made for the call (the code before the maps
    were remembered)."""
    ca, cb = ctx.c(a), ctx.c(b)
    a_shape = list(a.shape)
    b_shape = list(reversed(b.shape)) if transposed else list(b.shape)
    nd = len(out_shape)
    batch_out = nontrivial(out_shape, range(nd - 2))

    def a_map(d: frozenset[int]) -> frozenset[int] | None:
        if len(a_shape) - 1 in d:
            return None
        return nontrivial(out_shape, (x + nd - len(a_shape) for x in d))

    def b_map(d: frozenset[int]) -> frozenset[int] | None:
        if transposed:
            d = frozenset({0: 1, 1: 0}[x] for x in d)
        if len(b_shape) - 2 in d:
            return None
        return nontrivial(out_shape, (x + nd - len(b_shape) for x in d))

    def b_shift(s: frozenset[int]) -> frozenset[int]:
        if transposed:
            s = frozenset({0: 1, 1: 0}[x] for x in s)
        m = nontrivial(out_shape, [nd - 1]) if len(b_shape) - 1 in s else frozenset()
        return nontrivial(out_shape, [nd - 2]) | batch_out | m

    lost, partial = merge_general([ca, cb])
    pure: dict[int, Facet] = {}
    for e in set(ca.pure) | set(cb.pure):
        if lost >> e & 1:
            continue
        fa, fb = ca.pure.get(e), cb.pure.get(e)
        if fa is not None and fb is not None:
            if fa.kind == fb.kind == SCALE:
                full_a = None if fa.full is None else a_map(fa.full)
                full_b = None if fb.full is None else b_map(fb.full)
                full = full_a | full_b if full_a is not None and full_b is not None else None
                uniform = fa.uniform and fb.uniform
                if full is None and not uniform:
                    lost |= 1 << e
                    continue
                pure[e] = Facet(SCALE, full, uniform, fa.degree + fb.degree, fa.approx or fb.approx)
            else:
                lost |= 1 << e
            continue
        f = fa if fa is not None else fb
        assert f is not None
        if f.kind == SCALE:
            full = None if f.full is None else (a_map if fa is not None else b_map)(f.full)
            if full is None and not f.uniform:
                lost |= 1 << e
                continue
            pure[e] = Facet(SCALE, full, f.uniform, f.degree, f.approx, f.tag)
        elif f.full is None:
            lost |= 1 << e
        elif fa is not None:
            full = (
                (a_map(f.full - {len(a_shape) - 1}) or frozenset())
                | nontrivial(out_shape, [nd - 1])
                | batch_out
            )
            pure[e] = Facet(SHIFT, full, False, tag=new_tag())
        else:
            pure[e] = Facet(SHIFT, b_shift(f.full), False, tag=new_tag())
    return finish(lost, partial, pure)


def test_matmul_matches_its_maps_made_afresh() -> None:
    rng = random.Random(5)
    checked = 0
    for trial in range(400):
        n, k, m = rng.choice((1, 2, 3)), rng.choice((1, 2, 3)), rng.choice((1, 2, 3))
        batch = [rng.choice((1, 2)) for _ in range(rng.randint(0, 2))]
        transposed = not batch and rng.random() < 0.5  # a linear's weight, as (m, k)
        a = torch.zeros([*batch, n, k])
        b = torch.zeros([m, k] if transposed else [*batch[rng.randint(0, len(batch)) :], k, m])
        out = a @ (b.T if transposed else b)
        tags = [new_tag() for _ in range(4)]
        fresh_from = new_tag()
        carriers = {id(a): random_carrier(rng, a.dim(), tags, entities=8)}
        carriers[id(b)] = random_carrier(rng, b.dim(), tags, entities=8)
        results = []
        for matmul in (_matmul_carrier, matmul_reference):
            ctx = OpCall(Tracker(carriers), "torch.matmul", trial, (a, b), {}, out)
            got = matmul(ctx, a, b, list(out.shape), transposed)
            results.append(canonical(got, fresh_from))
        assert results[0] == results[1], (a.shape, b.shape, transposed)
        checked += bool(results[0][2])
    assert checked > 300
