"""`deadweight.check`: one forward and backward of a live model, judged by the DW1xx rules."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import FrameType
from typing import Any

import torch
from torch import nn

from deadweight import wrappers
from deadweight.checking import random_skips
from deadweight.checking.check_stats import GradFlowStats, Site
from deadweight.checking.first_backward import (
    BackwardParam,
    RecordedForward,
    first_backward_findings,
)
from deadweight.checking.flow_measurement import measure_grad_flow
from deadweight.checking.sites import user_site
from deadweight.config import ConfigLike, applies_settings
from deadweight.distributed import ranks as distributed
from deadweight.distributed.rules._ranks import merge_rank_findings
from deadweight.errors import CollectiveError, InputError
from deadweight.findings import Finding
from deadweight.registry import Selection, rules_consuming
from deadweight.report import Report
from deadweight.thresholds import Thresholds


@applies_settings
def check(
    model: nn.Module,
    loss_fn: Callable[[], Any],
    optimizer: Any = None,
    *,
    select: Iterable[str] | str | None = None,
    ignore: Iterable[str] | str | None = None,
    config: ConfigLike = None,
    thresholds: Thresholds | Mapping[str, Any] | None = None,
) -> Report:
    """Check that every trainable parameter of `model` gets a gradient, and why not.

    `loss_fn` is a zero-argument callable returning the scalar loss, like an
    optimizer closure: ``lambda: F.cross_entropy(model(x), y)``. It is run once with
    one backward, and re-run under no_grad only to confirm candidates for a
    cancelled parameter (one re-run per group of them, typically; a healthy model
    takes 1 call in all); the optimizer is never stepped. Parameters (values and
    autograd version counters), their `.grad`, buffers, train/eval modes and RNG
    states are left as they were, so a graph the caller built before the check
    still backwards after it, and no hook is left behind, also when `loss_fn` raises
    (`LossFnError`, chained to the original). A forward that writes to parameters
    itself (`.data`, under no_grad) is undone and reported (DW109).

    `select` / `ignore` take rule codes (`DW101`), code prefixes (`DW1`) or names.
    `config` reads the project configuration (True: the nearest deadweight.toml or
    `[tool.deadweight]`; or a path, or `deadweight.load_config()`): its select, ignore
    and thresholds apply unless given here. `thresholds` sets some of them, e.g.
    ``{"noise-floor-ulps": 32}``; `deadweight config` lists them.

    Framework wrappers are looked through: accelerate's, Lightning's and Fabric's
    optimizers, a DeepSpeed engine, a DDP or `torch.compile`d model (parameters keep
    the names of the user's own module). Compiled code runs eagerly during the check
    (`torch.compiler.set_stance("force_eager")`), so a compiled model gets the
    findings, source lines included, of the same model uncompiled.

    Under torch.distributed (a DDP-wrapped model, or any model once the process
    group spans several ranks) call it on every rank: each rank checks its own
    forward and backward without talking to the others, then the ranks exchange
    per-parameter flags and their findings over a gloo group of deadweight's own,
    with a timeout. Every rank returns the same report: findings seen on every rank
    read as in a single process, the others carry the ranks they were seen on,
    and DW108 / DW207 report parameters the ranks disagree on.

    An FSDP2 model (`fully_shard`, DTensor parameters) runs its forward and backward
    together on all ranks as in training; the gradient statistics are summed over
    the ranks' local shards by one collective of a few numbers per parameter, so
    the report is that of the whole parameters and the whole batch. The functional
    probes (which confirm a parameter the loss ignores) run there too, on all ranks
    together: each re-runs `loss_fn` on every rank with the sharded parameters
    changed in place and compares the mean of the ranks' losses, so every rank runs
    the same probes. A rank whose `loss_fn` raises in a probe makes that probe
    impossible on every rank.
    """
    selection = Selection.of(select, ignore)
    if not isinstance(model, nn.Module):  # before the wrappers are looked into
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if wrappers.deepspeed_engine(model):
        # Its gradient hooks would run in the check's backward (reducing and
        # partitioning gradients mid-step), and it refuses a plain backward anyway.
        raise InputError(
            "deadweight.check cannot run its backward through a DeepSpeed engine: call it "
            "on the model before deepspeed.initialize() (watch works on the engine)"
        )
    if optimizer is not None:  # a framework's wrapper: the torch optimizer inside it
        optimizer = wrappers.torch_optimizer(optimizer) or optimizer
    # Distributed: one call before measuring, one after (`_combine_ranks`).
    with distributed.layout_for_check(model) as layout, _eager(), wrappers.own_backward(model):
        # FSDP2: statistics are summed over the local shards inside the measurement.
        user_model = wrappers.user_model(model)

        def measure() -> GradFlowStats:
            return measure_grad_flow(user_model, loss_fn, optimizer, shards=layout.shards)

        # Sharded ranks run one forward together: they cannot redraw on their own.
        stats = (
            random_skips.measure_over_draws(measure, user_model, loss_fn)
            if layout.shards is None and isinstance(user_model, nn.Module)
            else measure()
        )
    findings = [f for r in rules_consuming(GradFlowStats) for f in r.judge(stats)]
    trainable = [p for p in stats.params if p.trainable]
    extra: dict[str, Any] = {}
    if stats.state_note is not None:
        extra["state_note"] = stats.state_note
    # What the check could not do, or did only in part: said beside the findings, so an
    # empty report never reads as a clean one where it was not.
    notes = [n for n in (stats.structure_note, stats.probe_note, stats.state_note) if n]
    if notes:
        extra["notes"] = notes
    if layout.ranks is not None:
        findings, extra["distributed"] = _combine_ranks(layout, model, stats, findings)
    return Report.of(
        "check",
        selection.filter(findings),
        subject={
            "model": stats.model,
            "parameters": len(stats.params),
            "trainable": len(trainable),
            "numel": sum(_numel(p.shape) for p in trainable),
            "loss": stats.loss.value,
            "optimizer": stats.optimizer,
            "training_mode": stats.model_training,
            **extra,
        },
    )


def _combine_ranks(
    layout: distributed.Layout, model: nn.Module, stats: GradFlowStats, local: list[Finding]
) -> tuple[list[Finding], dict[str, Any]]:
    """Every rank's findings merged, plus the cross-rank rules; marked incomplete on failure."""
    ranks = layout.ranks
    assert ranks is not None
    names = [p.name for p in stats.params]
    summary: dict[str, Any] = {**ranks.describe(), "complete": True}
    if layout.shards is not None:
        summary.update(sharded=True, note=stats.probe_note)
    try:
        distributed.check_same_names(ranks, names, "check")
        rows = [[p.has_grad for p in stats.params]]
        if stats.optimizer is not None:
            rows.append([bool(p.in_optimizer) for p in stats.params])
        flags = distributed.per_rank_flags(ranks, rows, "check: gradient flags")
        presence = distributed.RankPresence(
            names=tuple(names),
            world_size=ranks.world_size,
            trainable=tuple(p.trainable for p in stats.params),
            has_grad=flags[:, 0],
            in_optimizer=flags[:, 1] if stats.optimizer is not None else None,
            wrapper="FSDP2" if distributed.uses_fsdp2(model) else type(model).__name__,
        )
        per_rank = distributed.all_gather_objects(ranks, local, "check: findings")
    except CollectiveError as exc:
        # The other ranks are gone or stuck: this rank's own findings are still true.
        summary.update(complete=False, error=str(exc))
        return local, summary
    merged = merge_rank_findings(per_rank)
    merged += [f for r in rules_consuming(distributed.RankPresence) for f in r.judge(presence)]
    return merged, summary


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """Inside: `torch.compile`d code runs eagerly, so the check sees every op of the
    forward with its source line, exactly as for the uncompiled model, and causes no
    recompilation or graph break in the user's compiled code. The check's own module
    hooks are global; a compiled module's warning about them is about the check, not
    about the user's code, and is not shown."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    stance = set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()
    with stance, warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"Using `torch\.compile\(module\)` when there are global hooks"
        )
        yield


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def caller_site(frame: FrameType | None) -> Site | None:
    """The user's line at or outside `frame` (torch's and deadweight's own frames are
    skipped): where a module was called, for `deadweight run`'s record of a forward."""
    return user_site(frame)


__all__ = [
    "BackwardParam",
    "RecordedForward",
    "caller_site",
    "check",
    "first_backward_findings",
]
