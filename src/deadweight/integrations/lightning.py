"""`DeadweightCallback` for Lightning: `deadweight.watch` over the LightningModule and
the Trainer's optimizers for the length of `fit()`.

    from deadweight.integrations.lightning import DeadweightCallback

    dw = DeadweightCallback(every=20, log="run.jsonl")
    Trainer(max_steps=10_000, callbacks=[dw]).fit(module, data)
    dw.report                   # a deadweight.Report; also logged through `logging`

The watch starts in `on_train_start` and closes in `on_train_end` or, when `fit()`
raises or is interrupted, in `on_exception`: no hook outlives the run. Works with the
`lightning` package and, when only that is installed, with `pytorch_lightning`. Each
batch's training loss is recorded (on the device, read back at watched steps) for the
loss curve of `deadweight report -o`.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

import torch

from deadweight.integrations._session import WatchSession, checked_forward
from deadweight.integrations.forward import MAX_PARAMS
from deadweight.report import Report
from deadweight.watching.watcher import Watch, exit_reason
from deadweight.wrappers import torch_optimizer

logger = logging.getLogger(__name__)


def _import_lightning() -> tuple[ModuleType, ModuleType]:
    try:
        return (
            importlib.import_module("lightning.pytorch"),
            importlib.import_module("lightning.pytorch.loggers"),
        )
    except ImportError:
        return (
            importlib.import_module("pytorch_lightning"),
            importlib.import_module("pytorch_lightning.loggers"),
        )


pl, pl_loggers = _import_lightning()


class DeadweightCallback(pl.Callback):  # type: ignore[name-defined]
    """Watch a Lightning `fit()` for parameters that never learn or only pretend to.

    every: fuller statistics every `every` optimizer steps (see `deadweight.watch`).
    log: write the JSONL event log here (`deadweight report` reads it); with several
        processes each writes its own, `run.rank<N>.jsonl`.
    full: exact update norms of every large parameter on watched steps (costs a copy).
    forward: where the watch's scalars and findings go. "auto": the Trainer's
        TensorBoardLogger and/or WandbLogger, if it has one, else nowhere;
        "tensorboard" / "wandb": only that one; "none"; or a SummaryWriter-like object
        (`add_scalar`) or a W&B run (`log`) of your own. Only global rank 0 forwards.
    max_forwarded: per-parameter scalars are forwarded for at most this many parameters.
    """

    def __init__(
        self,
        *,
        every: int = 20,
        log: str | os.PathLike[str] | None = None,
        full: bool = False,
        forward: Any = "auto",
        max_forwarded: int = MAX_PARAMS,
    ) -> None:
        super().__init__()
        self.forward = checked_forward(forward)
        self._session = WatchSession(
            logger, every=every, log=log, full=full, max_forwarded=max_forwarded
        )
        self._batch_start_step = 0  # trainer.global_step when the batch began

    @property
    def watch(self) -> Watch | None:
        """The running (or last) watch; `watch.close()` is safe to call twice."""
        return self._session.watch

    @property
    def report(self) -> Report | None:
        """The report of the last run, once it has ended (None before)."""
        return self._session.report

    def close(self, reason: str = "closed") -> Report | None:
        """Remove every hook now and return the report (idempotent)."""
        return self._session.close(reason)

    # -- Lightning events ----------------------------------------------------------------

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._session.open:
            self.close("not closed: the previous fit() ended without on_train_end")
        optimizers = [opt for opt in trainer.optimizers if torch_optimizer(opt) is not None]
        plugin = getattr(trainer, "precision_plugin", None)
        started = self._session.start(
            [pl_module],
            optimizers or list(trainer.optimizers),
            # The 16-mixed precision plugin's GradScaler: its skipped steps are counted.
            scaler=getattr(plugin, "scaler", None),
            targets=self._targets(trainer),
            step_offset=int(trainer.global_step),
            rank=int(trainer.global_rank),
            world_size=int(trainer.world_size),
        )
        if started is None:
            self.close()

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start_step = int(trainer.global_step)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """The batch's loss, for the report's loss curve (on the device: no sync)."""
        w = self._session.watch
        if w is None or not self._session.open:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            return  # a skipped batch, or manual optimization that returned no loss
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            # Lightning hands over the loss divided by the accumulation: undo it.
            loss = loss * trainer.accumulate_grad_batches
        # The batch that ended with an optimizer step belongs to it, the others to the
        # coming one.
        stepped = int(trainer.global_step) > self._batch_start_step
        w.log_loss(loss, step=w.steps_taken if stepped else w.steps_taken + 1)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.close(exit_reason(exception))

    # -- wiring --------------------------------------------------------------------------

    def _targets(self, trainer: Any) -> list[Any]:
        if self.forward == "none" or not trainer.is_global_zero:
            return []
        if not isinstance(self.forward, str):
            return [self.forward]
        targets: list[Any] = []
        for lg in trainer.loggers:
            if self.forward in ("auto", "tensorboard") and isinstance(
                lg, pl_loggers.TensorBoardLogger
            ):
                targets.append(lg.experiment)  # its SummaryWriter
            elif self.forward in ("auto", "wandb") and isinstance(lg, pl_loggers.WandbLogger):
                targets.append(lg.experiment)  # its wandb run
        if not targets and self.forward != "auto":
            logger.warning(
                "deadweight: forward=%r but the Trainer has no %s logger; not forwarding",
                self.forward,
                self.forward,
            )
        return targets
