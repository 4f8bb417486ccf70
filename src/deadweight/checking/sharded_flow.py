"""Gradient flow on sharded parameters (FSDP2, DTensor): every rank measures together.

`measure_grad_flow` calls in here when the model holds DTensor parameters: after
the forward, to name the unsharded stand-ins the forward used (`stand_ins`); then
for the whole parameters' statistics (`whole_statistics`), and for re-runs of the
loss that every rank makes together, to confirm the structure pass's candidates
(`capturing_on_all_ranks`, each measured change agreed on by `agreement`) and to
probe the rest (`on_all_ranks`, `screens`). Nothing here runs for a model in one
process.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from deadweight.checking import cancellation_confirmation, invariance
from deadweight.checking.backward_reach import BackwardReach
from deadweight.checking.check_stats import GradStats, ProbeResult
from deadweight.distributed import ranks as distributed
from deadweight.errors import CollectiveError


def stand_ins(model: nn.Module, names_by_id: dict[int, str]) -> dict[int, torch.Tensor]:
    """Sharded parameter id -> the unsharded leaf FSDP2 swapped in for the forward;
    each leaf is named (in `names_by_id`) as its sharded parameter."""
    unsharded = distributed.fsdp2_unsharded(model)
    for sharded_id, leaf in unsharded.items():
        if sharded_id in names_by_id:
            names_by_id.setdefault(id(leaf), names_by_id[sharded_id])
    return unsharded


def whole_statistics(
    shards: distributed.Shards,
    trainable: list[tuple[str, nn.Parameter]],
    flow: BackwardReach,
    value: float,
) -> tuple[float, dict[str, GradStats], bool]:
    """The whole parameters' gradient statistics, the loss of the whole batch and
    whether backward failed on any rank, in one collective; `flow`'s gradient
    presence and reach become "on any rank"."""
    return _sum_over_shards(
        shards, trainable, flow.has_grad, flow.reached, value, flow.error is not None
    )


def on_all_ranks(
    model: nn.Module, shards: distributed.Shards, local_rerun: Callable[[], float | None]
) -> Callable[[], float | None]:
    """A re-run of the loss made by every rank together: the shards as they are now are
    gathered afresh, and the result is the mean of the ranks' losses (None on every
    rank when one rank's loss_fn raised or gave no finite loss)."""

    def rerun() -> float | None:
        distributed.fsdp2_reshard(model)
        try:
            mine = local_rerun()
        finally:
            distributed.fsdp2_reshard(model)
        return shards.mean(mine, "check: probe loss")

    return rerun


def capturing_on_all_ranks(
    model: nn.Module, shards: distributed.Shards, local_rerun: cancellation_confirmation.Rerun
) -> cancellation_confirmation.Rerun:
    """The confirming re-run (the loss and the cancelling ops' outputs on this rank's
    batch) made by every rank together; None on every rank when one rank failed."""

    def rerun(
        targets: set[tuple[str, int]],
    ) -> tuple[float | None, cancellation_confirmation.Outputs] | None:
        distributed.fsdp2_reshard(model)
        try:
            mine = local_rerun(targets)
        finally:
            distributed.fsdp2_reshard(model)
        world = shards.ranks.world_size if shards.ranks is not None else 1
        loss = None if mine is None else mine[0]
        finite = loss is not None and math.isfinite(loss)
        row = torch.tensor(
            [loss / world if finite else 0.0, float(not finite), float(mine is None)],  # type: ignore[operator]
            dtype=torch.float64,
        )
        total = shards.sum(row, "check: confirming re-run").tolist()
        if total[2] > 0 or mine is None:
            return None
        return (None if total[1] > 0 else float(total[0])), mine[1]

    return rerun


def agreement(shards: distributed.Shards) -> cancellation_confirmation.Agree:
    """Each measured change, the largest over the ranks: every rank judges alike."""

    def agree(values: list[float]) -> list[float]:
        if shards.ranks is None or not values:
            return values
        finite = torch.tensor(
            [v if math.isfinite(v) else _HUGE for v in values], dtype=torch.float64
        )
        largest = distributed.all_reduce(shards.ranks, finite, "max", "check: confirmation")
        return [math.inf if v >= _HUGE else v for v in largest.tolist()]

    return agree


# Stands for inf in a reduction (gloo's MAX over inf is fine, NaN is not: keep it plain).
_HUGE = 1e300


def screen_and_confirm_on_all_ranks(
    with_grad: list[tuple[str, nn.Parameter]],
    stats: dict[str, GradStats],
    loss: float,
    loss_eps: float,
    rerun: Callable[[], float | None],
    runnable: bool,
) -> tuple[dict[tuple[str, str], ProbeResult], str | None]:
    """The numerical screens and their loss probes for the parameters the structure
    pass could not follow, run by every rank together (`rerun` from `on_all_ranks`).

    Which probes run depends only on the whole parameters' statistics and the ranks'
    mean losses, so every rank runs the same ones in the same order. A rank that
    fails inside its forward, before FSDP2's own collectives, holds the others there
    until the process group's timeout; deadweight's collective then fails within its
    own.
    """
    try:
        return invariance.screen_and_confirm(
            with_grad, stats, loss, loss_eps, rerun, runnable=runnable
        )
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
