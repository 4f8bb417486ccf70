"""How each torch call carries the parameters' scale and shift effects from its
inputs to its outputs: the propagators of the structure pass's carrying ops.

A propagator takes one call (`OpCall`: its name, arguments, output and a way to read
its inputs' carriers) and returns the output's `Carrier`, or one per output. Ops that
carry an effect unchanged or with a known change propagate it: casts, reshapes,
permutations, slices, elementwise arithmetic, powers, reductions, matmul / linear /
conv / einsum, embedding, dropout. A hand-written normalization (x * rsqrt(mean(x^2)
+ eps), x - mean(x)) is seen here too, as degrees adding up to 0 or the same term
subtracted, and reported to the tracker (`absorb`). The ops that cancel, and the
table from torch names to propagators, are in `op_table`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any, Protocol

import torch

from deadweight.checking.carrier_algebra import (
    EMPTY,
    ONE,
    SCALE,
    SHIFT,
    ZERO,
    Carrier,
    DimMap,
    DimMapping,
    Facet,
    all_dims,
    broadcast_map,
    dim_map,
    finish,
    flat_args,
    general,
    map_carrier,
    merge_general,
    new_tag,
    nontrivial,
    norm_dim,
    remembered,
    reshape_dims,
    tensor_outputs,
)

Tensor = torch.Tensor


class CarrierSource(Protocol):
    """What a propagator asks of the tracker: an input's carrier, and where to record
    an effect its op cancels."""

    def carrier(self, value: object) -> Carrier: ...

    def absorb(
        self, ctx: OpCall, entity: int, facet: Facet, op: str, dims: Iterable[int], full: bool
    ) -> None: ...

    def free_means(self, entities: Iterable[int]) -> None:
        """`absorb` of the shifts whose mean alone a call cancelled (full=False)."""


class OpCall:
    """One traced call, as a propagator sees it. (A plain class with slots: one is
    made for every traced call that carries an effect.)"""

    __slots__ = ("absorbed", "args", "c", "kwargs", "name", "ordinal", "out", "tracker", "where")

    def __init__(
        self, tracker: CarrierSource, name: str, ordinal: int, args: tuple, kwargs: dict, out: Any
    ) -> None:
        self.tracker = tracker
        # An input's carrier: the tracker's own method, bound once per call (a method
        # of this class calling it cost a Python call per read, ~650 per forward)
        self.c: Callable[[object], Carrier] = tracker.carrier
        self.name = name
        self.ordinal = ordinal
        self.args = args
        self.kwargs = kwargs
        self.out = out
        self.absorbed = False
        # Filled by the tracker at the first effect the call cancels: its user site,
        # module and the rounding of its outputs
        self.where: tuple[Any, Any, float] | None = None

    def arg(self, i: int, key: str, default: Any = None) -> Any:
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(key, default)


# -- shape-only ops ------------------------------------------------------------


def _first_shape(ctx: OpCall) -> tuple[list[int], list[int]] | None:
    x = ctx.args[0] if ctx.args else None
    if not isinstance(x, Tensor) or not isinstance(ctx.out, Tensor):
        return None
    return list(x.shape), list(ctx.out.shape)


def propagate_same(ctx: OpCall) -> Carrier:
    """Elementwise, values kept (dtype casts, clone, contiguous). A tensor among the
    other arguments (`x.type_as(y)`, `x.to(y)`) lends only its dtype and device: its
    values, and the parameters behind them, do not reach the output (Gemma's RMSNorm
    casts back with `output.type_as(x)`, x the normalized input itself)."""
    c = ctx.c(ctx.args[0]) if ctx.args else EMPTY
    shapes = _first_shape(ctx)
    if shapes is None or shapes[0] != shapes[1]:
        return general([c])
    return c


def propagate_reshape(ctx: OpCall) -> Carrier:
    x = ctx.args[0]
    c = ctx.c(x)
    if not c.pure:
        return c  # dependences only: no dims to map
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor):
        return general([c])
    i, o = x.shape, out.shape
    mapping = dim_map(("reshape", i, o), lambda: _reshaping(list(i), list(o)))
    assert mapping is not None
    return map_carrier(c, mapping)


def _reshaping(i: list[int], o: list[int]) -> DimMapping:
    if math.prod(i) == math.prod(o):
        return lambda d: reshape_dims(i, o, d)
    # expand / broadcast_to / repeat: right-aligned; a repeated dim keeps its variation
    m = broadcast_map(i, o)
    return lambda d: nontrivial(o, (m(x) for x in d))


def _permutation(ctx: OpCall, ndim: int) -> list[int] | None:
    """Output dim i holds input dim perm[i]; None when the call cannot be read."""
    name = ctx.name.rsplit(".", 1)[-1]
    rest = list(ctx.args[1:])
    perm = list(range(ndim))
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        return [norm_dim(int(d), ndim) for d in (dims or ctx.kwargs.get("dims", []))]
    if name == "T":
        return list(reversed(perm))
    if name in ("t", "mT"):
        if ndim < 2:
            return perm
        first, second = ndim - 2, ndim - 1
    else:  # transpose, swapaxes, swapdims
        raw = (
            rest[:2]
            if len(rest) >= 2
            else [
                ctx.kwargs.get("dim0", ctx.kwargs.get("axis0")),
                ctx.kwargs.get("dim1", ctx.kwargs.get("axis1")),
            ]
        )
        given = [v for v in raw if isinstance(v, int)]
        if len(given) != 2:
            return None
        first, second = norm_dim(given[0], ndim), norm_dim(given[1], ndim)
    perm[first], perm[second] = perm[second], perm[first]
    return perm


def propagate_permute(ctx: OpCall) -> Carrier:
    x = ctx.args[0]
    c = ctx.c(x)
    if not isinstance(x, Tensor):
        return general([c])
    ndim = x.dim()
    rest = ctx.args[1:]
    mapping: DimMapping | None
    if not ctx.kwargs and all(type(d) is int for d in rest):
        # remembered by the dims, when they are plain ints (`x.transpose(1, 2)`): another
        # type that compares equal (a numpy int, a bool) is read afresh, as is a list
        key = ("permute", ctx.name, ndim, rest)
        mapping = dim_map(key, lambda: _permuting(_permutation(ctx, ndim), ndim))
    else:
        mapping = _permuting(_permutation(ctx, ndim), ndim)
    return general([c]) if mapping is None else map_carrier(c, mapping)


def _permuting(perm: list[int] | None, ndim: int) -> DimMapping | None:
    if perm is None or sorted(perm) != list(range(ndim)):
        return None
    where = {src: dst for dst, src in enumerate(perm)}
    return lambda d: frozenset(where[x] for x in d)


def propagate_slice(ctx: OpCall) -> Carrier | list[Carrier]:
    """Indexing, narrow, split: values kept; dims kept where the layout stays."""
    x = ctx.args[0]
    c = ctx.c(x)
    others = [ctx.c(v) for v in list(flat_args(ctx.args[1:], ctx.kwargs))]
    base = general(others) if any(o.lost or o.pure or o.partial for o in others) else None
    if base is not None:
        return general([c, base])
    name = ctx.name.rsplit(".", 1)[-1]
    outs = tensor_outputs(ctx.out)
    if not isinstance(x, Tensor) or not outs:
        return general([c])
    ndim = x.dim()
    mapping: Callable[[frozenset[int]], frozenset[int] | None]
    if name in ("split", "chunk", "tensor_split", "narrow", "split_with_sizes"):
        mapping = lambda d: d  # noqa: E731
    elif name in ("unbind", "select"):
        dim = norm_dim(int(ctx.arg(1, "dim", 0)), ndim)
        mapping = lambda d: frozenset(x - (x > dim) for x in d if x != dim)  # noqa: E731
    elif name == "__getitem__":
        mapping = _index_mapping(ctx.args[1] if len(ctx.args) > 1 else None, ndim)
    else:
        mapping = lambda d: None if d else d  # noqa: E731
    mapped = map_carrier(c, lambda d: _restrict(mapping(d), outs[0].shape))
    return [mapped] * len(outs) if isinstance(ctx.out, (tuple, list)) else mapped


def _restrict(dims: frozenset[int] | None, shape: Sequence[int]) -> frozenset[int] | None:
    return None if dims is None else nontrivial(shape, dims)


def _index_mapping(index: Any, ndim: int) -> Callable[[frozenset[int]], frozenset[int] | None]:
    items = index if isinstance(index, tuple) else (index,)
    if not all(i is None or i is Ellipsis or isinstance(i, (int, slice)) for i in items):
        return lambda d: None if d else d
    consumed = sum(1 for i in items if isinstance(i, (int, slice)))
    where: dict[int, int | None] = {}
    src = dst = 0
    for item in items:
        if item is Ellipsis:
            for _ in range(ndim - consumed):
                where[src] = dst
                src += 1
                dst += 1
        elif item is None:
            dst += 1
        elif isinstance(item, int):
            where[src] = None
            src += 1
        else:
            where[src] = dst
            src += 1
            dst += 1
    while src < ndim:
        where[src] = dst
        src += 1
        dst += 1

    def mapping(d: frozenset[int]) -> frozenset[int] | None:
        return frozenset(w for x in d if (w := where.get(x)) is not None)

    return mapping


# -- elementwise arithmetic ------------------------------------------------------


def _binary_operands(ctx: OpCall) -> tuple[Any, Any, float | None]:
    name = ctx.name.rsplit(".", 1)[-1]
    a = ctx.args[0] if ctx.args else ctx.kwargs.get("input")
    b = ctx.args[1] if len(ctx.args) > 1 else ctx.kwargs.get("other")
    alpha = ctx.kwargs.get("alpha")
    if name.startswith("__r") and name not in ("__rshift__",):
        a, b = b, a
    return a, b, alpha


def _shape_of(value: Any) -> list[int]:
    return list(value.shape) if isinstance(value, Tensor) else []


def _varying(value: Any, out_shape: Sequence[int]) -> frozenset[int]:
    """Dims of the output along which a plain operand varies (its non-size-1 dims)."""
    if not isinstance(value, Tensor):
        return frozenset()
    m = broadcast_map(value.shape, out_shape)
    return nontrivial(out_shape, (m(d) for d in range(value.dim()) if value.shape[d] > 1))


def _aligned(value: Any, c: Carrier, out_shape: Sequence[int]) -> Carrier:
    if not c.pure or not isinstance(value, Tensor):
        return c
    offset = len(out_shape) - value.dim()
    if offset == 0:
        # Same rank (the usual operand): dims stay where they are; only those of size 1
        # in the output drop out, and most facets have none.
        kept = all_dims(out_shape)
        if all(f.full is None or f.full <= kept for f in c.pure.values()):
            return c
    out = tuple(out_shape)
    mapping = dim_map(("aligned", offset, out), lambda: _shifted(out, offset))
    assert mapping is not None
    return map_carrier(c, mapping)


def _shifted(out_shape: tuple[int, ...], offset: int) -> DimMapping:
    return lambda d: nontrivial(out_shape, [x + offset for x in d])


def _is_small_constant(value: Any) -> bool:
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, Tensor) and value.numel() == 1


def _combine(
    ctx: OpCall, op: str, a: Any, b: Any, out_shape: Sequence[int], alpha: Any = None
) -> Carrier:
    ca = _aligned(a, ctx.c(a), out_shape)
    cb = _aligned(b, ctx.c(b), out_shape)
    lost, partial = ca.lost | cb.lost, ca.partial | cb.partial
    pure: dict[int, Facet] = {}
    pa, pb = ca.pure, cb.pure
    # A shift on one side of a sum passes unchanged (the same term added), unless it
    # is the right operand's, scaled by - or by alpha: `_combine_facet`'s first case,
    # taken here for the residual stream's many shifts without a call each.
    additive = op in ("add", "sub")
    b_kept = op == "add" and alpha in (None, 1)
    # One side's entities as they are, without a set made of them: only an entity on
    # both sides can be cancelled here, so the order in which they are taken matters
    # only then (to the order of the records), and then it stays the sets' union.
    for e in (set(pa) | set(pb)) if pa and pb else (pa or pb):
        if lost >> e & 1:
            continue
        fa, fb = pa.get(e), pb.get(e)
        if additive:
            if fb is None and fa is not None and fa.kind == SHIFT:
                pure[e] = fa
                continue
            if fa is None and fb is not None and fb.kind == SHIFT and b_kept:
                pure[e] = fb
                continue
        f = _combine_facet(ctx, op, e, fa, fb, a, b, out_shape, alpha)
        if f is None:
            lost |= 1 << e
        elif f is not _CANCELLED:
            pure[e] = f
    return finish(lost, partial, pure)


_CANCELLED = Facet(SCALE, None, uniform=False)


def _combine_facet(
    ctx: OpCall,
    op: str,
    e: int,
    fa: Facet | None,
    fb: Facet | None,
    a: Any,
    b: Any,
    out_shape: Sequence[int],
    alpha: Any,
) -> Facet | None:
    both = fa is not None and fb is not None
    if op in ("add", "sub"):
        if not both:
            f = fa if fa is not None else fb
            other = b if fa is not None else a
            assert f is not None
            if f.kind == SHIFT:
                # x + s + y: the same term added; a scaled operand gets a new term
                scaled = (fb is not None and op == "sub") or (
                    fb is not None and alpha not in (None, 1)
                )
                return (
                    Facet(SHIFT, f.full, f.uniform, f.degree, f.approx, new_tag()) if scaled else f
                )
            # a scale plus an independent term: only an eps-like constant keeps it
            if not _is_small_constant(other):
                return None
            return Facet(f.kind, f.full, f.uniform, f.degree, True, f.tag)
        assert fa is not None and fb is not None
        if fa.kind != fb.kind:
            return None
        if fa.kind == SHIFT:
            if op == "sub" and fa.tag == fb.tag and alpha in (None, 1):
                dims = fa.full or frozenset()
                ctx.tracker.absorb(
                    ctx, e, fa, "hand-written mean subtraction", dims, fa.full is not None
                )
                return _CANCELLED
            return _union(fa, fb, tag=new_tag())
        if fa.degree != fb.degree:
            return None
        full = fa.full if (fa.full is not None and fa.full == fb.full) else None
        return Facet(SCALE, full, fa.uniform and fb.uniform, fa.degree, fa.approx or fb.approx)
    # mul / div
    if not both:
        f = fa if fa is not None else fb
        other = b if fa is not None else a
        assert f is not None
        if f.kind == SCALE:
            if op == "div" and fb is not None:
                return Facet(SCALE, f.full, f.uniform, -f.degree, f.approx, f.tag)
            return f
        if op == "div" and fb is not None:
            return None  # 1 / (x + s)
        varying = _varying(other, out_shape)
        full = None if f.full is None else f.full | varying
        return Facet(SHIFT, full, f.uniform and not varying, tag=new_tag())
    assert fa is not None and fb is not None
    if fa.kind != SCALE or fb.kind != SCALE:
        return None
    degree = fa.degree + fb.degree if op == "mul" else fa.degree - fb.degree
    f = _product(fa, fb, fa.full, fb.full, degree)
    full, uniform = f.full, f.uniform
    if degree == ZERO:
        whole = full is not None and (fa.full == fb.full or not fb.full or not fa.full)
        if uniform or whole:
            ctx.tracker.absorb(ctx, e, f, "hand-written normalization", full or (), whole)
            return _CANCELLED
    return f


def _product(
    fa: Facet,
    fb: Facet,
    full_a: frozenset[int] | None,
    full_b: frozenset[int] | None,
    degree: Fraction,
) -> Facet:
    """The scale facet of a product of two scaled factors (dims already mapped)."""
    full = full_a | full_b if (full_a is not None and full_b is not None) else None
    return Facet(SCALE, full, fa.uniform and fb.uniform, degree, fa.approx or fb.approx)


def _union(fa: Facet, fb: Facet, tag: int = 0) -> Facet:
    full = fa.full | fb.full if (fa.full is not None and fb.full is not None) else None
    return Facet(fa.kind, full, fa.uniform and fb.uniform, fa.degree, fa.approx or fb.approx, tag)


def propagate_binary(op: str) -> Callable[[OpCall], Carrier]:
    def rule(ctx: OpCall) -> Carrier:
        a, b, alpha = _binary_operands(ctx)
        out = ctx.out
        if not isinstance(out, Tensor):
            return general([ctx.c(a), ctx.c(b)])
        if alpha is not None and not isinstance(alpha, (int, float)):
            return general([ctx.c(a), ctx.c(b)])
        return _combine(ctx, op, a, b, list(out.shape), alpha)

    return rule


def propagate_neg(ctx: OpCall) -> Carrier:
    c = ctx.c(ctx.args[0])
    pure = {
        e: (
            Facet(SHIFT, f.full, f.uniform, f.degree, f.approx, new_tag()) if f.kind == SHIFT else f
        )
        for e, f in c.pure.items()
    }
    return Carrier(c.lost, c.partial, pure)


def propagate_power(degree_of: Callable[[OpCall], Fraction | None]) -> Callable[[OpCall], Carrier]:
    def rule(ctx: OpCall) -> Carrier:
        c = ctx.c(ctx.args[0])
        others = [ctx.c(v) for v in list(flat_args(ctx.args[1:], ctx.kwargs))]
        k = degree_of(ctx)
        if k is None or any(o.lost or o.pure or o.partial for o in others):
            return general([c, *others])
        lost, partial = c.lost, c.partial
        pure = {}
        for e, f in c.pure.items():
            if f.kind == SCALE:
                pure[e] = Facet(SCALE, f.full, f.uniform, f.degree * k, f.approx, f.tag)
            else:
                lost |= 1 << e
        return finish(lost, partial, pure)

    return rule


def exponent(ctx: OpCall) -> Fraction | None:
    e = ctx.arg(1, "exponent")
    if isinstance(e, (int, float)) and math.isfinite(e):
        return Fraction(e).limit_denominator(64)
    return None


def propagate_scale_keeping(ctx: OpCall) -> Carrier:
    """abs: |lambda x| = |lambda| |x|, a scale survives (lambda > 0); a shift does not."""
    return propagate_power(lambda _: ONE)(ctx)


def propagate_dropout(ctx: OpCall) -> Carrier:
    x = ctx.args[0] if ctx.args else ctx.kwargs.get("input")
    p = ctx.arg(1, "p", 0.5)
    training = ctx.arg(2, "training", True)
    c = ctx.c(x)
    if not training or p == 0:
        return c
    lost, partial = c.lost, c.partial
    pure = {}
    for e, f in c.pure.items():
        if f.kind == SCALE:
            pure[e] = f  # the mask multiplies, the factor stays
        else:
            lost |= 1 << e
    return finish(lost, partial, pure)


# -- reductions -------------------------------------------------------------------


def _reduced_dims(ctx: OpCall, ndim: int) -> tuple[frozenset[int], bool]:
    dim = ctx.arg(1, "dim", None)
    if dim is None and "axis" in ctx.kwargs:
        dim = ctx.kwargs["axis"]
    keepdim = bool(ctx.arg(2, "keepdim", False))
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return frozenset(range(ndim)), keepdim
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return frozenset(range(ndim)), keepdim
    return frozenset(norm_dim(d, ndim) for d in dims), keepdim


def propagate_reduce(kind: str) -> Callable[[OpCall], Carrier]:
    """sum/mean and friends over dims R. kind: 'mean', 'sum', 'max' (shift and scale
    pass), 'lse' (logsumexp: a shift passes, a scale does not), 'var' (shift
    cancelled, degree 2), 'std' (shift cancelled, degree 1), 'norm' (scale passes,
    shift lost)."""

    def rule(ctx: OpCall) -> Carrier:
        x = ctx.args[0] if ctx.args else ctx.kwargs.get("input")
        c = ctx.c(x)
        if not isinstance(x, Tensor) or not isinstance(ctx.out, Tensor) or ctx.name.endswith("_"):
            return general([c])
        if kind == "norm":
            # norm(x, p, dim, keepdim): the dims are the third argument
            dim = ctx.arg(2, "dim", None)
            keep = bool(ctx.arg(3, "keepdim", False))
            ndim = x.dim()
            if dim is None:
                reduced = frozenset(range(ndim))
            else:
                ds = dim if isinstance(dim, (list, tuple)) else [dim]
                reduced = frozenset(norm_dim(int(d), ndim) for d in ds)
        elif (
            kind in ("var", "std")
            and "correction" not in ctx.kwargs
            and isinstance(ctx.arg(1, "dim"), bool)
        ):
            reduced, keep = frozenset(range(x.dim())), False
        else:
            reduced, keep = _reduced_dims(ctx, x.dim())
        ndim = x.dim()

        def remap(d: frozenset[int]) -> frozenset[int]:
            if keep:
                return frozenset(x for x in d if x not in reduced)
            return frozenset(x - sum(1 for r in reduced if r < x) for x in d if x not in reduced)

        lost, partial = c.lost, c.partial
        pure: dict[int, Facet] = {}
        for e, f in c.pure.items():
            crosses = f.full is not None and bool(f.full & reduced)
            if f.kind == SCALE:
                # logsumexp(lambda x) is not lambda logsumexp(x); the rest are homogeneous
                if kind not in ("mean", "sum", "max", "var", "std", "norm"):
                    lost |= 1 << e
                    continue
                degree = f.degree * (2 if kind == "var" else 1)
                full = None if (f.full is None or crosses) else remap(f.full)
                if full is None and not f.uniform:
                    lost |= 1 << e
                    continue
                pure[e] = Facet(SCALE, full, f.uniform, degree, f.approx)
            else:
                if kind in ("var", "std"):
                    if not crosses and f.full is not None:
                        ctx.tracker.absorb(ctx, e, f, "hand-written variance", reduced, True)
                        continue
                    if f.uniform:
                        ctx.tracker.absorb(ctx, e, f, "hand-written variance", reduced, False)
                        partial |= 1 << e
                        continue
                    lost |= 1 << e
                    continue
                if kind == "norm":
                    lost |= 1 << e
                    continue
                full = None if f.full is None else remap(f.full)
                same_value = kind in ("mean", "max", "lse") and not crosses and f.full is not None
                tag = f.tag if same_value else new_tag()
                pure[e] = Facet(SHIFT, full, f.uniform, tag=tag)
        del ndim
        return finish(lost, partial, pure)

    return rule


# -- linear algebra ---------------------------------------------------------------


def _matmul_carrier(
    ctx: OpCall, a: Any, b: Any, out_shape: Sequence[int], b_is_transposed_weight: bool = False
) -> Carrier:
    """a @ b for a.ndim >= 2 and b.ndim >= 2 (b given as (..., k, m))."""
    ca, cb = ctx.c(a), ctx.c(b)
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return general([ca, cb])
    a_rank, b_rank = a.dim(), b.dim()
    if a_rank < 2 or b_rank < 2:
        return general([ca, cb])
    a_map, b_map, a_shift, b_shift = _matmul_maps(
        a_rank, b_rank, tuple(out_shape), b_is_transposed_weight
    )
    lost, partial = ca.lost | cb.lost, ca.partial | cb.partial
    pure: dict[int, Facet] = {}
    for e in set(ca.pure) | set(cb.pure):
        if lost >> e & 1:
            continue
        fa, fb = ca.pure.get(e), cb.pure.get(e)
        if fa is not None and fb is not None:
            if fa.kind == fb.kind == SCALE:
                product = _product(
                    fa,
                    fb,
                    None if fa.full is None else a_map(fa.full),
                    None if fb.full is None else b_map(fb.full),
                    fa.degree + fb.degree,
                )
                if product.full is None and not product.uniform:
                    lost |= 1 << e
                    continue
                pure[e] = product
            else:
                lost |= 1 << e
            continue
        f = fa if fa is not None else fb
        assert f is not None
        on_a = fa is not None
        if f.kind == SCALE:
            full = None if f.full is None else (a_map if on_a else b_map)(f.full)
            if full is None and not f.uniform:
                lost |= 1 << e
                continue
            pure[e] = Facet(SCALE, full, f.uniform, f.degree, f.approx, f.tag)
            continue
        # shift: (A + s) B = AB + sB varies along m and B's batch dims; A (B + s) = AB + As
        # varies along n and A's batch dims, and along m only if s does.
        if f.full is None:
            lost |= 1 << e
            continue
        pure[e] = Facet(SHIFT, (a_shift if on_a else b_shift)(f.full), False, tag=new_tag())
    return finish(lost, partial, pure)


def _matmul_maps(
    a_rank: int, b_rank: int, out_shape: tuple[int, ...], transposed: bool
) -> tuple[DimMap, DimMap, DimMap, DimMap]:
    """How a @ b maps the dims of a facet of a (scale, shift) and of b (scale, shift)
    to the output's, remembered per ranks and output shape (`_matmul_carrier`)."""
    key = (a_rank, b_rank, out_shape, transposed)
    return remembered(_MATMUL_MAPS, key, _made_matmul_maps, *key)


def _made_matmul_maps(
    a_rank: int, b_rank: int, out_shape: tuple[int, ...], transposed: bool
) -> tuple[DimMap, DimMap, DimMap, DimMap]:
    nd = len(out_shape)
    m_dim = nd - 1
    batch_out = nontrivial(out_shape, range(nd - 2))

    def a_map(d: frozenset[int]) -> frozenset[int] | None:
        k = a_rank - 1
        if k in d:
            return None
        off = nd - a_rank
        return nontrivial(out_shape, (x + off for x in d))

    def b_map(d: frozenset[int]) -> frozenset[int] | None:
        if transposed:
            d = frozenset({0: 1, 1: 0}[x] for x in d)
        k = b_rank - 2
        if k in d:
            return None
        off = nd - b_rank
        return nontrivial(out_shape, (x + off for x in d))

    def a_shift(d: frozenset[int]) -> frozenset[int]:
        return (a_map(d - {a_rank - 1}) or frozenset()) | nontrivial(out_shape, [m_dim]) | batch_out

    def b_shift(d: frozenset[int]) -> frozenset[int]:
        return _shifted_b_dims(d, b_rank, out_shape, transposed)

    return DimMap(a_map), DimMap(b_map), DimMap(a_shift), DimMap(b_shift)


_MATMUL_MAPS: dict[tuple[Any, ...], tuple[DimMap, DimMap, DimMap, DimMap]] = {}


def _shifted_b_dims(
    s: frozenset[int], b_rank: int, out_shape: Sequence[int], transposed: bool
) -> frozenset[int]:
    """The output dims along which A (B + s) - AB = As varies: n and A's batch dims, and
    m only if s varies along B's last dim."""
    nd = len(out_shape)
    if transposed:
        s = frozenset({0: 1, 1: 0}[x] for x in s)
    m_varies = (b_rank - 1) in s
    return (
        nontrivial(out_shape, [nd - 2])
        | nontrivial(out_shape, range(nd - 2))
        | (nontrivial(out_shape, [nd - 1]) if m_varies else frozenset())
    )


def propagate_matmul(ctx: OpCall) -> Carrier:
    a, b, _ = _binary_operands(ctx)
    if not isinstance(ctx.out, Tensor):
        return general([ctx.c(a), ctx.c(b)])
    if ctx.name.rsplit(".", 1)[-1] == "__rmatmul__":
        a, b = b, a
    return _matmul_carrier(ctx, a, b, list(ctx.out.shape))


def propagate_linear(ctx: OpCall) -> Carrier:
    x, w = ctx.arg(0, "input"), ctx.arg(1, "weight")
    bias = ctx.arg(2, "bias")
    out = ctx.out
    if not isinstance(out, Tensor) or not isinstance(w, Tensor) or w.dim() != 2:
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
    if isinstance(x, Tensor) and x.dim() == 1:
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
    prod = _matmul_carrier(ctx, x, w, list(out.shape), b_is_transposed_weight=True)
    if bias is None:
        return prod
    return _add_carriers(ctx, prod, bias, list(out.shape))


def _add_carriers(ctx: OpCall, left: Carrier, value: Any, out_shape: Sequence[int]) -> Carrier:
    """`left` (a carrier of an output-shaped term) plus `value` (broadcast)."""
    return add_term(left, _aligned(value, ctx.c(value), out_shape))


def propagate_addmm(ctx: OpCall) -> Carrier:
    bias, m1, m2 = ctx.arg(0, "input"), ctx.arg(1, "mat1"), ctx.arg(2, "mat2")
    out = ctx.out
    beta, alpha = ctx.kwargs.get("beta", 1), ctx.kwargs.get("alpha", 1)
    if not isinstance(out, Tensor) or not (
        isinstance(beta, (int, float)) and isinstance(alpha, (int, float))
    ):
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
    prod = _matmul_carrier(ctx, m1, m2, list(out.shape))
    if beta == 0:
        return prod
    return _add_carriers(ctx, prod, bias, list(out.shape))


def propagate_multilinear(ctx: OpCall) -> Carrier:
    """einsum, bilinear and the like: each operand's uniform scale factor pulls out."""
    carriers = [ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)]
    lost, partial = merge_general(carriers)
    pure: dict[int, Facet] = {}
    degree: dict[int, Fraction] = {}
    for c in carriers:
        for e, f in c.pure.items():
            if f.kind == SCALE and f.uniform:
                degree[e] = degree.get(e, ZERO) + f.degree
            else:
                lost |= 1 << e
    for e, k in degree.items():
        if not lost >> e & 1:
            pure[e] = Facet(SCALE, None, True, k)
    return finish(lost, partial, pure)


def propagate_conv(ctx: OpCall) -> Carrier:
    x, w, bias = ctx.arg(0, "input"), ctx.arg(1, "weight"), ctx.arg(2, "bias")
    out = ctx.out
    cx, cw = ctx.c(x), ctx.c(w)
    others = [
        ctx.c(v)
        for v in list(
            flat_args(
                ctx.args[3:],
                {k: v for k, v in ctx.kwargs.items() if k not in ("input", "weight", "bias")},
            )
        )
    ]
    if not isinstance(out, Tensor) or any(o.lost or o.pure or o.partial for o in others):
        return general([cx, cw, ctx.c(bias), *others])
    lost, partial = cx.lost | cw.lost, cx.partial | cw.partial
    pure: dict[int, Facet] = {}
    channel = nontrivial(out.shape, [1])
    for e in set(cx.pure) | set(cw.pure):
        fx, fw = cx.pure.get(e), cw.pure.get(e)
        facets = [f for f in (fx, fw) if f is not None]
        if any(f.kind != SCALE for f in facets):
            lost |= 1 << e
            continue
        full_x = (
            None if fx is None else (fx.full if fx.full is not None and fx.full <= {0} else None)
        )
        full_w = (
            None if fw is None else (channel if fw.full is not None and fw.full <= {0} else None)
        )
        if fx is not None and fw is not None:
            full = full_x | full_w if (full_x is not None and full_w is not None) else None
        else:
            full = full_x if fx is not None else full_w
        uniform = all(f.uniform for f in facets)
        if full is None and not uniform:
            lost |= 1 << e
            continue
        pure[e] = Facet(
            SCALE,
            full,
            uniform,
            sum((f.degree for f in facets), ZERO),
            any(f.approx for f in facets),
        )
    prod = finish(lost, partial, pure)
    if bias is None:
        return prod
    cb = ctx.c(bias)
    if isinstance(bias, Tensor) and bias.dim() == 1 and cb.pure:
        cb = map_carrier(cb, lambda d: channel if d else d)
    return add_term(prod, cb)


def add_term(left: Carrier, right: Carrier) -> Carrier:
    """left + right, with `right` already in the output's dims."""
    lost, partial = left.lost | right.lost, left.partial | right.partial
    pure: dict[int, Facet] = {}
    for e in set(left.pure) | set(right.pure):
        fa, fb = left.pure.get(e), right.pure.get(e)
        if fa is not None and fb is not None:
            f: Facet | None = _union(fa, fb, tag=new_tag()) if fa.kind == fb.kind == SHIFT else None
        else:
            f = fa if fa is not None else fb
            assert f is not None
            if f.kind == SCALE:
                f = None
        if f is None:
            lost |= 1 << e
        else:
            pure[e] = f
    return finish(lost, partial, pure)


def mul_term(left: Carrier, right: Carrier, right_varying: frozenset[int]) -> Carrier:
    """left * right, `right` in the output's dims and varying along `right_varying`."""
    lost, partial = left.lost | right.lost, left.partial | right.partial
    pure: dict[int, Facet] = {}
    for e in set(left.pure) | set(right.pure):
        fa, fb = left.pure.get(e), right.pure.get(e)
        f: Facet | None
        if fa is not None and fb is not None:
            if fa.kind == fb.kind == SCALE:
                f = _product(fa, fb, fa.full, fb.full, fa.degree + fb.degree)
            else:
                f = None
        elif fa is not None:
            if fa.kind == SCALE:
                f = fa
            else:
                full = None if fa.full is None else fa.full | right_varying
                f = Facet(SHIFT, full, fa.uniform and not right_varying, tag=new_tag())
        else:
            assert fb is not None
            f = fb if fb.kind == SCALE else None
        if f is None:
            lost |= 1 << e
        else:
            pure[e] = f
    return finish(lost, partial, pure)


def propagate_embedding(ctx: OpCall) -> Carrier:
    ids, w = ctx.arg(0, "input"), ctx.arg(1, "weight")
    out = ctx.out
    cw = ctx.c(w)
    if not isinstance(out, Tensor) or ctx.c(ids).lost or ctx.c(ids).pure:
        return general([cw, ctx.c(ids)])
    last = nontrivial(out.shape, [out.dim() - 1])
    lost, partial = cw.lost, cw.partial
    pure: dict[int, Facet] = {}
    for e, f in cw.pure.items():
        full = None if f.full is None or 0 in f.full else (last if f.full else frozenset())
        if full is None and not f.uniform:
            lost |= 1 << e
            continue
        pure[e] = Facet(
            f.kind, full, f.uniform, f.degree, f.approx, new_tag() if f.kind == SHIFT else 0
        )
    return finish(lost, partial, pure)
