"""`deadweight.check`: one forward and backward of a live model, judged by the DW1xx rules."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from deadweight.probes.grad_flow import GradFlowStats, measure_grad_flow
from deadweight.registry import Selection, rules_consuming
from deadweight.report import Report


def check(
    model: nn.Module,
    loss_fn: Callable[[], Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    select: Iterable[str] | str | None = None,
    ignore: Iterable[str] | str | None = None,
) -> Report:
    """Check that every trainable parameter of `model` gets a gradient, and why not.

    `loss_fn` is a zero-argument callable returning the scalar loss, like an
    optimizer closure: ``lambda: F.cross_entropy(model(x), y)``. It is run once with
    one backward; the optimizer is never stepped. Parameters, their `.grad`,
    buffers, train/eval modes and RNG states are left as they were, and no hook is
    left behind, also when `loss_fn` raises (`LossFnError`, chained to the original).

    `select` / `ignore` take rule codes (`DW101`), code prefixes (`DW1`) or names.
    """
    selection = Selection.of(select, ignore)
    stats = measure_grad_flow(model, loss_fn, optimizer)
    findings = [f for r in rules_consuming(GradFlowStats) for f in r.judge(stats)]
    trainable = [p for p in stats.params if p.trainable]
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
        },
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
