"""A failing detector, log or listener never reaches the training loop.

Each fault is injected with monkeypatch into one piece of the monitor; training must
go on bitwise as without the watch, the report must name the disabled piece, and the
findings of the pieces still working must still appear (the seed-1 fused RMSNorm
keeps its DW301 on l1.weight and norm.weight).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import deadweight
from deadweight.demos import fused_rmsnorm
from deadweight.report.text import render_plain
from deadweight.watching import device_buckets, event_log, state_resets, step_monitor
from deadweight.watching.event_log import read_log

STEPS = 60  # DW301 needs 50 optimizer steps
# l1.weight (64 elements) is "large" then: its update norms are copied round-robin and
# its bitwise check goes through the checksum, so every detector has work to do.
SMALL = 16
UNMOVED = {"l1.weight", "norm.weight"}


def _train(watch: dict[str, Any] | None) -> tuple[dict[str, torch.Tensor], deadweight.Watch | None]:
    setup = fused_rmsnorm.make(False, seed=1)
    if watch is None:
        fused_rmsnorm.train(setup, STEPS)
        return {n: p.detach().clone() for n, p in setup.model.named_parameters()}, None
    with deadweight.watch(setup.model, setup.optimizer, small=SMALL, **watch) as w:
        fused_rmsnorm.train(setup, STEPS)
    return {n: p.detach().clone() for n, p in setup.model.named_parameters()}, w


_PLAIN: list[dict[str, torch.Tensor]] = []


def plain_params() -> dict[str, torch.Tensor]:
    if not _PLAIN:
        _PLAIN.append(_train(None)[0])
    return _PLAIN[0]


def failing(after: int = 0) -> Callable[..., Any]:
    """A replacement that raises on its (after + 1)-th call."""
    calls = [0]

    def fail(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("injected fault")

    return fail


def wrapped_failing(original: Callable[..., Any], after: int) -> Callable[..., Any]:
    """Runs `original` for `after` calls, then raises."""
    calls = [0]

    def fail(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise RuntimeError("injected fault")
        return original(*args, **kwargs)

    return fail


def dw301_params(report: deadweight.Report) -> set[str]:
    return {p for f in report.findings if f.code == "DW301" for p in f.params}


def test_healthy_watch_finds_the_seed_and_reports_no_errors():
    params, w = _train({"every": 10})
    assert w is not None
    report = w.report()
    assert dw301_params(report) == UNMOVED
    assert report.subject["detector_errors"] == []
    assert "disabled" not in render_plain(report)
    for name, value in plain_params().items():
        assert torch.equal(value, params[name]), name


# (class, method, detector named in the report, whether DW301 can still be judged)
FAULTS = [
    (step_monitor.StepMonitor, "_gradients", "gradients", True),
    (device_buckets.DeviceBucket, "grads_before", "gradients", True),
    (step_monitor.StepMonitor, "_learning_rates", "learning-rate", True),
    (state_resets.StateResets, "check", "resets", True),
    (state_resets.StateResets, "effects", "resets", True),
    (device_buckets.DeviceBucket, "small_before", "small-parameters", True),
    (device_buckets.DeviceBucket, "small_after", "small-parameters", True),
    (device_buckets.DeviceBucket, "copy_before", "update-norms", True),
    # Without its records nothing says whether a parameter moved: DW301 cannot be judged.
    (device_buckets.DeviceBucket, "measure_after", "record", False),
]


@pytest.mark.parametrize("after", [0, 3], ids=["first-call", "mid-run"])
@pytest.mark.parametrize(
    ("owner", "method", "detector", "judged"), FAULTS, ids=[f[1] for f in FAULTS]
)
def test_a_failing_detector_is_disabled_and_training_goes_on(
    monkeypatch, tmp_path, owner, method, detector, judged, after
):
    monkeypatch.setattr(owner, method, wrapped_failing(getattr(owner, method), after))
    log = tmp_path / "run.jsonl"
    params, w = _train({"every": 10, "log": log})
    assert w is not None
    for name, value in plain_params().items():
        assert torch.equal(value, params[name]), f"{name} differs with {method} failing"
    report = w.report()
    errors = report.subject["detector_errors"]
    assert [e["detector"] for e in errors] == [detector]
    assert "RuntimeError: injected fault" in errors[0]["message"]
    text = render_plain(report, width=200)
    assert f"disabled its {detector} detector" in text
    assert "injected fault" in text
    if judged:
        assert dw301_params(report) == UNMOVED
    # The error is in the log too, and the log is complete.
    events = read_log(log).events
    assert [e["detector"] for e in events if e["event"] == "error"] == [detector]
    assert events[-1]["event"] == "end"


def test_a_failing_monitor_hook_is_swallowed(monkeypatch):
    monkeypatch.setattr(step_monitor.StepMonitor, "before_step", failing())
    monkeypatch.setattr(step_monitor.StepMonitor, "after_step", failing())
    params, w = _train({"every": 10})
    assert w is not None
    for name, value in plain_params().items():
        assert torch.equal(value, params[name]), name


def test_a_failing_log_write_keeps_watching_in_memory(monkeypatch, tmp_path):
    log = tmp_path / "run.jsonl"
    original = event_log.LogWriter.write
    # The start, optimizer and step-1 events are written, then the disk is "full".
    monkeypatch.setattr(event_log.LogWriter, "write", wrapped_failing(original, 3))
    params, w = _train({"every": 10, "log": log})
    assert w is not None
    for name, value in plain_params().items():
        assert torch.equal(value, params[name]), name
    report = w.report()
    assert [e["detector"] for e in report.subject["detector_errors"]] == ["log"]
    assert "disabled its log detector at step 10:" in render_plain(report, width=200)
    assert dw301_params(report) == UNMOVED
    # What was written before the failure is still a readable log (without an end).
    events = read_log(log).events
    assert [e["event"] for e in events] == ["start", "optimizer", "step"]


def test_an_unwritable_log_path_does_not_stop_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    params, w = _train({"every": 10, "log": blocker / "run.jsonl"})  # a file as directory
    assert w is not None
    for name, value in plain_params().items():
        assert torch.equal(value, params[name]), name
    report = w.report()
    assert [e["detector"] for e in report.subject["detector_errors"]] == ["log"]
    assert dw301_params(report) == UNMOVED


def test_a_raising_listener_is_dropped_and_reported():
    setup = fused_rmsnorm.make(False, seed=1)
    seen: list[str] = []

    def listener(event: dict[str, Any]) -> None:
        seen.append(event["event"])
        if event["event"] == "step":
            raise ValueError("listener broke")

    with deadweight.watch(setup.model, setup.optimizer, every=10, small=SMALL) as w:
        good: list[str] = []
        w.add_listener(listener)
        w.add_listener(lambda e: good.append(e["event"]))
        fused_rmsnorm.train(setup, STEPS)
    assert seen == ["step"]  # dropped after its first failure
    assert good.count("step") == STEPS // 10 + 1 and good[-1] == "end"
    params = {n: p.detach() for n, p in setup.model.named_parameters()}
    for name, value in plain_params().items():
        assert torch.equal(value, params[name]), name
    report = w.report()
    errors = report.subject["detector_errors"]
    assert len(errors) == 1 and errors[0]["detector"].startswith("listener")
    assert "ValueError: listener broke" in errors[0]["message"]
    assert "listener broke" in render_plain(report, width=200)
    assert dw301_params(report) == UNMOVED


def test_a_monitor_that_cannot_be_built_leaves_the_optimizer_unwatched():
    # complex128 has 16-byte elements: the bit checksum has no integer view for them.
    model = nn.Linear(4, 4, dtype=torch.complex128)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, dtype=torch.complex128)
    with deadweight.watch(model, opt, every=1) as w:
        for _ in range(3):
            opt.zero_grad()
            model(x).abs().sum().backward()
            opt.step()
    assert opt._optimizer_step_pre_hooks == {} and opt._optimizer_step_post_hooks == {}
    errors = w.report().subject["detector_errors"]
    assert [e["detector"] for e in errors] == ["setup"]
    assert "Adam left unwatched" in errors[0]["message"]


def test_zero_code_mode_does_not_retry_a_monitor_that_cannot_be_built(monkeypatch):
    from deadweight import owners
    from deadweight.watching.global_watch import watch_all

    scans = [0]
    original = owners.owning_models

    def counting(params: Any) -> Any:
        scans[0] += 1
        return original(params)

    monkeypatch.setattr(owners, "owning_models", counting)
    model = nn.Linear(4, 4, dtype=torch.complex128)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4, dtype=torch.complex128)
    with watch_all(every=1) as w:
        for _ in range(4):
            opt.zero_grad()
            model(x).abs().sum().backward()
            opt.step()
    assert scans[0] == 1  # one garbage-collector scan, not one per step
    assert [e["detector"] for e in w.stats.errors] == ["setup"]


def test_a_failing_log_close_does_not_end_the_script(monkeypatch, tmp_path):
    monkeypatch.setattr(event_log.LogWriter, "close", failing())
    params, w = _train({"every": 10, "log": tmp_path / "run.jsonl"})  # no exception
    assert w is not None and w.stats.end is not None
    for name, value in plain_params().items():
        assert torch.equal(value, params[name]), name


def test_a_weakref_proxy_to_the_model_costs_no_names() -> None:
    """Lightning keeps a `weakref.proxy` to the LightningModule; the garbage collector's
    scan finds it beside the module, and it cannot itself be weakly referenced."""
    import weakref

    from deadweight.watching.global_watch import watch_all

    model = torch.nn.Sequential(torch.nn.Linear(3, 3))
    proxy = weakref.proxy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch_all(every=1) as w:
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
    assert proxy is not None
    assert not [e for e in w.stats.errors if e.get("detector") == "names"], w.stats.errors
    assert any(name.endswith("0.weight") for name in w.stats.params)
