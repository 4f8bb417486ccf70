"""Which parameters does a normalization cancel by construction? A structure pass.

During the traced forward every torch call is seen (`OpTracer`). For each parameter
this pass follows two pure effects through the ops, each as an exact algebraic
statement about the tensors it reaches:

- **scale**: changing the parameter from theta to lambda * theta multiplies the
  tensor by a factor (lambda^degree, broadcast);
- **shift**: changing it from theta to theta + delta adds something to the tensor.

Each effect has two facets. The *full* facet covers every direction of the
parameter (any lambda per entry, any delta) and records the dims along which the
factor or the added term varies; the *uniform* facet covers only lambda a single
number, or delta = c for every entry (the parameter's norm, or its mean).

Ops that carry an effect unchanged, or with known changes, propagate it: elementwise
mul/div (degrees add), additions of terms that do not depend on the parameter (a
shift survives them, a scale does not), reshapes and permutations (the dims are
mapped), linear/matmul/conv (a scale survives; the dims contracted over must not
vary), mean/sum over dims along which it does not vary, pow/sqrt/rsqrt (the degree
changes), dropout. A *cancelling* op removes an effect whose varying dims avoid the
dims it normalizes over: LayerNorm/RMSNorm/GroupNorm/BatchNorm (training)/
InstanceNorm and F.normalize a scale (and the mean-subtracting ones a shift),
softmax/log_softmax/cross_entropy and the softmax over keys inside
scaled_dot_product_attention a shift; a hand-written x * rsqrt(mean(x^2) + eps)
cancels because the degrees add up to 0, and x - mean(x) because the same shift is
subtracted. Every cancellation is recorded with its op, source line, module and dims.
Any other use of a tensor carrying an effect turns it into a plain dependence.

At the loss, a parameter one of whose effects was cancelled on every path and
reaches the loss in no other way is a candidate: its full facet cancelled means
no direction of it changes the loss; only the uniform facet means its norm (or mean)
is free while the rest learns. Calls the pass cannot see into (a user
`autograd.Function`, a custom op outside aten) make the parameters reaching them
*opaque*: for those the numerical screen in `invariance` is the fallback.

`confirm` then re-runs the forward with each candidate perturbed and compares the
output of the cancelling op itself, which a normalization keeps at a scale of its
own, so the verdict does not depend on the loss's value, form or scale.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from deadweight import autograd_graph
from deadweight.checking import state
from deadweight.checking.check_stats import Cancellation, Mechanism
from deadweight.checking.sites import user_site
from deadweight.distributed.ranks import local_tensor

Tensor = torch.Tensor
SCALE = 0
SHIFT = 1
KINDS = ("scale", "shift")
_ZERO = Fraction(0)
_ONE = Fraction(1)
_tags = itertools.count(1)


# -- the abstract values -------------------------------------------------------------


@dataclass(frozen=True)
class Facet:
    """One pure effect of one parameter on one tensor.

    full: the dims of the tensor along which the factor (scale) or the added term
    (shift) varies for a change in any direction of the parameter; None once that is
    no longer known (only the uniform facet holds). uniform: the effect of the
    uniform change (theta * c, theta + c) is still pure. degree: scale only, the
    tensor is multiplied by lambda^degree. approx: scale only, a constant (an eps)
    was added on the way, so a cancellation holds up to it. tag: shift only, the
    identity of the added term, so that x - mean(x) is seen to cancel it.
    """

    kind: int
    full: frozenset[int] | None
    uniform: bool = True
    degree: Fraction = _ONE
    approx: bool = False
    tag: int = 0


@dataclass(frozen=True)
class Carrier:
    """How the parameters reach one tensor. Entities are 2 * parameter index + kind.

    lost: entities whose effect reaches it in no known form (every direction).
    partial: entities whose non-uniform directions reach it in no known form.
    pure: the entities whose effect is still pure, with its facet.
    """

    lost: frozenset[int] = frozenset()
    partial: frozenset[int] = frozenset()
    pure: dict[int, Facet] = field(default_factory=dict)

    def depends(self, entity: int) -> bool:
        return entity in self.lost or entity in self.pure or entity in self.partial

    def all_entities(self) -> frozenset[int]:
        return self.lost | frozenset(self.pure)


_EMPTY = Carrier()


@dataclass
class StructureResult:
    """What the structure pass concluded for the parameters of one forward."""

    cancellations: dict[str, Cancellation]
    # Parameters whose influence on the loss the pass proved (through ops it knows)
    influencing: frozenset[str]
    # Parameters that reached a call the pass cannot see into (fallback: numeric screen)
    opaque: frozenset[str]


# -- dims ---------------------------------------------------------------------------


def _nontrivial(shape: Sequence[int], dims: Iterable[int]) -> frozenset[int]:
    return frozenset(d for d in dims if 0 <= d < len(shape) and shape[d] > 1)


def _all_dims(shape: Sequence[int]) -> frozenset[int]:
    return _nontrivial(shape, range(len(shape)))


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _broadcast_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> Callable[[int], int]:
    offset = len(out_shape) - len(in_shape)
    return lambda d: d + offset


def _reshape_dims(
    in_shape: Sequence[int], out_shape: Sequence[int], dims: frozenset[int]
) -> frozenset[int]:
    """Output dims sharing digits of the flat index with the given input dims."""
    if not dims:
        return frozenset()

    def spans(shape: Sequence[int]) -> list[tuple[int, int]]:
        out = []
        inner = 1
        for size in reversed(shape):
            out.append((inner, inner * size))
            inner *= size
        return list(reversed(out))

    ins, outs = spans(in_shape), spans(out_shape)
    result = set()
    for d in dims:
        lo, hi = ins[d]
        for e, (olo, ohi) in enumerate(outs):
            if olo < hi and lo < ohi and out_shape[e] > 1:
                result.add(e)
    return frozenset(result)


# -- facet algebra ------------------------------------------------------------------


def _map_facet(f: Facet, mapping: Callable[[frozenset[int]], frozenset[int] | None]) -> Facet:
    if f.full is None:
        return f
    return replace(f, full=mapping(f.full))


def _map_carrier(c: Carrier, mapping: Callable[[frozenset[int]], frozenset[int] | None]) -> Carrier:
    if not c.pure:
        return c
    return Carrier(c.lost, c.partial, {e: _map_facet(f, mapping) for e, f in c.pure.items()})


def _merge_general(carriers: Iterable[Carrier]) -> tuple[frozenset[int], frozenset[int]]:
    lost: frozenset[int] = frozenset()
    partial: frozenset[int] = frozenset()
    for c in carriers:
        if c.lost:
            lost = lost | c.lost if lost is not c.lost else lost
        if c.partial:
            partial = partial | c.partial
    return lost, partial


def _general(carriers: Iterable[Carrier]) -> Carrier:
    """Every effect turned into a plain dependence."""
    cs = list(carriers)
    lost, partial = _merge_general(cs)
    for c in cs:
        if c.pure:
            lost = lost | frozenset(c.pure)
    return Carrier(lost, partial - lost)


def _finish(lost: frozenset[int], partial: frozenset[int], pure: dict[int, Facet]) -> Carrier:
    for e in list(pure):
        if e in lost:
            del pure[e]
    for e, f in pure.items():
        if f.full is None:
            partial = partial | {e}
    return Carrier(lost, partial - lost, pure)


# -- the tracker --------------------------------------------------------------------


class StructureTracker:
    """Follows the parameters' scale and shift effects through one traced forward.

    `OpTracer` calls `observe` for every call it sees outside autograd.Function
    forwards and `opaque_call` for what it cannot see into; `result` reads it out.
    """

    def __init__(
        self,
        params: dict[int, Tensor],
        names: dict[int, str],
        stand_ins: Callable[[], dict[int, Tensor]] | None = None,
    ) -> None:
        """`stand_ins`: where the forward computes with other leaves in place of the
        parameters (FSDP2's unsharded copies), id(parameter) -> the leaf it uses now;
        asked when an unknown parameter-like leaf first turns up."""
        self._index = {pid: i for i, pid in enumerate(params)}
        self._stand_ins = stand_ins
        self._strangers: set[int] = set()  # leaves known not to stand in for a parameter
        self._names = [names.get(pid, str(pid)) for pid in params]
        self.param_names = self._names
        self._entry: dict[int, Carrier] = {}
        self._carriers: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.absorbed: dict[int, list[Mechanism]] = {}
        self.opaque: set[int] = set()  # parameter indices
        # The entities (parameter and kind) that reached a call the pass cannot see
        # into: a scale cancelled before such a call still holds when only the
        # parameter's shift went on into it (a norm, then Megatron's ColumnParallelLinear).
        self._opaque_entities: set[int] = set()
        self.ordinals: dict[str, int] = {}
        self._current_module: Callable[[], str | None] = lambda: None
        self.failed: str | None = None  # an internal error switches the pass off
        # The op outputs of every cancelling call, for the confirming re-run, and their
        # autograd nodes, to check that every gradient path goes through them.
        self.outputs: dict[tuple[str, int], Tensor] = {}
        self.nodes: dict[tuple[str, int], Any] = {}
        # entity -> the unit roundoff of the coarsest dtype that carried its pure effect
        # (only those coarser than float32 are kept)
        self._rounding: dict[int, float] = {}

    def set_module_lookup(self, current: Callable[[], str | None]) -> None:
        self._current_module = current

    # -- carriers of values -------------------------------------------------------
    def carrier(self, value: object) -> Carrier:
        if not isinstance(value, Tensor):
            return _EMPTY
        pid = id(value)
        i = self._index.get(pid)
        if i is None and self._stand_ins is not None and isinstance(value, torch.nn.Parameter):
            i = self._stand_in_index(value)
        if i is not None and value.requires_grad:
            entry = self._entry.get(i)
            if entry is None:
                dims = _all_dims(value.shape)
                entry = self._entry[i] = Carrier(
                    pure={
                        2 * i + SCALE: Facet(SCALE, dims),
                        2 * i + SHIFT: Facet(SHIFT, dims, tag=next(_tags)),
                    }
                )
                self._coarsen(entry, value)
            return entry
        return self._carriers.get(value, _EMPTY)

    def _stand_in_index(self, leaf: Tensor) -> int | None:
        pid = id(leaf)
        if pid in self._strangers or self._stand_ins is None:
            return None
        for sharded, now in self._stand_ins().items():
            i = self._index.get(sharded)
            if i is not None:
                self._index.setdefault(id(now), i)
        i = self._index.get(pid)
        if i is None:
            self._strangers.add(pid)
        return i

    def _set(self, out: object, c: Carrier) -> None:
        if isinstance(out, Tensor):
            if c.lost or c.partial or c.pure:
                self._carriers[out] = c
                self._coarsen(c, out)
            elif out in self._carriers:
                del self._carriers[out]

    def _coarsen(self, c: Carrier, value: Tensor) -> None:
        """Note that the pure effects of `c` now sit in `value`'s dtype."""
        u = unit_roundoff(value.dtype)
        if u <= _FLOAT32_ROUNDOFF or not c.pure:
            return
        rounding = self._rounding
        for e in c.pure:
            if rounding.get(e, 0.0) < u:
                rounding[e] = u

    # -- called by the tracer -----------------------------------------------------
    def count(self, name: str) -> int:
        n = self.ordinals.get(name, 0)
        self.ordinals[name] = n + 1
        return n

    def observe(self, func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        ordinal = self.count(name) if name in COUNTED else -1
        if self.failed is not None:
            return
        try:
            self._observe(func, name, ordinal, args, kwargs, out)
        except Exception as exc:  # the pass must never break the user's forward
            self.failed = f"{type(exc).__name__} at {name}: {exc}"

    def opaque_call(
        self, args: tuple, kwargs: dict, outputs: list[Tensor], inner: Iterable[Any]
    ) -> None:
        """A call the pass cannot see into: its outputs depend on everything it used."""
        carriers = [self.carrier(v) for v in _flat(args, kwargs)]
        carriers += [self.carrier(v) for v in inner]
        merged = _general(carriers)
        self._opaque(merged.lost | merged.partial)
        for o in outputs:
            self._set(o, merged)

    def pass_through(self, inputs: list[Tensor], outputs: list[Tensor]) -> None:
        """A call that returns its tensor inputs unchanged, in order."""
        if len(inputs) != len(outputs):
            self.opaque_call(tuple(inputs), {}, outputs, ())
            return
        for i, o in zip(inputs, outputs, strict=True):
            self._set(o, self.carrier(i))

    def opaque_params(self, params: Iterable[Any]) -> None:
        for p in params:
            i = self._index.get(id(p))
            if i is not None:
                self._opaque({2 * i + SCALE, 2 * i + SHIFT})

    def _opaque(self, entities: Iterable[int]) -> None:
        for e in entities:
            self._opaque_entities.add(e)
            self.opaque.add(e // 2)

    def _observe(
        self, func: Any, name: str, ordinal: int, args: tuple, kwargs: dict, out: Any
    ) -> None:
        values = list(_flat(args, kwargs))
        carriers = [self.carrier(v) for v in values]
        if not any(c.lost or c.partial or c.pure for c in carriers):
            return
        outs = [o for o in _outputs(out)]
        if not outs:
            return
        rule = _RULES.get(name)
        if rule is None:
            if _is_custom_op(func):
                for c in carriers:
                    self._opaque(c.all_entities() | c.partial)
            merged = _general(carriers)
            for o in outs:
                self._set(o, merged)
            return
        ctx = _Call(self, name, ordinal, args, kwargs, out)
        result = rule(ctx)
        if isinstance(result, list):
            for o, c in zip(outs, result, strict=False):
                self._set(o, c)
        else:
            for o in outs:
                self._set(o, result)
        if ctx.absorbed and isinstance(out, Tensor):
            self.outputs[(name, ordinal)] = out.detach()
            self.nodes[(name, ordinal)] = out.grad_fn

    def absorb(
        self, ctx: _Call, entity: int, facet: Facet, op: str, dims: Iterable[int], full: bool
    ) -> None:
        self.absorbed.setdefault(entity, []).append(
            Mechanism(
                op=op,
                call=ctx.name,
                ordinal=ctx.ordinal,
                site=user_site(sys._getframe(1)),
                module=self._current_module(),
                dims=tuple(sorted(dims)),
                facet="full" if full else "uniform",
                approx=facet.approx or op in _EPS_OPS,
                rounding=max(
                    [self._rounding.get(entity, _FLOAT32_ROUNDOFF)]
                    + [unit_roundoff(o.dtype) for o in _outputs(ctx.out)]
                ),
            )
        )
        ctx.absorbed = True

    # -- the verdict --------------------------------------------------------------
    def result(self, loss: Tensor, has_grad: Callable[[int], bool]) -> StructureResult:
        at_loss = self.carrier(loss)
        influencing = {e // 2 for e in at_loss.lost | frozenset(at_loss.pure)}
        cancellations: dict[str, Cancellation] = {}
        for e, mechanisms in self.absorbed.items():
            i, kind = divmod(e, 2)
            if e in self._opaque_entities or not has_grad(i):
                continue
            if e in at_loss.lost or e in at_loss.pure:
                continue  # it reaches the loss in another way too
            full = e not in at_loss.partial and all(m.facet == "full" for m in mechanisms)
            if kind == SHIFT and not full:
                # A free mean (a bias or an embedding feeding a LayerNorm or a softmax) is
                # how mean-subtracting designs work; nothing to report or to confirm.
                continue
            name = self._names[i]
            known = cancellations.get(name)
            # A full cancellation of either effect says more than a uniform one.
            if known is not None and (known.full or not full):
                continue
            cancellations[name] = Cancellation(name, KINDS[kind], full, _unique(mechanisms))
        # Every path of the autograd graph from the loss to a candidate must pass one of
        # the ops that cancel it; a path around them is a use the pass did not see (a
        # call outside torch's API, a compiled region): then it is no candidate.
        ids: dict[str, list[int]] = {}
        for pid, i in self._index.items():  # a parameter and the leaf standing in for it
            ids.setdefault(self._names[i], []).append(pid)
        by_stop: dict[frozenset[Any], list[str]] = {}
        for name, c in cancellations.items():
            stop = frozenset(
                n for m in c.mechanisms if (n := self.nodes.get((m.call, m.ordinal))) is not None
            )
            by_stop.setdefault(stop, []).append(name)
        root = loss.grad_fn
        for stop, names in by_stop.items():
            around = autograd_graph.walk([root], stop=stop).leaves if root is not None else {}
            for name in names:
                pids = ids.get(name, [])
                if any(pid in around for pid in pids):
                    del cancellations[name]
                    influencing.add(self._index[pids[0]])
        influencing -= {i for i in influencing if self._names[i] in cancellations}
        # A parameter one of whose effects is cancelled everywhere is not "influencing"
        # through the other effect's plain dependence (that effect is not exact).
        return StructureResult(
            cancellations=cancellations,
            influencing=frozenset(self._names[i] for i in influencing),
            opaque=frozenset(self._names[i] for i in self.opaque),
        )


def _unique(mechanisms: list[Mechanism]) -> tuple[Mechanism, ...]:
    seen: dict[tuple[str, int], Mechanism] = {}
    for m in mechanisms:
        seen.setdefault((m.call, m.ordinal), m)
    return tuple(seen.values())


@dataclass
class _Call:
    tracker: StructureTracker
    name: str
    ordinal: int
    args: tuple
    kwargs: dict
    out: Any
    absorbed: bool = False

    def arg(self, i: int, key: str, default: Any = None) -> Any:
        if len(self.args) > i:
            return self.args[i]
        return self.kwargs.get(key, default)

    def c(self, value: object) -> Carrier:
        return self.tracker.carrier(value)


def _flat(args: tuple, kwargs: dict) -> Iterator[Any]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def _outputs(out: Any) -> list[Tensor]:
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, Tensor)]
    return []


_FLOAT32_ROUNDOFF = 2.0**-24
_ROUNDOFF: dict[torch.dtype, float] = {}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the gap between 1 and the next number of `dtype` (its relative rounding
    error); float32's for a dtype that is not floating (an index, a mask)."""
    u = _ROUNDOFF.get(dtype)
    if u is None:
        u = float(torch.finfo(dtype).eps) / 2 if dtype.is_floating_point else _FLOAT32_ROUNDOFF
        _ROUNDOFF[dtype] = u
    return u


def _is_custom_op(func: Any) -> bool:
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        namespace = getattr(func, "namespace", None) or str(func).split("::")[0].split(".")[-1]
        return namespace not in ("aten", "prims")
    return False


# -- rules: shape-only ops ------------------------------------------------------------


def _first_shape(ctx: _Call) -> tuple[list[int], list[int]] | None:
    x = ctx.args[0] if ctx.args else None
    if not isinstance(x, Tensor) or not isinstance(ctx.out, Tensor):
        return None
    return list(x.shape), list(ctx.out.shape)


def _rule_same(ctx: _Call) -> Carrier:
    """Elementwise, values kept (dtype casts, clone, contiguous). A tensor among the
    other arguments (`x.type_as(y)`, `x.to(y)`) lends only its dtype and device: its
    values, and the parameters behind them, do not reach the output (Gemma's RMSNorm
    casts back with `output.type_as(x)`, x the normalized input itself)."""
    c = ctx.c(ctx.args[0]) if ctx.args else _EMPTY
    shapes = _first_shape(ctx)
    if shapes is None or shapes[0] != shapes[1]:
        return _general([c])
    return c


def _rule_reshape(ctx: _Call) -> Carrier:
    shapes = _first_shape(ctx)
    c = ctx.c(ctx.args[0])
    if shapes is None:
        return _general([c])
    i, o = shapes
    if math.prod(i) == math.prod(o):
        return _map_carrier(c, lambda d: _reshape_dims(i, o, d))
    # expand / broadcast_to / repeat: right-aligned; a repeated dim keeps its variation
    m = _broadcast_map(i, o)
    return _map_carrier(c, lambda d: _nontrivial(o, (m(x) for x in d)))


def _permutation(ctx: _Call, ndim: int) -> list[int] | None:
    """Output dim i holds input dim perm[i]; None when the call cannot be read."""
    name = ctx.name.rsplit(".", 1)[-1]
    rest = list(ctx.args[1:])
    perm = list(range(ndim))
    if name == "permute":
        dims = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        return [_norm_dim(int(d), ndim) for d in (dims or ctx.kwargs.get("dims", []))]
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
        first, second = _norm_dim(given[0], ndim), _norm_dim(given[1], ndim)
    perm[first], perm[second] = perm[second], perm[first]
    return perm


def _rule_permute(ctx: _Call) -> Carrier:
    x = ctx.args[0]
    c = ctx.c(x)
    if not isinstance(x, Tensor):
        return _general([c])
    perm = _permutation(ctx, x.dim())
    if perm is None or sorted(perm) != list(range(x.dim())):
        return _general([c])
    where = {src: dst for dst, src in enumerate(perm)}
    return _map_carrier(c, lambda d: frozenset(where[x] for x in d))


def _rule_slice(ctx: _Call) -> Carrier | list[Carrier]:
    """Indexing, narrow, split: values kept; dims kept where the layout stays."""
    x = ctx.args[0]
    c = ctx.c(x)
    others = [ctx.c(v) for v in list(_flat(ctx.args[1:], ctx.kwargs))]
    base = _general(others) if any(o.lost or o.pure or o.partial for o in others) else None
    if base is not None:
        return _general([c, base])
    name = ctx.name.rsplit(".", 1)[-1]
    outs = _outputs(ctx.out)
    if not isinstance(x, Tensor) or not outs:
        return _general([c])
    ndim = x.dim()
    mapping: Callable[[frozenset[int]], frozenset[int] | None]
    if name in ("split", "chunk", "tensor_split", "narrow", "split_with_sizes"):
        mapping = lambda d: d  # noqa: E731
    elif name in ("unbind", "select"):
        dim = _norm_dim(int(ctx.arg(1, "dim", 0)), ndim)
        mapping = lambda d: frozenset(x - (x > dim) for x in d if x != dim)  # noqa: E731
    elif name == "__getitem__":
        mapping = _index_mapping(ctx.args[1] if len(ctx.args) > 1 else None, ndim)
    else:
        mapping = lambda d: None if d else d  # noqa: E731
    mapped = _map_carrier(c, lambda d: _restrict(mapping(d), outs[0].shape))
    return [mapped] * len(outs) if isinstance(ctx.out, (tuple, list)) else mapped


def _restrict(dims: frozenset[int] | None, shape: Sequence[int]) -> frozenset[int] | None:
    return None if dims is None else _nontrivial(shape, dims)


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


# -- rules: elementwise arithmetic ------------------------------------------------------


def _binary_operands(ctx: _Call) -> tuple[Any, Any, float | None]:
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
    m = _broadcast_map(value.shape, out_shape)
    return _nontrivial(out_shape, (m(d) for d in range(value.dim()) if value.shape[d] > 1))


def _aligned(value: Any, c: Carrier, out_shape: Sequence[int]) -> Carrier:
    if not c.pure or not isinstance(value, Tensor):
        return c
    m = _broadcast_map(value.shape, out_shape)
    return _map_carrier(c, lambda d: _nontrivial(out_shape, (m(x) for x in d)))


def _is_small_constant(value: Any) -> bool:
    if isinstance(value, (int, float)):
        return True
    return isinstance(value, Tensor) and value.numel() == 1


def _combine(
    ctx: _Call, op: str, a: Any, b: Any, out_shape: Sequence[int], alpha: Any = None
) -> Carrier:
    ca = _aligned(a, ctx.c(a), out_shape)
    cb = _aligned(b, ctx.c(b), out_shape)
    lost, partial = _merge_general([ca, cb])
    pure: dict[int, Facet] = {}
    for e in set(ca.pure) | set(cb.pure):
        if e in lost:
            continue
        fa, fb = ca.pure.get(e), cb.pure.get(e)
        f = _combine_facet(ctx, op, e, fa, fb, a, b, out_shape, alpha)
        if f is None:
            lost = lost | {e}
        elif f is not _CANCELLED:
            pure[e] = f
    return _finish(lost, partial, pure)


_CANCELLED = Facet(SCALE, None, uniform=False)


def _combine_facet(
    ctx: _Call,
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
                return replace(f, tag=next(_tags)) if scaled else f
            # a scale plus an independent term: only an eps-like constant keeps it
            return replace(f, approx=True) if _is_small_constant(other) else None
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
            return _union(fa, fb, tag=next(_tags))
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
                return replace(f, degree=-f.degree)
            return f
        if op == "div" and fb is not None:
            return None  # 1 / (x + s)
        varying = _varying(other, out_shape)
        full = None if f.full is None else f.full | varying
        return Facet(SHIFT, full, f.uniform and not varying, tag=next(_tags))
    assert fa is not None and fb is not None
    if fa.kind != SCALE or fb.kind != SCALE:
        return None
    degree = fa.degree + fb.degree if op == "mul" else fa.degree - fb.degree
    f = _product(fa, fb, fa.full, fb.full, degree)
    full, uniform = f.full, f.uniform
    if degree == _ZERO:
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


def _rule_binary(op: str) -> Callable[[_Call], Carrier]:
    def rule(ctx: _Call) -> Carrier:
        a, b, alpha = _binary_operands(ctx)
        out = ctx.out
        if not isinstance(out, Tensor):
            return _general([ctx.c(a), ctx.c(b)])
        if alpha is not None and not isinstance(alpha, (int, float)):
            return _general([ctx.c(a), ctx.c(b)])
        return _combine(ctx, op, a, b, list(out.shape), alpha)

    return rule


def _rule_neg(ctx: _Call) -> Carrier:
    c = ctx.c(ctx.args[0])
    pure = {e: (replace(f, tag=next(_tags)) if f.kind == SHIFT else f) for e, f in c.pure.items()}
    return Carrier(c.lost, c.partial, pure)


def _rule_power(degree_of: Callable[[_Call], Fraction | None]) -> Callable[[_Call], Carrier]:
    def rule(ctx: _Call) -> Carrier:
        c = ctx.c(ctx.args[0])
        others = [ctx.c(v) for v in list(_flat(ctx.args[1:], ctx.kwargs))]
        k = degree_of(ctx)
        if k is None or any(o.lost or o.pure or o.partial for o in others):
            return _general([c, *others])
        lost, partial = c.lost, c.partial
        pure = {}
        for e, f in c.pure.items():
            if f.kind == SCALE:
                pure[e] = replace(f, degree=f.degree * k)
            else:
                lost = lost | {e}
        return _finish(lost, partial, pure)

    return rule


def _exponent(ctx: _Call) -> Fraction | None:
    e = ctx.arg(1, "exponent")
    if isinstance(e, (int, float)) and math.isfinite(e):
        return Fraction(e).limit_denominator(64)
    return None


def _rule_scale_keeping(ctx: _Call) -> Carrier:
    """abs: |lambda x| = |lambda| |x|, a scale survives (lambda > 0); a shift does not."""
    return _rule_power(lambda _: _ONE)(ctx)


def _rule_dropout(ctx: _Call) -> Carrier:
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
            lost = lost | {e}
    return _finish(lost, partial, pure)


# -- rules: reductions -------------------------------------------------------------------


def _reduced_dims(ctx: _Call, ndim: int) -> tuple[frozenset[int], bool]:
    dim = ctx.arg(1, "dim", None)
    if dim is None and "axis" in ctx.kwargs:
        dim = ctx.kwargs["axis"]
    keepdim = bool(ctx.arg(2, "keepdim", False))
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return frozenset(range(ndim)), keepdim
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return frozenset(range(ndim)), keepdim
    return frozenset(_norm_dim(d, ndim) for d in dims), keepdim


def _rule_reduce(kind: str) -> Callable[[_Call], Carrier]:
    """sum/mean and friends over dims R. kind: 'mean', 'sum', 'max' (shift and scale
    pass), 'lse' (logsumexp: a shift passes, a scale does not), 'var' (shift
    cancelled, degree 2), 'std' (shift cancelled, degree 1), 'norm' (scale passes,
    shift lost)."""

    def rule(ctx: _Call) -> Carrier:
        x = ctx.args[0] if ctx.args else ctx.kwargs.get("input")
        c = ctx.c(x)
        if not isinstance(x, Tensor) or not isinstance(ctx.out, Tensor) or ctx.name.endswith("_"):
            return _general([c])
        if kind == "norm":
            # norm(x, p, dim, keepdim): the dims are the third argument
            dim = ctx.arg(2, "dim", None)
            keep = bool(ctx.arg(3, "keepdim", False))
            ndim = x.dim()
            if dim is None:
                reduced = frozenset(range(ndim))
            else:
                ds = dim if isinstance(dim, (list, tuple)) else [dim]
                reduced = frozenset(_norm_dim(int(d), ndim) for d in ds)
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
                    lost = lost | {e}
                    continue
                degree = f.degree * (2 if kind == "var" else 1)
                full = None if (f.full is None or crosses) else remap(f.full)
                if full is None and not f.uniform:
                    lost = lost | {e}
                    continue
                pure[e] = Facet(SCALE, full, f.uniform, degree, f.approx)
            else:
                if kind in ("var", "std"):
                    if not crosses and f.full is not None:
                        ctx.tracker.absorb(ctx, e, f, "hand-written variance", reduced, True)
                        continue
                    if f.uniform:
                        ctx.tracker.absorb(ctx, e, f, "hand-written variance", reduced, False)
                        partial = partial | {e}
                        continue
                    lost = lost | {e}
                    continue
                if kind == "norm":
                    lost = lost | {e}
                    continue
                full = None if f.full is None else remap(f.full)
                same_value = kind in ("mean", "max", "lse") and not crosses and f.full is not None
                tag = f.tag if same_value else next(_tags)
                pure[e] = Facet(SHIFT, full, f.uniform, tag=tag)
        del ndim
        return _finish(lost, partial, pure)

    return rule


# -- rules: linear algebra ---------------------------------------------------------------


def _matmul_carrier(
    ctx: _Call, a: Any, b: Any, out_shape: Sequence[int], b_is_transposed_weight: bool = False
) -> Carrier:
    """a @ b for a.ndim >= 2 and b.ndim >= 2 (b given as (..., k, m))."""
    ca, cb = ctx.c(a), ctx.c(b)
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return _general([ca, cb])
    a_shape = list(a.shape)
    b_shape = list(reversed(b.shape)) if b_is_transposed_weight else list(b.shape)
    if len(a_shape) < 2 or len(b_shape) < 2:
        return _general([ca, cb])
    nd = len(out_shape)
    n_dim, m_dim = nd - 2, nd - 1
    batch_out = _nontrivial(out_shape, range(nd - 2))

    def a_map(d: frozenset[int]) -> frozenset[int] | None:
        k = len(a_shape) - 1
        if k in d:
            return None
        off = nd - len(a_shape)
        return _nontrivial(out_shape, (x + off for x in d))

    def b_map(d: frozenset[int]) -> frozenset[int] | None:
        if b_is_transposed_weight:
            d = frozenset({0: 1, 1: 0}[x] for x in d)
        k = len(b_shape) - 2
        if k in d:
            return None
        off = nd - len(b_shape)
        return _nontrivial(out_shape, (x + off for x in d))

    lost, partial = _merge_general([ca, cb])
    pure: dict[int, Facet] = {}
    for e in set(ca.pure) | set(cb.pure):
        if e in lost:
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
                    lost = lost | {e}
                    continue
                pure[e] = product
            else:
                lost = lost | {e}
            continue
        f = fa if fa is not None else fb
        assert f is not None
        on_a = fa is not None
        mapping = a_map if on_a else b_map
        if f.kind == SCALE:
            full = None if f.full is None else mapping(f.full)
            if full is None and not f.uniform:
                lost = lost | {e}
                continue
            pure[e] = replace(f, full=full)
            continue
        # shift: (A + s) B = AB + sB varies along m and B's batch dims; A (B + s) = AB + As
        # varies along n and A's batch dims, and along m only if s does.
        if f.full is None:
            lost = lost | {e}
            continue
        if on_a:
            full = (
                (mapping(f.full - {len(a_shape) - 1}) or frozenset())
                | _nontrivial(out_shape, [m_dim])
                | batch_out
            )
        else:
            s = f.full
            if b_is_transposed_weight:
                s = frozenset({0: 1, 1: 0}[x] for x in s)
            m_varies = (len(b_shape) - 1) in s
            full = (
                _nontrivial(out_shape, [n_dim])
                | batch_out
                | (_nontrivial(out_shape, [m_dim]) if m_varies else frozenset())
            )
        pure[e] = Facet(SHIFT, full, False, tag=next(_tags))
    return _finish(lost, partial, pure)


def _rule_matmul(ctx: _Call) -> Carrier:
    a, b, _ = _binary_operands(ctx)
    if not isinstance(ctx.out, Tensor):
        return _general([ctx.c(a), ctx.c(b)])
    if ctx.name.rsplit(".", 1)[-1] == "__rmatmul__":
        a, b = b, a
    return _matmul_carrier(ctx, a, b, list(ctx.out.shape))


def _rule_linear(ctx: _Call) -> Carrier:
    x, w = ctx.arg(0, "input"), ctx.arg(1, "weight")
    bias = ctx.arg(2, "bias")
    out = ctx.out
    if not isinstance(out, Tensor) or not isinstance(w, Tensor) or w.dim() != 2:
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
    if isinstance(x, Tensor) and x.dim() == 1:
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
    prod = _matmul_carrier(ctx, x, w, list(out.shape), b_is_transposed_weight=True)
    if bias is None:
        return prod
    return _add_carriers(ctx, prod, bias, list(out.shape))


def _add_carriers(ctx: _Call, left: Carrier, value: Any, out_shape: Sequence[int]) -> Carrier:
    """`left` (a carrier of an output-shaped term) plus `value` (broadcast)."""
    return _add_term(left, _aligned(value, ctx.c(value), out_shape))


def _rule_addmm(ctx: _Call) -> Carrier:
    bias, m1, m2 = ctx.arg(0, "input"), ctx.arg(1, "mat1"), ctx.arg(2, "mat2")
    out = ctx.out
    beta, alpha = ctx.kwargs.get("beta", 1), ctx.kwargs.get("alpha", 1)
    if not isinstance(out, Tensor) or not (
        isinstance(beta, (int, float)) and isinstance(alpha, (int, float))
    ):
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
    prod = _matmul_carrier(ctx, m1, m2, list(out.shape))
    if beta == 0:
        return prod
    return _add_carriers(ctx, prod, bias, list(out.shape))


def _rule_multilinear(ctx: _Call) -> Carrier:
    """einsum, bilinear and the like: each operand's uniform scale factor pulls out."""
    carriers = [ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)]
    lost, partial = _merge_general(carriers)
    pure: dict[int, Facet] = {}
    degree: dict[int, Fraction] = {}
    for c in carriers:
        for e, f in c.pure.items():
            if f.kind == SCALE and f.uniform:
                degree[e] = degree.get(e, _ZERO) + f.degree
            else:
                lost = lost | {e}
    for e, k in degree.items():
        if e not in lost:
            pure[e] = Facet(SCALE, None, True, k)
    return _finish(lost, partial, pure)


def _rule_conv(ctx: _Call) -> Carrier:
    x, w, bias = ctx.arg(0, "input"), ctx.arg(1, "weight"), ctx.arg(2, "bias")
    out = ctx.out
    cx, cw = ctx.c(x), ctx.c(w)
    others = [
        ctx.c(v)
        for v in list(
            _flat(
                ctx.args[3:],
                {k: v for k, v in ctx.kwargs.items() if k not in ("input", "weight", "bias")},
            )
        )
    ]
    if not isinstance(out, Tensor) or any(o.lost or o.pure or o.partial for o in others):
        return _general([cx, cw, ctx.c(bias), *others])
    lost, partial = _merge_general([cx, cw])
    pure: dict[int, Facet] = {}
    channel = _nontrivial(out.shape, [1])
    for e in set(cx.pure) | set(cw.pure):
        fx, fw = cx.pure.get(e), cw.pure.get(e)
        facets = [f for f in (fx, fw) if f is not None]
        if any(f.kind != SCALE for f in facets):
            lost = lost | {e}
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
            lost = lost | {e}
            continue
        pure[e] = Facet(
            SCALE,
            full,
            uniform,
            sum((f.degree for f in facets), _ZERO),
            any(f.approx for f in facets),
        )
    prod = _finish(lost, partial, pure)
    if bias is None:
        return prod
    cb = ctx.c(bias)
    if isinstance(bias, Tensor) and bias.dim() == 1 and cb.pure:
        cb = _map_carrier(cb, lambda d: channel if d else d)
    return _add_term(prod, cb)


def _add_term(left: Carrier, right: Carrier) -> Carrier:
    """left + right, with `right` already in the output's dims."""
    lost, partial = _merge_general([left, right])
    pure: dict[int, Facet] = {}
    for e in set(left.pure) | set(right.pure):
        fa, fb = left.pure.get(e), right.pure.get(e)
        if fa is not None and fb is not None:
            f: Facet | None = (
                _union(fa, fb, tag=next(_tags)) if fa.kind == fb.kind == SHIFT else None
            )
        else:
            f = fa if fa is not None else fb
            assert f is not None
            if f.kind == SCALE:
                f = None
        if f is None:
            lost = lost | {e}
        else:
            pure[e] = f
    return _finish(lost, partial, pure)


def _mul_term(left: Carrier, right: Carrier, right_varying: frozenset[int]) -> Carrier:
    """left * right, `right` in the output's dims and varying along `right_varying`."""
    lost, partial = _merge_general([left, right])
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
                f = Facet(SHIFT, full, fa.uniform and not right_varying, tag=next(_tags))
        else:
            assert fb is not None
            f = fb if fb.kind == SCALE else None
        if f is None:
            lost = lost | {e}
        else:
            pure[e] = f
    return _finish(lost, partial, pure)


def _rule_embedding(ctx: _Call) -> Carrier:
    ids, w = ctx.arg(0, "input"), ctx.arg(1, "weight")
    out = ctx.out
    cw = ctx.c(w)
    if not isinstance(out, Tensor) or ctx.c(ids).lost or ctx.c(ids).pure:
        return _general([cw, ctx.c(ids)])
    last = _nontrivial(out.shape, [out.dim() - 1])
    lost, partial = cw.lost, cw.partial
    pure: dict[int, Facet] = {}
    for e, f in cw.pure.items():
        full = None if f.full is None or 0 in f.full else (last if f.full else frozenset())
        if full is None and not f.uniform:
            lost = lost | {e}
            continue
        pure[e] = replace(f, full=full, tag=next(_tags) if f.kind == SHIFT else 0)
    return _finish(lost, partial, pure)


# -- rules: the cancelling ops -----------------------------------------------------------


def _cancel(
    ctx: _Call,
    c: Carrier,
    over: frozenset[int],
    allowed: frozenset[int] | None,
    kinds: tuple[int, ...],
    op: str,
    keep_scale: bool = False,
    keep_shift: bool = False,
) -> Carrier:
    """The normalized output's carrier: effects of the given kinds whose varying dims lie
    within `allowed` (None: outside `over`) are cancelled; the rest becomes plain."""
    lost, partial = c.lost, c.partial
    pure: dict[int, Facet] = {}
    for e, f in c.pure.items():
        if f.kind in kinds:
            fits = f.full is not None and (
                (f.full <= allowed) if allowed is not None else not (f.full & over)
            )
            if fits:
                ctx.tracker.absorb(ctx, e, f, op, over, True)
                continue
            if f.uniform:
                ctx.tracker.absorb(ctx, e, f, op, over, False)
                partial = partial | {e}
                continue
        elif (f.kind == SCALE and keep_scale) or (f.kind == SHIFT and keep_shift):
            pure[e] = f
            continue
        lost = lost | {e}
    return _finish(lost, partial, pure)


def _affine(
    ctx: _Call, normed: Carrier, weight: Any, bias: Any, out: Tensor, dims: Sequence[int]
) -> Carrier:
    """normed * weight + bias, weight and bias laid along the output dims `dims`."""
    result = normed
    for value, is_weight in ((weight, True), (bias, False)):
        if not isinstance(value, Tensor):
            continue
        cv = ctx.c(value)
        if not (cv.lost or cv.pure or cv.partial):
            if is_weight:
                result = _mul_term(result, _EMPTY, _nontrivial(out.shape, dims))
            continue
        laid = list(dims)[-value.dim() :] if value.dim() else []
        mapped = _map_carrier(cv, lambda d, laid=laid: _nontrivial(out.shape, (laid[x] for x in d)))  # type: ignore[misc]
        if is_weight:
            result = _mul_term(result, mapped, _nontrivial(out.shape, laid))
        else:
            result = _add_term(result, mapped)
    return result


def _rule_layer_norm(rms: bool) -> Callable[[_Call], Carrier]:
    def rule(ctx: _Call) -> Carrier:
        x = ctx.arg(0, "input")
        shape = ctx.arg(1, "normalized_shape")
        w = ctx.arg(2, "weight")
        b = None if rms else ctx.arg(3, "bias")
        out = ctx.out
        if not isinstance(x, Tensor) or not isinstance(out, Tensor):
            return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
        n = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
        over = frozenset(range(x.dim() - n, x.dim()))
        kinds = (SCALE,) if rms else (SCALE, SHIFT)
        normed = _cancel(ctx, ctx.c(x), over, None, kinds, "RMSNorm" if rms else "LayerNorm")
        return _affine(ctx, normed, w, b, out, sorted(over))

    return rule


def _rule_group_norm(ctx: _Call) -> Carrier:
    x, groups = ctx.arg(0, "input"), ctx.arg(1, "num_groups")
    w, b = ctx.arg(2, "weight"), ctx.arg(3, "bias")
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or x.dim() < 2:
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
    channels = x.shape[1]
    allowed = frozenset({0, 1}) if groups == channels else frozenset({0})
    over = frozenset(range(1, x.dim()))
    normed = _cancel(ctx, ctx.c(x), over, allowed, (SCALE, SHIFT), "GroupNorm")
    return _affine(ctx, normed, w, b, out, [1])


def _rule_batch_norm(ctx: _Call) -> Carrier:
    x = ctx.arg(0, "input")
    running_mean = ctx.arg(1, "running_mean")
    w, b = ctx.arg(3, "weight"), ctx.arg(4, "bias")
    training = ctx.arg(5, "training", False)
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or x.dim() < 2:
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
    if not training and running_mean is not None:
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])  # fixed statistics
    over = frozenset({0} | set(range(2, x.dim())))
    normed = _cancel(ctx, ctx.c(x), over, frozenset({1}), (SCALE, SHIFT), "BatchNorm")
    return _affine(ctx, normed, w, b, out, [1])


def _rule_instance_norm(ctx: _Call) -> Carrier:
    x = ctx.arg(0, "input")
    w, b = ctx.arg(3, "weight"), ctx.arg(4, "bias")
    use_input_stats = ctx.arg(5, "use_input_stats", True)
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not use_input_stats:
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
    over = frozenset(range(2, x.dim()))
    normed = _cancel(ctx, ctx.c(x), over, frozenset({0, 1}), (SCALE, SHIFT), "InstanceNorm")
    return _affine(ctx, normed, w, b, out, [1])


def _rule_normalize(ctx: _Call) -> Carrier:
    x = ctx.arg(0, "input")
    dim = ctx.arg(2, "dim", 1)
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not isinstance(dim, int):
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
    over = frozenset({_norm_dim(dim, x.dim())})
    return _cancel(ctx, ctx.c(x), over, None, (SCALE,), "F.normalize")


def _rule_softmax(log: bool) -> Callable[[_Call], Carrier]:
    def rule(ctx: _Call) -> Carrier:
        x = ctx.arg(0, "input")
        dim = ctx.arg(1, "dim")
        out = ctx.out
        if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not isinstance(dim, int):
            return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
        over = frozenset({_norm_dim(dim, x.dim())})
        op = "log_softmax" if log else "softmax"
        return _cancel(ctx, ctx.c(x), over, None, (SHIFT,), f"{op} over dim {dim}")

    return rule


def _rule_cross_entropy(ctx: _Call) -> Carrier:
    x, target = ctx.arg(0, "input"), ctx.arg(1, "target")
    rest = [
        ctx.c(v)
        for v in list(
            _flat(
                ctx.args[2:], {k: v for k, v in ctx.kwargs.items() if k not in ("input", "target")}
            )
        )
    ]
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor):
        return _general([ctx.c(v) for v in _flat(ctx.args, ctx.kwargs)])
    class_dim = 1 if x.dim() >= 2 else 0
    over = frozenset({class_dim})
    normed = _cancel(ctx, ctx.c(x), over, None, (SHIFT,), "cross_entropy over the classes")
    return _general([normed, ctx.c(target), *rest])


def _rule_sdpa(ctx: _Call) -> Carrier:
    q, k, v = ctx.arg(0, "query"), ctx.arg(1, "key"), ctx.arg(2, "value")
    mask = ctx.arg(3, "attn_mask")
    dropout_p = ctx.arg(4, "dropout_p", 0.0)
    out = ctx.out
    if not all(isinstance(t, Tensor) for t in (q, k, v)) or not isinstance(out, Tensor):
        return _general([ctx.c(t) for t in _flat(ctx.args, ctx.kwargs)])
    seq = k.dim() - 2
    keys = _cancel(
        ctx,
        ctx.c(k),
        frozenset({seq}),
        None,
        (SHIFT,),
        "softmax over keys (scaled_dot_product_attention)",
    )
    cv = ctx.c(v)
    if cv.pure:
        vseq = v.dim() - 2
        offset = out.dim() - v.dim()

        def vmap(d: frozenset[int]) -> frozenset[int] | None:
            return None if vseq in d else _nontrivial(out.shape, (x + offset for x in d))

        lost, partial = cv.lost, cv.partial
        pure = {}
        for e, f in cv.pure.items():
            mapped = _map_facet(f, vmap)
            if f.kind == SCALE or dropout_p == 0:
                if mapped.full is None and not mapped.uniform:
                    lost = lost | {e}
                else:
                    pure[e] = mapped
            else:
                lost = lost | {e}
        cv = _finish(lost, partial, pure)
    plain = _general([ctx.c(q), keys, ctx.c(mask)])
    return _add_term(plain, cv) if cv.pure else _general([plain, cv])


_EPS_OPS = {"LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm", "InstanceNorm", "F.normalize"}


# -- the rule table ------------------------------------------------------------------


def _names(*bases: str, methods: bool = True, functions: bool = True) -> list[str]:
    out = []
    for base in bases:
        if functions:
            out += [f"torch.{base}", f"torch.nn.functional.{base}"]
        if methods:
            out += [f"Tensor.{base}"]
    return out


_RULES: dict[str, Callable[[_Call], Any]] = {}


def _register(names: Iterable[str], rule: Callable[[_Call], Any]) -> None:
    for n in names:
        _RULES[n] = rule


_register(
    _names(
        "float",
        "double",
        "half",
        "bfloat16",
        "to",
        "type",
        "type_as",
        "clone",
        "contiguous",
        "detach",
        "requires_grad_",
        "cpu",
        "cuda",
    ),
    _rule_same,
)
_register(
    _names(
        "view",
        "reshape",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "view_as",
        "reshape_as",
        "expand",
        "expand_as",
        "broadcast_to",
        "repeat",
        "ravel",
    ),
    _rule_reshape,
)
_register(
    [*_names("permute", "transpose", "t", "swapaxes", "swapdims"), "Tensor.T", "Tensor.mT"],
    _rule_permute,
)
_register(
    [
        *_names("split", "chunk", "tensor_split", "narrow", "unbind", "select", "split_with_sizes"),
        "Tensor.__getitem__",
    ],
    _rule_slice,
)
for _op, _aliases in {
    "add": ("add", "__add__", "__radd__", "__iadd__", "add_"),
    "sub": ("sub", "subtract", "__sub__", "__rsub__", "__isub__", "sub_"),
    "mul": ("mul", "multiply", "__mul__", "__rmul__", "__imul__", "mul_"),
    "div": ("div", "divide", "true_divide", "__truediv__", "__rtruediv__", "__itruediv__", "div_"),
}.items():
    _register(_names(*_aliases), _rule_binary(_op))
_register(_names("neg", "negative", "__neg__"), _rule_neg)
_register(_names("pow", "__pow__", "float_power"), _rule_power(_exponent))
_register(_names("square"), _rule_power(lambda _: Fraction(2)))
_register(_names("sqrt"), _rule_power(lambda _: Fraction(1, 2)))
_register(_names("rsqrt"), _rule_power(lambda _: Fraction(-1, 2)))
_register(_names("reciprocal"), _rule_power(lambda _: Fraction(-1)))
_register(_names("abs", "__abs__"), _rule_scale_keeping)
_register(_names("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout"), _rule_dropout)
_register(_names("sum"), _rule_reduce("sum"))
_register(_names("mean"), _rule_reduce("mean"))
_register(_names("amax", "amin"), _rule_reduce("max"))
_register(_names("logsumexp"), _rule_reduce("lse"))
_register(_names("var"), _rule_reduce("var"))
_register(_names("std"), _rule_reduce("std"))
_register([*_names("norm"), "torch.linalg.vector_norm"], _rule_reduce("norm"))
_register(_names("matmul", "__matmul__", "__rmatmul__", "bmm", "mm"), _rule_matmul)
_register(["torch.nn.functional.linear", "torch._C._nn.linear"], _rule_linear)
_register(_names("addmm"), _rule_addmm)
_register(
    ["torch.einsum", "torch.functional.einsum", "torch.nn.functional.bilinear"], _rule_multilinear
)
_register(
    [f"torch.nn.functional.conv{n}d" for n in (1, 2, 3)] + [f"torch.conv{n}d" for n in (1, 2, 3)],
    _rule_conv,
)
_register(["torch.nn.functional.embedding"], _rule_embedding)
_register(["torch.nn.functional.layer_norm", "torch.layer_norm"], _rule_layer_norm(rms=False))
_register(["torch.nn.functional.rms_norm", "torch.rms_norm"], _rule_layer_norm(rms=True))
_register(["torch.nn.functional.group_norm", "torch.group_norm"], _rule_group_norm)
_register(["torch.nn.functional.batch_norm", "torch.batch_norm"], _rule_batch_norm)
_register(["torch.nn.functional.instance_norm", "torch.instance_norm"], _rule_instance_norm)
_register(["torch.nn.functional.normalize"], _rule_normalize)
_register(_names("softmax"), _rule_softmax(log=False))
_register(_names("log_softmax"), _rule_softmax(log=True))
_register(["torch.nn.functional.cross_entropy"], _rule_cross_entropy)
_register(
    [
        "torch.nn.functional.scaled_dot_product_attention",
        "torch._C._nn.scaled_dot_product_attention",
    ],
    _rule_sdpa,
)

# The calls that can cancel, counted in call order so that a re-run finds the same one.
COUNTED = frozenset(_RULES)


# -- confirmation --------------------------------------------------------------------


class OutputCapture(TorchFunctionMode):
    """Counts calls as `StructureTracker` does and keeps the outputs of the given calls."""

    def __init__(self, targets: set[tuple[str, int]], name_of: Callable[[Any], str]) -> None:
        super().__init__()
        self._targets = targets
        self._name_of = name_of
        self.ordinals: dict[str, int] = {}
        self.outputs: dict[tuple[str, int], Tensor] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = self._name_of(func)
        if name in COUNTED:
            n = self.ordinals.get(name, 0)
            self.ordinals[name] = n + 1
            if (name, n) in self._targets and isinstance(out, Tensor):
                self.outputs[(name, n)] = out.detach()
        return out


def relative_change(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b||, in float64; inf when shapes differ or values are not finite."""
    if a.shape != b.shape:
        return math.inf
    a64, b64 = a.detach().double(), b.detach().double()
    denom = float(b64.norm())
    diff = float((a64 - b64).norm())
    if not (math.isfinite(diff) and math.isfinite(denom)):
        return math.inf
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)


# A cancelled shift is exact: what is left is rounding, of the order of the unit
# roundoff of the coarsest dtype on the way (2^-24 for float32) times the size of the
# shift against the values; 2e-4 leaves room for shifts 1000x the values and still sits
# 50x under the 1e-2 that a real but weak shift influence of a freshly initialised
# layer showed. A path through half precision gets 16 of its unit roundoffs (bfloat16:
# 0.0625, float16: 0.0078): x + c rounded to bf16 loses x's low bits, and the op
# amplifies that by |x + c| / std(x).
SHIFT_TOLERANCE = 2e-4
HALF_ROUNDOFFS = 16
# Scale candidates are multiplied by powers of two. Binary floating point rounds
# 2^k * x exactly as it rounds x, so through every op that carries a scale (products,
# sums, means, matmuls, convolutions, casts) the cancelling op sees its input scaled
# exactly, in any dtype: what is left of the change in its output is its own eps
# residue (about eps / 2 var(x)) and the rounding of its own output, never rounding
# noise of a bfloat16 path. x16 first (2^4), then x256 (the exponents doubled).
SCALE_EXPONENT = 4
# A cancelled scale leaves the op's eps residue, which the growth x16 -> x256 shrinks
# ~256x (the residue goes as 1 / lambda^2); a weak real influence grows 10-170x. So:
# invariant when x16 changed the output by at most SCALE_RESIDUE and x256 added at
# most GROWTH of that, or nothing beyond rounding.
SCALE_RESIDUE = 0.05
GROWTH = 0.25


def tolerance(t: Tensor, rounding: float = _FLOAT32_ROUNDOFF) -> float:
    """How much `t`, an op's output, may change in a re-run and count as unchanged:
    the rounding of its own dtype, or of a coarser one on the way (`rounding`)."""
    u = max(unit_roundoff(t.dtype), rounding)
    return max(SHIFT_TOLERANCE, HALF_ROUNDOFFS * u) if u > _FLOAT32_ROUNDOFF else SHIFT_TOLERANCE


def _mechanism_tolerance(m: Mechanism, kind: str, base: Tensor) -> float:
    # A scale reaches the op exactly (powers of two): only the op's own output rounds.
    return tolerance(base, m.rounding if kind == "shift" else _FLOAT32_ROUNDOFF)


@dataclass
class _Probe:
    name: str
    param: Tensor
    cancellation: Cancellation

    def op_keys(self) -> list[tuple[str, int]]:
        return [(m.call, m.ordinal) for m in self.cancellation.mechanisms]


Outputs = dict[tuple[str, int], Tensor]
Rerun = Callable[[set[tuple[str, int]]], tuple[float | None, Outputs] | None]
# Under FSDP2 every rank re-runs its own batch: each measured change is agreed on (the
# largest over the ranks), so all ranks take the same decisions and re-runs.
Agree = Callable[[list[float]], list[float]]
# Groups of would-be warnings (every direction cancelled) confirmed by one re-run.
GROUP = 16
NOT_SEEN = "the cancelling op was not seen again in the re-run"


def confirm(
    cancellations: dict[str, Cancellation],
    params: dict[str, Tensor],
    baseline: Outputs,
    rerun: Rerun,
    loss: float | None,
    seed: int = 0,
    agree: Agree | None = None,
) -> dict[str, Cancellation]:
    """Re-run the forward with the candidates perturbed; keep what the cancelling ops say.

    Every candidate is changed at once, each by a different amount (joint-only
    cancellations then do not pass): scale candidates by x16 (their full facet by a
    random x16 or x32 per entry; candidates that one op cancels together get x2 and x4
    in turn, so that the op does not see 16^n), shift candidates by c = 10 x their RMS
    (10 for an all-zero one; full facet: c times a random sign per entry). A candidate
    holds when every op that cancels it gave the same output within rounding; a scale
    whose op output moved by an eps-sized amount gets a second point (x256, every
    exponent doubled) and holds when the change shrank (see the tolerances above). A
    group in which something failed is split in halves until each candidate stands
    alone, within a bounded number of re-runs. `rerun(targets)` re-runs the loss under
    no_grad on the checked run's RNG state and returns (loss, captured outputs), or
    None when it cannot. `agree` combines each rank's measured changes (FSDP2).
    """
    probes = [_Probe(n, params[n], c) for n, c in cancellations.items() if n in params]
    if not probes:
        return dict(cancellations)
    return _Confirmation(probes, baseline, rerun, loss, seed, agree).settle_all(cancellations)


class _Confirmation:
    """The re-runs of one `confirm`: perturb, re-run, measure, judge, split."""

    def __init__(
        self,
        probes: list[_Probe],
        baseline: Outputs,
        rerun: Rerun,
        loss: float | None,
        seed: int,
        agree: Agree | None,
    ) -> None:
        self.probes = probes
        self.baseline = baseline
        self.rerun = rerun
        self.loss = loss
        self.agree: Agree = agree or (lambda values: values)
        generator = torch.Generator().manual_seed(seed)
        self.exponents = _scale_exponents(probes, generator)
        self.shifts = {
            p.name: _shift(p, generator) for p in probes if p.cancellation.kind == "shift"
        }
        self.budget = 2 * 4 + 2 * len(probes)  # re-runs left: 9 + 2 per candidate in all
        self.out: dict[str, Cancellation] = {}

    def settle_all(self, cancellations: dict[str, Cancellation]) -> dict[str, Cancellation]:
        self.out = dict(cancellations)
        # Would-be warnings (every direction cancelled) in groups of 16; free norms, which
        # can only ever be info, all in one group.
        full = [p for p in self.probes if p.cancellation.full]
        for start in range(0, len(full), GROUP):
            self.settle(full[start : start + GROUP])
        free = [p for p in self.probes if not p.cancellation.full]
        if free:
            self.settle(free)
        self.unless_reproducible([p for p in self.probes if self.out[p.name].confirmed is False])
        return self.out

    def settle(self, group: list[_Probe]) -> None:
        found = self.verdicts(group)
        if found is None:
            for p in group:
                self.out[p.name] = replace(
                    p.cancellation, confirmed=None, evidence={"probe": "not run"}
                )
            return
        if all(ok for ok, _ in found.values()) or len(group) == 1:
            for p in group:
                ok, evidence = found[p.name]
                self.out[p.name] = replace(p.cancellation, confirmed=ok, evidence=evidence)
            return
        half = len(group) // 2
        self.settle(group[:half])
        self.settle(group[half:])

    def verdicts(self, group: list[_Probe]) -> dict[str, tuple[bool, dict[str, Any]]] | None:
        first = self.run(group, 0)
        if first is None:
            return None
        change1 = self.changes(group, first[1], self.baseline)
        # Unchanged within rounding at x16 settles a scale; only an eps-sized change
        # needs the second point, to see it shrink rather than grow.
        needs_second = any(
            p.cancellation.kind == "scale"
            and any(
                c > _mechanism_tolerance(m, "scale", self.baseline[k])
                for m, k, c in zip(
                    p.cancellation.mechanisms, p.op_keys(), change1[p.name], strict=True
                )
                if k in self.baseline
            )
            for p in group
        )
        change2 = None
        if needs_second:
            second = self.run(group, 1)
            if second is not None:
                change2 = self.changes(group, second[1], first[1])
        return {
            p.name: _judge(
                p,
                self.baseline,
                change1[p.name],
                None if change2 is None else change2[p.name],
                _relative(first[0], self.loss),
            )
            for p in group
        }

    def changes(
        self, group: list[_Probe], outputs: Outputs, reference: Outputs
    ) -> dict[str, list[float]]:
        """Per candidate, the relative change of each cancelling op's output (inf where
        the op was not seen), agreed on by the ranks."""
        flat = [
            relative_change(outputs[k], reference[k])
            if k in outputs and k in reference
            else math.inf
            for p in group
            for k in p.op_keys()
        ]
        agreed = iter(self.agree(flat))
        return {p.name: [next(agreed) for _ in p.op_keys()] for p in group}

    def run(self, group: list[_Probe], step: int) -> tuple[float | None, Outputs] | None:
        """The forward re-run with `group` perturbed (the first point, or the second at
        `step` 1), its parameters put back bitwise afterwards."""
        if self.budget <= 0:
            return None
        self.budget -= 1
        saved = [p.param.detach().clone() for p in group]
        versions = state.versions_of([p.param for p in group])
        try:
            with torch.no_grad():
                for k, p in enumerate(group):
                    local = local_tensor(p.param)  # a shard of an FSDP2 parameter
                    if p.cancellation.kind == "scale":
                        local.mul_(_power_of_two(self.exponents[p.name] * (step + 1), local))
                    else:
                        local.add_(self.shifts[p.name] * (1.0 + 0.25 * (k % 8)))
            targets = {k for p in group for k in p.op_keys()}
            return self.rerun(targets or set(self.baseline))
        finally:
            with torch.no_grad():
                for p, s in zip(group, saved, strict=True):
                    p.param.copy_(s)
            # values back bitwise, so the version counters too (a graph of the user's
            # own forward may have saved these parameters)
            state.set_versions([p.param for p in group], versions)

    def unless_reproducible(self, refuted: list[_Probe]) -> None:
        """Before trusting a refutation, make sure an unchanged re-run reproduces the
        checked forward: a loss_fn that draws a new batch (or a model with randomness
        outside torch's RNG) cannot confirm anything either way."""
        if not refuted:
            return
        self.budget += 1
        again = self.run([], 0)
        keys = [k for p in refuted for k in p.op_keys() if k in self.baseline]
        moved = self.agree(
            [
                relative_change(again[1][k], self.baseline[k]) if k in again[1] else math.inf
                for k in keys
            ]
            if again is not None
            else [math.inf] * len(keys)
        )
        if again is not None and all(
            change <= tolerance(self.baseline[k]) for k, change in zip(keys, moved, strict=True)
        ):
            return
        for p in refuted:
            self.out[p.name] = replace(
                self.out[p.name],
                confirmed=None,
                evidence={
                    "probe": "not reproducible: re-running loss_fn unchanged gave other "
                    "outputs; make it use one fixed batch"
                },
            )


def _relative(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return abs(value - reference) / max(abs(reference), 1e-12)


def _scale_exponents(probes: list[_Probe], generator: torch.Generator) -> dict[str, Any]:
    """The power of two each scale candidate is multiplied by at the first point (an
    int, or an int tensor for a full facet: each entry its own, 2^4 or 2^5).

    Candidates that one op cancels together (a chain of scalars before one norm) would
    multiply the op's input by 16^n; they get 2^1 and 2^2 in turn instead, each a
    different amount from its neighbour, by their place among the widest such set."""
    sharing: dict[tuple[str, int], list[str]] = {}
    scale = [p for p in probes if p.cancellation.kind == "scale"]
    for p in scale:
        for m in p.cancellation.mechanisms:
            sharing.setdefault((m.call, m.ordinal), []).append(p.name)
    exponents: dict[str, Any] = {}
    for p in scale:
        widest = max((sharing[(m.call, m.ordinal)] for m in p.cancellation.mechanisms), key=len)
        base = SCALE_EXPONENT if len(widest) == 1 else 1 + widest.index(p.name) % 2
        t = local_tensor(p.param.detach())
        if p.cancellation.full and t.numel() > 1:
            jitter = torch.randint(0, 2, t.shape, generator=generator)
            exponents[p.name] = (jitter + base).to(t.device)
        else:
            exponents[p.name] = base
    return exponents


def _power_of_two(exponent: Any, like: Tensor) -> Tensor | float:
    if isinstance(exponent, Tensor):
        ones = torch.ones(exponent.shape, dtype=torch.float32, device=like.device)
        return torch.ldexp(ones, exponent).to(like.dtype)
    return 2.0**exponent


def _shift(p: _Probe, generator: torch.Generator) -> Tensor | float:
    t = local_tensor(p.param.detach())
    rms = float(t.double().pow(2).mean().sqrt()) if t.numel() else 0.0
    step = 10.0 * rms if rms > 0 else 10.0
    if p.cancellation.full and t.numel() > 1:
        signs = torch.randint(0, 2, t.shape, generator=generator).to(torch.float64) * 2 - 1
        return (signs * step).to(t.dtype).to(t.device)
    return step


def _judge(
    p: _Probe,
    baseline: Outputs,
    change1: list[float],
    change2: list[float] | None,
    loss_change: float | None,
) -> tuple[bool, dict[str, Any]]:
    """Whether the changes of the ops that cancel `p` (first point; second point
    against the first) say it holds, with the evidence."""
    if not all(math.isfinite(c) for c in change1) or (
        change2 is not None and not all(math.isfinite(c) for c in change2)
    ):
        return False, {"probe": NOT_SEEN}
    tol = max(
        _mechanism_tolerance(m, p.cancellation.kind, baseline[k])
        for m, k in zip(p.cancellation.mechanisms, p.op_keys(), strict=True)
    )
    worst1 = max(change1)
    evidence: dict[str, Any]
    if p.cancellation.kind == "shift":
        evidence = {"probe": "+shift", "op_output_change": worst1, "tolerance": tol}
        ok = worst1 <= tol
    else:
        per_entry = p.cancellation.full and p.param.numel() > 1
        evidence = {
            "probe": ("x16 or x32 per entry" if per_entry else "x16")
            + (", squared" if per_entry and change2 is not None else "")
            + (", x256" if not per_entry and change2 is not None else ""),
            "op_output_change": worst1,
        }
        if change2 is None:
            ok = worst1 <= tol
        else:
            worst2 = max(change2)
            evidence["op_output_growth"] = worst2
            ok = worst2 <= tol or (worst1 <= SCALE_RESIDUE and worst2 <= GROWTH * worst1)
    if loss_change is not None:
        # Shown, never judged by: its scale is the loss's (a sum near 0 in bf16 moves by
        # half its value on a rounding-level change of the op's output).
        evidence["relative_loss_change"] = loss_change
    return ok, evidence


__all__ = [
    "Cancellation",
    "Carrier",
    "Facet",
    "Mechanism",
    "OutputCapture",
    "StructureResult",
    "StructureTracker",
    "confirm",
    "relative_change",
]
