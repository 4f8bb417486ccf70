"""How often `check` calls `loss_fn` is what the README says it is."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import deadweight
from deadweight.demos import fused_rmsnorm, layer_scalar_drift
from tests.checking.test_check_backward_after import GainBeforeNorm

README = " ".join((Path(__file__).parents[2] / "README.md").read_text().split())


def _calls(model: nn.Module, loss: Callable[[], torch.Tensor], opt=None) -> int:  # type: ignore[no-untyped-def]
    n = [0]

    def loss_fn() -> torch.Tensor:
        n[0] += 1
        return loss()

    deadweight.check(model, loss_fn, opt)
    return n[0]


def _stated() -> tuple[int, int, int]:
    """(healthy, first seed demo, second seed demo) as the README states them."""
    m = re.search(
        r"A healthy model takes (\d+) calls?, as does the first seed demo; "
        r"the second \([^)]*\) takes (\d+)\.",
        README,
    )
    assert m, "the README's loss_fn call counts moved: update this test with them"
    return int(m.group(1)), int(m.group(1)), int(m.group(2))


def test_call_counts_are_the_readmes() -> None:
    healthy, first, second = _stated()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(5, 4)
    assert _calls(model, lambda: model(x).pow(2).mean()) == healthy
    fused = fused_rmsnorm.make(diff=False)
    assert _calls(fused.model, fused.loss, fused.optimizer) == first
    drift = layer_scalar_drift.make()
    assert _calls(drift.model, drift.loss, drift.optimizer) == second


def test_fallback_probes_stay_within_the_stated_bound() -> None:
    bound = int(re.search(r"at most (\d+) more where an op cannot be followed", README).group(1))  # type: ignore[union-attr]
    model = GainBeforeNorm()
    x = torch.randn(6, 8)
    n = _calls(model, lambda: model(x).pow(2).mean())
    assert 2 < n <= 1 + bound
