"""Every hook and patch deadweight installs goes away: after close(), after an exception
in the `with` block, and for the zero-code global hooks and the GradScaler patch."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.amp.grad_scaler import GradScaler
from torch.optim import optimizer as optimizer_module

import deadweight
from deadweight.watching import scaler_steps
from deadweight.watching.global_watch import watch_all


def _global_hooks() -> tuple[dict, dict]:
    return (
        dict(optimizer_module._global_optimizer_pre_hooks),
        dict(optimizer_module._global_optimizer_post_hooks),
    )


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    F.mse_loss(model(torch.randn(4, 4)), torch.zeros(4, 1)).backward()
    opt.step()


def _no_hooks(opt: torch.optim.Optimizer) -> bool:
    return not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_close_removes_the_hooks_and_twice_is_fine(tmp_path):
    model, opt = _setup()
    before = _global_hooks()
    gc.collect()  # a watch an earlier test left open and unreachable
    scaler_step = torch.amp.GradScaler.step
    w = deadweight.watch(model, opt, every=1, log=tmp_path / "run.jsonl")
    assert len(opt._optimizer_step_pre_hooks) == 1 and len(opt._optimizer_step_post_hooks) == 1
    assert torch.amp.GradScaler.step is not scaler_step  # skipped steps are seen
    _step(model, opt)
    w.close()
    assert _no_hooks(opt)
    assert _global_hooks() == before
    assert torch.amp.GradScaler.step is scaler_step
    assert not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())
    steps = w.stats.steps
    _step(model, opt)  # not watched any more
    assert w.stats.steps == steps
    w.close()  # a second close changes nothing
    w.close("again")
    assert w.stats.end == {"event": "end", "reason": "closed", "steps": steps, "backwards": 1}
    lines = (tmp_path / "run.jsonl").read_text().splitlines()
    assert sum('"event":"end"' in line for line in lines) == 1


def test_an_exception_in_the_block_removes_the_hooks_and_is_not_swallowed(tmp_path):
    model, opt = _setup()
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    before = _global_hooks()
    with (
        pytest.raises(ValueError, match="bad batch"),
        deadweight.watch(model, [opt, second], scaler=scaler) as w,
    ):
        # A torch GradScaler is seen through the class; nothing is set on the instance.
        assert scaler_steps.installed() and "step" not in vars(scaler)
        _step(model, opt)
        raise ValueError("bad batch")
    assert _no_hooks(opt) and _no_hooks(second)
    assert _global_hooks() == before
    assert "step" not in vars(scaler)
    assert not scaler_steps.installed()
    assert w.stats.end is not None
    assert w.stats.end["reason"] == "raised ValueError: bad batch"


def test_keyboard_interrupt_in_the_block_is_recorded_as_interrupted():
    model, opt = _setup()
    with pytest.raises(KeyboardInterrupt), deadweight.watch(model, opt) as w:
        _step(model, opt)
        raise KeyboardInterrupt
    assert _no_hooks(opt)
    assert w.stats.end is not None and w.stats.end["reason"] == "interrupted"


def test_a_scaler_with_its_own_step_gets_it_back():
    model, opt = _setup()
    scaler = GradScaler("cpu")

    def own_step(optimizer, *args, **kwargs):
        return GradScaler.step(scaler, optimizer, *args, **kwargs)

    scaler.step = own_step  # type: ignore[method-assign]
    w = deadweight.watch(model, opt, scaler=scaler)
    assert scaler.step is not own_step
    w.close()
    assert scaler.step is own_step


def test_a_watch_never_closed_does_not_keep_the_grad_scaler_wrapped():
    def forgotten() -> None:
        model, opt = _setup()
        deadweight.watch(model, opt)  # never closed: lives as long as its optimizer
        assert scaler_steps.installed()

    forgotten()
    gc.collect()
    assert not scaler_steps.installed()
    assert "step" in vars(GradScaler)  # the class's own method, back in place


def test_a_scaler_skip_seen_by_two_wrappers_counts_once():
    model, opt = _setup()
    scaler = GradScaler("cpu")

    def own_step(optimizer, *args, **kwargs):  # its own step, which calls the class's
        return GradScaler.step(scaler, optimizer, *args, **kwargs)

    scaler.step = own_step  # type: ignore[method-assign]
    with deadweight.watch(model, opt, scaler=scaler) as w:
        for _ in range(3):
            opt.zero_grad()
            loss = model(torch.full((4, 4), float("inf"))).sum()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert w.stats.optimizers[0].scaler_skips == [0, 0, 0]


def test_watch_added_optimizer_loses_its_hooks_too():
    model, opt = _setup()
    extra = torch.optim.SGD(model.parameters(), lr=0.1)
    w = deadweight.watch(model, opt)
    w.add(extra)
    w.add(extra)  # adding twice installs nothing more
    assert len(extra._optimizer_step_pre_hooks) == 1
    w.close()
    assert _no_hooks(opt) and _no_hooks(extra)


@pytest.mark.parametrize("ending", ["normal", "raise", "interrupt"])
def test_watch_all_restores_the_global_hooks_and_the_grad_scaler(ending):
    model, opt = _setup()
    before = _global_hooks()
    gc.collect()  # a watch an earlier test left open and unreachable
    assert not scaler_steps.installed()
    original_step = GradScaler.step
    reasons = {"normal": "closed", "raise": "raised RuntimeError: boom", "interrupt": "interrupted"}
    try:
        with watch_all(every=1) as w:
            assert len(_global_hooks()[0]) == len(before[0]) + 1
            assert GradScaler.step is not original_step
            _step(model, opt)
            if ending == "raise":
                raise RuntimeError("boom")
            if ending == "interrupt":
                raise KeyboardInterrupt
    except (RuntimeError, KeyboardInterrupt):
        assert ending != "normal"
    assert _global_hooks() == before
    assert GradScaler.step is original_step
    assert _no_hooks(opt)
    assert w.stats.steps == 1
    assert w.stats.end is not None and w.stats.end["reason"] == reasons[ending]
    _step(model, opt)  # no longer watched
    assert w.stats.steps == 1


def test_a_bad_scaler_is_refused_before_any_hook_is_installed(tmp_path):
    model, opt = _setup()
    with pytest.raises(TypeError, match="GradScaler"):
        deadweight.watch(model, opt, scaler=object(), log=tmp_path / "run.jsonl")
    assert _no_hooks(opt)
    assert not (tmp_path / "run.jsonl").exists()


def test_adding_to_a_closed_watch_is_refused():
    model, opt = _setup()
    w = deadweight.watch(model, opt)
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.add(torch.optim.SGD(model.parameters(), lr=0.1))
    assert _no_hooks(opt)
