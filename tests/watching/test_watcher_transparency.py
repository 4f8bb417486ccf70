"""Watching changes nothing: a seeded run is bitwise the same with `deadweight.watch` on.

Every loss, every parameter and every tensor of the optimizer's (and the GradScaler's)
state is compared with `torch.equal` against the same run without the watch, for
SGD with momentum, Adam, AdamW and fused AdamW, with and without a GradScaler (fp16
autocast on CPU) that skips steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight.watching.step_monitor import SMALL_DEFAULT

STEPS = 12
# Steps whose gradient gets an inf injected after backward: the GradScaler must skip them.
INF_STEPS = (3, 7)


class Net(nn.Module):
    """Large and small parameters; `side` has a gradient on odd steps only, `unused` never."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(64, 80)  # weight: 5120 elements, above SMALL_DEFAULT
        self.side = nn.Linear(64, 80, bias=False)  # large, and intermittent
        self.gain = nn.Parameter(torch.ones(80))
        self.scalar = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(80, 4)
        self.unused = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        h = self.big(x)
        if use_side:
            h = h + self.side(x)
        return self.head(torch.tanh(h) * self.gain * self.scalar)


def _optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    # A fused optimizer is stepped by the GradScaler even on inf/NaN, with scaled grads.
    return torch.optim.AdamW(
        [
            {"params": [model.big.weight, model.side.weight], "weight_decay": 0.1},
            {"params": [p for n, p in model.named_parameters() if "weight" not in n]},
            {"params": [model.head.weight], "lr": 3e-3},
        ],
        lr=1e-2,
        fused=name == "adamw-fused",
    )


@dataclass
class Run:
    losses: list[torch.Tensor]
    params: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    scaler_state: dict[str, Any] | None
    report: deadweight.Report | None
    watch: deadweight.Watch | None


def train(
    optimizer: str,
    scaler: bool,
    watch: dict[str, Any] | None,
    *,
    pass_scaler: bool = True,
    steps: int = STEPS,
    bf16: bool = False,
) -> Run:
    torch.manual_seed(0)
    model = Net()
    opt = _optimizer(optimizer, model)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if scaler else None
    gen = torch.Generator().manual_seed(1)
    w = None
    if watch is not None:
        w = deadweight.watch(
            model, opt, scaler=grad_scaler if pass_scaler else None, **watch
        ).__enter__()
    losses = []
    for step in range(steps):
        x, y = torch.randn(16, 64, generator=gen), torch.randn(16, 4, generator=gen)
        opt.zero_grad(set_to_none=True)
        if grad_scaler is None:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(x, step % 2 == 1)
            loss = F.mse_loss(out.float(), y)
            loss.backward()
            opt.step()
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x, step % 2 == 1)
            loss = F.mse_loss(out.float(), y)
            grad_scaler.scale(loss).backward()
            if step in INF_STEPS:
                assert model.big.weight.grad is not None
                model.big.weight.grad[0, 0] = float("inf")
            grad_scaler.step(opt)
            grad_scaler.update()
        losses.append(loss.detach().clone())
    report = None
    if w is not None:
        w.__exit__(None, None, None)
        report = w.report()
    return Run(
        losses,
        {n: p.detach().clone() for n, p in model.named_parameters()},
        opt.state_dict(),
        grad_scaler.state_dict() if grad_scaler is not None else None,
        report,
        w,
    )


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


_BASELINES: dict[tuple[str, bool], Run] = {}


def baseline(optimizer: str, scaler: bool) -> Run:
    key = (optimizer, scaler)
    if key not in _BASELINES:
        _BASELINES[key] = train(optimizer, scaler, None)
    return _BASELINES[key]


def test_the_model_has_what_the_comparison_needs():
    model = Net()
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert sizes["big.weight"] > SMALL_DEFAULT and sizes["side.weight"] > SMALL_DEFAULT
    assert sizes["scalar"] <= SMALL_DEFAULT and sizes["head.bias"] <= SMALL_DEFAULT
    # The baseline really skips the injected steps and really leaves `side` without state
    # from its gradient-free steps: otherwise the comparison would prove less.
    run = baseline("adam", True)
    assert run.scaler_state is not None and run.scaler_state["scale"] < 2.0**8
    no_watch = baseline("adam", False)
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    state = no_watch.optimizer_state["state"]
    assert int(state[index["side.weight"]]["step"]) == STEPS // 2
    assert index["unused"] not in state


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "adamw-fused"])
@pytest.mark.parametrize("scaler", [False, True], ids=["fp32", "gradscaler"])
@pytest.mark.parametrize(
    "config",
    [{"every": 1, "full": False}, {"every": 5, "full": True}, {"every": 5, "full": False}],
    ids=["every1", "every5-full", "every5"],
)
def test_watched_run_is_bitwise_identical(optimizer, scaler, config):
    plain = baseline(optimizer, scaler)
    watched = train(optimizer, scaler, config)
    assert_bitwise_equal(plain.losses, watched.losses, "losses")
    assert_bitwise_equal(plain.params, watched.params, "params")
    assert_bitwise_equal(plain.optimizer_state, watched.optimizer_state, "optimizer state")
    assert_bitwise_equal(plain.scaler_state, watched.scaler_state, "scaler state")
    assert watched.report is not None
    assert watched.report.subject["detector_errors"] == []
    assert watched.report.subject["complete"] is True
    # Skipped steps do not call optimizer.step(), but a fused optimizer's are called.
    skipped = len(INF_STEPS) if scaler and optimizer != "adamw-fused" else 0
    assert watched.report.subject["steps"] == STEPS - skipped


@pytest.mark.parametrize("optimizer", ["sgd", "adamw", "adamw-fused"])
def test_scaler_skips_reach_dw304_and_change_nothing(optimizer):
    plain = baseline(optimizer, True)
    watched = train(optimizer, True, {"every": 1, "full": True})
    assert_bitwise_equal(plain.params, watched.params, "params")
    assert_bitwise_equal(plain.optimizer_state, watched.optimizer_state, "optimizer state")
    assert watched.report is not None
    skips = [f for f in watched.report.findings if f.code == "DW304" and "GradScaler" in f.message]
    assert len(skips) == 1
    assert skips[0].evidence["skipped"] == len(INF_STEPS)
    # Steps 0-2 went through; a fused optimizer's skipped step is stepped (and counted).
    first = INF_STEPS[0] + (optimizer == "adamw-fused")
    assert skips[0].evidence["first_after_step"] == first
    # The gradient the inf went into is named, on each skip: a fused optimizer's skips
    # are counted on the device, and still blamed on it.
    assert skips[0].evidence["nonfinite_on_skips"] == {"big.weight": len(INF_STEPS)}
    assert not [f for f in watched.report.findings if f.code == "DW305"]


def test_fused_optimizer_sees_unscaled_gradients():
    """The GradScaler hands a fused optimizer scaled gradients (and the kernel unscales
    them): deadweight's gradient statistics must be those of the unscaled gradients."""
    plain = train("adamw", True, {"every": 1})
    fused = train("adamw-fused", True, {"every": 1})
    assert plain.watch is not None and fused.watch is not None
    for name, track in plain.watch.stats.params.items():
        first = track.series.grad_rms[0]
        other = fused.watch.stats.params[name].series.grad_rms[0]
        if name in ("side.weight", "unused"):  # no gradient on step 0
            assert first is None and other is None
            continue
        assert first is not None and first < 10  # unscaled: the loss is O(1)
        assert other == pytest.approx(first, rel=1e-6)
        if track.small_stats is not None:  # no update "lost" on the skipped steps
            assert fused.watch.stats.params[name].small_stats.zero_updates == 0


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_without_the_scaler_argument_skips_are_reported_the_same(optimizer):
    """A GradScaler is seen without `scaler=`: the class-level wrapper sees its steps."""
    plain = baseline(optimizer, True)
    passed = train(optimizer, True, {"every": 5}, pass_scaler=True)
    unpassed = train(optimizer, True, {"every": 5}, pass_scaler=False)
    assert_bitwise_equal(plain.params, unpassed.params, "params")
    assert passed.report is not None and unpassed.report is not None
    assert unpassed.report.subject["steps"] == STEPS - len(INF_STEPS)
    codes = sorted((f.code, f.message) for f in passed.report.findings)
    assert sorted((f.code, f.message) for f in unpassed.report.findings) == codes
    skips = [f for f in unpassed.report.findings if f.code == "DW304" and "GradScaler" in f.message]
    assert len(skips) == 1 and skips[0].evidence["skipped"] == len(INF_STEPS)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_bf16_autocast_is_bitwise_transparent(optimizer):
    plain = train(optimizer, False, None, bf16=True)
    watched = train(optimizer, False, {"every": 3, "full": True}, bf16=True)
    assert_bitwise_equal(plain.losses, watched.losses, "losses")
    assert_bitwise_equal(plain.params, watched.params, "params")
    assert_bitwise_equal(plain.optimizer_state, watched.optimizer_state, "optimizer state")
    assert watched.report is not None and watched.report.subject["detector_errors"] == []
