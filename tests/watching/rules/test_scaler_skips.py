"""DW304/DW305 for a GradScaler, seen without `scaler=`, and DW309 (no steps)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler

import deadweight
from deadweight.watching import scaler_steps
from deadweight.watching.global_watch import watch_all


class WithBadBranch(nn.Module):
    """`bad` gets an inf gradient on the steps chosen by `poison(step)`."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        self.bad = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor, poisoned: bool) -> torch.Tensor:
        out = self.body(x).pow(2).mean()
        factor = torch.tensor(float("inf") if poisoned else 1.0)
        return out + (self.bad * factor).sum() * 1e-3


def _amp_loop(model: WithBadBranch, opt, steps: int, poison, scaler: GradScaler) -> None:
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(torch.randn(8, 4), poison(step))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def test_a_scaler_skipping_every_step_is_reported_naming_the_parameter() -> None:
    torch.manual_seed(0)
    model = WithBadBranch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with deadweight.watch(model, opt) as w:  # no scaler= argument
        _amp_loop(model, opt, 30, lambda s: True, GradScaler("cpu"))
    report = w.report()
    (skips,) = report.by_code("DW304")
    assert skips.severity == deadweight.Severity.WARNING
    assert skips.evidence["skipped"] == 30 and skips.evidence["share"] == 1
    assert skips.params == ("bad",) and skips.evidence["nonfinite_on_skips"] == {"bad": 30}
    assert "DW305" in skips.fix and "master" not in skips.fix  # fp32 already: the overflow
    (overflow,) = report.by_code("DW305")
    assert overflow.params == ("bad",)
    assert overflow.evidence["nonfinite_on_skips"] == {"bad": 30}
    assert not report.by_code("DW309")  # the scaler's steps are steps tried


def test_a_few_early_skips_are_information_and_no_dw305() -> None:
    torch.manual_seed(0)
    model = WithBadBranch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with deadweight.watch(model, opt) as w:
        _amp_loop(model, opt, 60, lambda s: s in (0, 1), GradScaler("cpu"))
    report = w.report()
    (skips,) = report.by_code("DW304")
    assert skips.severity == deadweight.Severity.INFO
    assert skips.evidence["skipped"] == 2
    assert not report.by_code("DW305")


def test_zero_code_mode_sees_a_scaler_that_skips_from_the_first_step() -> None:
    torch.manual_seed(0)
    model = WithBadBranch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with watch_all(every=10) as w:  # optimizer.step() never runs: found through the scaler
        _amp_loop(model, opt, 20, lambda s: True, GradScaler("cpu"))
    report = w.report()
    (skips,) = report.by_code("DW304")
    assert skips.evidence["skipped"] == 20 and skips.params == ("bad",)
    assert report.by_code("DW305")


@pytest.mark.parametrize("zero_code", [False, True])
def test_a_scaler_stepping_a_framework_wrapper_is_seen(zero_code: bool) -> None:
    """`scaler.step(accelerated_opt)`: the wrapper is looked through to the optimizer watched."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    model = WithBadBranch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, wrapped = accelerate.Accelerator(cpu=True).prepare(model, opt)
    try:
        with watch_all(every=10) if zero_code else deadweight.watch(model, wrapped) as w:
            _amp_loop(model, wrapped, 12, lambda s: s >= 2, GradScaler("cpu"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    report = w.report()
    assert report.subject["optimizers"] == ["AdamW#0"]  # one monitor, on the inner optimizer
    (skips,) = report.by_code("DW304")
    assert skips.evidence["skipped"] == 10 and skips.params == ("bad",)


def test_the_skip_check_reads_nothing_on_healthy_steps(monkeypatch) -> None:
    """The per-parameter inf/NaN check runs on skipped steps only."""
    from deadweight.watching import scaler_skips

    calls = []
    original = scaler_skips.ScalerSkips.nonfinite_grads
    monkeypatch.setattr(
        scaler_skips.ScalerSkips,
        "nonfinite_grads",
        lambda self: calls.append(1) or original(self),
    )
    torch.manual_seed(0)
    model = WithBadBranch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with deadweight.watch(model, opt):
        _amp_loop(model, opt, 10, lambda s: s == 4, GradScaler("cpu"))
    assert len(calls) == 1


# -- DW309 --------------------------------------------------------------------------------


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_dw309_backward_but_the_watched_optimizer_never_steps() -> None:
    model, opt = _model_opt()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadweight.watch(model, opt) as w:
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            other.step()  # not the watched one
            other.zero_grad()
        assert not w.report().by_code("DW309")  # 3 backward passes, still open: no finding
    (found,) = w.report().by_code("DW309")
    assert found.evidence == {"backwards": 3, "optimizers": ["SGD#0"], "complete": True}


def test_dw309_quiet_when_steps_run_or_nothing_trains() -> None:
    model, opt = _model_opt()
    with deadweight.watch(model, opt) as w:
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    assert not w.report().by_code("DW309")
    with deadweight.watch(model, opt) as w, torch.no_grad():  # evaluation only
        model(torch.randn(8, 4))
    assert not w.report().by_code("DW309")


def test_dw309_while_open_after_many_backwards() -> None:
    from deadweight.watching.rules.dynamics import LIVE_BACKWARDS_WITHOUT_STEP

    model, opt = _model_opt()
    with deadweight.watch(model, opt) as w:
        for _ in range(LIVE_BACKWARDS_WITHOUT_STEP):
            model(torch.randn(2, 4)).sum().backward()
        (found,) = w.report().by_code("DW309")
        assert found.evidence["complete"] is False


def test_dw309_from_a_saved_log(tmp_path) -> None:
    model, opt = _model_opt()
    log = tmp_path / "run.jsonl"
    with deadweight.watch(model, opt, log=log):
        model(torch.randn(8, 4)).pow(2).mean().backward()
    from deadweight.watching.event_log import read_log
    from deadweight.watching.watch_stats import stats_from_events
    from deadweight.watching.watcher import report_from_stats

    contents = read_log(log)
    assert contents.problems == []  # the new fields pass the log's schema
    stats = stats_from_events(contents.events)
    assert stats.backwards == 1
    assert report_from_stats(stats).by_code("DW309")


def test_a_log_repeating_a_position_counts_it_once_per_skip(tmp_path) -> None:
    """A hand-edited or corrupt log cannot make a parameter non-finite on more skips
    than there were."""
    import json

    from deadweight.watching.event_log import read_log
    from deadweight.watching.watch_stats import stats_from_events
    from deadweight.watching.watcher import report_from_stats

    model, opt = _model_opt()
    log = tmp_path / "run.jsonl"
    with deadweight.watch(model, opt, log=log):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    lines = log.read_text().splitlines()
    skip = {"event": "skip", "optimizer": 0, "step": 1, "nonfinite": [0] * 1000 + [99, 10**6]}
    lines[-1:-1] = [json.dumps(skip)] * 10
    log.write_text("\n".join(lines) + "\n")
    stats = stats_from_events(read_log(log).events)
    assert stats.params["0.weight"].skipped_nonfinite == 10
    (found,) = report_from_stats(stats).by_code("DW304")
    assert found.evidence["nonfinite_on_skips"] == {"0.weight": 10}


@pytest.fixture(autouse=True)
def _no_scaler_wrapper_left():
    yield
    import gc

    gc.collect()
    assert not scaler_steps.installed()
