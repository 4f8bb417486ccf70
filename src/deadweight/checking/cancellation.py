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

This module is the tracker; the abstract values are in `carrier_algebra`, each op's
propagator in `op_propagation` and `op_table`. `cancellation_confirmation` then
re-runs the forward with each candidate perturbed and compares the output of the
cancelling op itself, which a normalization keeps at a scale of its own, so the
verdict does not depend on the loss's value, form or scale.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from deadweight import autograd_graph
from deadweight.checking.carrier_algebra import (
    EMPTY,
    FLOAT32_ROUNDOFF,
    KINDS,
    SCALE,
    SHIFT,
    Carrier,
    Facet,
    all_dims,
    bits,
    flat_args,
    general,
    new_tag,
    remembered,
    tensor_outputs,
    unit_roundoff,
)
from deadweight.checking.check_stats import Cancellation, Mechanism
from deadweight.checking.op_propagation import OpCall
from deadweight.checking.op_table import CARRY_THROUGH, COUNTED, EPS_OPS, PROPAGATORS
from deadweight.checking.sites import user_site

Tensor = torch.Tensor


@dataclass
class StructureResult:
    """What the structure pass concluded for the parameters of one forward."""

    cancellations: dict[str, Cancellation]
    # Parameters whose influence on the loss the pass proved (through ops it knows)
    influencing: frozenset[str]
    # Parameters that reached a call the pass cannot see into (fallback: numeric screen)
    opaque: frozenset[str]


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
        self._carriers = _TensorCarriers()
        self.absorbed: dict[int, list[_Absorbed]] = {}
        self._free_means: set[int] = set()  # shift entities some call absorbed in part
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
            return EMPTY
        pid = id(value)
        i = self._index.get(pid)
        if i is None:
            if self._stand_ins is None or not isinstance(value, torch.nn.Parameter):
                # an activation: `_TensorCarriers.get`, inlined (it runs for every
                # tensor argument of every traced call)
                found = self._carriers.by_id.get(pid)
                return found[1] if found is not None and found[0]() is value else EMPTY
            i = self._stand_in_index(value)
        if i is not None and value.requires_grad:
            entry = self._entry.get(i)
            if entry is None:
                entry = self._entry[i] = _param_entry(i, value.shape)
                if value.dtype not in _FINE_DTYPES:
                    self._coarsen(entry, value)
            return entry
        return self._carriers.get(value)

    def _carries_any(self, args: tuple, kwargs: dict) -> bool:
        """Whether any argument carries a parameter's effect (`carrier` is not EMPTY),
        without making the carriers: most calls of a forward take none."""
        carrier = self.carrier
        for group in (args, kwargs.values()) if kwargs else (args,):
            for value in group:  # `flat_args`, unrolled: this runs for every traced call
                if isinstance(value, Tensor):
                    if carrier(value) is not EMPTY:
                        return True
                elif isinstance(value, (list, tuple)):
                    for v in value:
                        if isinstance(v, Tensor) and carrier(v) is not EMPTY:
                            return True
        return False

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
                self._carriers.set(out, c)
                # `_coarsen` only for a dtype coarser than float32
                if c.pure and out.dtype not in _FINE_DTYPES:
                    self._coarsen(c, out)
            else:
                self._carriers.discard(out)

    def _coarsen(self, c: Carrier, value: Tensor) -> None:
        """Note that the pure effects of `c` now sit in `value`'s dtype."""
        if not c.pure:
            return
        u = unit_roundoff(value.dtype)
        if u <= FLOAT32_ROUNDOFF:
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
        if name in COUNTED:  # `count`, inlined
            ordinal = self.ordinals.get(name, 0)
            self.ordinals[name] = ordinal + 1
        else:
            ordinal = -1
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
        carriers = [self.carrier(v) for v in flat_args(args, kwargs)]
        carriers += [self.carrier(v) for v in inner]
        merged = general(carriers)
        self._opaque(bits(merged.lost | merged.partial))
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
        # Most calls need no bookkeeping: those that return no tensor (shape, size,
        # dtype) and those whose inputs carry no parameter's effect (ids, masks,
        # positions): they leave before any carrier is made.
        outs = [out] if isinstance(out, Tensor) else tensor_outputs(out)
        if not outs:
            return
        first = args[0] if args else None
        if isinstance(first, Tensor):  # most calls: its carrier is read once, here
            c = self.carrier(first)
            if c is EMPTY:
                if not self._carries_any(args[1:], kwargs):
                    return
            elif not c.pure and name in CARRY_THROUGH and not self._carries_any(args[1:], kwargs):
                for o in outs:
                    self._set(o, c)
                return
        elif not self._carries_any(args, kwargs):
            return
        propagate = PROPAGATORS.get(name)
        if propagate is None:
            carriers = [self.carrier(v) for v in flat_args(args, kwargs)]
            if _is_custom_op(func):
                for c in carriers:
                    self._opaque(bits(c.all_entities() | c.partial))
            merged = general(carriers)
            for o in outs:
                self._set(o, merged)
            return
        ctx = OpCall(self, name, ordinal, args, kwargs, out)
        result = propagate(ctx)
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
        self, ctx: OpCall, entity: int, facet: Facet, op: str, dims: Iterable[int], full: bool
    ) -> None:
        if facet.kind == SHIFT and not full:
            self.free_means((entity,))
            return
        if ctx.where is None:
            # Where the call ran, and its outputs' rounding: the same for every effect it
            # cancels, so the frame walk is made once per call, not once per parameter.
            ctx.where = (
                user_site(sys._getframe(1)),
                self._current_module(),
                max([FLOAT32_ROUNDOFF] + [unit_roundoff(o.dtype) for o in tensor_outputs(ctx.out)]),
            )
        # A record, not yet a Mechanism: `result` makes one only for the effects it
        # reports.
        self.absorbed.setdefault(entity, []).append(
            _Absorbed(
                ctx.name,
                ctx.ordinal,
                op,
                ctx.where,
                dims,
                full,
                facet.approx or op in EPS_OPS,
                max(self._rounding.get(entity, FLOAT32_ROUNDOFF), ctx.where[2]),
            )
        )
        ctx.absorbed = True

    def free_means(self, entities: Iterable[int]) -> None:
        # A free mean, which `result` never reports (see there): noted, not recorded.
        # Every LayerNorm frees the mean of each bias upstream of it, so these are most
        # of what a transformer's norms absorb.
        self._free_means.update(entities)

    def forward_done(self, loss: Tensor) -> None:
        """The forward is over: from here on only the loss's carrier is read (`result`).
        The others go now, while the garbage collector is off: the collection due when
        it resumes would otherwise scan each of them (0.4 ms of a 47 ms check on a
        12-layer GPT-2)."""
        kept = self._carriers.by_id.get(id(loss))
        self._carriers.by_id = {id(loss): kept} if kept is not None and kept[0]() is loss else {}

    # -- the verdict --------------------------------------------------------------
    def result(self, loss: Tensor, has_grad: Callable[[int], bool]) -> StructureResult:
        at_loss = self.carrier(loss)
        influencing = {e // 2 for e in bits(at_loss.all_entities())}
        cancellations: dict[str, Cancellation] = {}
        for e, records in self.absorbed.items():
            i, kind = divmod(e, 2)
            if e in self._opaque_entities or not has_grad(i):
                continue
            if at_loss.lost >> e & 1 or e in at_loss.pure:
                continue  # it reaches the loss in another way too
            full = not at_loss.partial >> e & 1 and all(r.full for r in records)
            if kind == SHIFT and (not full or e in self._free_means):
                # A free mean (a bias or an embedding feeding a LayerNorm or a softmax) is
                # how mean-subtracting designs work; nothing to report or to confirm.
                continue
            name = self._names[i]
            known = cancellations.get(name)
            # A full cancellation of either effect says more than a uniform one; of two
            # full ones the scale is reported, whatever order the calls recorded them in
            if known is not None and (
                not full or (known.full and (kind == SHIFT or known.kind == KINDS[SCALE]))
            ):
                continue
            cancellations[name] = Cancellation(name, KINDS[kind], full, _unique(records))
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


class _Absorbed(NamedTuple):
    """One effect a call cancelled, as `absorb` records it (a tuple: it is made for
    every effect every norm of the forward cancels)."""

    call: str
    ordinal: int
    op: str
    where: tuple[Any, Any, float]  # the call's site, module and output rounding
    dims: Iterable[int]
    full: bool
    approx: bool
    rounding: float


def _unique(records: list[_Absorbed]) -> tuple[Mechanism, ...]:
    """One Mechanism per cancelling call, from the first record of it."""
    seen: dict[tuple[str, int], _Absorbed] = {}
    for r in records:
        seen.setdefault((r.call, r.ordinal), r)
    return tuple(
        Mechanism(
            op=r.op,
            call=r.call,
            ordinal=r.ordinal,
            site=r.where[0],
            module=r.where[1],
            dims=tuple(sorted(r.dims)),
            facet="full" if r.full else "uniform",
            approx=r.approx,
            rounding=r.rounding,
        )
        for r in seen.values()
    )


def _param_entry(i: int, shape: torch.Size) -> Carrier:
    """The carrier of parameter `i` itself: its scale and its shift, along every dim.
    Looked up, as every check of a model makes the same ones: made afresh, those of a
    148-tensor GPT-2 cost 0.35 ms a check, looked up 0.04 ms. A carrier is never changed
    once made, and the shift's tag stays unique: only parameter `i` of a check has it,
    and the tags made since are all new."""
    key = (i, tuple(shape))
    return remembered(_PARAM_ENTRIES, key, _new_param_entry, i, key[1], bound=65536)


def _new_param_entry(i: int, shape: tuple[int, ...]) -> Carrier:
    dims = all_dims(shape)
    return Carrier(
        pure={
            2 * i + SCALE: Facet(SCALE, dims),
            2 * i + SHIFT: Facet(SHIFT, dims, tag=new_tag()),
        }
    )


# dtypes whose rounding is float32's or finer: a pure effect in them coarsens nothing
_FINE_DTYPES = frozenset(
    d
    for d in (torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool)
    if unit_roundoff(d) <= FLOAT32_ROUNDOFF
)

# (parameter index, shape) -> `_param_entry`
_PARAM_ENTRIES: dict[tuple[int, tuple[int, ...]], Carrier] = {}


class _TensorCarriers:
    """Carriers by tensor, held weakly: a dict by id, each entry with a weak reference
    that tells a live tensor from a later one that reused its id. (A WeakIdKeyDictionary
    built a weak key object on every lookup, several per traced call; a plain
    `weakref.ref` is called in C, where torch's WeakIdRef runs a Python `__call__`.)

    An entry outlives its tensor: the tracker follows one forward, so they are at most
    its carrying calls, and dropping each as its tensor died took a Python callback per
    activation, most of them run inside the backward, when the saved tensors go."""

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[weakref.ref[Tensor], Carrier]] = {}

    def get(self, value: Tensor) -> Carrier:
        entry = self.by_id.get(id(value))
        if entry is not None and entry[0]() is value:
            return entry[1]
        return EMPTY

    def set(self, value: Tensor, carrier: Carrier) -> None:
        self.by_id[id(value)] = (weakref.ref(value), carrier)

    def discard(self, value: Tensor) -> None:
        entry = self.by_id.get(id(value))
        if entry is not None and entry[0]() is value:
            del self.by_id[id(value)]


def _is_custom_op(func: Any) -> bool:
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        namespace = getattr(func, "namespace", None) or str(func).split("::")[0].split(".")[-1]
        return namespace not in ("aten", "prims")
    return False
