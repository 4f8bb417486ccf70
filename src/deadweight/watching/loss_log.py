"""The training loss for the report's curve: held on its device, read back once per
watched step, and written as one `loss` event (`Watch.log_loss`, and under
`deadweight run` the loss of every scalar `.backward()`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from deadweight.watching.event_writer import EventWriter

if TYPE_CHECKING:
    from deadweight.watching.step_monitor import StepMonitor

# Losses held on their device between watched steps. A loop that logs more often than
# it steps (evaluation inside the loop), or a process that never steps, must not hold
# memory without bound: at this many the values are read back (one sync) or, with no
# optimizer watched yet, dropped. 4096 0-d tensors are 2 MB of 512-byte CUDA blocks.
MAX_PENDING_LOSSES = 4096


class LossLog:
    """Detached losses and their steps, until the next watched step reads them back in
    one transfer. `len()` is how many are held."""

    def __init__(self, events: EventWriter, monitors: Mapping[int, StepMonitor]) -> None:
        """`monitors`: the watch's monitors by optimizer, whose steps number the losses."""
        self.events = events
        self.monitors = monitors
        self.values: list[torch.Tensor | float] = []
        self.steps: list[int] = []
        self.after_step: bool | None = None  # how the loop logs, seen at its first call
        self.off = False  # set when recording the loss failed once

    def __len__(self) -> int:
        return len(self.values)

    def step_for(self, *, before: bool | None) -> int:
        """The step a loss recorded now belongs to (`before`: the loop logs before its
        `optimizer.step()`; None: decide at the first call)."""
        taken = max((m.step for m in self.monitors.values()), default=0)
        if any(m._began for m in self.monitors.values()):
            return taken  # inside optimizer.step(closure): the step in progress
        if before is None:
            if self.after_step is None:
                self.after_step = taken > 0
            before = not self.after_step
        return taken + 1 if before else taken

    def record(self, loss: torch.Tensor | float, step: int) -> None:
        value: torch.Tensor | float
        if isinstance(loss, torch.Tensor):
            value = loss.detach() if loss.numel() == 1 else loss.detach().float().mean()
        else:
            value = float(loss)
        self.values.append(value)
        self.steps.append(step)
        if len(self.values) >= MAX_PENDING_LOSSES:
            if self.monitors:
                self.flush()
            else:
                self.values.clear()
                self.steps.clear()

    def flush(self) -> None:
        """One `loss` event with everything recorded since the last one."""
        losses, steps = self.values, self.steps
        if not losses:
            return
        self.values, self.steps = [], []
        try:
            values: list[float | None] = [v if isinstance(v, float) else None for v in losses]
            by_device: dict[torch.device, list[int]] = {}
            for i, v in enumerate(losses):
                if isinstance(v, torch.Tensor):
                    by_device.setdefault(v.device, []).append(i)
            for positions in by_device.values():
                # One transfer per device (a host sync), once per watched step.
                tensors = [
                    v.reshape(()) for i in positions if isinstance(v := losses[i], torch.Tensor)
                ]
                read = torch.stack(tensors).double().tolist()
                for i, v in zip(positions, read, strict=True):
                    values[i] = v
            self.events.emit(
                {
                    "event": "loss",
                    "steps": steps,
                    # 7 significant digits: the curve needs no more, and the log stays small.
                    "values": [float(f"{v:.7g}") if v is not None else None for v in values],
                }
            )
        except Exception as exc:
            self.failed(exc)

    def failed(self, exc: Exception) -> None:
        """Recording failed: no more losses are recorded, and an error event says why."""
        self.off = True
        self.values, self.steps = [], []
        self.events.emit(
            {
                "event": "error",
                "optimizer": None,
                "step": self.events.stats.steps,
                "detector": "loss",
                "message": f"{type(exc).__name__}: {exc}",
            }
        )
