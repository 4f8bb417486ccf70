"""A tiny configuration of the model, for `deadweight check` in CI:

    deadweight check examples/ci/tiny_model.py:make

`make()` returns (model, loss_fn, optimizer). Build your own model the way training
does, only small: a layer or two, a narrow width, one short batch. The check needs one
forward and backward, so a few seconds on a CPU runner is enough.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parents[1] / "first_model_test"))
from model import TinyNet  # your model's import goes here


def make() -> tuple[torch.nn.Module, object, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet(dim=8, fused=False)  # fused=True is the bug: the check fails on w1, g
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, lambda: F.mse_loss(model(x), y), optimizer
