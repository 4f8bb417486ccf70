"""What a training script's own first backward proves, without running anything again.

`deadweight run`'s step-0 check replays the script's first training forward; where it
cannot (or where the replay left parameters of the stepping optimizer out), what is
certain still comes from the script's real backward: which parameters got no
gradient, and, from the module forwards recorded before it, the module that explains
it (one whose output never reached the loss, one that returned no graph, one the
loss reached while parameters inside it got nothing). These become a
`GradFlowStats` judged by DW101 and DW102, as check's own measurement would be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deadweight.checking.check_stats import Cut, GradFlowStats, LossInfo, ParamInfo, Site
from deadweight.findings import Finding
from deadweight.registry import get_rule

# The rules that judge what a backward alone shows (the others need a replay).
RULES = ("DW101", "DW102")


@dataclass(frozen=True)
class RecordedForward:
    """One outermost module forward that ran with gradients before the backward."""

    module: str  # its path, as the watch names it
    module_type: str
    site: Site | None  # the user's line that called it
    params: tuple[str, ...]  # the trainable parameters under it
    reached: bool  # the loss's graph reaches one of its outputs
    has_graph: bool  # one of its floating outputs has a grad_fn


@dataclass(frozen=True)
class BackwardParam:
    name: str
    shape: tuple[int, ...]
    dtype: str
    has_grad: bool


def first_backward_findings(
    model: str,
    optimizer: str | None,
    params: list[BackwardParam],
    forwards: list[RecordedForward],
) -> list[Finding]:
    """DW101 for the parameters that got no gradient, each explained where a recorded
    forward explains it (DW102 at the module and the line that called it)."""
    missing = {p.name for p in params if not p.has_grad}
    if not missing:
        return []
    cuts = []
    for forward in forwards:
        cut_off = frozenset(n for n in forward.params if n in missing)
        if not cut_off:
            continue
        if not forward.has_graph:
            kind = "module-cut"
        elif not forward.reached:
            kind = "output-unused"
        else:
            kind = "cut-inside"
        cuts.append(Cut(kind, forward.module_type, forward.site, forward.module, cut_off))
    stats = GradFlowStats(
        model=model,
        model_training=True,
        optimizer=optimizer,
        loss=LossInfo(value=None, finite=True, has_graph=True, site=None),
        params=[
            ParamInfo(
                name=p.name,
                module=p.name.rpartition(".")[0],
                shape=p.shape,
                dtype=p.dtype,
                trainable=True,
                has_grad=p.has_grad,
                reaches_loss=p.has_grad,
                in_optimizer=True,
                numel=math.prod(p.shape),
            )
            for p in params
        ],
        cuts=cuts,
    )
    return [f for code in RULES for f in get_rule(code).judge(stats)]
