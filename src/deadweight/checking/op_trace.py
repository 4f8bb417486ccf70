"""Forward-time tracing of every place where a tensor loses its link to the autograd graph.

A `TorchFunctionMode` sees each torch call during the user's forward. An op whose
inputs require grad but whose outputs do not is a *cut event*: it ran under
`torch.no_grad` / `inference_mode`, or it was `.detach()`, `.data`, `.item()`,
`.tolist()`, `.numpy()`, a tensor rebuilt with `torch.tensor(...)`, or an op that has
no derivative (comparisons, argmax). `autograd.Function.apply` is not visible to a
mode, so it is wrapped for the duration of the trace: a Function whose outputs come
back without a graph while its inputs, or the parameters used inside it, needed one
(`ctx.mark_non_differentiable`, reentrant checkpointing with no input that requires
grad) is a cut event at the line that applied it.

Grad mode is global, so an op that runs without grad cannot tell which line turned it
off. While tracing, the grad-mode context managers (`no_grad`, `enable_grad`,
`set_grad_enabled`, `inference_mode`) note the frame that enters each region, and a
cut under no_grad is placed at the user's line inside the region that is outermost
(the `with torch.no_grad():` block's line in the user's forward); the op inside the
module called there is kept as the detail (`op_site`).

Cut events are candidates. What a cut event's *output* feeds is followed by taint:
tensors (and Python values from `.item()` / `.tolist()`) derived from it carry its id,
so the caller can tell a cut whose value reaches the loss from one used for logging.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointFunction
from torch.utils.weak import WeakIdKeyDictionary

from deadweight.checking.cancellation import StructureTracker
from deadweight.checking.check_stats import Site
from deadweight.checking.op_table import COUNTED
from deadweight.checking.sites import (
    caller_frame,
    outermost_user_frame,
    site_of,
    user_frame,
    user_site,
)

Tensor = torch.Tensor
_TensorBase = torch._C.TensorBase
_DATA = _TensorBase.__dict__["data"]
_DETACH_INPLACE = _TensorBase.detach_
_DETACH = _TensorBase.detach
# Calls that turn tensor values into Python values. `x.numpy()` on a tensor that
# requires grad raises, so the silent form is `x.detach().numpy()`: the detach is the cut.
_TO_PYTHON = {
    _TensorBase.item: "item",
    _TensorBase.tolist: "tolist",
    _TensorBase.numpy: "numpy",
    _TensorBase.__float__: "item",
    _TensorBase.__int__: "item",
}
_REBUILD = {torch.tensor, torch.as_tensor, _TensorBase.new_tensor}
_OPS_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)
# Calls that only read a tensor's metadata: they return no tensor and no value derived
# from its data, write nothing and cut nothing, so the tracer passes them straight
# through (a third of a transformer forward's traced calls are these). `.data`,
# `.item()`, `.tolist()` are not among them: each is a cut.
_METADATA = frozenset(
    f"Tensor.{name}"
    for name in (
        "shape", "size", "dim", "ndim", "ndimension", "dtype", "device", "layout",
        "grad_fn", "requires_grad", "is_leaf", "is_floating_point", "is_complex",
        "numel", "nelement", "stride", "is_contiguous", "storage_offset", "is_cuda",
        "is_sparse", "is_meta", "is_quantized", "get_device", "__len__",
    )
)  # fmt: skip
# Python values followed by identity. Not ints: small ints are shared objects (every
# `32` is the same one), and metadata such as x.size(-1) would taint every later 32.
_PY_VALUE_TYPES = (float, complex, list, np.ndarray)


@dataclass
class CutEvent:
    """One place where a tensor that needed a gradient produced a result without one."""

    index: int
    kind: str
    op: str
    site: Site | None
    module: str | None
    # What the event's inputs hang from: autograd nodes, or leaf tensors that require grad.
    roots: list[Any] = field(repr=False)
    grad_enabled: bool = True
    caller: Site | None = None  # the user frame that called the function holding `site`
    # Where the op itself ran, when `site` is elsewhere: for an op under no_grad /
    # inference_mode, `site` is the user's line that entered the region (the
    # `with torch.no_grad():` block's line), `op_site` the line inside the callee.
    op_site: Site | None = None


@dataclass(frozen=True)
class NodeOrigin:
    """Which call created an autograd node, for nodes that may drop gradients in backward."""

    op: str
    site: Site | None
    module: str | None


@dataclass
class _GradRegion:
    """A `with torch.no_grad()` (enable_grad, set_grad_enabled, inference_mode) open now."""

    context: object
    frame: FrameType  # the frame that entered it: the `with` line's, or the decorator's
    grad_enabled: bool  # grad mode inside (grad mode is per thread, and so are regions)
    thread: int


# The grad-mode context managers whose entries the tracer notes. A decorated function
# (`@torch.no_grad()`) enters a fresh one on each call, from torch's wrapper.
_GRAD_MODES = (torch.no_grad, torch.enable_grad, torch.set_grad_enabled, torch.inference_mode)


@dataclass
class _FunctionCall:
    cls: type
    inner_roots: list[Any] = field(default_factory=list)
    inner_params: list[Tensor] = field(default_factory=list)


# autograd.Functions whose forward returns its tensor inputs unchanged, in order: the
# structure pass carries each input's effects to its output (FSDP2 wraps every sharded
# module's inputs in one, to hook its backward).
PASS_THROUGH_FUNCTIONS = frozenset(
    {"torch.distributed.fsdp._fully_shard._fsdp_param_group.RegisterPostBackwardFunction"}
)


class OpTracer(TorchFunctionMode):
    """Use as a context manager around the user's forward; read `events` afterwards."""

    def __init__(
        self,
        current_module: Callable[[], str | None] = lambda: None,
        params: dict[int, Tensor] | None = None,
        before_param_write: Callable[[Tensor, str, str, Site | None], None] | None = None,
        structure: StructureTracker | None = None,
    ) -> None:
        super().__init__()
        # Follows the parameters' scale and shift effects through every call (see
        # checking/cancellation.py); None leaves that pass out.
        self._structure = structure
        self._current_module = current_module
        self._params = params or {}
        self._before_param_write = before_param_write
        # Parameters by the address of their storage: an in-place op on `p.data`,
        # `p.detach()` or a view of them writes the parameter through another tensor.
        self._param_storage: dict[int, list[Tensor]] = {}
        if before_param_write is not None:
            for p in self._params.values():
                ptr = _storage_ptr(p)
                if ptr:  # 0: an empty storage, shared by every empty tensor
                    self._param_storage.setdefault(ptr, []).append(p)
        self._written: set[int] = set()
        # Leaf tensors used inside autograd.Function forwards (reentrant checkpoint
        # segments): backward reaches them, but the graph does not show them beforehand.
        self.leaves_inside_functions: dict[int, Tensor] = {}
        self.events: list[CutEvent] = []
        self.node_origins: dict[Any, NodeOrigin] = {}
        self.scalar_origins: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._taint: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._py_taint: dict[int, tuple[object, frozenset[int]]] = {}
        self._ptr_taint: dict[int, frozenset[int]] = {}
        self._functions: list[_FunctionCall] = []
        self._saved_apply: Any = None
        self._regions: list[_GradRegion] = []
        self._saved_modes: list[tuple[type, str, Any]] = []

    # -- context -----------------------------------------------------------------
    def __enter__(self) -> OpTracer:
        self._patch_function_apply()
        try:
            self._patch_grad_modes()
            super().__enter__()
        except BaseException:
            self._unpatch()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._unpatch()

    def _unpatch(self) -> None:
        try:
            self._unpatch_grad_modes()
        finally:
            self._unpatch_function_apply()

    def taint_of(self, value: object) -> frozenset[int]:
        """Ids of the cut events whose output flowed into `value`."""
        if isinstance(value, Tensor):
            return self._taint.get(value, frozenset())
        entry = self._py_taint.get(id(value))
        return entry[1] if entry is not None and entry[0] is value else frozenset()

    # -- the mode ----------------------------------------------------------------
    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        try:  # `op_name`, inlined: this runs for every torch call of the forward
            name = _NAMES[func]
        except (KeyError, TypeError):
            name = op_name(func)
        if not self._functions and name in _METADATA:
            return func(*args, **kwargs)  # nothing to note: no tensor, no cut, no write
        pre_roots = _grad_roots(args, kwargs) if func is _DETACH_INPLACE else None
        if self._before_param_write is not None:
            try:  # `_may_write`, inlined
                may_write = _MAY_WRITE[func]
            except (KeyError, TypeError):
                may_write = _may_write(func)
            if may_write or "out" in kwargs:
                self._note_param_writes(func, args, kwargs)
        out = func(*args, **kwargs)

        if self._functions:
            # Inside autograd.Function.forward grad is always off; that is how every
            # Function works, so only remember what needed a grad for the verdict at apply.
            if not _any_requires_grad(out):
                self._functions[-1].inner_roots.extend(_grad_roots(args, kwargs))
            if self._structure is not None:
                if name in COUNTED:
                    self._structure.count(name)
                self._functions[-1].inner_params.extend(
                    v for v in _flat_args(args, kwargs) if id(v) in self._params
                )
            return out
        if self._structure is not None:
            self._structure.observe(func, name, args, kwargs, out)

        # Taint starts at a cut event: before the first one there is none to follow.
        taint = self._incoming_taint(args, kwargs) if self.events else None

        if isinstance(out, Tensor):
            if out.requires_grad:
                if isinstance(func, _OPS_TYPES) and out.grad_fn is not None:
                    self._remember_node(out.grad_fn, _op_name(func))
                if taint:
                    self._taint[out] = taint
                return out
            roots = pre_roots if pre_roots is not None else _grad_roots(args, kwargs)
            if roots:
                event = self._record(func, roots, _kind_for_tensor_op(func, out))
                taint = self._taint_after_cut(event, args, kwargs)
            elif out.dim() == 0:
                # a loss computed under no_grad is shown where the region was entered
                site = site_of(self._frames(sys._getframe())[0])
                self.scalar_origins[out] = (_op_name(func), site, torch.is_grad_enabled())
            if taint:
                self._taint[out] = taint
            return out

        if isinstance(out, (tuple, list)) and any(isinstance(o, Tensor) for o in out):
            tensors = [o for o in out if isinstance(o, Tensor)]
            if not any(t.requires_grad for t in tensors):
                roots = _grad_roots(args, kwargs)
                if roots:
                    event = self._record(func, roots, _kind_for_tensor_op(func, tensors[0]))
                    taint = self._taint_after_cut(event, args, kwargs)
            if taint:
                for t in tensors:
                    self._taint[t] = taint
            return out

        kind = _TO_PYTHON.get(func)
        if kind is not None:
            roots = _grad_roots(args, kwargs)
            if roots:
                event = self._record(func, roots, kind)
                taint = self._taint_after_cut(event, args, kwargs)
        # Only values converted out of a tensor carry its data; .size(), .dim() do not.
        if taint and kind is not None and isinstance(out, _PY_VALUE_TYPES):
            self._py_taint[id(out)] = (out, taint)
            if isinstance(out, np.ndarray):
                # torch.from_numpy is invisible to the mode; its tensor shares this memory.
                self._ptr_taint[out.__array_interface__["data"][0]] = taint
        return out

    def _note_param_writes(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Tell `before_param_write` about every parameter this call is about to write:
        in place (e.g. nn.Embedding(max_norm=...) renormalises its weight), through a
        tensor sharing its memory (`p.data.mul_`, `p.detach()[0].fill_`), or by
        rebinding `p.data`."""
        assert self._before_param_write is not None
        if getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", "") == "__set__":
            if args and id(args[0]) in self._params:
                self._param_written(args[0], "rebind", "Tensor.data (assigned)")
            return
        if not _writes_in_place(func, args, kwargs):
            return
        for target in _write_targets(func, args, kwargs):
            if id(target) in self._params:
                self._param_written(target, "in-place", op_name(func))
            elif self._param_storage:
                for p in self._param_storage.get(_storage_ptr(target), ()):
                    self._param_written(p, "alias", op_name(func))

    def _param_written(self, param: Tensor, how: str, op: str) -> None:
        first = id(param) not in self._written
        self._written.add(id(param))
        assert self._before_param_write is not None
        # The line is looked up once per parameter: a frame walk is not free.
        self._before_param_write(param, how, op, user_site() if first else None)

    # -- autograd.Function -------------------------------------------------------
    def _patch_function_apply(self) -> None:
        original = torch.autograd.Function.__dict__["apply"]
        self._saved_apply = original
        tracer = self

        def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
            return tracer._traced_apply(original.__func__, cls, args, kwargs)

        torch.autograd.Function.apply = classmethod(apply)  # type: ignore[method-assign,assignment]

    def _unpatch_function_apply(self) -> None:
        if self._saved_apply is not None:
            torch.autograd.Function.apply = self._saved_apply  # type: ignore[method-assign]
            self._saved_apply = None

    def _traced_apply(
        self, original: Callable[..., Any], cls: type, args: tuple, kwargs: dict
    ) -> Any:
        outer = bool(self._functions)
        call = _FunctionCall(cls)
        self._functions.append(call)
        try:
            out = original(cls, *args, **kwargs)
        finally:
            self._functions.pop()
        if outer:  # a Function inside another Function's forward belongs to the outer one
            if not _any_requires_grad(out):
                self._functions[-1].inner_roots.extend(_grad_roots(args, kwargs))
                self._functions[-1].inner_roots.extend(call.inner_roots)
            self._functions[-1].inner_params.extend(call.inner_params)
            return out
        for root in call.inner_roots:
            if isinstance(root, Tensor):
                self.leaves_inside_functions[id(root)] = root
        outputs = list(tensors_in(out))
        name = f"{cls.__module__}.{cls.__qualname__}"
        if self._structure is not None:
            if name in PASS_THROUGH_FUNCTIONS and not call.inner_params:
                self._structure.pass_through(list(tensors_in((args, kwargs))), outputs)
            else:
                # The pass cannot see into a Function: what comes out depends on all it used.
                self._structure.opaque_call(args, kwargs, outputs, call.inner_params)
        for o in outputs:
            if o.grad_fn is not None and o.grad_fn not in self.node_origins:
                self._remember_node(o.grad_fn, name)
        taint = self._incoming_taint(args, kwargs) if self.events else None
        if not any(o.requires_grad for o in outputs):
            roots = _grad_roots(args, kwargs) + call.inner_roots
            if roots and outputs:
                kind = "reentrant-checkpoint" if issubclass(cls, CheckpointFunction) else "function"
                event = self._record(None, roots, kind, op=name)
                taint = self._taint_after_cut(event, args, kwargs)
        if taint:
            for o in outputs:
                self._taint[o] = taint
        return out

    # -- grad-mode regions -------------------------------------------------------
    def _patch_grad_modes(self) -> None:
        """Note which frame enters each grad-mode region while tracing, and when it
        leaves: grad mode is global, so the op that runs without grad cannot tell
        which line turned it off."""
        tracer = self
        for cls in _GRAD_MODES:
            enter, exit_ = cls.__enter__, cls.__exit__
            self._saved_modes += [(cls, "__enter__", enter), (cls, "__exit__", exit_)]

            def entered(ctx: Any, _enter: Any = enter) -> Any:
                result = _enter(ctx)
                tracer._regions.append(
                    _GradRegion(
                        ctx, sys._getframe(1), torch.is_grad_enabled(), threading.get_ident()
                    )
                )
                return result

            def exited(ctx: Any, *exc: Any, _exit: Any = exit_) -> Any:
                for k in range(len(tracer._regions) - 1, -1, -1):
                    if tracer._regions[k].context is ctx:
                        del tracer._regions[k]
                        break
                return _exit(ctx, *exc)

            cls.__enter__ = entered  # type: ignore[method-assign]
            cls.__exit__ = exited  # type: ignore[method-assign]

    def _unpatch_grad_modes(self) -> None:
        while self._saved_modes:
            cls, name, original = self._saved_modes.pop()
            setattr(cls, name, original)
        self._regions.clear()  # they hold frames

    def _no_grad_entry(self) -> FrameType | None:
        """The frame that turned grad off, when a region open now did: the outermost of
        the no-grad regions nested innermost (a `no_grad` inside a `no_grad` changes
        nothing; one inside `enable_grad` does)."""
        entry = None
        thread = threading.get_ident()
        for region in reversed(self._regions):
            if region.thread != thread:
                continue
            if region.grad_enabled:
                break
            entry = region.frame
        return entry

    def _sites(self, start: FrameType) -> tuple[Site | None, Site | None, Site | None]:
        """Where a cut is shown (`site`), who called that function (`caller`), and
        where the op ran when that is elsewhere (`op_site`).

        Under no_grad / inference_mode the site is the user's line inside the region
        that is outermost: the `with torch.no_grad():` block's line in the user's
        forward, not the innocent `F.layer_norm` line of the module it calls there;
        for a function decorated with `@torch.no_grad()`, its own line. Otherwise, and
        when grad went off outside any region seen (`torch.set_grad_enabled(False)` as
        a call), the innermost user frame."""
        frame, inner = self._frames(start)
        caller = site_of(caller_frame(frame)) if frame is not None else None
        op_site = site_of(inner) if frame is not inner else None
        return site_of(frame), caller, op_site

    def _frames(self, start: FrameType) -> tuple[FrameType | None, FrameType | None]:
        """The frame a cut is shown at (see `_sites`), and the innermost user frame."""
        inner = user_frame(start)
        entry = None if torch.is_grad_enabled() else self._no_grad_entry()
        if entry is None:
            return inner, inner
        return outermost_user_frame(start, entry) or inner, inner

    # -- helpers -----------------------------------------------------------------
    def _record(self, func: Any, roots: list[Any], kind: str, op: str | None = None) -> CutEvent:
        site, caller, op_site = self._sites(sys._getframe(1))
        event = CutEvent(
            index=len(self.events),
            kind=kind,
            op=op or _op_name(func),
            site=site,
            module=self._current_module(),
            roots=roots,
            grad_enabled=torch.is_grad_enabled(),
            caller=caller,
            op_site=op_site,
        )
        self.events.append(event)
        return event

    def _remember_node(self, node: Any, op: str) -> None:
        self.node_origins[node] = NodeOrigin(
            op, user_site(sys._getframe(1)), self._current_module()
        )

    def _taint_after_cut(self, event: CutEvent, args: tuple, kwargs: dict) -> frozenset[int]:
        """A cut's output carries the cut, plus earlier cuts reaching it through values
        without grad (the ops of one no-grad kernel chain up). Earlier cuts that reach it
        through a tensor that still has a graph are dropped: fixing them alone would not
        bring any gradient past this cut.
        """
        earlier = self._incoming_taint(args, kwargs, skip_grad=True) or frozenset()
        return earlier | {event.index}

    def _incoming_taint(
        self, args: tuple, kwargs: dict, skip_grad: bool = False
    ) -> frozenset[int] | None:
        found: frozenset[int] = frozenset()
        for value in _flat_args(args, kwargs):
            if isinstance(value, Tensor):
                if skip_grad and value.requires_grad:
                    continue
                t = self._taint.get(value)
                if t is None and self._ptr_taint and value.device.type == "cpu":
                    t = self._ptr_taint.get(value.data_ptr())
                if t:
                    found |= t
            elif self._py_taint:
                entry = self._py_taint.get(id(value))
                if entry is not None and entry[0] is value:
                    found |= entry[1]
        return found or None


def _kind_for_tensor_op(func: Any, out: Tensor) -> str:
    if torch.is_inference_mode_enabled():
        return "inference-mode"
    if not torch.is_grad_enabled():
        return "no-grad"
    if func is _DETACH or func is _DETACH_INPLACE:
        return "detach"
    if getattr(func, "__self__", None) is _DATA:
        return "data"
    if func in _REBUILD:
        return "rebuilt-tensor"
    if not (out.is_floating_point() or out.is_complex()):
        return "non-differentiable"
    return "other"


_MAY_WRITE: dict[Any, bool] = {}


def _may_write(func: Any) -> bool:
    """Whether calls of `func` can write to a tensor argument whatever their arguments
    (an out= argument aside): in-place ops and operators, `F.embedding` (max_norm),
    the `.data` setter. Remembered per callable: it is asked for every traced call."""
    try:
        known = _MAY_WRITE.get(func)
    except TypeError:  # an unhashable callable
        return True
    if known is None:
        known = _MAY_WRITE[func] = (
            _in_place_name(func) or func is F.embedding or getattr(func, "__self__", None) is _DATA
        )
    return known


def _in_place_name(func: Any) -> bool:
    """Whether `func` is named as an in-place op (`mul_`, `torch._foreach_add_`) or an
    in-place operator (`__iadd__`, `__setitem__`)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


def _writes_in_place(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call may write to its tensor arguments (in-place ops, out=, renorming)."""
    if _in_place_name(func) or "out" in kwargs:
        return True
    # F.embedding(max_norm=...) renormalises rows of its weight in place, inside the
    # call, where a mode no longer sees the in-place op.
    return func is F.embedding and (
        kwargs.get("max_norm") is not None or (len(args) > 3 and args[3] is not None)
    )


# In-place operator methods: `x[i] = v`, `x *= 2` (most dispatch to `mul_` and co,
# which the name test catches as well).
_INPLACE_DUNDERS = frozenset(
    {
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
        "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
        "__irshift__", "__imatmul__",
    }
)  # fmt: skip


def _write_targets(func: Any, args: tuple, kwargs: dict) -> Iterator[Tensor]:
    """The tensors a call that `_writes_in_place` writes: `self` (or a list of them, for
    torch._foreach_*_), the `out=` tensors, an embedding's weight."""
    if func is F.embedding:
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if isinstance(weight, Tensor):
            yield weight
        return
    if "out" in kwargs:
        out = kwargs["out"]
        yield from (
            o for o in (out if isinstance(out, (list, tuple)) else [out]) if isinstance(o, Tensor)
        )
    if args and _in_place_name(func):
        first = args[0]
        for value in first if isinstance(first, (list, tuple)) else [first]:
            if isinstance(value, Tensor):
                yield value


def _storage_ptr(t: Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, TypeError, NotImplementedError):  # no storage (a subclass, sparse)
        return 0


def _flat_args(args: tuple, kwargs: dict) -> Iterator[Any]:
    for value in (*args, *kwargs.values()):
        yield value
        if isinstance(value, (list, tuple)):
            yield from value


def _grad_roots(args: tuple, kwargs: dict) -> list[Any]:
    """The graph nodes (or leaf tensors) that the tensor arguments needing grad hang from."""
    roots = []
    for value in _flat_args(args, kwargs):
        if isinstance(value, Tensor) and value.requires_grad:
            roots.append(value.grad_fn if value.grad_fn is not None else value)
    return roots


def _any_requires_grad(out: Any) -> bool:
    return any(t.requires_grad for t in tensors_in(out))


def tensors_in(obj: Any, depth: int = 3) -> Iterator[Tensor]:
    """Tensors inside an output: plain, in tuples/lists/dicts, or fields of a dataclass."""
    if isinstance(obj, Tensor):
        yield obj
    elif depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, depth - 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, depth - 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name, None), depth - 1)


_NAMES: dict[Any, str] = {}


def op_name(func: Any) -> str:
    """`_op_name`, remembered per callable (it runs for every call of a traced forward)."""
    try:
        name = _NAMES.get(func)
    except TypeError:  # an unhashable callable
        return _op_name(func)
    if name is None:
        name = _NAMES[func] = _op_name(func)
    return name


def _op_name(func: Any) -> str:
    if isinstance(func, torch._ops.OpOverload):
        return func.name()
    if isinstance(func, torch._ops.OpOverloadPacket):
        return str(func._qualified_op_name)
    owner = getattr(func, "__self__", None)
    if owner is not None and type(owner).__name__ == "getset_descriptor":
        return f"Tensor.{owner.__name__}"
    qualname = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))
    name = str(getattr(func, "__name__", qualname))
    if qualname.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qualname.split(".", 1)[1]
    module = str(getattr(func, "__module__", None) or "")
    if module == "torch._C._nn" or module.startswith("torch.nn.functional"):
        return f"torch.nn.functional.{name}"
    if module.startswith("torch") or qualname.startswith("_VariableFunctionsClass"):
        return f"torch.{name}"
    return f"{module}.{qualname}" if module else qualname
