"""DeadweightCallback in a real Lightning Trainer on a tiny LightningModule."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.integrations._tensorboard import read_events

pl = pytest.importorskip("lightning.pytorch")

from deadweight.integrations.lightning import DeadweightCallback  # noqa: E402

# Lightning's own chatter (no num_workers, its use of a deprecated torch pytree API).
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore:.*LeafSpec.*")


class Tiny(pl.LightningModule):  # type: ignore[misc]
    def __init__(self, *, cut: bool = False, raise_at: int | None = None) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.l2 = nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.ones(1))  # a layer scalar: its value is forwarded
        self.cut = cut
        self.raise_at = raise_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if self.cut:
            # A norm that records no backward: l1 and the norm never get a gradient.
            with torch.no_grad():
                h = self.norm(h)
        else:
            h = self.norm(h)
        return self.l2(torch.relu(h)) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.raise_at is not None and self.global_step == self.raise_at:
            raise RuntimeError(f"boom at step {self.raise_at}")
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(
    module: Any,
    callback: DeadweightCallback,
    *,
    logger: Any = False,
    steps: int = 60,
    samples: int = 64,
    before: Sequence[Any] = (),
    **options: Any,
) -> Any:
    """A quiet CPU Trainer fitting `module` on `samples` random rows, batches of 8; the
    `before` callbacks run ahead of deadweight's, `options` go to the Trainer."""
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(samples, 8), torch.randn(samples, 1)),
        batch_size=8,
    )
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*before, callback],
        **options,
    )
    trainer.fit(module, data)
    return trainer


def hooks_left(trainer: Any) -> int:
    (opt,) = trainer.optimizers
    return len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)


def test_never_learning_layers_are_named(caplog: pytest.LogCaptureFixture) -> None:
    dw = DeadweightCallback(every=10)
    with caplog.at_level(logging.INFO, logger="deadweight"):
        trainer = fit(Tiny(cut=True), dw)
    assert dw.report is not None
    (finding,) = dw.report.by_code("DW301")
    assert set(finding.params) == {"l1.weight", "l1.bias", "norm.weight", "norm.bias"}
    assert finding.evidence["cause"] == "they never received a gradient"
    assert dw.report.subject["end"] == "closed"
    assert hooks_left(trainer) == 0
    assert any("DW301" in r.getMessage() for r in caplog.records)


def test_healthy_run_sees_every_steps_gradient() -> None:
    dw = DeadweightCallback(every=10)
    trainer = fit(Tiny(), dw)
    assert dw.report is not None and dw.report.ok, str(dw.report)
    assert hooks_left(trainer) == 0
    assert dw.watch is not None
    stats = dw.watch.stats
    # Lightning runs backward inside optimizer.step(closure): without running the
    # closure first, step 1 would look gradient-free and each later step would see
    # the previous step's gradient.
    for name in ("l1.weight", "norm.weight", "scale"):
        track = stats.params[name]
        assert track.steps == 60 and track.grad_present == 60, name
        assert track.series.grad_rms[0] is not None, name


def test_gradient_seen_is_this_steps_gradient() -> None:
    """The gradient norm the watch records at step 1 is the one backward produced then."""
    torch.manual_seed(0)
    module = Tiny()
    seen: list[float] = []

    class Spy(pl.Callback):  # type: ignore[misc]
        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            seen.append(float(pl_module.scale.grad.norm()))

    dw = DeadweightCallback(every=1)
    fit(module, dw, steps=2, samples=16, before=[Spy()])
    assert dw.watch is not None
    recorded = dw.watch.stats.params["scale"].series.grad_rms
    assert recorded == pytest.approx(seen, rel=1e-6)


def test_exception_leaves_no_hooks() -> None:
    dw = DeadweightCallback(every=2)
    module = Tiny(raise_at=7)
    trainer: Any = None

    class Keep(pl.Callback):  # type: ignore[misc]
        def on_train_start(self, t: Any, pl_module: Any) -> None:
            nonlocal trainer
            trainer = t

    with pytest.raises(RuntimeError, match="boom at step 7"):
        fit(module, dw, before=[Keep()])
    assert hooks_left(trainer) == 0
    assert dw.report is not None
    assert dw.report.subject["end"] == "raised RuntimeError: boom at step 7"
    assert dw.report.subject["steps"] == 7


def test_forwards_into_the_trainers_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    dw = DeadweightCallback(every=10)  # forward="auto"
    fit(Tiny(cut=True), dw, logger=loggers.TensorBoardLogger(str(tmp_path), name="tb"))
    scalars, texts = read_events(tmp_path)
    scale = scalars["deadweight/value/scale"]
    assert [step for step, _ in scale] == [1, 10, 20, 30, 40, 50, 60]
    assert scale[-1][1] != 1.0  # it learned
    assert "deadweight/update_ratio/l2.bias" in scalars
    assert scalars["deadweight/summary/unmoved"][-1] == (60, 4.0)
    assert scalars["deadweight/findings/error"] == [(60, 1.0)]
    assert "l1.weight" in texts["deadweight/findings/text_summary"]


def test_forwards_into_the_trainers_wandb_run(tmp_path: Path, offline_wandb: Any) -> None:
    loggers = pytest.importorskip("lightning.pytorch.loggers")
    lg = loggers.WandbLogger(save_dir=str(tmp_path), offline=True)
    dw = DeadweightCallback(every=10)  # forward="auto"
    module = Tiny(cut=True)
    fit(module, dw, logger=lg)
    summary = lg.experiment.summary
    assert summary["deadweight/findings/error"] == 1
    assert summary["deadweight/value/scale"] == pytest.approx(module.scale.item())
    assert summary.get("trainer/global_step") is not None  # Lightning's own logging works


def test_forwards_to_a_run_of_your_own() -> None:
    rows: list[dict[str, Any]] = []

    class Run:
        def log(self, data: dict[str, Any]) -> None:
            rows.append(data)

    dw = DeadweightCallback(every=10, forward=Run())
    fit(Tiny(), dw, steps=20)
    assert [row["deadweight/step"] for row in rows] == [1, 10, 20, 20]
    assert "deadweight/value/scale" in rows[0]
    assert rows[-1]["deadweight/findings/error"] == 0.0


class Recording(Tiny):
    """Tiny, keeping each training step's loss as a number (the slow reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_loss_of_each_batch_is_recorded_at_its_step(accumulate: int) -> None:
    module = Recording()
    dw = DeadweightCallback(every=10)
    fit(module, dw, steps=12, accumulate_grad_batches=accumulate)
    assert dw.watch is not None
    stats = dw.watch.stats
    # Every micro-batch's loss, undivided by the accumulation, at the step it fed.
    assert stats.loss_steps == [s for s in range(1, 13) for _ in range(accumulate)]
    assert stats.loss_values == pytest.approx(module.losses, rel=1e-6)
