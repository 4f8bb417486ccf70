"""deadweight.pin: a parameter kept bit-exactly in place while it stays trainable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight import Severity
from deadweight.demos import layer_scalar_drift as d

LAST = f"blocks.{d.LAYERS - 1}.layer_scalar"


class Tiny(nn.Module):
    """A gain that learns (unlike the incident's), so holding it still is not vacuous."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 16)
        self.gain = nn.Parameter(torch.ones(1))
        self.lin2 = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(F.gelu(self.gain * self.lin1(x)))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, dtype=torch.float32) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen).to(dtype)
        y = torch.randn(16, 2, generator=gen).to(dtype)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x).float(), y.float()).backward()
        opt.step()


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(torch.uint8).flatten().tolist())


def test_pin_keeps_it_trainable_and_tagged():
    model = Tiny()
    handle = deadweight.pin(model, "gain")
    assert isinstance(handle, deadweight.PinHandle)
    assert handle.name == "gain" and handle.param is model.gain
    assert model.gain.requires_grad
    assert model.gain._no_weight_decay is True  # type: ignore[attr-defined]
    F.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 2)).backward()
    assert model.gain.grad is not None and torch.count_nonzero(model.gain.grad) == 0
    assert torch.count_nonzero(model.lin1.weight.grad) > 0  # type: ignore[arg-type]
    assert "active" in repr(handle)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_value_bit_exact_over_200_adamw_steps(dtype, foreach):
    model = Tiny().to(dtype)
    with torch.no_grad():
        model.gain.fill_(1.375)  # exactly representable in bf16 too
    handle = deadweight.pin(model, "gain")
    opt = torch.optim.AdamW(deadweight.param_groups(model, 0.1), lr=1e-2, foreach=foreach)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pinned_bits = bits(model.gain)
    train(model, opt, 200, dtype)
    assert bits(model.gain) == pinned_bits
    assert handle.moved() == 0.0
    for name, p in model.named_parameters():
        if name != "gain":
            assert not torch.equal(p, before[name]), f"{name} did not train"


def test_without_pin_the_gain_does_train():
    model = Tiny()
    opt = torch.optim.AdamW(deadweight.param_groups(model, 0.1), lr=1e-2)
    train(model, opt, 20)
    assert model.gain.item() != 1.0


def test_remove_restores_the_tag_and_training():
    model = Tiny()
    assert not hasattr(model.gain, "_no_weight_decay")
    handle = deadweight.pin(model, "gain")
    opt = torch.optim.AdamW(deadweight.param_groups(model, 0.1), lr=1e-2)
    assert any(p is model.gain for p in opt.param_groups[1]["params"])  # the no-decay group
    assert opt.param_groups[1]["weight_decay"] == 0.0
    train(model, opt, 10)
    assert handle.moved() == 0.0
    handle.remove()
    assert not hasattr(model.gain, "_no_weight_decay")
    assert not hasattr(model.gain, "_deadweight_pin")
    assert "removed" in repr(handle)
    handle.remove()  # idempotent
    train(model, opt, 10)
    assert handle.moved() > 0.0
    # it is decayed again by a freshly built set of groups
    groups = deadweight.param_groups(model, 0.1)
    assert any(p is model.gain for p in groups[0]["params"])


def test_remove_restores_a_previous_tag_value():
    model = Tiny()
    model.gain._no_weight_decay = False  # type: ignore[attr-defined]
    handle = deadweight.pin(model, "gain")
    assert model.gain._no_weight_decay is True  # type: ignore[attr-defined]
    handle.remove()
    assert model.gain._no_weight_decay is False  # type: ignore[attr-defined]


def test_unknown_name_lists_the_nearest():
    setup = d.make()
    with pytest.raises(deadweight.InputError) as info:
        deadweight.pin(setup.model, "blocks.3.layer_scaler")
    message = str(info.value)
    assert "blocks.3.layer_scaler" in message
    assert "nearest" in message and "blocks.3.layer_scalar" in message


def test_pinning_twice_raises_and_repinning_after_remove_works():
    model = Tiny()
    handle = deadweight.pin(model, "gain")
    with pytest.raises(deadweight.InputError, match="already pinned"):
        deadweight.pin(model, "gain")
    handle.remove()
    again = deadweight.pin(model, "gain")
    assert again.param is model.gain
    again.remove()


def test_frozen_parameter_raises():
    model = Tiny()
    model.gain.requires_grad_(False)
    with pytest.raises(deadweight.InputError, match="frozen"):
        deadweight.pin(model, "gain")


def test_optimizer_with_the_param_in_a_decay_group_raises_and_pins_nothing():
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    with pytest.raises(deadweight.InputError, match="weight_decay"):
        deadweight.pin(model, "gain", optimizer=opt)
    assert not hasattr(model.gain, "_deadweight_pin")
    assert not hasattr(model.gain, "_no_weight_decay")
    assert not model.gain._post_accumulate_grad_hooks  # no hook left behind


@pytest.mark.parametrize("pass_optimizer", [True, False])
def test_optimizer_argument_clears_stale_adam_state(pass_optimizer):
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    train(model, opt, 10)  # builds Adam moments for the gain
    assert model.gain in opt.state
    handle = deadweight.pin(model, "gain", optimizer=opt if pass_optimizer else None)
    train(model, opt, 20)
    if pass_optimizer:
        assert handle.moved() == 0.0
    else:  # the control: old moments keep moving it although its gradient is 0
        assert handle.moved() > 0.0
    handle.remove()


def test_moved_is_zero_then_positive_after_remove_and_training():
    setup = d.make()
    handle = deadweight.pin(setup.model, LAST, optimizer=setup.optimizer)
    assert handle.moved() == 0.0
    d.train(setup, 30, every=1000)
    assert handle.moved() == 0.0
    assert setup.last_scalar.item() == 1.0
    handle.remove()
    d.train(setup, 30, every=1000)
    assert handle.moved() > 0.0  # it drifts again, on noise


def test_check_after_pin_reports_the_scalar_at_most_at_info():
    setup = d.make()
    before = deadweight.check(setup.model, setup.loss, setup.optimizer)
    assert {f.code for f in before.findings if LAST in f.params} == {"DW104", "DW203", "DW204"}

    handle = deadweight.pin(setup.model, LAST, optimizer=setup.optimizer)
    report = deadweight.check(setup.model, setup.loss, setup.optimizer)
    about = [f for f in report.findings if LAST in f.params]
    assert about, "the cancelled scalar is still worth an info line"
    assert all(f.severity.rank <= Severity.INFO.rank for f in about)
    assert not report.by_code("DW204")
    assert not report.by_code("DW203")
    (dw104,) = report.by_code("DW104")
    assert dw104.evidence["params"][LAST]["pinned"] is True
    assert report.ok
    handle.remove()
    # check leaves the pin's hook alone: it still zeroes gradients afterwards
    handle = deadweight.pin(setup.model, LAST)
    deadweight.check(setup.model, setup.loss)
    setup.optimizer.zero_grad(set_to_none=True)
    setup.loss().backward()
    assert setup.last_scalar.grad is not None and setup.last_scalar.grad.item() == 0.0
    handle.remove()


def test_pin_accepts_the_alias_of_a_tied_parameter():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    assert model.get_parameter("lm_head.weight") is model.transformer.wte.weight
    try:
        handle = deadweight.pin(model, "lm_head.weight")
    except deadweight.InputError as exc:  # acceptable too: name the parameter it is tied to
        assert "transformer.wte.weight" in str(exc)
    else:
        assert handle.param is model.transformer.wte.weight
        handle.remove()
