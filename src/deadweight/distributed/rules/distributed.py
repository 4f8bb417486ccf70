"""Rules about ranks that disagree: gradients or optimizer coverage present on some ranks only."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from deadweight.distributed.rank_stats import RankPresence
from deadweight.findings import Finding, Severity
from deadweight.registry import get_rule, rule
from deadweight.watching.watch_stats import WatchStats

if TYPE_CHECKING:  # torch is imported where a presence is built, not to load the rules
    import torch


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _split(
    presence: RankPresence, flags: torch.Tensor, only_trainable: bool
) -> dict[tuple[tuple[int, ...], tuple[int, ...]], list[str]]:
    """(ranks with, ranks without) -> parameter names, for parameters the ranks disagree on."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[str]] = defaultdict(list)
    for j, name in enumerate(presence.names):
        if only_trainable and not presence.trainable[j]:
            continue
        with_ = tuple(presence.ranks_where(flags, j, True))
        without = tuple(presence.ranks_where(flags, j, False))
        if with_ and without:
            groups[(with_, without)].append(name)
    return groups


@rule(
    code="DW108",
    name="rank-dependent-gradient",
    severity=Severity.ERROR,
    summary="A parameter gets a gradient on some ranks and not on others.",
    consumes=RankPresence,
)
def rank_dependent_gradient(presence: RankPresence) -> Iterator[Finding]:
    """
    ## What it does
    Under torch.distributed, runs the check on every rank and compares which
    parameters got a gradient from each rank's own forward and backward. A
    parameter that gets one on some ranks and not on others is reported with both
    lists of ranks.

    ## Why is this bad
    DDP expects every rank to produce a gradient for the same parameters. Without
    `find_unused_parameters=True` it stops at the next iteration with "Expected to
    have finished reduction in the prior iteration". With it, DDP goes on silently
    and averages in zeros for the ranks that had no gradient, so the parameter's
    update shrinks by the fraction of ranks that skipped it, and how much it learns
    depends on how many GPUs the job ran on. A branch taken only on rank 0 (a
    logging path, a rank-dependent data subset, an `if rank == 0` in the forward) is
    the usual cause.

    ## Example
    ```python
    def forward(self, x):
        h = self.body(x)
        if dist.get_rank() == 0:      # only rank 0 runs the probe head
            h = h + self.probe(h)
        return self.head(h)
    # DW108: probe.weight, probe.bias get a gradient on rank 0 but not on rank 1
    ```

    ## Fix
    Make every rank run the same modules in the forward. If a branch really must be
    rank-dependent, take it out of the trained model (run it under no_grad on a
    detached copy) so that DDP's parameter set is the same everywhere.

    ## Evidence
    - `ranks_with_gradient`, `ranks_without_gradient`: which ranks saw a gradient.
    - `world_size`: the number of ranks.
    - `wrapper`: the model's wrapper class (DistributedDataParallel, ...).
    """
    if presence.has_grad is None:
        return
    world = presence.world_size
    for (with_, without), names in _split(presence, presence.has_grad, True).items():
        n = len(names)
        share = f"{len(with_)}/{world}"
        message = (
            f"{n} parameter{'s' if n > 1 else ''} get{'' if n > 1 else 's'} a gradient on "
            f"{_ranks(list(with_))} but not on {_ranks(list(without))} (of {world}): "
            "DDP without find_unused_parameters=True stops with 'Expected to have "
            "finished reduction'; with it, DDP averages in zeros from the ranks without "
            f"a gradient, so the update is {share} of its size."
        )
        yield get_rule("DW108").finding(
            message,
            params=names,
            evidence={
                "ranks_with_gradient": list(with_),
                "ranks_without_gradient": list(without),
                "world_size": world,
                "wrapper": presence.wrapper,
            },
        )


@rule(
    code="DW207",
    name="optimizer-differs-across-ranks",
    severity=Severity.ERROR,
    summary="The optimizer covers different parameters on different ranks.",
    consumes=RankPresence,
)
def optimizer_differs_across_ranks(presence: RankPresence) -> Iterator[Finding]:
    """
    ## What it does
    Under torch.distributed, compares which parameters each rank's optimizer holds
    and reports the parameters that some ranks' optimizers step and others' do not.

    ## Why is this bad
    Data parallel training keeps every replica identical only if every rank applies
    the same update. A parameter stepped on rank 0 and left alone on rank 1 (an
    optimizer built from a rank-dependent filter, a parameter group added on one
    rank after a checkpoint load) makes the replicas drift apart; DDP averages the
    gradients but does not compare the parameters, so nothing fails.

    ## Example
    ```python
    params = [p for n, p in model.named_parameters() if rank == 0 or "head" not in n]
    opt = torch.optim.AdamW(params)   # rank 1 never updates the head
    ```

    ## Fix
    Build the optimizer from the same parameter list on every rank; with FSDP2 and
    DDP that is `model.parameters()` of the wrapped model, filtered identically.

    ## Evidence
    - `ranks_in_optimizer`, `ranks_not_in_optimizer`: which ranks' optimizers hold the parameters.
    - `world_size`: the number of ranks.
    """
    if presence.in_optimizer is None:
        return
    world = presence.world_size
    for (with_, without), names in _split(presence, presence.in_optimizer, False).items():
        n = len(names)
        yield get_rule("DW207").finding(
            f"{n} parameter{'s' if n > 1 else ''} {'are' if n > 1 else 'is'} in the "
            f"optimizer on {_ranks(list(with_))} but not on {_ranks(list(without))} "
            f"(of {world}): the replicas stop being identical after the first step.",
            params=names,
            evidence={
                "ranks_in_optimizer": list(with_),
                "ranks_not_in_optimizer": list(without),
                "world_size": world,
            },
        )


def presence_from_watch(stats: WatchStats) -> RankPresence | None:
    """What a watch saw of the ranks' optimizers, as DW207 reads it."""
    event = stats.rank_params
    if event is None:
        return None
    import torch

    held = torch.tensor(event["held"], dtype=torch.bool)
    return RankPresence(
        names=tuple(event["names"]),
        world_size=held.shape[0],
        trainable=tuple(True for _ in event["names"]),
        has_grad=None,
        in_optimizer=held,
        wrapper="",
    )


@rule(
    code="DW308",
    name="replica-divergence",
    severity=Severity.ERROR,
    summary="A parameter that data parallelism keeps identical on every rank differs between ranks.",
    consumes=WatchStats,
)
def replica_divergence(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Under DDP, at every watched step, compares a checksum of each parameter's
    bits across ranks (one small all-reduce: four numbers per parameter tensor) and
    reports the parameters whose copies differ, with the ranks grouped by the copy
    they hold and the spread of the copies' norms. Copies are compared among the
    ranks that should hold them: a DDP wrapper built on a process group of some
    ranks is compared within that group, and under HSDP (FSDP2 on a 2-D mesh)
    each shard among the ranks that replicate it. Plain FSDP2 holds no copies.

    ## Why is this bad
    DDP averages gradients but never compares parameters: it assumes every rank
    applies the same update to the same values. Anything that breaks that (an
    optimizer step on one rank only, a parameter written in place on rank 0, a
    non-deterministic update, a checkpoint loaded on some ranks) makes the replicas
    drift apart silently. Each rank then trains a different model, and the
    checkpoint saved from rank 0 is not the model the other ranks evaluated.

    ## Example
    ```python
    if rank == 0:
        with torch.no_grad():
            model.module.head.weight.mul_(0.5)   # rank 0 only
    # DW308: head.weight differs across ranks (rank 0 vs ranks 1)
    ```

    ## Fix
    Apply every change to the parameters on all ranks alike, and load checkpoints
    on every rank (or broadcast from rank 0 after loading).

    ## Evidence
    - `first_step`, `last_step`: the watched steps the replicas differed at.
    - `groups`: the ranks grouped by the value they hold.
    - `norm_min`, `norm_max`, `norm_spread`: the parameter's norm across the ranks.
    - `world_size`: the number of ranks holding copies (the world under plain DDP).
    """
    for name, seen in stats.replicas.items():
        groups = seen["groups"]
        split = " vs ".join(
            f"rank{'s' if len(g) > 1 else ''} {', '.join(map(str, g))}" for g in groups
        )
        yield get_rule("DW308").finding(
            f"`{name}` differs across its {seen['world_size']} replicas from step "
            f"{seen['first_step']} on ({split}); its norm ranges from "
            f"{seen['norm_min']:.6g} to {seen['norm_max']:.6g}.",
            params=[name],
            evidence={k: v for k, v in seen.items()},
        )
