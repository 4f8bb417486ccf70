"""Bad inputs to `deadweight.check` give a clear deadweight error or finding, never a deep traceback."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

import deadweight
from deadweight import DeadweightError, InputError, LossFnError, Severity
from tests.conftest import reference_no_grad


def _quiet(report: deadweight.Report) -> bool:
    """Nothing found but info-level notes on scale/shift invariance (DW103-DW105),
    which healthy models with normalization layers have."""
    return all(
        f.code in ("DW103", "DW104", "DW105") and f.severity is deadweight.Severity.INFO
        for f in report.findings
    )


class Net(nn.Module):
    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8, bias=False)  # BatchNorm follows: a bias would be cancelled
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(8, 2)
        if with_unused:
            self.unused = nn.Linear(3, 3)  # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 2, (5,), generator=torch.Generator().manual_seed(2))


def _loss(model: nn.Module) -> torch.Tensor:
    return F.cross_entropy(model(X), Y)


def _untouched() -> tuple[object, ...]:
    """Everything check installs for the duration of a run."""
    return (
        len(nn_module._global_forward_pre_hooks),
        len(nn_module._global_forward_hooks),
        len(getattr(nn_module, "_global_forward_hooks_always_called", {})),
        torch._C._len_torch_function_stack(),
        torch.autograd.Function.__dict__["apply"],
        torch.is_grad_enabled(),
    )


def _no_grad_params(report: deadweight.Report) -> set[str]:
    return {p for f in report.by_code("DW101") for p in f.params}


# -- loss_fn raises ----------------------------------------------------------------


class CustomError(Exception):
    pass


@pytest.mark.parametrize("exc", [ValueError("bad shape"), KeyError("input_ids"), CustomError("x")])
def test_loss_fn_raising_gives_loss_fn_error_chained_to_the_original(exc: Exception) -> None:
    model = Net()
    before = _untouched()

    def loss_fn() -> torch.Tensor:
        model(X)  # part of the work is done, hooks have fired
        raise exc

    with pytest.raises(LossFnError) as info:
        deadweight.check(model, loss_fn)
    assert info.value.__cause__ is exc
    assert isinstance(info.value, DeadweightError)
    assert type(exc).__name__ in str(info.value)
    assert _untouched() == before


def test_loss_fn_raising_inside_a_submodule_forward() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("kernel failed")

    model = nn.Sequential(nn.Linear(4, 4), Bad(), nn.Linear(4, 1))
    before = _untouched()
    with pytest.raises(LossFnError, match="kernel failed") as info:
        deadweight.check(model, lambda: model(X).sum())
    assert isinstance(info.value.__cause__, RuntimeError)
    assert str(info.value.__cause__) == "kernel failed"
    assert _untouched() == before
    # the model still works normally afterwards, and check does too
    assert model[0](X).shape == (5, 4)
    ok = nn.Sequential(nn.Linear(4, 1))
    assert _quiet(deadweight.check(ok, lambda: ok(X).sum()))


def test_loss_fn_that_calls_backward_itself_is_a_deadweight_error() -> None:
    model = Net()
    grads = [p.grad for p in model.parameters()]

    def closure() -> torch.Tensor:
        loss = _loss(model)
        loss.backward()
        return loss

    with pytest.raises(DeadweightError, match="backward"):
        deadweight.check(model, closure)
    assert [p.grad for p in model.parameters()] == grads


# -- loss_fn returns the wrong thing ----------------------------------------------


def test_dict_with_loss_hints_at_loss_field() -> None:
    model = Net()
    before = _untouched()
    with pytest.raises(InputError, match=r"\.loss") as info:
        deadweight.check(model, lambda: {"loss": _loss(model), "logits": model(X)})
    assert "dict" in str(info.value)
    assert _untouched() == before
    assert all(p.grad is None for p in model.parameters())


def test_output_object_with_loss_attribute_hints_at_loss_field() -> None:
    @dataclasses.dataclass
    class Output:
        loss: torch.Tensor
        logits: torch.Tensor

    model = Net()
    with pytest.raises(InputError, match=r"\.loss"):
        deadweight.check(model, lambda: Output(_loss(model), model(X)))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda m: _loss(m).item(), id="float"),
        pytest.param(lambda m: None, id="none"),
        pytest.param(lambda m: (_loss(m), m(X)), id="tuple"),
        pytest.param(lambda m: [_loss(m)], id="list"),
    ],
)
def test_non_tensor_return_is_input_error(make: Callable[[nn.Module], object]) -> None:
    model = Net()
    before = _untouched()
    with pytest.raises(InputError, match="loss_fn must return") as info:
        deadweight.check(model, lambda: make(model))
    assert "`loss`" not in str(info.value)  # no .loss hint where there is no loss field
    assert _untouched() == before


@pytest.mark.parametrize("shape", [(5,), (5, 2), (0,)])
def test_non_scalar_tensor_is_input_error(shape: tuple[int, ...]) -> None:
    model = Net()

    def loss_fn() -> torch.Tensor:
        out = F.cross_entropy(model(X), Y, reduction="none")
        return out.new_ones(shape) * out.sum()

    with pytest.raises(InputError, match="scalar") as info:
        deadweight.check(model, loss_fn)
    assert str(tuple(shape)) in str(info.value)
    assert "mean()" in str(info.value)


def test_per_sample_loss_is_input_error() -> None:
    model = Net()
    with pytest.raises(InputError, match=r"shape \(5,\)"):
        deadweight.check(model, lambda: F.cross_entropy(model(X), Y, reduction="none"))


def test_one_element_loss_is_accepted() -> None:
    model = Net()
    report = deadweight.check(model, lambda: _loss(model).reshape(1, 1))
    assert _quiet(report)


def test_loss_without_graph_is_a_finding_not_a_crash() -> None:
    model = Net()
    report = deadweight.check(model, lambda: torch.tensor(_loss(model).item()))
    names = _no_grad_params(report)
    assert names == {n for n, _ in model.named_parameters()}
    assert [f.evidence["kind"] for f in report.by_code("DW102")] == ["loss-no-grad-fn"]


# -- non-finite loss --------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_is_dw106_error(bad: float) -> None:
    model = Net()
    report = deadweight.check(model, lambda: _loss(model) * bad)
    [finding] = report.by_code("DW106")
    assert finding.severity is Severity.ERROR
    assert not report.ok
    assert not report.by_code("DW101")
    assert not report.by_code("DW102")
    value = report.subject["loss"]
    assert math.isnan(value) if math.isnan(bad) else value == bad
    assert report.to_json()  # serialisable with a non-finite value


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_loss_still_reports_dw101_correctly(bad: float) -> None:
    model = Net(with_unused=True)

    def loss_of(m: nn.Module) -> torch.Tensor:
        return F.cross_entropy(m(X), Y) + torch.tensor(bad)

    expected = reference_no_grad(model, loss_of)
    assert expected == {"unused.weight", "unused.bias"}
    report = deadweight.check(model, lambda: loss_of(model))
    assert len(report.by_code("DW106")) == 1
    assert _no_grad_params(report) == expected


def test_nan_from_log_of_zero_is_dw106() -> None:
    model = nn.Sequential(nn.Linear(4, 2), nn.ReLU())
    with torch.no_grad():
        model[0].weight.fill_(-1.0)
        model[0].bias.fill_(-1.0)
    x = X.abs()
    report = deadweight.check(model, lambda: -torch.log(model(x)).mean())
    assert report.by_code("DW106")
    assert report.by_code("DW106")[0].evidence["loss_value"] == "inf"


# -- bad models -------------------------------------------------------------------


def test_no_trainable_parameters_is_input_error() -> None:
    model = Net().requires_grad_(False)
    with pytest.raises(InputError, match="no trainable parameters"):
        deadweight.check(model, lambda: _loss(model))


def test_no_parameters_at_all_is_input_error() -> None:
    model = nn.Sequential(nn.ReLU())
    with pytest.raises(InputError, match="no trainable parameters"):
        deadweight.check(model, lambda: model(X).sum())


def test_meta_parameters_are_input_error() -> None:
    with torch.device("meta"):
        model = Net()
    with pytest.raises(InputError, match="meta") as info:
        deadweight.check(model, lambda: model(X.to("meta")).sum())
    assert "to_empty" in str(info.value)


def test_some_meta_parameters_are_input_error() -> None:
    model = Net()
    with torch.device("meta"):
        model.fc2 = nn.Linear(8, 2)
    with pytest.raises(InputError, match=r"fc2\.weight"):
        deadweight.check(model, lambda: _loss(model))


def test_non_module_model_is_input_error() -> None:
    with pytest.raises(InputError, match=r"nn\.Module"):
        deadweight.check(lambda x: x, lambda: torch.zeros(()))  # type: ignore[arg-type]


def test_non_callable_loss_fn_is_input_error() -> None:
    model = Net()
    with pytest.raises(InputError, match="callable"):
        deadweight.check(model, _loss(model))  # the loss, not a function computing it


def test_non_optimizer_is_input_error() -> None:
    model = Net()
    with pytest.raises(InputError, match="Optimizer"):
        deadweight.check(model, lambda: _loss(model), optimizer=list(model.parameters()))


# -- eval mode and no_grad --------------------------------------------------------


def test_eval_mode_is_dw107_info_and_nothing_else() -> None:
    model = Net().eval()
    report = deadweight.check(model, lambda: _loss(model))
    assert [f.code for f in report.findings if f.code not in ("DW104", "DW105")] == ["DW107"]
    [finding] = report.by_code("DW107")
    assert finding.severity is Severity.INFO
    assert finding.name == "model-in-eval-mode"
    assert report.ok
    assert report.subject["training_mode"] is False
    assert not model.training
    assert not any(m.training for m in model.modules())


def test_train_mode_has_no_dw107() -> None:
    model = Net().train()
    report = deadweight.check(model, lambda: _loss(model))
    assert _quiet(report)
    assert report.subject["training_mode"] is True


def test_eval_root_with_training_submodule_is_dw107() -> None:
    model = Net().eval()
    model.fc1.train()
    report = deadweight.check(model, lambda: _loss(model))
    assert [f.code for f in report.findings if f.code not in ("DW104", "DW105")] == ["DW107"]


def test_check_inside_no_grad_still_works() -> None:
    model = Net(with_unused=True)
    with torch.no_grad():
        report = deadweight.check(model, lambda: _loss(model))
        assert not torch.is_grad_enabled()
    assert _no_grad_params(report) == {"unused.weight", "unused.bias"}
    assert [f.evidence["kind"] for f in report.by_code("DW102")] == ["never-ran"]


def test_check_inside_no_grad_healthy_model_has_no_findings() -> None:
    model = Net()
    with torch.no_grad():
        report = deadweight.check(model, lambda: _loss(model))
    assert _quiet(report)
    assert all(p.grad is None for p in model.parameters())


def test_check_inside_inference_mode_still_works() -> None:
    model = Net()
    with torch.inference_mode():
        report = deadweight.check(model, lambda: _loss(model))
    assert _quiet(report)


def test_no_grad_inside_loss_fn_is_still_caught() -> None:
    """The caller's no_grad is lifted for the check, the model's own is not."""
    model = Net()

    def loss_fn() -> torch.Tensor:
        with torch.no_grad():
            h = model.fc1(X)
        return F.cross_entropy(model.fc2(torch.relu(h)), Y)

    with torch.no_grad():
        report = deadweight.check(model, loss_fn)
    assert _no_grad_params(report) >= {"fc1.weight"}
    assert "fc2.weight" not in _no_grad_params(report)


# -- transformers outputs ---------------------------------------------------------


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=100,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config).train()


IDS = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(0))


def test_model_output_with_loss_hints_at_loss_field() -> None:
    model = _tiny_gpt2()
    with pytest.raises(InputError, match=r"\.loss") as info:
        deadweight.check(model, lambda: model(input_ids=IDS, labels=IDS))
    assert "CausalLMOutput" in str(info.value)


def test_model_output_without_loss_does_not_hint_at_none_field() -> None:
    model = _tiny_gpt2()
    with pytest.raises(InputError) as info:
        deadweight.check(model, lambda: model(input_ids=IDS))  # forgot labels=
    message = str(info.value)
    assert "return that" not in message
    assert "None" in message or "labels" in message


# -- select / ignore --------------------------------------------------------------


def test_select_and_ignore_filter_findings() -> None:
    model = Net(with_unused=True).eval()
    full = deadweight.check(model, lambda: _loss(model))
    # (fc2.bias is shift-invariant under cross-entropy: an info-level DW105)
    assert {f.code for f in full.findings} - {"DW105"} == {"DW101", "DW102", "DW107"}
    only = deadweight.check(model, lambda: _loss(model), select=["DW101"])
    assert {f.code for f in only.findings} == {"DW101"}
    by_name = deadweight.check(model, lambda: _loss(model), select=["no-gradient"])
    assert [f.to_dict() for f in by_name.findings] == [f.to_dict() for f in only.findings]
    ignored = deadweight.check(model, lambda: _loss(model), ignore=["DW10"])
    assert _quiet(ignored)


def test_unknown_rule_in_select_fails_before_running_loss_fn() -> None:
    model = Net()
    calls: list[int] = []

    def loss_fn() -> torch.Tensor:
        calls.append(1)
        return _loss(model)

    with pytest.raises(ValueError, match="DW999"):
        deadweight.check(model, loss_fn, select=["DW999"])
    assert calls == []


def test_select_as_single_string() -> None:
    model = Net().eval()
    try:
        report = deadweight.check(model, lambda: _loss(model), select="DW107")
    except ValueError as exc:  # a clear refusal would do too
        assert "DW107" in str(exc), str(exc)
    else:
        assert [f.code for f in report.findings if f.code not in ("DW104", "DW105")] == ["DW107"]
