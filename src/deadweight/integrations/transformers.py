"""`DeadweightCallback` for the transformers `Trainer`: `deadweight.watch` over its model
and optimizer for the length of `train()`.

    from deadweight.integrations.transformers import DeadweightCallback

    dw = DeadweightCallback(every=20, log="run.jsonl")
    trainer = Trainer(model, args, train_dataset=data, callbacks=[dw])
    with dw:                    # optional: also closes the watch if train() raises
        trainer.train()
    dw.report                   # a deadweight.Report; also logged through `logging`

The loss the Trainer logs (every `logging_steps`) is recorded too, for the loss curve
of `deadweight report -o`. The Trainer calls `on_train_end` only when training succeeds. If `train()` raises
outside a `with dw:` block the optimizer hooks stay until `dw.close()` (safe to call
any number of times, as is `dw.watch.close()`) or the next `train()` on this
callback, which closes the stale watch first.
"""

from __future__ import annotations

import logging
import os
import sys
from types import TracebackType
from typing import Any

from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback, WandbCallback
from transformers.trainer_callback import CallbackHandler

from deadweight.integrations._session import WatchSession, checked_forward
from deadweight.integrations.forward import MAX_PARAMS
from deadweight.report import Report
from deadweight.watching.watcher import Watch, exit_reason

logger = logging.getLogger(__name__)


class DeadweightCallback(TrainerCallback):
    """Watch a `Trainer` run for parameters that never learn or only pretend to.

    every: fuller statistics every `every` optimizer steps (see `deadweight.watch`).
    log: write the JSONL event log here (`deadweight report` reads it); with several
        processes each writes its own, `run.rank<N>.jsonl`.
    full: exact update norms of every large parameter on watched steps (costs a copy).
    forward: where the watch's scalars and findings go. "auto": the Trainer's own
        TensorBoard writer and/or W&B run, if `report_to` set them up, else nowhere;
        "tensorboard" / "wandb": only that one; "none"; or a SummaryWriter-like object
        (`add_scalar`) or a W&B run (`log`) of your own. Only the main process forwards.
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
        self.forward = checked_forward(forward)
        self._session = WatchSession(
            logger, every=every, log=log, full=full, max_forwarded=max_forwarded
        )
        self._pending = False  # train() began without an optimizer: start at the first step

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
        self._pending = False
        return self._session.close(reason)

    def __enter__(self) -> DeadweightCallback:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exit_reason(exc))

    # -- Trainer events ------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._session.open:  # an earlier train() raised and never reached on_train_end
            self.close("not closed: the previous train() ended without on_train_end")
        self._pending = True
        self._start(args, state, kwargs, _calling_handler())

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Trainers that create the optimizer after on_train_begin (older transformers,
        # some distributed set-ups) have it by the first step.
        if self._pending:
            self._start(args, state, kwargs, _calling_handler())

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        """The training loss the Trainer logs (already a number, averaged over the
        `logging_steps` since its last log), for the report's loss curve."""
        w = self._session.watch
        loss = (logs or {}).get("loss")
        if w is not None and self._session.open and isinstance(loss, (int, float)):
            w.log_loss(float(loss), step=w.steps_taken)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # -- wiring --------------------------------------------------------------------------

    def _start(
        self, args: Any, state: Any, kwargs: dict[str, Any], handler: CallbackHandler | None
    ) -> None:
        optimizer = kwargs.get("optimizer")
        model = kwargs.get("model")
        if optimizer is None or model is None:
            return  # try again at the next step
        self._pending = False
        targets = self._targets(state, handler)
        self._session.start(
            [model],
            [optimizer],
            # accelerate keeps the fp16 GradScaler on its optimizer wrapper; its skipped
            # steps are worth counting.
            scaler=getattr(optimizer, "scaler", None),
            targets=targets,
            step_offset=int(getattr(state, "global_step", 0) or 0),
            rank=int(getattr(args, "process_index", 0) or 0),
            world_size=int(getattr(args, "world_size", 1) or 1),
        )

    def _targets(self, state: Any, handler: CallbackHandler | None) -> list[Any]:
        if self.forward == "none" or not getattr(state, "is_world_process_zero", True):
            return []
        if not isinstance(self.forward, str):
            return [self.forward]
        callbacks = handler.callbacks if handler is not None else []
        targets: list[Any] = []
        if self.forward in ("auto", "tensorboard"):
            targets += [
                cb.tb_writer
                for cb in callbacks
                if isinstance(cb, TensorBoardCallback) and cb.tb_writer is not None
            ]
        if self.forward in ("auto", "wandb") and any(
            isinstance(cb, WandbCallback) for cb in callbacks
        ):
            # WandbCallback started (or joined) the global run in its on_train_begin,
            # which runs before ours: report_to callbacks come before user callbacks.
            wandb = sys.modules.get("wandb")
            run = getattr(wandb, "run", None)
            if run is not None:
                targets.append(run)
        if not targets and self.forward != "auto":
            logger.warning(
                "deadweight: forward=%r but the Trainer has no %s logger set up (report_to); "
                "not forwarding",
                self.forward,
                self.forward,
            )
        return targets


def _calling_handler() -> CallbackHandler | None:
    """The Trainer's CallbackHandler that is calling this callback.

    transformers hands a callback neither the Trainer nor the other callbacks, so the
    TensorBoard writer that `report_to` created is only reachable through the handler
    that dispatches the event: `CallbackHandler.call_event` calls us directly.
    """
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler):
            return owner
    return None
