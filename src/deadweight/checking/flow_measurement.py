"""Measure gradient flow: run the user's loss and one backward, and record what happened.

`measure_grad_flow` produces `GradFlowStats`: per parameter whether a gradient
arrived, and the *candidate cuts* that could explain a missing one, each with the
parameters upstream of it. Choosing which cut explains which parameter is left to
the rules.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import logging
import math
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deadweight import autograd_graph, param_roles, wrappers
from deadweight.checking import cancellation_confirmation, invariance, sharded_flow
from deadweight.checking import gates as gates_module
from deadweight.checking.backward_reach import BackwardReach
from deadweight.checking.cancellation import StructureResult, StructureTracker
from deadweight.checking.check_stats import (
    FLOAT32_EPS,
    Cancellation,
    Cut,
    GradFlowStats,
    GradStats,
    LossInfo,
    ParamInfo,
    ParamWrite,
    ProbeResult,
    Site,
)
from deadweight.checking.module_trace import ModuleTracer, took_part
from deadweight.checking.op_trace import OpTracer, op_name, tensors_in
from deadweight.checking.optimizer_groups import optimizer_facts
from deadweight.checking.sites import definition_site
from deadweight.checking.state import (
    ParamGuard,
    grads_set_aside,
    post_accumulate_hooks_suspended,
    preserved,
    unrestored_versions,
)
from deadweight.distributed import ranks as distributed
from deadweight.errors import InputError, LossFnError

log = logging.getLogger(__name__)

_NO_FORMULA = re.compile(r"Trying to backward through (\S+) but no autograd formula was registered")


LossFn = Callable[[], Any]


def measure_grad_flow(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    shards: distributed.Shards | None = None,
) -> GradFlowStats:
    """Run `loss_fn` and one backward; leave the model, its grads and the RNG as they were.

    Four steps: trace the forward, run the backward, collect the cuts, probe the
    parameters the loss may ignore. With `shards` (DTensor parameters, FSDP2) every
    rank must call it: gradient presence, the gradient statistics and the loss are
    summed over the ranks' local shards in one collective, so every rank measures the
    whole parameters, and the functional probes run on all ranks together
    (`sharded_flow`).
    """
    named = _validated_params(model, loss_fn, optimizer)
    run = _Run(model, loss_fn, named, shards)
    unrestored_versions()  # count this check's failures only
    with (
        preserved(model, named, run.modules) as guard,
        torch.inference_mode(False),
        torch.enable_grad(),
    ):
        with _collection_paused():
            traced = _trace(run, guard)
            flow = _backward_step(run, traced)
            # What the forward wrote to parameters goes back before any re-run, so the
            # probes re-run the forward from the values the checked one started from.
            guard.restore()
            cuts = flow.cuts + _collect_cuts(run, traced, flow)
            gradients = _gradient_statistics(run, traced, flow)
        probed = _statistics_and_probes(run, traced, flow, guard, gradients)
    param_writes = guard.writes()
    if param_writes:
        log.debug("the forward wrote to parameters: %s", param_writes)
    return _assemble(run, optimizer, traced, flow, probed, cuts, param_writes)


@dataclass
class _Run:
    """What one measurement works on: the model's parameters by name and by id."""

    model: nn.Module
    loss_fn: LossFn
    named: list[tuple[str, nn.Parameter]]
    shards: distributed.Shards | None
    # `model.named_modules()` before the forward, walked once for the snapshot and the
    # module tracer (each walk of a 12-layer GPT-2's 164 modules is 0.09 ms)
    modules: list[tuple[str, nn.Module]] = field(init=False)
    names_by_id: dict[int, str] = field(init=False)
    trainable: list[tuple[str, nn.Parameter]] = field(init=False)
    # FSDP2's forward uses unsharded stand-ins for the parameters: the structure pass
    # asks FSDP2 which stand-in is which parameter's when one turns up.
    structure: StructureTracker | None = field(init=False)

    def __post_init__(self) -> None:
        self.modules = list(self.model.named_modules())
        self.names_by_id = {id(p): n for n, p in self.named}
        self.trainable = [(n, p) for n, p in self.named if p.requires_grad]
        model = self.model
        self.structure = StructureTracker(
            {id(p): p for _, p in self.trainable},
            self.names_by_id,
            stand_ins=(lambda: distributed.fsdp2_unsharded(model)) if self.shards else None,
        )


@dataclass
class _Traced:
    """The forward, as the tracers saw it."""

    loss: torch.Tensor
    tracer: OpTracer
    modules: ModuleTracer
    walk: autograd_graph.GraphWalk  # the loss's autograd graph
    unsharded: dict[int, torch.Tensor]  # FSDP2: sharded parameter id -> the forward's leaf
    # A loss without grad_fn: the line that made it, and whether grad mode was on there
    site: Site | None = None
    grad_enabled_at_site: bool | None = None


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the traced forward, its backward, the
    restore of what the forward wrote, the reading of its cuts and the gradient
    statistics. The structure pass allocates many small short-lived objects per call
    (carriers, facets), which triggered collections that each scanned the whole heap
    (model, framework): about a sixth of check's time on a dispatch-bound 12-layer
    GPT-2; resumed right after the forward, the collection then due still scanned
    everything the pass held until the backward freed it. Nothing is lost: collection
    resumes before any re-run of the loss function (the only user code inside is the
    one forward, and what a backward runs: hooks, autograd Functions, a checkpointed
    segment's recomputation)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _trace(run: _Run, guard: ParamGuard) -> _Traced:
    """Run `loss_fn` under the module and op tracers (and the structure pass)."""
    modules = ModuleTracer(run.model, run.modules)
    if run.structure is not None:
        run.structure.set_module_lookup(modules.current)
    tracer = OpTracer(
        modules.current,
        params={id(p): p for _, p in run.named},
        before_param_write=guard.before_write,
        structure=run.structure,
    )
    try:
        with modules, tracer:
            raw = run.loss_fn()
    except Exception as exc:
        raise LossFnError(
            f"loss_fn raised {type(exc).__name__}: {exc} "
            "(its traceback is above; deadweight removed all of its hooks)"
        ) from exc
    loss = _validated_loss(raw)
    if run.structure is not None:
        run.structure.forward_done(loss)
    # Under FSDP2 the graph's leaves are the unsharded parameters swapped in for the
    # forward: they go by the sharded parameters' names.
    unsharded = sharded_flow.stand_ins(run.model, run.names_by_id) if run.shards else {}
    walk = (
        autograd_graph.walk([loss.grad_fn or loss])
        if loss.requires_grad
        else autograd_graph.GraphWalk()
    )
    traced = _Traced(loss, tracer, modules, walk, unsharded)
    if not loss.requires_grad:
        origin = tracer.scalar_origins.get(loss)
        if origin is not None:
            _, traced.site, traced.grad_enabled_at_site = origin
        else:
            traced.site = definition_site(run.loss_fn)
    return traced


def _backward_step(run: _Run, traced: _Traced) -> BackwardReach:
    error: str | None = None
    cuts: list[Cut] = []
    reached = traced.walk.leaves
    if traced.loss.requires_grad:
        outside = {
            i: t
            for leaves in (traced.walk.leaves, traced.tracer.leaves_inside_functions)
            for i, t in leaves.items()
            if i not in run.names_by_id
        }
        error, cuts, reached = _backward(
            traced.loss,
            traced.walk,
            [p for _, p in run.trainable],
            list(outside.values()),
            traced.tracer,
            run.names_by_id,
        )
    reached_ids = set(reached)
    reached_ids |= {i for i, leaf in traced.unsharded.items() if id(leaf) in reached_ids}
    if error is None:
        has_grad = {id(p): p.grad is not None for _, p in run.trainable}
    else:  # backward stopped half-way: what would have arrived is what is reachable
        has_grad = {id(p): id(p) in reached_ids for _, p in run.trainable}
    grads = {n: p.grad for n, p in run.trainable}
    return BackwardReach(error, cuts, reached_ids, has_grad, grads)


def _collect_cuts(run: _Run, traced: _Traced, flow: BackwardReach) -> list[Cut]:
    """The forward's candidate cuts: a loss without graph, the ops that cut it, and
    modules whose outputs never reached the loss."""
    cuts: list[Cut] = []
    tracer, walk = traced.tracer, traced.walk
    if not traced.loss.requires_grad:
        everything = frozenset(n for n, _ in run.trainable)
        cuts.append(Cut("loss-no-grad-fn", None, traced.site, None, everything))
    loss_taint = tracer.taint_of(traced.loss)
    for event in tracer.events:
        params = _upstream_params(event.roots, walk.nodes, run.names_by_id)
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
                    op_site=event.op_site,
                )
            )
    # A module output that feeds a cut whose result reaches the loss was not dropped:
    # that cut explains it. (One feeding only a logging .detach() was.)
    feeds_cuts = autograd_graph.walk(
        r for e in tracer.events if e.index in loss_taint for r in e.roots
    ).nodes
    consumed = walk.nodes | feeds_cuts
    cuts.extend(
        _module_cuts(
            run.model, traced.modules, walk.nodes, consumed, run.names_by_id, run.trainable
        )
    )
    return cuts


@dataclass
class _Probed:
    value: float
    loss_eps: float
    stats: dict[str, GradStats]  # per parameter with a gradient
    probes: dict[tuple[str, str], ProbeResult]
    probe_note: str | None
    structural: _Structural
    gated_by: dict[str, tuple[str, ...]] = field(default_factory=dict)  # zero gradient -> gates


@dataclass
class _Gradients:
    """What the checked backward left: the loss and the gradients' norms."""

    value: float  # the loss
    norms: dict[str, invariance.GradNorms]  # per parameter with a gradient
    failed: bool  # backward failed: what the statistics show is not the whole story
    # FSDP2: every statistic of every parameter, summed over the ranks' shards at once
    whole: dict[str, GradStats] | None = None

    def stats(
        self, with_grad: list[tuple[str, nn.Parameter]], flow: BackwardReach, wanted: set[str]
    ) -> dict[str, GradStats]:
        """Every statistic of each parameter with a gradient (`with_grad`, those in
        `norms`): <g, theta> and sum(g) only for those in `wanted`
        (`invariance.grad_stats`). From the gradients the checked backward left: a
        re-run since may have cleared `.grad`."""
        if self.whole is not None:
            return self.whole
        names = [n for n, _ in with_grad]
        return dict(
            zip(
                names,
                invariance.grad_stats(
                    [_checked_grad(flow, n) for n in names],
                    [p for _, p in with_grad],
                    [self.norms[n] for n in names],
                    [n in wanted for n in names],
                ),
                strict=True,
            )
        )


def _gradient_statistics(run: _Run, traced: _Traced, flow: BackwardReach) -> _Gradients:
    """The loss and the gradients' norms, in one transfer; under FSDP2 every statistic
    of the whole parameters, summed over the ranks' shards (`sharded_flow`)."""
    value = float(traced.loss.detach().float().item())
    failed = flow.error is not None
    if run.shards is not None:
        value, stats, failed = sharded_flow.whole_statistics(run.shards, run.trainable, flow, value)
        norms = {
            n: invariance.GradNorms(s.grad_norm, s.param_norm, s.exact_zero)
            for n, s in stats.items()
        }
        return _Gradients(value, norms, failed, whole=stats)
    with_grad = [(n, p) for n, p in run.trainable if flow.grads.get(n) is not None]
    found = invariance.gradient_norms(
        [_checked_grad(flow, n) for n, _ in with_grad], [p for _, p in with_grad]
    )
    return _Gradients(value, dict(zip([n for n, _ in with_grad], found, strict=True)), failed)


def _checked_grad(flow: BackwardReach, name: str) -> torch.Tensor:
    grad = flow.grads[name]
    assert grad is not None
    return grad


def _statistics_and_probes(
    run: _Run, traced: _Traced, flow: BackwardReach, guard: ParamGuard, gradients: _Gradients
) -> _Probed:
    """The structure pass's candidates confirmed and the numerical screens' candidates
    probed by re-running the forward, from the gradient statistics. Under FSDP2 every
    re-run is made by all ranks together (`sharded_flow`)."""
    loss = traced.loss
    value, norms, failed = gradients.value, gradients.norms, gradients.failed
    loss_eps = _screen_eps(loss)
    rerun = invariance.rerun_of(run.loss_fn, guard)
    capturing = _capturing_rerun(run.loss_fn, guard)
    agree: cancellation_confirmation.Agree | None = None
    if run.shards is not None:
        rerun = sharded_flow.on_all_ranks(run.model, run.shards, rerun)
        capturing = sharded_flow.capturing_on_all_ranks(run.model, run.shards, capturing)
        agree = sharded_flow.agreement(run.shards)
    with_grad = [(n, p) for n, p in run.trainable if n in norms]
    runnable = not failed and math.isfinite(value)
    found = _structure_found(run.structure, loss, with_grad, agree)
    screened = [(n, p) for n, p in with_grad if n in found.unstructured]
    # <g, theta> and sum(g): for the screens and for the evidence of the findings that
    # can show them (an exactly zero gradient, a cancellation). Taken before any
    # re-run: a loss_fn that zeroes the gradients in place would zero them.
    stats = gradients.stats(
        with_grad,
        flow,
        {n for n, _ in screened}
        | set(found.cancellations)
        | {n for n, g in norms.items() if g.exact_zero},
    )
    structural = _structure_confirmed(
        found, run.structure, with_grad, capturing, value, runnable, agree
    )
    if screened and _half(loss):
        structural = dataclasses.replace(
            structural,
            note="; ".join(
                n
                for n in (
                    structural.note,
                    f"{len(screened)} parameter(s) reach the {str(loss.dtype).removeprefix('torch.')} "
                    "loss through ops deadweight cannot see into: their numerical screens are "
                    "judged at float32's resolution, so a cancellation there can go unseen; "
                    "check once with the model in float32 to be sure",
                )
                if n
            ),
        )
    if run.shards is not None:
        probes, note = sharded_flow.screen_and_confirm_on_all_ranks(
            screened, stats, value, loss_eps, rerun, runnable
        )
        gated: dict[str, tuple[str, ...]] = {}  # the gates' walk reads local gradients
    else:
        probes, note = invariance.screen_and_confirm(
            screened, stats, value, loss_eps, rerun, runnable
        )
        gated = _gates_at_init(loss, with_grad, stats)
    return _Probed(value, loss_eps, stats, probes, note, structural, gated)


def _half(loss: torch.Tensor) -> bool:
    return loss.dtype in (torch.float16, torch.bfloat16)


def _screen_eps(loss: torch.Tensor) -> float:
    """The resolution the numerical screens judge the loss at: its dtype's, but never
    coarser than float32's. A bfloat16 loss rounds to 2^-8 of itself, far coarser than
    the gradients and activations behind it (computed with float32 accumulators): at
    its own resolution, 16 of its ulps (12% of the loss) would call healthy small
    gradients noise, and 32 would pass a 25% change of the loss as none. Judged at
    float32's, half precision errs the other way: a cancellation that only these
    screens can see may go unseen, and the report says so."""
    if not loss.is_floating_point():
        return 0.0
    return min(float(torch.finfo(loss.dtype).eps), FLOAT32_EPS)


def _gates_at_init(
    loss: torch.Tensor, with_grad: list[tuple[str, nn.Parameter]], stats: dict[str, GradStats]
) -> dict[str, tuple[str, ...]]:
    """Parameters with an exactly zero gradient -> the zero-initialised gate before them."""
    silent = {id(p): n for n, p in with_grad if stats[n].exact_zero}
    if not silent:
        return {}
    live = [(n, p) for n, p in with_grad if not stats[n].exact_zero]  # a gate learns
    zero = gates_module.zero_valued(live)
    gates = {id(p): n for n, p in live if id(p) in zero}
    return gates_module.gated_by(loss, gates, silent)


def _assemble(
    run: _Run,
    optimizer: torch.optim.Optimizer | None,
    traced: _Traced,
    flow: BackwardReach,
    probed: _Probed,
    cuts: list[Cut],
    param_writes: list[ParamWrite],
) -> GradFlowStats:
    lost_versions = unrestored_versions()
    state_note = (
        f"the autograd version counters of {lost_versions} tensor(s) could not be put back: "
        "a graph built before the check that saved them will refuse to backward"
        if lost_versions
        else None
    )
    model = run.model
    in_opt = _optimizer_param_ids(optimizer)
    # Walked again, after the forward and any re-run: they may have replaced a
    # module or a parameter (a registry entry rebound inside the forward)
    roles = param_roles.parameter_roles(model)
    structural = probed.structural
    return GradFlowStats(
        invariance=probed.probes,
        probe_note=probed.probe_note,
        cancellations=structural.cancellations,
        influencing=structural.influencing,
        unstructured=structural.unstructured,
        structure_note=structural.note,
        gated_by=probed.gated_by,
        loss_eps=probed.loss_eps,
        optimizer_facts=optimizer_facts(model, optimizer) if optimizer is not None else None,
        model=type(model).__name__,
        model_training=model.training,
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        loss=LossInfo(
            value=probed.value,
            finite=math.isfinite(probed.value),
            has_graph=traced.loss.requires_grad,
            site=traced.site,
            grad_enabled_at_site=traced.grad_enabled_at_site,
        ),
        params=[
            ParamInfo(
                name=n,
                module=n.rpartition(".")[0],
                shape=tuple(p.shape),
                dtype=str(p.dtype).removeprefix("torch."),
                trainable=p.requires_grad,
                has_grad=flow.has_grad.get(id(p), False),
                reaches_loss=id(p) in flow.reached,
                in_optimizer=(id(p) in in_opt) if in_opt is not None else None,
                numel=p.numel(),
                role=roles.get(n, _REMOVED)[0],
                module_type=roles.get(n, _REMOVED)[1],
                grad=probed.stats.get(n),
                pinned=hasattr(p, "_deadweight_pin"),
                moved_since_pin=p._deadweight_pin.moved()
                if hasattr(p, "_deadweight_pin")
                else None,
            )
            for n, p in run.named
        ],
        cuts=cuts,
        backward_error=flow.error,
        grads=flow.grads,
        param_writes=param_writes,
        state_note=state_note,
    )


# The role of a parameter the forward took out of the model (a module deleted or
# replaced there): nothing owns it any more.
_REMOVED = (param_roles.OTHER, "")


@dataclass(frozen=True)
class _Structural:
    cancellations: dict[str, Cancellation]
    influencing: frozenset[str]
    unstructured: frozenset[str]
    note: str | None


def _structure_found(
    structure: StructureTracker | None,
    loss: torch.Tensor,
    with_grad: list[tuple[str, nn.Parameter]],
    agree: cancellation_confirmation.Agree | None,
) -> _Structural:
    """The structure pass's candidates, not yet confirmed (`_structure_confirmed`)."""
    names = frozenset(n for n, _ in with_grad)
    found = None
    if structure is not None and structure.failed is None:
        found = structure.result(loss, lambda i: structure.param_names[i] in names)
    if agree is not None and not _ranks_agree(found, agree):
        # Each rank ran its own batch, and the ranks' passes did not conclude alike (a
        # data-dependent route, a failure on one rank): the numerical screens decide,
        # from statistics every rank shares.
        return _Structural({}, frozenset(), names, "structure pass off: the ranks disagree")
    if structure is None or found is None:
        note = f"structure pass off: {structure.failed}" if structure is not None else None
        return _Structural({}, frozenset(), names, note)
    candidates = {n: c for n, c in found.cancellations.items() if n in names}
    return _Structural(candidates, found.influencing, found.opaque & names, None)


def _structure_confirmed(
    found: _Structural,
    structure: StructureTracker | None,
    with_grad: list[tuple[str, nn.Parameter]],
    rerun: cancellation_confirmation.Rerun,
    value: float,
    runnable: bool,
    agree: cancellation_confirmation.Agree | None,
) -> _Structural:
    """The structure pass's candidates, each confirmed by re-running the forward."""
    candidates = found.cancellations
    if not candidates or structure is None:
        return found
    note = None
    if runnable:
        candidates = cancellation_confirmation.confirm_by_op_outputs(
            candidates,
            dict(with_grad),
            structure.outputs,
            rerun,
            value,
            agree=agree,
        )
        if any(cancellation_confirmation.not_reproducible(c) for c in candidates.values()):
            note = (
                "structural candidates not confirmed: re-running loss_fn gave other "
                "outputs; make it use one fixed batch"
            )
    else:
        note = "structural candidates not confirmed: the loss is not finite or backward failed"
    return dataclasses.replace(found, cancellations=candidates, note=note)


def _ranks_agree(found: StructureResult | None, agree: cancellation_confirmation.Agree) -> bool:
    """Whether every rank's structure pass found the same candidates and opaque
    parameters (a checksum of the names, compared by one reduction)."""
    if found is None:
        key = -1.0
    else:
        text = "\n".join([*sorted(found.cancellations), "", *sorted(found.opaque)])
        key = float(zlib.crc32(text.encode("utf-8", "surrogatepass")))
    largest, negated_smallest = agree([key, -key])
    return largest == -negated_smallest


def _capturing_rerun(
    loss_fn: LossFn, guard: Any
) -> Callable[
    [set[tuple[str, int]]], tuple[float | None, dict[tuple[str, int], torch.Tensor]] | None
]:
    """`loss_fn` re-run under no_grad on the checked run's RNG state, keeping the outputs
    of the given calls (`cancellation_confirmation.OutputCapture`); None when it raises."""

    def rerun(
        targets: set[tuple[str, int]],
    ) -> tuple[float | None, dict[tuple[str, int], torch.Tensor]] | None:
        guard.reset_rng()
        capture = cancellation_confirmation.OutputCapture(targets, op_name)
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
        with (
            grads_set_aside(other_leaves),
            post_accumulate_hooks_suspended(params),
            wrappers.megatron_grad_hooks_suspended(params),
            watch,
        ):
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
    trainable_names = sorted(n for n, _ in trainable)
    cuts = []
    ran = modules.calls
    # Containers (ModuleList, ModuleDict) are never called themselves: a module took
    # part in the forward if it, or anything below it, ran.
    ran_or_above = {""} | took_part(ran)
    # Walked again, after the forward: a forward may have replaced or removed a module
    by_path = dict(model.named_modules())
    for path, module in by_path.items():
        if not path:
            continue
        if path not in ran_or_above:
            if path.rpartition(".")[0] in ran_or_above:  # the outermost module that sat out
                params = names_under(trainable_names, path)
                if params:
                    site = definition_site(module)
                    detail = _routing(by_path, path, ran)
                    cuts.append(
                        Cut("never-ran", type(module).__name__, site, path, params, detail=detail)
                    )
            continue
        record = ran.get(path)
        if record is None:
            continue
        if record.output_nodes and not any(n in consumed_nodes for n in record.output_nodes):
            params = names_under(trainable_names, path)
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


def names_under(sorted_names: list[str], path: str) -> frozenset[str]:
    """The parameter names under module `path`, from all names sorted. Those under a
    prefix are one run of the sorted list: found by bisection, where a scan of every
    name for every module cost modules x parameters in a deep model."""
    # `Encoder:` is one of several models, named `Encoder:fc.weight` (deadweight run)
    prefix = path if not path or path.endswith(":") else path + "."
    start = end = bisect.bisect_left(sorted_names, prefix)
    while end < len(sorted_names) and sorted_names[end].startswith(prefix):
        end += 1
    return frozenset(sorted_names[start:end])


def _routing(modules: dict[str, nn.Module], path: str, ran: dict[str, Any]) -> str:
    """For a module in a ModuleList / ModuleDict whose siblings ran (the experts of a
    mixture): how many rows each sibling ran on, and the router, a Linear beside
    the container with one output per member. "" when it is not that layout."""
    container_path, _, _ = path.rpartition(".")
    container = modules.get(container_path)
    if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
        return ""
    members = [f"{container_path}.{k}" for k, _ in container.named_children()]
    counts = [(m, ran[m].rows) for m in members if m in ran]
    if not counts:
        return ""
    leaf = container_path.rpartition(".")[2]
    shown = [f"{leaf}.{m.rpartition('.')[2]}" for m, _ in counts]
    routed = ", ".join(
        f"{name} ran on {rows} rows" if i == 0 else f"{name} on {rows}"
        for i, (name, (_, rows)) in enumerate(zip(shown, counts, strict=True))
    )
    text = f"routing: {routed}, {leaf}.{path.rpartition('.')[2]} on none"
    block = modules.get(container_path.rpartition(".")[0])  # "" is the model itself
    if block is not None:
        routers = [
            name
            for name, child in block.named_children()
            if isinstance(child, nn.Linear) and child.out_features == len(container)
        ]
        if len(routers) == 1:
            text += f"; router `{routers[0]}`"
    return text


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


__all__ = ["measure_grad_flow", "tensors_in"]
