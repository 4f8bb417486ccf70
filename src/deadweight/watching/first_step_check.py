"""The step-0 check of `deadweight run`: `deadweight.check` on the script's own first
training batch, with no change to the script.

Until the first training iteration is over, module forward hooks (process-wide)
record the outermost forwards that run with gradients enabled: their module,
arguments and output, and the line that called them. At each `.backward()` the loss
is traced back through them: which forwards its graph reaches, and how each one's
inputs came from the earlier ones' outputs (passed on as they are, `dec(enc(x))`, or
through code between them, `z = mu + sigma * eps`). That is the pipeline to replay:
an encoder and its decoder, a model and a separate head or loss module, a
Sequential's members called one by one, a GAN's generator and discriminator. At the
first step of each optimizer the hooks' record of the latest backward becomes a
`deadweight.check` on the modules of the pipeline, with a loss function that runs
them again on the same first inputs, each on the outputs of the ones before it. The
forwards are held only until that backward; what is kept for the replay holds no
graph. The hooks go once an optimizer steps a second time (a whole iteration ran).

When the loss is one of the last module's scalars (`model(x, y).loss`, nanoGPT's
`logits, loss = model(X, Y)`, a loss module's output, also divided for gradient
accumulation or scaled by a GradScaler) and the modules pass their outputs on as they
are, the replay computes the same loss: the findings are `check`'s on the same
model and batch. Otherwise the check runs with a stand-in loss, a fixed random
projection of every output the loss was computed from, and keeps only what holds for
any loss computed from them: which parameters get no gradient and where the graph
was cut (DW101/DW102, each parameter confirmed by the script's own backward, which
left it without a gradient too), cancellations the graph's structure proves, and the
optimizer audit (DW2xx). Numerical verdicts (DW103-DW105) need the real loss and are
left out; the report says so.

Where no replay is possible (no recorded forward leads to the loss, or the replay
fails), and for the stepping optimizer's parameters the replay does not cover, the
script's own backward still proves which of its parameters got no gradient; the
recorded forwards say which module explains it (`checking.first_backward`). The check
never stops the script: what it could not do, it says.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deadweight import autograd_graph, owners, wrappers
from deadweight.distributed import ranks as distributed
from deadweight.findings import Finding

log = logging.getLogger(__name__)

# How deep an output (or the arguments) is searched for tensors, and how many
# one-input operations may lie between the loss passed to backward() and a scalar of
# the output.
MAX_DEPTH = 4
MAX_HOPS = 8
# Outermost forwards held until a backward: a pipeline longer than this is replayed
# from its last members (the first ones' outputs then enter as constants).
MAX_CHAIN = 16
# Optimizers checked at their first step (a GAN has two; an optimizer per parameter,
# stepped inside backward, would otherwise cost a check each).
MAX_CHECKS = 4
# Autograd nodes walked back from the loss (or an input) to the recorded outputs.
MAX_WALK = 1 << 16
# Findings that hold whatever loss is computed from the module's output; and those
# that do when the graph's structure proves them (a norm that divides a scalar out).
STRUCTURAL = ("DW101", "DW102", "DW2")
CANCELLED = ("DW104", "DW105")
STAND_IN = (
    " (by construction: found with a stand-in for the loss, which is computed outside the "
    "model; the structure holds for any loss computed from the model's output, the "
    "gradient's size is the stand-in's)"
)

Path = tuple[Any, ...]
Place = tuple[int, Path]  # a forward of the chain, and a tensor in its output
# What a forward hook with always_call gets as its output when the forward raised.
_RAISED = object()


@dataclass
class _Forward:
    """An outermost grad-enabled forward of the iteration in progress."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    site: Any  # the user's line that called it (checking.api.caller_site)
    # The module has forward hooks of its own, which run after the process-wide ones
    # and may replace the output these saw (a detached copy of it).
    hooked: bool = False


@dataclass
class _Step:
    """One module call of a replay: its recorded inputs, with those that were earlier
    outputs (`links`: input path -> place) filled in from the replay's own outputs."""

    index: int
    module: nn.Module
    inputs: tuple[tuple[Any, ...], dict[str, Any]]  # (args, kwargs), no graph held
    links: dict[Path, Place]


@dataclass
class Replay:
    """How to run the first training forward(s) again and get the loss (`exact`) or the
    outputs it was computed from."""

    steps: list[_Step]
    sinks: list[Place]  # the loss itself (exact), or the outputs it was computed from
    exact: bool
    # Call the user's own modules inside framework wrappers (a pipeline of several:
    # a DDP wrapper's forward would prepare a gradient sync for the check's backward).
    unwrapped: bool = False

    @property
    def modules(self) -> list[nn.Module]:
        return list({id(s.module): s.module for s in self.steps}.values())

    def run(self) -> dict[int, Any]:
        """Each step's output, by its index in the chain."""
        outputs: dict[int, Any] = {}
        for step in self.steps:
            inputs: Any = step.inputs
            for path, (i, where) in step.links.items():
                inputs = _replace(inputs, path, _pick(outputs[i], where))
            args, kwargs = inputs
            module = wrappers.user_model(step.module) if self.unwrapped else step.module
            outputs[step.index] = module(*args, **kwargs)
        return outputs

    def loss_fn(self, params: list[nn.Parameter]) -> Callable[[], torch.Tensor]:
        """The loss to check with. A stand-in (not `exact`) is a fixed random projection
        of each output the loss was computed from, plus zero times each of `params` the
        script's own backward gave a gradient that those outputs do not lead to: those
        get one in the check as well (a temperature used only by the loss outside the
        modules is not cut off)."""
        if self.exact:
            ((index, path),) = self.sinks
            return lambda: _pick(self.run()[index], path)
        reached = [p for p in params if p.requires_grad and _got_gradient(p)]
        projections: dict[int, torch.Tensor] = {}

        def stand_in() -> torch.Tensor:
            outputs = self.run()
            loss: torch.Tensor | None = None
            nodes = []
            for k, (index, path) in enumerate(self.sinks):
                out = _pick(outputs[index], path)
                if not isinstance(out, torch.Tensor) or not out.is_floating_point():
                    continue
                r = projections.get(k)
                if r is None or r.shape != out.shape:
                    gen = torch.Generator(device="cpu").manual_seed(k)
                    r = torch.randn(out.shape, generator=gen).to(out.device, torch.float32)
                    projections[k] = r
                term = (out.float() * r).sum()
                loss = term if loss is None else loss + term
                nodes.append(out.grad_fn)
            if loss is None:
                raise ValueError("none of the outputs the loss came from is a float tensor")
            # Only those the outputs do not already lead to: a second path would hide
            # a cancellation on the first one from the structure pass.
            upstream = autograd_graph.walk(n for n in nodes if n is not None).leaves
            # Under FSDP2 the forward's leaves are the unsharded parameters it swapped in.
            unsharded: dict[int, torch.Tensor] = {}
            for module in self.modules:
                unsharded.update(distributed.fsdp2_unsharded(module))
            for p in reached:
                leaf = unsharded.get(id(p), p)
                if id(p) not in upstream and id(leaf) not in upstream:
                    loss = loss + 0.0 * distributed.local_tensor(p).float().sum()
            return loss

        return stand_in


def _got_gradient(p: torch.Tensor) -> bool:
    """The script's backward gave `p` a gradient: in `.grad`, or, under megatron-core's
    DDP, added into its slice of the gradient buffer (zeroed before each step's
    backward, so a slice that is still all zero got nothing). Once, at step 0."""
    grad = wrappers.gradient(p)
    if grad is None:
        return False
    return grad is p.grad or bool(grad.any())


# -- the outputs of a forward, and where the loss comes from ------------------------------


def _tensors(obj: Any, path: Path = (), depth: int = 0) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor in a forward's output (or arguments), with the path to it."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif depth >= MAX_DEPTH:
        return
    elif isinstance(obj, dict):  # transformers' ModelOutput is one
        for key, value in list(obj.items()):
            yield from _tensors(value, (*path, key), depth + 1)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, (*path, i), depth + 1)


def _pick(obj: Any, path: Path) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _replace(obj: Any, path: Path, value: Any) -> Any:
    """`obj` with the item at `path` replaced, the containers on the way copied."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(obj, tuple):
        items = list(obj)
        items[key] = _replace(items[key], rest, value)
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        items = list(obj)
        items[key] = _replace(items[key], rest, value)
        return items
    new = copy.copy(obj)  # a dict, or a ModelOutput
    new[key] = _replace(obj[key], rest, value)
    return new


class _Outputs:
    """The tensors in the recorded forwards' outputs, by identity and by autograd node
    (two outputs may share one: the halves of a `chunk`)."""

    def __init__(self, chain: list[_Forward]) -> None:
        self.by_id: dict[int, Place] = {}
        self.by_memory: dict[tuple[Any, ...], Place] = {}
        self.by_node: dict[Any, list[Place]] = {}
        self.tensors: dict[Place, torch.Tensor] = {}
        for i, forward in enumerate(chain):
            for path, t in _tensors(forward.output):
                self.by_id[id(t)] = (i, path)
                self.tensors[(i, path)] = t
                key = _memory(t) if forward.hooked else None
                if key is not None:
                    self.by_memory[key] = (i, path)
                if t.grad_fn is not None:
                    self.by_node.setdefault(t.grad_fn, []).append((i, path))

    def passed_on(self, t: torch.Tensor) -> Place | None:
        """The output `t` is, or the same values in the same memory as an output of a
        module with hooks of its own (one that detached it, say): what the module
        really returned. A copy the script itself detached is not passed on."""
        place = self.by_id.get(id(t))
        if place is None:
            key = _memory(t)
            place = self.by_memory.get(key) if key is not None else None
        return place

    def reached(self, roots: list[Any]) -> list[Place]:
        """The outputs a graph reaches first walking back from `roots` (the walk stops
        at each, so an output behind another one is not among them)."""
        hits: list[Place] = []
        seen: set[Any] = set()
        stack = [r for r in roots if r is not None]
        while stack and len(seen) < MAX_WALK:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            owners = self.by_node.get(node)
            if owners is not None:
                hits.extend(o for o in owners if o not in hits)
                continue
            stack.extend(n for n, _ in node.next_functions if n is not None)
        return hits

    def scalar(self, loss: torch.Tensor) -> Place | None:
        """The output scalar the loss is, or a chain of one-input operations on one
        (`loss / accumulation_steps`, a GradScaler's scale)."""
        place = self.by_id.get(id(loss))
        if place is not None and loss.numel() == 1:
            return place
        node = loss.grad_fn
        for _ in range(MAX_HOPS):
            if node is None:
                return None
            for place in self.by_node.get(node, ()):
                if self.tensors[place].numel() == 1:
                    return place
            inputs = [n for n, _ in node.next_functions if n is not None]
            if len(inputs) != 1:
                return None
            node = inputs[0]
        return None


def _memory(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Where a tensor's values are: equal keys hold equal values."""
    try:
        if t.device.type == "meta" or t.numel() == 0:
            return None
        return (t.device, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    except Exception:  # a tensor subclass without storage
        return None


def locate(loss: torch.Tensor, output: Any) -> tuple[Path, bool] | None:
    """Where `loss` comes from in one forward's `output`: (path, True) for one of its
    scalars (or a chain of one-input operations on one), (path, False) for the first
    output tensor it was computed from by something else, None if it does not come
    from this output."""
    outputs = _Outputs([_Forward(nn.Module(), (), {}, output, None)])
    scalar = outputs.scalar(loss)
    if scalar is not None:
        return scalar[1], True
    hits = [p for p in outputs.reached([loss.grad_fn]) if outputs.tensors[p].is_floating_point()]
    return (hits[0][1], False) if hits else None


@dataclass
class _Plan:
    """What one backward's loss shows: how to replay it, and the record of every
    forward before it (for what the backward alone proves)."""

    replay: Replay | None
    note: str | None
    forwards: list[tuple[nn.Module, Any, bool, bool]] = field(default_factory=list)
    # (module, call site, its output reached the loss, it returned a graph)


def _plan(loss: torch.Tensor, chain: list[_Forward]) -> tuple[_Plan, set[int]]:
    """The replay of `loss` over the recorded `chain`, and the forwards it takes part of."""
    outputs = _Outputs(chain)
    exact = outputs.scalar(loss)
    direct = [exact] if exact is not None else outputs.reached([loss.grad_fn])
    sinks = [p for p in direct if outputs.tensors[p].is_floating_point()]
    members = {i for i, _ in sinks}
    queue = sorted(members)
    links: dict[int, dict[Path, Place]] = {}
    constants: dict[int, dict[Path, Any]] = {}
    while queue:
        j = queue.pop()
        for path, t in _tensors((chain[j].args, chain[j].kwargs), depth=-1):
            owner = outputs.passed_on(t)
            if owner is not None and owner[0] < j:  # passed on as it is
                links.setdefault(j, {})[path] = owner
                constants.setdefault(j, {})[path] = None  # filled in at replay time
                if owner[0] not in members:
                    members.add(owner[0])
                    queue.append(owner[0])
                continue
            if t.grad_fn is None:  # data, or a leaf (no graph is held)
                continue
            # Computed from earlier outputs by code between the modules, or by code
            # outside any: replayed as the value it had, and the outputs behind it
            # join the stand-in loss so that their modules are still checked.
            constants.setdefault(j, {})[path] = t.detach()
            for i, where in outputs.reached([t.grad_fn]):
                if i < j and outputs.tensors[(i, where)].is_floating_point():
                    if (i, where) not in sinks:
                        sinks.append((i, where))
                    if i not in members:
                        members.add(i)
                        queue.append(i)
    record = [
        (
            f.module,
            f.site,
            i in members,
            any(t.grad_fn is not None for _, t in _tensors(f.output) if t.is_floating_point()),
        )
        for i, f in enumerate(chain)
    ]
    if not sinks:
        called = ", ".join(dict.fromkeys(f"{type(f.module).__name__}.forward" for f in chain))
        note = f"the loss passed to backward() does not come from the output of {called}"
        return _Plan(None, note, record), members
    steps = []
    for i in sorted(members):
        inputs: Any = (chain[i].args, chain[i].kwargs)
        for path, value in constants.get(i, {}).items():
            inputs = _replace(inputs, path, value)
        steps.append(_Step(i, chain[i].module, inputs, links.get(i, {})))
    exact_replay = exact is not None and not any(
        v is not None for c in constants.values() for v in c.values()
    )
    return _Plan(Replay(steps, sinks, exact_replay), None, record), members


# -- the hooks -------------------------------------------------------------------------------


class FirstStep:
    """Records the first iteration's forwards and losses; `run` checks them at each
    optimizer's first step. Its hooks are process-wide and removed once an optimizer
    steps a second time (or at `close`)."""

    def __init__(self) -> None:
        self._depth = 0
        self._chain: list[_Forward] = []
        self._plan: _Plan | None = None
        self.unmatched: str | None = None  # why no loss could be matched yet
        self.done = False
        self._checked: set[int] = set()  # optimizers checked (by id)
        self._root: nn.Module | None = None  # the outermost module now running
        self._site: Any = None  # the line that called it
        register_pre = torch.nn.modules.module.register_module_forward_pre_hook
        register_post = torch.nn.modules.module.register_module_forward_hook
        self._handles = [
            register_pre(self._pre),
            register_post(self._post, with_kwargs=True, always_call=True),
        ]
        self._local = False
        self._paused = False  # the check's own forwards are not the script's

    @property
    def replay(self) -> Replay | None:
        return self._plan.replay if self._plan is not None else None

    def _pre(self, module: nn.Module, args: Any) -> None:
        # Not inside code torch.compile traces (a module compiled in place): the hooks
        # would be traced into its graph, or break it.
        if self._paused or torch.compiler.is_compiling():
            return
        if self._depth == 0:
            self._root = module
            self._site = _caller(sys._getframe(1))
        self._depth += 1
        if type(module).__name__ == "OptimizedModule" and self._root is not None:
            # torch.compile is about to trace what runs inside: process-wide hooks would
            # be traced into its graph and guarded on, so removing them later would
            # recompile the model. From here on, only the outermost module is hooked,
            # by hooks of its own, which run eagerly around the compiled code.
            self._go_local(self._root)

    def _go_local(self, root: nn.Module) -> None:
        for handle in self._handles:
            handle.remove()
        self._local = True
        self._depth = 0
        self._handles = [root.register_forward_hook(self._post, with_kwargs=True, always_call=True)]

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any = _RAISED) -> None:
        if self._paused or torch.compiler.is_compiling():
            return
        if not self._local:
            self._depth = max(0, self._depth - 1)
        if output is _RAISED:  # the forward raised (torch then passes no kwargs): nothing ran
            return
        if (
            self._depth == 0
            and torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            # not a forward that backward re-runs (reentrant activation checkpointing)
            and torch._C._current_graph_task_id() == -1
        ):
            with contextlib.suppress(Exception):  # never let deadweight stop training
                site = self._site if not self._local else None
                hooked = bool(module._forward_hooks)
                self._record(_Forward(module, tuple(args), dict(kwargs), output, site, hooked))

    def _record(self, forward: _Forward) -> None:
        """Keep the forward in the chain. A module called again on inputs that owe
        nothing to the chain (an evaluation loop run with gradients, a discriminator
        on real and then on fake data) replaces its earlier call, so what is held
        stays bounded by the modules of one iteration."""
        chain = self._chain
        if any(f.module is forward.module for f in chain) and not _fed_by(forward, chain):
            chain[:] = [f for f in chain if f.module is not forward.module]
        chain.append(forward)
        if len(chain) > MAX_CHAIN:
            del chain[0]

    def on_backward(self, loss: torch.Tensor) -> None:
        """The script called backward on `loss` (the unscaled loss behind a GradScaler's)."""
        if self.done:
            return
        chain = self._chain
        if not chain:
            if self._plan is None:
                self.unmatched = "no module forward ran with gradients before the first backward"
            return  # a second backward through the same forwards (retain_graph)
        try:
            self._plan, members = _plan(loss, chain)
            self.unmatched = self._plan.note
        except Exception as exc:  # an odd output: no replay, never a failed step
            log.debug("step-0 check: cannot trace the loss: %s", exc)
            members = set(range(len(chain)))
            self._plan = _Plan(None, f"the loss could not be traced: {type(exc).__name__}: {exc}")
            self.unmatched = self._plan.note
        # The forwards of this loss are not held past its backward. Those it did not
        # reach stay for a later one: a GAN's generator output, detached for the
        # discriminator's loss and then fed to the discriminator for its own.
        self._chain = [f for i, f in enumerate(chain) if i not in members]

    def before_step(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """At an optimizer step's start: whether to check it now. Not when the backward
        is still to come inside `step(closure)` (Lightning): then after the step. An
        optimizer stepping a second time ends the first iteration: the hooks go."""
        if id(optimizer) in self._checked:
            self.close()
            return False
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        return self._plan is not None or not callable(closure)

    def after_step(self, optimizer: Any) -> bool:
        """At an optimizer step's end: whether it is still to be checked."""
        return not self.done and id(optimizer) not in self._checked

    def close(self) -> None:
        self.done = True
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._chain = []
        self._plan = None

    def run(self, optimizer: Any, names: dict[int, str]) -> dict[str, Any]:
        """At an optimizer's first step: the check event (findings as dicts, and how
        they were obtained). Never raises. `names`: the watch's parameter names by id."""
        self._checked.add(id(optimizer))
        plan, unmatched = self._plan, self.unmatched
        if len(self._checked) >= MAX_CHECKS:
            self.close()
        if torch._C._current_graph_task_id() != -1:  # stepped inside backward
            return _unavailable("the optimizer stepped inside backward (optimizer-in-backward)")
        if plan is None:
            return _unavailable(unmatched or "no loss seen")
        self._paused = True
        try:
            return _checked(plan, optimizer, names)
        except Exception as exc:  # a deadweight bug: say so
            return _unavailable(f"the step-0 check failed: {type(exc).__name__}: {exc}")
        finally:
            self._paused = False


def _caller(frame: Any) -> Any:
    from deadweight.checking.api import caller_site

    return caller_site(frame)


def _fed_by(forward: _Forward, chain: list[_Forward]) -> bool:
    """Whether an input of `forward` is, or was computed from, an output in `chain`."""
    inputs = list(_tensors((forward.args, forward.kwargs), depth=-1))
    if not inputs:
        return False
    outputs = _Outputs(chain)
    if any(outputs.passed_on(t) is not None for _, t in inputs):
        return True
    return bool(outputs.reached([t.grad_fn for _, t in inputs if t.grad_fn is not None]))


def _unavailable(note: str) -> dict[str, Any]:
    return {"mode": "unavailable", "findings": [], "note": note}


# -- the check -----------------------------------------------------------------------------


def _checked(plan: _Plan, optimizer: Any, names: dict[int, str]) -> dict[str, Any]:
    from deadweight.checking.api import check

    replay = plan.replay
    if replay is not None and any(wrappers.deepspeed_engine(m) for m in replay.modules):
        # Its gradient hooks would run in the check's backward, and it keeps the
        # gradients in its own buffers: neither a replay nor `.grad` can be read.
        return _unavailable(
            "deadweight.check cannot run its backward through a DeepSpeed engine: call it "
            "on the model before deepspeed.initialize() (watch works on the engine)"
        )
    findings: list[Finding] = []
    covered: set[int] = set()
    mode, note = "from-backward", plan.note or "no replay"
    note_or_none: str | None
    model: nn.Module | None = None
    if replay is not None:
        model = _pipeline(replay.modules, names)
        replay.unwrapped = isinstance(model, _Pipeline)
        params = [p for _, p in model.named_parameters()]
        try:
            report = check(model, replay.loss_fn(params), optimizer)
        except Exception as exc:  # a replay that fails: what the backward proves stays
            with contextlib.suppress(Exception):
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            note = f"the replay of the first forward failed: {type(exc).__name__}: {exc}"
        else:
            covered = {id(p) for p in params}
            findings = [
                f
                for f in report.findings
                if not _held_elsewhere(f, model, optimizer)
                # The optimizer's parameters outside the replayed modules are judged
                # below, from the backward: not "stale" for being outside this view.
                and not (f.code == "DW202" and "tensors" in f.evidence)
            ]
            if replay.exact:
                mode, note = "replayed", ""
            else:
                mode = "structure-only"
                findings = [_structural(f) for f in findings if _holds_for_any_loss(f)]
                note = (
                    "the loss is computed outside the modules' forward: the step-0 check "
                    "replayed them with a stand-in loss and reports only gradients that never "
                    "arrive, where the graph was cut, cancellations proven by the graph's "
                    "structure, and the optimizer audit (run `deadweight check` with the real "
                    "loss for the rest)"
                )
    # The stepping optimizer's parameters the replay did not cover: what the script's
    # own backward proves about them. Only where its gradients are in `.grad` at all
    # (Megatron keeps them in `main_grad`): else a missing `.grad` proves nothing.
    stepping = [p for p in _optimizer_params(optimizer) if p.requires_grad]
    rest = [p for p in stepping if id(p) not in covered]
    if rest and any(p.grad is not None for p in stepping):
        findings += _from_backward(rest, plan, optimizer, names)
    elif rest and mode == "from-backward":
        return _unavailable(
            f"{note}; and no parameter of {type(optimizer).__name__} holds a gradient in "
            "`.grad` at its first step, so the script's backward proves nothing either"
        )
    if mode == "from-backward":
        note = (
            f"{note}; reported instead: what the script's own first backward proves (which "
            "parameters got no gradient, and the module that explains it)"
        )
    note_or_none = note or None
    return {
        "mode": mode,
        "model": type(model).__name__ if model is not None else None,
        "optimizer": type(optimizer).__name__,
        "findings": [f.to_dict() for f in findings],
        "note": note_or_none,
    }


def _optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    params = {id(p): p for g in getattr(optimizer, "param_groups", []) for p in g["params"]}
    return list(params.values())


def _from_backward(
    params: list[torch.Tensor], plan: _Plan, optimizer: Any, names: dict[int, str]
) -> list[Finding]:
    from deadweight.checking.api import BackwardParam, RecordedForward, first_backward_findings

    named = {id(p): _name(p, names) for p in params}
    forwards = []
    for module, site, reached, has_graph in plan.forwards:
        under = tuple(
            named[id(p)] for p in module.parameters() if id(p) in named and p.requires_grad
        )
        if under:
            path = _module_path(module, names)
            forwards.append(
                RecordedForward(path, type(module).__name__, site, under, reached, has_graph)
            )
    return first_backward_findings(
        model="the script's model",
        optimizer=type(optimizer).__name__,
        params=[
            BackwardParam(
                named[id(p)],
                tuple(p.shape),
                str(p.dtype).removeprefix("torch."),
                p.grad is not None,
            )
            for p in params
        ],
        forwards=forwards,
    )


def _name(p: torch.Tensor, names: dict[int, str]) -> str:
    name = names.get(id(p))
    if name is None:
        shape = "x".join(str(d) for d in p.shape) or "scalar"
        name = f"param[{shape}]@{id(p):x}"
    return name


def _module_path(module: nn.Module, names: dict[int, str]) -> str:
    """The module's path as the watch names its parameters ("" for a model itself,
    `Encoder:` for one of several models, `transformer.h.1` inside one)."""
    for local, p in wrappers.user_model(module).named_parameters():
        name = names.get(id(p))
        if name is not None and name.endswith(local):
            prefix = name[: len(name) - len(local)]
            return prefix[:-1] if prefix.endswith(".") else prefix
    return f"{type(module).__name__}:"


def _held_elsewhere(finding: Finding, model: nn.Module, optimizer: Any) -> bool:
    """DW201 about parameters another optimizer steps (a GAN's discriminator in the
    check of the generator's step): they are in an optimizer, just not this one."""
    if finding.code != "DW201" or not finding.params:
        return False
    others = owners.live_optimizers(optimizer)[1:]
    held = {id(p) for opt in others for g in opt.param_groups for p in g["params"]}
    by_name = dict(model.named_parameters())
    return all(n in by_name and id(by_name[n]) in held for n in finding.params)


def _holds_for_any_loss(finding: Finding) -> bool:
    if finding.code.startswith(STRUCTURAL):
        return True
    if finding.code not in CANCELLED:
        return False
    per_param = finding.evidence.get("params")
    return (
        isinstance(per_param, dict)
        and bool(per_param)
        and all(isinstance(e, dict) and e.get("by_construction") for e in per_param.values())
    )


def _structural(finding: Finding) -> Finding:
    if finding.code in CANCELLED:
        return dataclasses.replace(finding, message=finding.message + STAND_IN)
    return finding


# -- the modules of a pipeline as one model -------------------------------------------------


def _pipeline(modules: list[nn.Module], names: dict[int, str]) -> nn.Module:
    """The model to check: the one module itself (inside its framework wrapper, which
    check looks through) when the watch names its parameters as the module does, else
    `_Pipeline` over the user's own modules."""
    members = [(_module_path(m, names), wrappers.user_model(m)) for m in modules]
    if len(members) == 1 and members[0][0] == "":
        return modules[0]
    return _Pipeline(members)


def _join(path: str, name: str) -> str:
    if not path:
        return name
    if not name:
        return path
    return path + name if path.endswith(":") else f"{path}.{name}"


class _Pipeline(nn.Module):
    """The modules one loss ran through, as one model whose parameters and modules have
    the names the watch gives them (`enc.fc.weight` inside one model, `Encoder:fc.weight`
    across several). Only naming and train/eval are defined; it is never called."""

    def __init__(self, members: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        # An ancestor before what it holds, so a module is named from its outermost path.
        ordered = sorted(members, key=lambda pm: (pm[0].endswith(":") is False, len(pm[0])))
        self._members: list[tuple[str, nn.Module]]
        object.__setattr__(self, "_members", ordered)
        trained = [m for _, m in ordered if any(p.requires_grad for p in m.parameters())]
        self.training = all(m.training for m in trained) if trained else True

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        for k, (_, module) in enumerate(self._members):
            yield str(k), module

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        memo = set() if memo is None else memo
        if self not in memo:
            if remove_duplicate:
                memo.add(self)
            yield prefix, self
        for path, module in self._members:
            for sub, found in module.named_modules(memo, "", remove_duplicate):
                yield _join(_join(prefix, path), sub), found

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        if not recurse:
            return
        seen: set[int] = set()
        for path, module in self._members:
            for name, p in module.named_parameters(remove_duplicate=remove_duplicate):
                if remove_duplicate and id(p) in seen:
                    continue
                seen.add(id(p))
                yield _join(_join(prefix, path), name), p
