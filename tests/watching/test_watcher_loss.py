"""The loss for the report's curve: `Watch.log_loss`, and the loss `deadweight run` sees at
`.backward()`. Values on the device until a watched step, one `loss` event each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import deadweight
from deadweight.demos import fused_rmsnorm
from deadweight.watching.event_log import LOG_SCHEMA_VERSION, read_log
from deadweight.watching.global_watch import watch_all
from deadweight.watching.loss_log import MAX_PENDING_LOSSES
from deadweight.watching.watch_stats import stats_from_events


def _train(setup: fused_rmsnorm.Setup, steps: int, log_loss: Any = None, *, before: bool = False
           ) -> list[float]:  # fmt: skip
    """The demo's loop; the loss handed to `log_loss` before or after optimizer.step()."""
    losses = []
    for _ in range(steps):
        setup.optimizer.zero_grad(set_to_none=True)
        loss = setup.loss()
        loss.backward()
        if log_loss is not None and before:
            log_loss(loss)
        setup.optimizer.step()
        if log_loss is not None and not before:
            log_loss(loss)
        losses.append(loss.item())  # the slow reference, read after the step
    return losses


@pytest.mark.parametrize("before", [False, True], ids=["after-step", "before-step"])
def test_each_loss_is_recorded_at_its_step(tmp_path: Path, before: bool) -> None:
    setup = fused_rmsnorm.make(False)
    seen: list[int] = []
    with deadweight.watch(setup.model, setup.optimizer, every=20, log=tmp_path / "r.jsonl") as w:
        w.add_listener(lambda e: seen.append(w.steps_taken) if e["event"] == "loss" else None)
        reference = _train(setup, 100, w.log_loss, before=before)
    assert w.stats.loss_steps == list(range(1, 101))
    assert w.stats.loss_values == pytest.approx(reference, rel=1e-6)
    # Read back once per watched step with losses pending (step 1 is the baseline
    # record), and once at close, not per step.
    expected = [1, 20, 40, 60, 80, 100] if before else [20, 40, 60, 80, 100, 100]
    assert seen == expected
    events = read_log(tmp_path / "r.jsonl").events
    assert events[0]["schema_version"] == LOG_SCHEMA_VERSION == 2
    from_log = stats_from_events(events)
    assert from_log.loss_steps == w.stats.loss_steps
    assert from_log.loss_values == w.stats.loss_values


def test_explicit_step_and_several_losses_per_step() -> None:
    setup = fused_rmsnorm.make(False)
    with deadweight.watch(setup.model, setup.optimizer, every=5) as w:
        for step in range(1, 11):
            for micro in range(2):  # gradient accumulation: two losses per step
                loss = setup.loss() * (1 + micro)
                loss.backward()
                w.log_loss(loss, step=step)
            setup.optimizer.step()
            setup.optimizer.zero_grad()
        w.log_loss(torch.tensor([1.0, 3.0]), step=11)  # several elements: the mean
        w.log_loss(2.5, step=12)  # a number (what the HF Trainer logs)
    assert w.stats.loss_steps == [s for s in range(1, 11) for _ in range(2)] + [11, 12]
    assert w.stats.loss_values[-2:] == [2.0, 2.5]


def test_log_loss_costs_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between watched steps nothing is read back from the device."""
    setup = fused_rmsnorm.make(False)
    reads: list[str] = []
    for method in ("item", "tolist", "__float__"):
        original = getattr(torch.Tensor, method)

        def counting(self: torch.Tensor, *a: Any, _o: Any = original, _m: str = method) -> Any:
            reads.append(_m)
            return _o(self, *a)

        monkeypatch.setattr(torch.Tensor, method, counting)
    with deadweight.watch(setup.model, setup.optimizer, every=1000) as w:
        _train_quiet(setup, 3)  # steps 1..3: step 1 is the baseline record
        reads.clear()
        for _ in range(50):
            loss = setup.loss()
            loss.backward()
            setup.optimizer.step()
            setup.optimizer.zero_grad()
            w.log_loss(loss)
        assert reads == []
    assert len(w.stats.loss_values) == 50  # read back at close


def _train_quiet(setup: fused_rmsnorm.Setup, steps: int) -> None:
    for _ in range(steps):
        setup.loss().backward()
        setup.optimizer.step()
        setup.optimizer.zero_grad()


def test_pending_losses_are_bounded() -> None:
    setup = fused_rmsnorm.make(False)
    loss = setup.loss().detach()
    with deadweight.watch(setup.model, setup.optimizer, every=10) as w:
        for _ in range(MAX_PENDING_LOSSES + 10):  # logging without stepping
            w.log_loss(loss)
        assert len(w._losses) == 10  # the first MAX_PENDING_LOSSES were read back
        assert len(w.stats.loss_values) == MAX_PENDING_LOSSES
    # A process that has stepped no optimizer (zero-code mode): nothing to attach them to.
    with watch_all(every=10) as g:
        for _ in range(MAX_PENDING_LOSSES + 10):
            g.log_loss(loss)
        assert len(g._losses) == 10
    assert len(g.stats.loss_values) == 10


def test_a_failing_loss_is_reported_not_raised() -> None:
    setup = fused_rmsnorm.make(False)
    with deadweight.watch(setup.model, setup.optimizer, every=10) as w:
        w.log_loss("not a loss")  # type: ignore[arg-type]
        w.log_loss(setup.loss())  # logging is off after the failure
        _train_quiet(setup, 20)
    assert [e["detector"] for e in w.stats.errors] == ["loss"]
    assert not w.stats.loss_recorded


def test_old_log_without_loss_reads(tmp_path: Path) -> None:
    setup = fused_rmsnorm.make(False)
    with deadweight.watch(setup.model, setup.optimizer, every=10, log=tmp_path / "r.jsonl"):
        _train_quiet(setup, 60)
    events = read_log(tmp_path / "r.jsonl").events
    old = [e for e in events if e["event"] != "loss"]
    old[0]["schema_version"] = 1
    (tmp_path / "old.jsonl").write_text("".join(json.dumps(e) + "\n" for e in old))
    contents = read_log(tmp_path / "old.jsonl")
    assert contents.problems == []  # an older version is no problem
    stats = stats_from_events(contents.events)
    assert not stats.loss_recorded and stats.steps == 60


# -- deadweight run: the loss at .backward() --------------------------------------------------


def test_zero_code_records_the_backward_loss(tmp_path: Path) -> None:
    original = torch.Tensor.backward
    setup = fused_rmsnorm.make(False)
    with watch_all(every=20, log=str(tmp_path / "run.jsonl")) as w:
        assert torch.Tensor.backward is not original
        reference = _train(setup, 60)
        # Not losses: a vector-Jacobian product, and a backward that raises.
        x = torch.ones(3, requires_grad=True)
        (x * 2).backward(torch.ones(3))
        with pytest.raises(RuntimeError):
            torch.tensor(1.0).backward()
    assert torch.Tensor.backward is original  # removed at close
    assert w.stats.loss_steps == list(range(1, 61))  # backward comes before its step
    assert w.stats.loss_values == pytest.approx(reference, rel=1e-6)


def test_zero_code_records_the_unscaled_loss_under_a_grad_scaler() -> None:
    setup = fused_rmsnorm.make(False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    reference = []
    with watch_all(every=10) as w:
        for _ in range(30):
            setup.optimizer.zero_grad()
            loss = setup.loss()
            scaler.scale(loss).backward()
            scaler.step(setup.optimizer)
            scaler.update()
            reference.append(loss.item())
    assert w.stats.loss_values == pytest.approx(reference, rel=1e-6)


def test_zero_code_without_loss_records_none_but_still_counts_backward() -> None:
    """The backward passes are what tells `deadweight run` a script that trained
    without a watched optimizer step; the wrapper goes when the watch closes."""
    original = torch.Tensor.backward
    setup = fused_rmsnorm.make(False)
    with watch_all(every=10, loss=False) as w:
        _train(setup, 20)
    assert torch.Tensor.backward is original
    assert not w.stats.loss_recorded
    assert w.backwards == 20
