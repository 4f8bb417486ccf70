"""The checks of the training loop around one optimizer's steps, wired as one object.

`StepMonitor` measures what a step does to the parameters; these measure how the loop
around the steps treats them: gradients never zeroed between steps
(`grad_accumulation.StaleGradients`) and steps taken with modules in eval mode
(`training_mode.TrainingMode`). Each costs O(1) per step whatever the model's size,
and each is guarded: an exception disables it, is reported as an `error` event, and
never reaches the training loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from deadweight.watching.grad_accumulation import StaleGradients, choose_sentinels
from deadweight.watching.training_mode import TrainingMode

Emit = Callable[[dict[str, Any]], None]


class LoopChecks:
    def __init__(
        self,
        index: int,
        params: Sequence[torch.Tensor],
        held: Sequence[bool],
        models: Sequence[tuple[str, nn.Module]],
        emit: Emit,
        *,
        gradients_in_grad: bool = True,
    ) -> None:
        """`params`: the monitor's parameters (positions as in its events); `held`: which
        of them the optimizer holds; `gradients_in_grad`: False for an optimizer whose
        gradients live elsewhere (DeepSpeed's view), where zeroing is not the loop's."""
        self.index = index
        self.emit = emit
        self.handles: list[RemovableHandle] = []
        self.disabled: set[str] = set()
        self.stale: StaleGradients | None = None
        if gradients_in_grad:
            positions = choose_sentinels(params, held)
            if positions:
                self.stale = StaleGradients(index, params, positions, emit)
                self.handles += self.stale.install()
        self.mode = TrainingMode(index, models, emit) if models else None

    def after_step(self, step: int) -> None:
        if self.stale is not None:
            self._guarded("zero-grad", self.stale.after_step, step)
        if self.mode is not None:
            self._guarded("train-mode", self.mode.before_step, step)

    def watched_step(self) -> None:
        """A watched step: read what the zero-grad check left on an accelerator."""
        if self.stale is not None and self.stale.unread:
            self._guarded("zero-grad", self.stale.flush)

    def close(self) -> None:
        self.watched_step()
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        if self.mode is not None:
            with contextlib.suppress(Exception):
                self.mode.close()

    def _guarded(self, detector: str, fn: Callable[..., Any], *args: Any) -> None:
        if detector in self.disabled:
            return
        try:
            fn(*args)
        except Exception as exc:  # a deadweight bug must never stop training
            self.disabled.add(detector)
            if detector == "zero-grad" and self.stale is not None:
                self.stale.disabled = True
            with contextlib.suppress(Exception):
                self.emit(
                    {
                        "event": "error",
                        "optimizer": self.index,
                        "step": None,
                        "detector": detector,
                        "message": f"{type(exc).__name__}: {exc}",
                    }
                )
