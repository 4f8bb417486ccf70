"""deadweight.testing: assertions for a model's unit tests, failing with the CLI's text."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deadweight.demos import fused_rmsnorm
from deadweight.report.text import render_plain
from deadweight.testing import assert_all_learn, assert_no_findings, loss_from_batch


def fused() -> fused_rmsnorm.Setup:
    return fused_rmsnorm.make(diff=False)


def test_a_model_whose_first_layer_gets_no_gradient_fails_naming_it() -> None:
    setup = fused()
    with pytest.raises(AssertionError) as info:
        assert_all_learn(setup.model, setup.loss, setup.optimizer)
    message = str(info.value)
    assert message.startswith("deadweight check: 2 findings at or above warning:\n")
    assert "DW101 no-gradient" in message and "DW102 graph-cut" in message
    assert "params   l1.weight, norm.weight" in message  # w1 and g of the incident
    assert "fused_rmsnorm.py:31 in fused_rms_norm" in message
    # the same text as `deadweight check` prints for these findings
    import deadweight

    report = deadweight.check(setup.model, setup.loss, setup.optimizer)
    assert render_plain(report) in message


def test_a_healthy_model_passes_and_returns_its_report() -> None:
    setup = fused_rmsnorm.make(diff=True)
    report = assert_all_learn(setup.model, setup.loss, setup.optimizer)
    assert report.kind == "check" and report.subject["trainable"] == 3


def test_allow_accepts_rules_and_parameters() -> None:
    setup = fused()
    assert_all_learn(setup.model, setup.loss, allow=["DW101", "graph-cut"])
    assert_all_learn(setup.model, setup.loss, allow=["l1.*", "norm.weight"])
    with pytest.raises(AssertionError, match=r"l1\.weight, norm\.weight"):
        assert_all_learn(setup.model, setup.loss, allow=["l1.*"])  # g still fails it
    with pytest.raises(AssertionError):
        assert_all_learn(setup.model, setup.loss, allow=["DW101"])  # DW102 still fails it


def test_fail_on_and_a_selection_that_could_never_fail() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)).eval()  # DW107 is info
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    loss_fn = loss_from_batch(model, (x, y), F.mse_loss)
    assert_all_learn(model, loss_fn)
    with pytest.raises(AssertionError, match="DW107 model-in-eval-mode"):
        assert_all_learn(model, loss_fn, fail_on="info")
    with pytest.raises(ValueError, match="could never fail"):
        assert_all_learn(model, loss_fn, select=["DW5"])


def test_assert_no_findings_on_any_report() -> None:
    setup = fused()
    import deadweight

    report = deadweight.check(setup.model, setup.loss)
    with pytest.raises(AssertionError, match="DW102 graph-cut"):
        assert_no_findings(report, select="DW102")
    assert_no_findings(report, ignore=["DW101", "DW102"])
    assert_no_findings(report, select="DW2")
    with pytest.raises(ValueError, match="unknown rule"):
        assert_no_findings(report, ignore=["DW9"])


class ScalarBeforeNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.scalar = nn.Parameter(torch.ones(1))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.scalar * self.lin(x)))


def test_thresholds_and_config_reach_the_check(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # The LayerNorm cancels the scalar; whether AdamW moves it materially depends on
    # the horizon the prediction looks over (drift-horizon-steps).
    model = ScalarBeforeNorm()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    loss_fn = loss_from_batch(model, (x, y), F.mse_loss)
    with pytest.raises(AssertionError, match="DW104 scale-invariant"):
        assert_all_learn(model, loss_fn, opt)
    assert_all_learn(model, loss_fn, opt, thresholds={"drift-horizon-steps": 1})
    (tmp_path / "deadweight.toml").write_text("[thresholds]\ndrift-horizon-steps = 1\n")
    assert_all_learn(model, loss_fn, opt, config=tmp_path / "deadweight.toml")


class SelfLoss(nn.Module):
    """Returns its own loss in the shapes models do: a tensor, .loss, a dict, a tuple."""

    def __init__(self, shape: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.shape = shape

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):  # type: ignore[no-untyped-def]
        out = self.lin(x)
        loss = F.mse_loss(out, labels) if labels is not None else out.pow(2).mean()
        if self.shape == "tensor":
            return loss
        if self.shape == "attr":
            return types.SimpleNamespace(loss=loss, logits=out)
        if self.shape == "dict":
            return {"loss": loss, "logits": out}
        return out, loss  # nanoGPT's (logits, loss)


@pytest.mark.parametrize("shape", ["tensor", "attr", "dict", "tuple"])
def test_loss_from_batch_finds_the_models_own_loss(shape: str) -> None:
    model = SelfLoss(shape)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    for batch in ((x, y), {"x": x, "labels": y}, x):
        loss = loss_from_batch(model, batch)()
        assert loss.ndim == 0 and loss.requires_grad
    assert_all_learn(model, loss_from_batch(model, (x, y)))


def test_loss_from_batch_with_a_criterion() -> None:
    model = nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    expected = F.mse_loss(model(x), y)
    assert torch.equal(loss_from_batch(model, (x, y), F.mse_loss)(), expected)
    assert torch.equal(loss_from_batch(model, {"input": x, "labels": y}, F.mse_loss)(), expected)
    with pytest.raises(KeyError, match="'target'"):
        loss_from_batch(model, {"input": x}, F.mse_loss, target_key="target")()
    with pytest.raises(TypeError, match="must be \\(inputs, targets\\)"):
        loss_from_batch(model, x, F.mse_loss)()
    with pytest.raises(TypeError, match="not a loss: pass a criterion"):
        loss_from_batch(model, x)()  # an (8, 1) output is no loss
