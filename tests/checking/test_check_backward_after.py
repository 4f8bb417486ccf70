"""Forward -> `deadweight.check` -> backward: the user's own graph survives the check.

The user computes `loss = loss_fn()` (graph alive), calls `check`, then
`loss.backward()`. That backward must work and give the gradients a plain backward
gives without the check in between (slow reference: a deep copy of the model, the
same RNG state, no check). Without care it raises "one of the variables needed for
gradient computation has been modified by an inplace operation": the check restores
BatchNorm's running statistics in place, and its probes scale parameters x10 and
put them back, each bumping the tensors' autograd version counters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight.demos import layer_scalar_drift
from tests.tiny_transformers import bert_config

LossOf = Callable[[nn.Module], torch.Tensor]


def _grads_after_check(model: nn.Module, loss_of: LossOf) -> tuple[dict, dict, int]:
    """(reference grads, grads after forward -> check -> backward, loss_fn calls)."""
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    loss_of(reference).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}

    torch.manual_seed(1)
    loss = loss_of(model)  # the user's graph, alive during the check
    calls = [0]

    def loss_fn() -> torch.Tensor:
        calls[0] += 1
        return loss_of(model)

    report = deadweight.check(model, loss_fn)
    loss.backward()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert report.subject["parameters"] == len(got)
    return expected, got, calls[0]


def _assert_same(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    for name, g in expected.items():
        if g is None:
            assert got[name] is None, name
        else:
            assert got[name] is not None, name
            assert torch.equal(got[name], g), name


def _bn_cnn() -> tuple[nn.Module, LossOf]:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 2),
    ).train()
    x = torch.randn(4, 3, 8, 8)
    y = torch.randint(0, 2, (4,))
    return model, lambda m: F.cross_entropy(m(x), y)


def test_backward_after_check_on_a_batchnorm_cnn() -> None:
    model, loss_of = _bn_cnn()
    expected, got, calls = _grads_after_check(model, loss_of)
    _assert_same(expected, got)
    assert calls == 2  # the conv bias before BatchNorm is a candidate: one confirming re-run


def test_backward_after_check_on_an_eval_batchnorm_cnn() -> None:
    # In eval mode BatchNorm saves the running statistics themselves for backward.
    model, loss_of = _bn_cnn()
    model.eval()
    expected, got, _ = _grads_after_check(model, loss_of)
    _assert_same(expected, got)


def test_backward_after_check_when_probes_scale_a_cancelled_scalar() -> None:
    setup = layer_scalar_drift.make()
    setup.next_batch()
    assert setup.batch is not None
    x, y = setup.batch
    model = setup.model
    expected, got, calls = _grads_after_check(model, lambda m: F.mse_loss(m(x), y))
    _assert_same(expected, got)
    assert calls == 2  # the structure pass's candidate, confirmed by one re-run


class GainBeforeNorm(nn.Module):
    """A gain a LayerNorm divides out, behind a custom Function the structure pass cannot
    see into: the numerical fallback probes scale it x10 and x100 in place."""

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 2.0

        @staticmethod
        def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
            return g * 2.0

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.ones(1))
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = GainBeforeNorm.Twice.apply(self.gain * self.fc(x))
        return self.out(self.norm(h))


def test_backward_after_check_when_fallback_probes_run() -> None:
    model = GainBeforeNorm()
    x = torch.randn(6, 8)
    report = deadweight.check(model, lambda: model(x).pow(2).mean())
    assert "gain" in {p for f in report.by_code("DW104") for p in f.params}
    expected, got, calls = _grads_after_check(model, lambda m: m(x).pow(2).mean())
    _assert_same(expected, got)
    assert calls > 2  # the probes did re-run the loss


def test_backward_after_check_on_a_tiny_bert() -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.BertForSequenceClassification(bert_config()).train()  # dropout on
    ids = torch.randint(1, 100, (2, 16))
    labels = torch.tensor([0, 2])
    expected, got, _ = _grads_after_check(model, lambda m: m(input_ids=ids, labels=labels).loss)
    _assert_same(expected, got)
