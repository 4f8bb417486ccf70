"""Measure gradient flow: run the user's loss and one backward, and record what happened.

`measure_grad_flow` produces `GradFlowStats`: per parameter whether a gradient
arrived, and the *candidate cuts* that could explain a missing one, each with the
parameters upstream of it. Choosing which cut explains which parameter is left to
the rules.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deadweight import autograd_graph, param_roles
from deadweight.checking import cancellation, invariance
from deadweight.checking.cancellation import Cancellation, StructureTracker
from deadweight.checking.invariance import GradStats, ProbeResult
from deadweight.checking.module_trace import ModuleTracer
from deadweight.checking.op_trace import OpTracer, op_name, tensors_in
from deadweight.checking.optimizer_groups import OptimizerFacts, optimizer_facts
from deadweight.checking.sites import Site, definition_site
from deadweight.checking.state import (
    ParamWrite,
    grads_set_aside,
    post_accumulate_hooks_suspended,
    preserved,
    unrestored_versions,
)
from deadweight.distributed import ranks as distributed
from deadweight.errors import CollectiveError, InputError, LossFnError

log = logging.getLogger(__name__)

_NO_FORMULA = re.compile(r"Trying to backward through (\S+) but no autograd formula was registered")


@dataclass(frozen=True)
class ParamInfo:
    name: str
    module: str  # path of the module that owns it ("" for the root)
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    has_grad: bool
    reaches_loss: bool  # the parameter's node is in the loss's autograd graph
    in_optimizer: bool | None  # None when no optimizer was given
    numel: int = 0
    role: str = param_roles.OTHER  # bias, normalization weight, embedding, tagged, other
    module_type: str = ""
    grad: GradStats | None = None  # None without a gradient
    pinned: bool = False  # deadweight.pin holds it
    moved_since_pin: float | None = None  # largest change since the pin, if pinned


@dataclass(frozen=True)
class Cut:
    """A candidate explanation for parameters that got no gradient.

    kind: how the graph was cut (see `CUT_KINDS`); op: the call; site: the user's
    line; module: the module path running at the time; params: trainable
    parameters upstream of the cut; flows_to_loss: whether the cut's result was seen
    reaching the loss (None when that does not apply to this kind).
    """

    kind: str
    op: str | None
    site: Site | None
    module: str | None
    params: frozenset[str]
    flows_to_loss: bool | None = None
    detail: str = ""
    caller: Site | None = None


CUT_KINDS = {
    "no-grad": "ran under torch.no_grad, so its output has no grad_fn while its input requires grad",
    "inference-mode": "ran under torch.inference_mode, so its output has no grad_fn while its input requires grad",
    "detach": "detached its input with .detach(), so no gradient flows back through it",
    "data": "read .data, which returns the values without the autograd graph",
    "item": "turned a tensor into a Python number (.item() / float()), which carries no gradient",
    "tolist": "turned a tensor into a Python list (.tolist()), which carries no gradient",
    "numpy": "turned a tensor into a NumPy array, which carries no gradient",
    "rebuilt-tensor": "built a new tensor from another tensor's values (torch.tensor), which starts a new graph",
    "non-differentiable": "has no derivative (its output is an integer or boolean tensor)",
    "other": "returned a result without grad_fn although its input requires grad",
    "function": "is an autograd.Function whose outputs come back without grad_fn (ctx.mark_non_differentiable)",
    "reentrant-checkpoint": "is torch.utils.checkpoint with use_reentrant=True and no input that requires grad, so the checkpointed parameters get no gradient",
    "dropped-in-backward": "returned None from backward for an input that needs a gradient",
    "no-autograd-kernel": "is a custom op registered without an autograd kernel: backward warns once and then passes no gradient",
    "custom-op-no-autograd": "is a torch.library.custom_op with no register_autograd: backward through it raises",
    "module-cut": "returned outputs without grad_fn although its inputs or parameters require grad",
    "never-ran": "never ran in this forward",
    "output-unused": "ran, but its output never reaches the loss",
    "loss-no-grad-fn": "has no grad_fn, so backward cannot reach any parameter",
}


@dataclass(frozen=True)
class LossInfo:
    value: float | None
    finite: bool
    has_graph: bool
    site: Site | None  # the line that produced a loss without grad_fn, when traced
    grad_enabled_at_site: bool | None = None


@dataclass
class GradFlowStats:
    """What one forward+backward showed about gradient flow."""

    model: str
    model_training: bool
    optimizer: str | None
    loss: LossInfo
    params: list[ParamInfo]
    cuts: list[Cut]
    backward_error: str | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict, repr=False)
    # (name, "scale" | "shift") -> the functional probe's result, for screened candidates
    invariance: dict[tuple[str, str], ProbeResult] = field(default_factory=dict)
    probe_note: str | None = None  # why probes were skipped, when they were
    # Parameters a cancelling op removes from the loss by construction (the structure
    # pass, checking/cancellation.py), with the re-run that confirmed them.
    cancellations: dict[str, Cancellation] = field(default_factory=dict)
    # Parameters the structure pass proved to reach the loss through ops it knows:
    # a tiny gradient there is a weak coupling (a fresh layer), not noise.
    influencing: frozenset[str] = frozenset()
    # Parameters the structure pass could not follow (a custom op or autograd.Function
    # on their way, or the pass off); only these get the numerical screens.
    unstructured: frozenset[str] = frozenset()
    structure_note: str | None = None
    loss_eps: float = float(torch.finfo(torch.float32).eps)
    optimizer_facts: OptimizerFacts | None = None
    # Parameters whose values a forward run by the check changed (and whether they
    # were put back): a forward that writes `.data` changes the model every step.
    param_writes: list[ParamWrite] = field(default_factory=list)
    state_note: str | None = None  # what of the model's state could not be put back

    def param(self, name: str) -> ParamInfo:
        return self._by_name[name]

    @property
    def _by_name(self) -> dict[str, ParamInfo]:
        return {p.name: p for p in self.params}

    @property
    def no_grad_params(self) -> list[ParamInfo]:
        return [p for p in self.params if p.trainable and not p.has_grad]


LossFn = Callable[[], Any]


def measure_grad_flow(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    shards: distributed.Shards | None = None,
) -> GradFlowStats:
    """Run `loss_fn` and one backward; leave the model, its grads and the RNG as they were.

    With `shards` (DTensor parameters, FSDP2) every rank must call it: gradient
    presence, the gradient statistics and the loss are summed over the ranks' local
    shards in one collective, so every rank measures the whole parameters, and the
    functional probes run on all ranks together (`_probe_shards`).
    """
    named = _validated_params(model, loss_fn, optimizer)
    names_by_id = {id(p): n for n, p in named}
    trainable = [(n, p) for n, p in named if p.requires_grad]
    in_opt = _optimizer_param_ids(optimizer)

    # FSDP2's forward uses unsharded stand-ins for the parameters, which the pass would
    # not recognise: there the numerical screens decide alone.
    structure = (
        StructureTracker({id(p): p for _, p in trainable}, names_by_id) if shards is None else None
    )
    unrestored_versions()  # count this check's failures only
    with preserved(model) as guard:
        modules = ModuleTracer(model)
        if structure is not None:
            structure.set_module_lookup(modules.current)
        tracer = OpTracer(
            modules.current,
            params={id(p): p for _, p in named},
            before_param_write=guard.before_write,
            structure=structure,
        )
        with torch.inference_mode(False), torch.enable_grad():
            try:
                with modules, tracer:
                    raw = loss_fn()
            except Exception as exc:
                raise LossFnError(
                    f"loss_fn raised {type(exc).__name__}: {exc} "
                    "(its traceback is above; deadweight removed all of its hooks)"
                ) from exc
            loss = _validated_loss(raw)
            # Under FSDP2 the graph's leaves are the unsharded parameters swapped in
            # for the forward: they go by the sharded parameters' names.
            unsharded = distributed.fsdp2_unsharded(model) if shards is not None else {}
            for sharded_id, leaf in unsharded.items():
                if sharded_id in names_by_id:
                    names_by_id.setdefault(id(leaf), names_by_id[sharded_id])

            has_graph = loss.requires_grad
            loss_walk = (
                autograd_graph.walk([loss.grad_fn or loss])
                if has_graph
                else autograd_graph.GraphWalk()
            )
            cuts: list[Cut] = []
            backward_error = None
            reached = loss_walk.leaves
            if has_graph:
                outside = {
                    **{i: t for i, t in loss_walk.leaves.items() if i not in names_by_id},
                    **{
                        i: t
                        for i, t in tracer.leaves_inside_functions.items()
                        if i not in names_by_id
                    },
                }
                backward_error, dropped_cuts, reached = _backward(
                    loss,
                    loss_walk,
                    [p for _, p in trainable],
                    list(outside.values()),
                    tracer,
                    names_by_id,
                )
                cuts.extend(dropped_cuts)

            # What the forward wrote to parameters goes back before any re-run, so the
            # probes re-run the forward from the values the checked one started from.
            guard.restore()
            reached_ids = set(reached)
            for sharded_id, leaf in unsharded.items():
                if id(leaf) in reached_ids:
                    reached_ids.add(sharded_id)
            if backward_error is None:
                has_grad = {id(p): p.grad is not None for _, p in trainable}
            else:  # backward stopped half-way: what would have arrived is what is reachable
                has_grad = {id(p): id(p) in reached_ids for _, p in trainable}
            grads = {n: p.grad for n, p in trainable}

            loss_site = None
            site_grad_enabled = None
            if not has_graph:
                origin = tracer.scalar_origins.get(loss)
                if origin is not None:
                    _, loss_site, site_grad_enabled = origin
                else:
                    loss_site = definition_site(loss_fn)
                cuts.append(
                    Cut(
                        "loss-no-grad-fn", None, loss_site, None, frozenset(n for n, _ in trainable)
                    )
                )

            loss_taint = tracer.taint_of(loss)
            for event in tracer.events:
                params = _upstream_params(event.roots, loss_walk.nodes, names_by_id)
                if params:
                    cuts.append(
                        Cut(
                            event.kind,
                            event.op,
                            event.site,
                            event.module,
                            params,
                            flows_to_loss=event.index in loss_taint,
                            caller=event.caller,
                        )
                    )
            # A module output that feeds a cut whose result reaches the loss was not
            # dropped: that cut explains it. (One feeding only a logging .detach() was.)
            feeds_cuts = autograd_graph.walk(
                r for e in tracer.events if e.index in loss_taint for r in e.roots
            ).nodes
            consumed = loss_walk.nodes | feeds_cuts
            cuts.extend(
                _module_cuts(model, modules, loss_walk.nodes, consumed, names_by_id, trainable)
            )

            value = float(loss.detach().float().item())
            loss_eps = float(torch.finfo(loss.dtype).eps) if loss.is_floating_point() else 0.0
            probes: dict[tuple[str, str], ProbeResult]
            probe_note: str | None
            if shards is not None:
                value, stats_by_name, backward_failed = _sum_over_shards(
                    shards, trainable, has_grad, reached_ids, value, backward_error is not None
                )
                # Every rank probes the same candidates in the same order: the
                # statistics, the loss and the rerun's value are the same on every rank.
                probes, probe_note = _probe_shards(
                    model,
                    shards,
                    [(n, p) for n, p in trainable if has_grad[id(p)]],
                    stats_by_name,
                    value,
                    loss_eps,
                    invariance.rerun_of(loss_fn, guard),
                    runnable=not backward_failed and math.isfinite(value),
                )
            else:
                with_grad = [(n, p) for n, p in trainable if p.grad is not None]
                stats_by_name = dict(
                    zip(
                        [n for n, _ in with_grad],
                        invariance.grad_stats([p for _, p in with_grad]),
                        strict=True,
                    )
                )
                runnable = backward_error is None and math.isfinite(value)
                structural = _structure_verdict(
                    structure, loss, with_grad, stats_by_name, loss_fn, guard, value, runnable
                )
                screened = [(n, p) for n, p in with_grad if n in structural.unstructured]
                probes, probe_note = invariance.probe(
                    screened,
                    stats_by_name,
                    value,
                    loss_eps,
                    invariance.rerun_of(loss_fn, guard),
                    runnable=runnable,
                )

    param_writes = guard.writes()
    if param_writes:
        log.debug("the forward wrote to parameters: %s", param_writes)
    lost_versions = unrestored_versions()
    state_note = (
        f"the autograd version counters of {lost_versions} tensor(s) could not be put back: "
        "a graph built before the check that saved them will refuse to backward"
        if lost_versions
        else None
    )
    if shards is not None:
        structural = _Structural({}, frozenset(), frozenset(n for n, _ in trainable), None)
    roles = param_roles.parameter_roles(model)
    return GradFlowStats(
        invariance=probes,
        probe_note=probe_note,
        cancellations=structural.cancellations,
        influencing=structural.influencing,
        unstructured=structural.unstructured,
        structure_note=structural.note,
        loss_eps=loss_eps,
        optimizer_facts=optimizer_facts(model, optimizer) if optimizer is not None else None,
        model=type(model).__name__,
        model_training=model.training,
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        loss=LossInfo(
            value=value,
            finite=value is not None and math.isfinite(value),
            has_graph=has_graph,
            site=loss_site,
            grad_enabled_at_site=site_grad_enabled,
        ),
        params=[
            ParamInfo(
                name=n,
                module=n.rpartition(".")[0],
                shape=tuple(p.shape),
                dtype=str(p.dtype).removeprefix("torch."),
                trainable=p.requires_grad,
                has_grad=has_grad.get(id(p), False),
                reaches_loss=id(p) in reached_ids,
                in_optimizer=(id(p) in in_opt) if in_opt is not None else None,
                numel=p.numel(),
                role=roles[n][0],
                module_type=roles[n][1],
                grad=stats_by_name.get(n),
                pinned=hasattr(p, "_deadweight_pin"),
                moved_since_pin=p._deadweight_pin.moved()
                if hasattr(p, "_deadweight_pin")
                else None,
            )
            for n, p in named
        ],
        cuts=cuts,
        backward_error=backward_error,
        grads=grads,
        param_writes=param_writes,
        state_note=state_note,
    )


@dataclass(frozen=True)
class _Structural:
    cancellations: dict[str, Cancellation]
    influencing: frozenset[str]
    unstructured: frozenset[str]
    note: str | None


def _structure_verdict(
    structure: StructureTracker | None,
    loss: torch.Tensor,
    with_grad: list[tuple[str, nn.Parameter]],
    stats: dict[str, GradStats],
    loss_fn: LossFn,
    guard: Any,
    value: float,
    runnable: bool,
) -> _Structural:
    """The structure pass's candidates, each confirmed by re-running the forward."""
    names = frozenset(n for n, _ in with_grad)
    if structure is None or structure.failed is not None:
        note = f"structure pass off: {structure.failed}" if structure is not None else None
        return _Structural({}, frozenset(), names, note)
    found = structure.result(loss, lambda i: structure.param_names[i] in names)
    candidates = {n: c for n, c in found.cancellations.items() if n in stats}
    note = None
    if candidates and runnable:
        params = dict(with_grad)
        candidates = cancellation.confirm(
            candidates,
            params,  # type: ignore[arg-type]
            structure.outputs,
            _capturing_rerun(loss_fn, guard),
            value,
        )
        if any("not reproducible" in str(c.evidence.get("probe")) for c in candidates.values()):
            note = (
                "structural candidates not confirmed: re-running loss_fn gave other "
                "outputs; make it use one fixed batch"
            )
    elif candidates:
        note = "structural candidates not confirmed: the loss is not finite or backward failed"
    return _Structural(candidates, found.influencing, found.opaque & names, note)


def _capturing_rerun(
    loss_fn: LossFn, guard: Any
) -> Callable[
    [set[tuple[str, int]]], tuple[float | None, dict[tuple[str, int], torch.Tensor]] | None
]:
    """`loss_fn` re-run under no_grad on the checked run's RNG state, keeping the outputs
    of the given calls (`cancellation.OutputCapture`); None when it raises."""

    def rerun(
        targets: set[tuple[str, int]],
    ) -> tuple[float | None, dict[tuple[str, int], torch.Tensor]] | None:
        guard.reset_rng()
        capture = cancellation.OutputCapture(targets, op_name)
        try:
            with torch.no_grad(), capture:
                out = loss_fn()
        except Exception:
            return None
        loss = None
        if isinstance(out, torch.Tensor) and out.numel() == 1:
            loss = float(out.detach().float().item())
        return loss, capture.outputs

    return rerun


def _probe_shards(
    model: nn.Module,
    shards: distributed.Shards,
    with_grad: list[tuple[str, nn.Parameter]],
    stats: dict[str, GradStats],
    loss: float,
    loss_eps: float,
    local_rerun: Callable[[], float | None],
    runnable: bool,
) -> tuple[dict[tuple[str, str], ProbeResult], str | None]:
    """The functional probes on DTensor parameters, run by every rank together.

    A probe writes to the sharded parameters in place (as an optimizer step does) and
    re-runs the loss, whose forward all-gathers them. Each rerun's loss is the mean
    of the ranks' losses (the loss of the whole batch, as the checked one), from one
    all-reduce of two numbers; a rank whose loss_fn raises or gives a non-finite loss
    makes the probe impossible on every rank. A rank that fails inside its forward,
    before FSDP2's own collectives, holds the others there until the process
    group's timeout; deadweight's collective then fails within its own.
    """

    def rerun() -> float | None:
        distributed.fsdp2_reshard(model)
        try:
            mine = local_rerun()
        finally:
            distributed.fsdp2_reshard(model)
        return shards.mean(mine, "check: probe loss")

    try:
        return invariance.probe(with_grad, stats, loss, loss_eps, rerun, runnable=runnable)
    except CollectiveError as exc:
        # The ranks no longer agree on which probe comes next: drop them all.
        return {}, f"functional probes stopped: {exc}"


# Per parameter: got a gradient, reaches the loss, then the five sums of
# `invariance.grad_stats_from_sums`.
_SHARD_COLUMNS = 7


@torch.no_grad()
def _sum_over_shards(
    shards: distributed.Shards,
    trainable: list[tuple[str, nn.Parameter]],
    has_grad: dict[int, bool],
    reached: set[int],
    loss: float,
    backward_failed: bool,
) -> tuple[float, dict[str, GradStats], bool]:
    """Whole-parameter statistics from every rank's local shards, in one collective.

    Every rank sends a row for every trainable parameter, also those without a
    gradient or with an empty local shard (a shape-[1] scalar on 3 ranks), so all
    ranks enter the same collective with the same shape. `has_grad` and `reached`
    are updated in place to "on any rank" (FSDP2 reduce-scatters gradients, so a
    gradient on one rank is a gradient everywhere); the loss becomes the mean over
    the ranks, the loss of the whole batch, and `backward_failed` "on any rank".
    """
    world = shards.ranks.world_size if shards.ranks is not None else 1
    rows = torch.zeros(len(trainable) + 1, _SHARD_COLUMNS, dtype=torch.float64)
    for k, (_, p) in enumerate(trainable):
        weight = distributed.share_of_sum(p, world)
        rows[k, 0] = float(has_grad.get(id(p), False))
        rows[k, 1] = float(id(p) in reached)
        theta = distributed.local_tensor(p.detach()).double()
        g = p.grad
        if g is not None:
            gl = distributed.local_tensor(g.detach()).double()
            sums = [(gl * gl).sum(), (gl * theta).sum(), gl.sum(), (theta * theta).sum()]
            sums.append((gl != 0).sum().double())
            rows[k, 2:7] = torch.stack(sums).cpu() * weight
        else:
            rows[k, 5] = (theta * theta).sum().cpu() * weight
    rows[-1, 0] = loss / world
    rows[-1, 1] = float(backward_failed)
    total = shards.sum(rows, "check: gradient statistics").tolist()
    stats: dict[str, GradStats] = {}
    for k, (name, p) in enumerate(trainable):
        has_grad[id(p)] = total[k][0] > 0
        if total[k][1] > 0:
            reached.add(id(p))
        if has_grad[id(p)]:
            stats[name] = invariance.grad_stats_from_sums([total[k][2:7]], [p.numel()])[0]
    return total[-1][0], stats, total[-1][1] > 0


def _backward(
    loss: torch.Tensor,
    loss_walk: autograd_graph.GraphWalk,
    params: list[nn.Parameter],
    other_leaves: list[torch.Tensor],
    tracer: OpTracer,
    names_by_id: dict[int, str],
) -> tuple[str | None, list[Cut], dict[int, torch.Tensor]]:
    """One backward, watched; returns (error of a custom op without autograd, cuts, reached).

    Not `backward(inputs=params)`: reentrant checkpointing refuses it. Instead the
    .grad of every other leaf that backward will reach is set aside and restored,
    and the parameters' post-accumulate-grad hooks (optimizer-in-backward steps
    the optimizer there) are suspended for the duration.
    """
    cuts: list[Cut] = []
    error = None
    reached = loss_walk.leaves
    watch = autograd_graph.DropWatch(loss_walk.nodes)
    try:
        with grads_set_aside(other_leaves), post_accumulate_hooks_suspended(params), watch:
            loss.backward()
    except RuntimeError as exc:
        match = _NO_FORMULA.search(str(exc))
        if match is None:
            raise LossFnError(f"backward failed: {exc}") from exc
        error = str(exc).splitlines()[0]
        bad = autograd_graph.raising_nodes(loss_walk.nodes, match.group(1))
        for node in bad:
            inputs = range(len(node.next_functions))
            cuts.append(_node_cut(node, inputs, "custom-op-no-autograd", tracer, names_by_id))
        reached = autograd_graph.walk([loss.grad_fn], stop=frozenset(bad)).leaves
    for drop in watch.drops:
        kind = (
            "dropped-in-backward"
            if isinstance(drop.node, torch.autograd.function.BackwardCFunction)
            else "no-autograd-kernel"
        )
        cuts.append(_node_cut(drop.node, drop.inputs, kind, tracer, names_by_id))
    return error, cuts, reached


def _validated_params(
    model: nn.Module, loss_fn: LossFn, optimizer: torch.optim.Optimizer | None
) -> list[tuple[str, nn.Parameter]]:
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise InputError(
            f"loss_fn must be a zero-argument callable returning the loss, got {type(loss_fn).__name__}"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    named = list(model.named_parameters())
    meta = [n for n, p in named if p.is_meta]
    if meta:
        raise InputError(
            f"{len(meta)} parameter(s) are on the meta device and hold no values "
            f"({_few(meta)}); materialise the model first, e.g. model.to_empty(device='cpu') "
            "and load its weights"
        )
    if not any(p.requires_grad for _, p in named):
        raise InputError(
            f"{type(model).__name__} has no trainable parameters "
            f"({len(named)} parameter(s), all with requires_grad=False); nothing can learn"
        )
    return named


def _validated_loss(raw: Any) -> torch.Tensor:
    if not isinstance(raw, torch.Tensor):
        raise InputError(
            f"loss_fn must return the scalar loss tensor, got {type(raw).__name__}{_hint(raw)}"
        )
    if raw.is_complex():
        raise InputError(
            f"loss_fn must return a real-valued loss, got a {raw.dtype} tensor; "
            "reduce it to a real number the way your training does"
        )
    if raw.numel() != 1:
        raise InputError(
            f"loss_fn must return a scalar loss, got a tensor of shape {tuple(raw.shape)}; "
            "reduce it the way your training does, e.g. with .mean()"
        )
    return raw


def _hint(raw: Any) -> str:
    if isinstance(raw, dict) and "loss" in raw:
        loss = raw["loss"]
    elif hasattr(raw, "loss"):
        loss = raw.loss
    else:
        return ""
    if loss is None:
        return (
            " whose `loss` is None: models compute a loss only when given labels, "
            "e.g. `lambda: model(input_ids=ids, labels=ids).loss`"
        )
    return " (it has a `loss` field: return that, e.g. `lambda: model(**batch).loss`)"


def _optimizer_param_ids(optimizer: torch.optim.Optimizer | None) -> set[int] | None:
    if optimizer is None:
        return None
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _upstream_params(
    roots: list[Any], loss_nodes: set[Any], names_by_id: dict[int, str]
) -> frozenset[str]:
    # A node that the loss reaches passes gradients to everything above it, so the
    # walk stops there: only parameters that hang *solely* from the cut are wanted.
    upstream = autograd_graph.walk(roots, stop=frozenset(loss_nodes))
    return frozenset(names_by_id[i] for i in upstream.leaves if i in names_by_id)


def _node_cut(
    node: Any, inputs: Any, kind: str, tracer: OpTracer, names_by_id: dict[int, str]
) -> Cut:
    roots = [node.next_functions[i][0] for i in inputs]
    params = frozenset(
        names_by_id[i] for i in autograd_graph.walk(roots).leaves if i in names_by_id
    )
    origin = tracer.node_origins.get(node)
    op = origin.op if origin else type(node).__name__
    return Cut(
        kind,
        op,
        origin.site if origin else None,
        origin.module if origin else None,
        params,
        detail=f"input(s) {list(inputs)} of {type(node).__name__}",
    )


def _module_cuts(
    model: nn.Module,
    modules: ModuleTracer,
    loss_nodes: set[Any],
    consumed_nodes: set[Any],
    names_by_id: dict[int, str],
    trainable: list[tuple[str, nn.Parameter]],
) -> list[Cut]:
    trainable_names = [n for n, _ in trainable]

    def params_under(path: str) -> frozenset[str]:
        prefix = path + "." if path else ""
        return frozenset(n for n in trainable_names if n.startswith(prefix))

    cuts = []
    ran = modules.calls
    # Containers (ModuleList, ModuleDict) are never called themselves: a module took
    # part in the forward if it, or anything below it, ran.
    took_part = {""} | {prefix for path in ran for prefix in _prefixes(path)}
    for path, module in model.named_modules():
        if not path:
            continue
        if path not in took_part:
            if path.rpartition(".")[0] in took_part:  # the outermost module that sat out
                params = params_under(path)
                if params:
                    site = definition_site(module)
                    cuts.append(Cut("never-ran", type(module).__name__, site, path, params))
            continue
        record = ran.get(path)
        if record is None:
            continue
        if record.output_nodes and not any(n in consumed_nodes for n in record.output_nodes):
            params = params_under(path)
            if params:
                cuts.append(
                    Cut("output-unused", type(module).__name__, record.call_site, path, params)
                )
        if record.cut_roots:
            params = _upstream_params(record.cut_roots, loss_nodes, names_by_id)
            if params:
                cuts.append(
                    Cut("module-cut", type(module).__name__, record.call_site, path, params)
                )
    return cuts


def _prefixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


__all__ = [
    "CUT_KINDS",
    "Cut",
    "GradFlowStats",
    "LossInfo",
    "ParamInfo",
    "measure_grad_flow",
    "tensors_in",
]
