"""The first test a new model gets: every trainable parameter receives a gradient that can
move it. `pytest examples/first_model_test` fails for the fused model, naming w1 and g.

The `deadweight` fixture comes with deadweight (a pytest plugin); outside pytest,
`deadweight.testing.assert_all_learn` is the same assertion.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model import TinyNet

MODEL_FACTORIES = {
    "fused": lambda: TinyNet(fused=True),  # the bug: fails, naming w1 and g
    "differentiable": lambda: TinyNet(fused=False),
}


@pytest.mark.parametrize("name", MODEL_FACTORIES)
def test_every_parameter_learns(deadweight, name):
    torch.manual_seed(0)
    model = MODEL_FACTORIES[name]()
    batch = (torch.randn(16, 8), torch.randn(16, 1))  # (inputs, targets)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = deadweight.loss_from_batch(model, batch, F.mse_loss)
    deadweight.assert_all_learn(model, loss_fn, optimizer)
