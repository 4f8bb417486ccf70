"""DW311 (gradients not zeroed), DW312 (trained in eval mode), DW313 (never got a
gradient): each fires where it must and stays quiet on its healthy twin."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import deadweight
from deadweight import Severity


def _mlp(dropout: float = 0.3, batchnorm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 16)]
    if batchnorm:
        layers.append(nn.BatchNorm1d(16))
    layers += [nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1)]
    return nn.Sequential(*layers)


def _codes(report) -> set[str]:
    return {f.code for f in report.findings}


def _train(model: nn.Module, opt, steps: int, before: Callable[[int], None], **kw):
    torch.manual_seed(1)
    with deadweight.watch(model, opt, every=kw.pop("every", 10), **kw) as w:
        for step in range(steps):
            before(step)
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
    return w.report()


# -- DW311 ----------------------------------------------------------------------------------


def test_missing_zero_grad_is_an_error_at_the_second_step() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    report = _train(model, opt, 20, lambda step: None)
    (found,) = report.by_code("DW311")
    assert found.severity is Severity.ERROR
    assert found.evidence["step"] == 2  # the first step that consumed a stale gradient
    assert "Adam" in found.message and "previous step" in found.message


@pytest.mark.parametrize(
    "zero",
    [
        "set_to_none=True",
        "set_to_none=False",
        "model.zero_grad",
        "p.grad = None",
        "p.grad.data.zero_",  # zeroes behind the version counter: the values decide
        "p.grad.zero_",
    ],
)
def test_every_way_of_zeroing_is_quiet(zero: str) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)

    def before(step: int) -> None:
        if zero == "set_to_none=True":
            opt.zero_grad(set_to_none=True)
        elif zero == "set_to_none=False":
            opt.zero_grad(set_to_none=False)
        elif zero == "model.zero_grad":
            model.zero_grad()
        else:
            for p in model.parameters():
                if p.grad is None:
                    continue
                if zero == "p.grad = None":
                    p.grad = None
                elif zero == "p.grad.data.zero_":
                    p.grad.data.zero_()
                else:
                    p.grad.zero_()

    assert "DW311" not in _codes(_train(model, opt, 15, before))


def test_gradient_accumulation_zeroed_after_the_step_is_quiet() -> None:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with deadweight.watch(model, opt, every=5) as w:
        for _ in range(12):
            for _ in range(4):  # four backward passes per step, on purpose
                (model(torch.randn(8, 8)).pow(2).mean() / 4).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
    assert "DW311" not in _codes(w.report())


def test_accumulation_never_zeroed_is_caught_through_clipping_and_a_scaler() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with deadweight.watch(model, opt, every=5) as w:
        for _ in range(8):
            for _ in range(2):
                scaler.scale(model(torch.randn(8, 8)).pow(2).mean()).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
    (found,) = w.report().by_code("DW311")
    assert found.evidence["step"] == 2


def _gan(zero: Callable[[torch.optim.Optimizer], None]):
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    disc = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    bce = nn.functional.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    with deadweight.watch([gen, disc], [opt_g, opt_d], every=5) as w:
        for _ in range(12):
            fake = gen(torch.randn(16, 4))
            zero(opt_d)
            (bce(disc(torch.randn(16, 4) + 2), ones) + bce(disc(fake.detach()), zeros)).backward()
            opt_d.step()
            zero(opt_g)
            bce(disc(fake), ones).backward()  # reaches the discriminator's gradients too
            opt_g.step()
    return w.report()


def _zero_data(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.grad.data.zero_()


@pytest.mark.parametrize(
    "zero",
    [
        lambda o: o.zero_grad(),
        lambda o: o.zero_grad(set_to_none=False),
        _zero_data,
    ],
    ids=["none", "in-place", "data"],
)
def test_a_gan_whose_generator_pass_reaches_the_discriminator_is_quiet(zero) -> None:
    """The generator's backward adds into the discriminator's stepped gradients; the
    discriminator zeroes them before its own backward: its steps are clean."""
    assert "DW311" not in _codes(_gan(zero))


def test_a_gan_that_never_zeroes_the_discriminator_is_caught() -> None:
    def zero(opt: torch.optim.Optimizer) -> None:
        if len(opt.param_groups[0]["params"]) and opt.param_groups[0]["params"][-1].shape[0] == 4:
            opt.zero_grad()  # only the generator's optimizer (its last bias has 4 elements)

    (found,) = _gan(zero).by_code("DW311")
    assert all(name.startswith("Sequential[1]:") for name in found.params)


@pytest.mark.parametrize("zeroes", [True, False])
def test_a_closure_that_zeroes_is_quiet_and_one_that_does_not_is_caught(zeroes: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def closure() -> torch.Tensor:
        if zeroes:
            opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    with deadweight.watch(model, opt, every=5) as w:
        for _ in range(6):
            opt.step(closure)
    assert ("DW311" in _codes(w.report())) is not zeroes


def test_autograd_grad_after_the_step_is_not_an_accumulation() -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def before(step: int) -> None:
        opt.zero_grad()
        if step:  # a gradient penalty: torch.autograd.grad never touches .grad
            torch.autograd.grad(model(torch.randn(4, 8)).sum(), list(model.parameters()))

    assert "DW311" not in _codes(_train(model, opt, 10, before))


# -- DW312 ----------------------------------------------------------------------------------


def test_model_left_in_eval_after_validation_is_a_warning_from_that_step() -> None:
    model = _mlp(batchnorm=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        opt.zero_grad()
        if step == 5:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 8))  # validation, and no model.train() after it

    (found,) = _train(model, opt, 20, before).by_code("DW312")
    assert found.severity is Severity.WARNING
    assert found.evidence["start"] == 6 and found.evidence["end"] is None
    assert set(found.evidence["modules"]) == {"1", "3"}  # the BatchNorm and the Dropout
    assert found.evidence["kinds"] == ["dropout", "norm"]


def test_validation_that_returns_to_train_mode_is_quiet() -> None:
    model = _mlp(batchnorm=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        opt.zero_grad()
        if step % 5 == 4:
            model.eval()
            with torch.no_grad():
                model(torch.randn(4, 8))
            model.train()

    assert "DW312" not in _codes(_train(model, opt, 20, before))


def test_an_episode_that_ends_says_so() -> None:
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        opt.zero_grad()
        if step == 3:
            model.eval()
        if step == 9:
            model.train()

    (found,) = _train(model, opt, 15, before).by_code("DW312")
    assert (found.evidence["start"], found.evidence["end"]) == (4, 10)


class _Detector(nn.Module):
    """A frozen BatchNorm backbone (in eval on purpose) under a trainable head."""

    def __init__(self, frozen_bn_only: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.neck = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(16, 1))
        if not frozen_bn_only:
            self.backbone.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.neck(self.backbone(x)))


def test_a_frozen_backbone_in_eval_mode_is_quiet() -> None:
    torch.manual_seed(0)
    model = _Detector()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def before(step: int) -> None:
        opt.zero_grad()
        model.train()
        model.backbone.eval()  # frozen statistics, frozen weights

    assert "DW312" not in _codes(_train(model, opt, 12, before))


def test_batchnorm_frozen_one_by_one_while_the_model_trains_is_quiet() -> None:
    """mmdetection's norm_eval: every BatchNorm in eval, the convolutions training."""
    torch.manual_seed(0)
    model = _Detector(frozen_bn_only=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def before(step: int) -> None:
        opt.zero_grad()
        model.train()
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.eval()

    assert "DW312" not in _codes(_train(model, opt, 12, before))


def test_the_whole_detector_left_in_eval_names_only_what_trains_downstream() -> None:
    torch.manual_seed(0)
    model = _Detector()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def before(step: int) -> None:
        opt.zero_grad()
        if step == 2:
            model.eval()

    (found,) = _train(model, opt, 12, before).by_code("DW312")
    # the backbone's BatchNorm has nothing trainable upstream or inside: left out
    assert set(found.evidence["modules"]) == {"neck.1", "head.0"}


def test_transformers_style_functional_dropout_counts() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.dropout = 0.1  # applied as F.dropout(x, self.dropout, self.training)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(self.proj(x), self.dropout, self.training)

    torch.manual_seed(0)
    model = nn.Sequential(Attention(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def before(step: int) -> None:
        opt.zero_grad()
        model.eval()

    (found,) = _train(model, opt, 6, before).by_code("DW312")
    assert found.evidence["modules"] == ["0"] and found.evidence["start"] == 1


# -- DW313 ----------------------------------------------------------------------------------


class _Unused(nn.Module):
    def __init__(self, use_proj: bool) -> None:
        super().__init__()
        self.encoder, self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.use_proj = use_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return self.head(self.proj(h) if self.use_proj else h)


@pytest.mark.parametrize("steps", [10, 40])
def test_an_unused_module_is_an_error_within_ten_steps(steps: int) -> None:
    torch.manual_seed(0)
    model = _Unused(use_proj=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = _train(model, opt, steps, lambda s: opt.zero_grad())
    (found,) = report.by_code("DW313")
    assert set(found.params) == {"proj.weight", "proj.bias"}
    assert found.severity is Severity.ERROR and found.evidence["steps"] == steps
    assert not report.by_code("DW301")  # its 50 steps are not reached


def test_nine_steps_are_too_few_and_the_used_module_is_quiet() -> None:
    torch.manual_seed(0)
    model = _Unused(use_proj=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert "DW313" not in _codes(_train(model, opt, 9, lambda s: opt.zero_grad()))
    model = _Unused(use_proj=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert not _codes(_train(model, opt, 40, lambda s: opt.zero_grad()))


def test_dw301_takes_over_after_its_own_steps() -> None:
    torch.manual_seed(0)
    model = _Unused(use_proj=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = _train(model, opt, 60, lambda s: opt.zero_grad())
    assert "DW313" not in _codes(report)
    (found,) = report.by_code("DW301")
    assert "never received a gradient" in found.message


def test_a_gradient_that_arrives_later_is_not_never() -> None:
    torch.manual_seed(0)
    model = _Unused(use_proj=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def before(step: int) -> None:
        opt.zero_grad()
        model.use_proj = step >= 15  # a head switched on after a warm-up

    assert "DW313" not in _codes(_train(model, opt, 30, before))


def test_the_threshold_is_configurable() -> None:
    torch.manual_seed(0)
    model = _Unused(use_proj=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = _train(model, opt, 12, lambda s: opt.zero_grad(), thresholds={"no-gradient-steps": 20})
    assert "DW313" not in _codes(report)


def test_an_all_zero_gradient_is_dw310_within_ten_steps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    gate = nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([*model.parameters(), gate], lr=1e-2)
    with deadweight.watch(model, opt, every=5) as w:
        for _ in range(12):
            opt.zero_grad()
            x = torch.randn(8, 8)
            (model(x).pow(2).mean() + 0 * gate).backward()  # its gradient is exactly 0
            opt.step()
    (found,) = w.report().by_code("DW310")
    assert found.params == ("optimizer0.group0.param4[scalar]",)
