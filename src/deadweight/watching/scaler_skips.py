"""The steps a GradScaler skipped for one monitor's optimizer, as `skip` events.

Two ways a scaler skips. A plain optimizer is simply not stepped: the scaler wrapper
(`scaler_steps`) tells the monitor, which reads right then which gradients held
inf/NaN (the scaler synced to decide anyway). A fused optimizer
(`_step_supports_amp_scaling`) is stepped with the gradients still scaled and skips
inside its kernel, told through `found_inf` / `grad_scale`: those skips are counted on
the device every step and reported at watched steps, with no sync per step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deadweight.distributed import ranks as distributed
from deadweight.watching.device_buckets import AmpStep

if TYPE_CHECKING:
    from deadweight.watching.step_monitor import StepMonitor

# A skip event names at most this many parameters (the count says how many there were).
MAX_SKIP_NAMES = 64


class ScalerSkips:
    """The GradScaler skips of one monitor's optimizer."""

    def __init__(self, monitor: StepMonitor) -> None:
        self.monitor = monitor
        # Steps a fused optimizer skipped, counted on the device and read at watched
        # steps (no sync per step); how many were reported already.
        self.fused: torch.Tensor | None = None
        self.fused_reported = 0
        self.blamed: dict[int, int] = {}  # per position: skips already blamed on it

    def amp_step(self) -> AmpStep | None:
        """A GradScaler steps a fused optimizer (`_step_supports_amp_scaling`) with the
        gradients still scaled, and even when they hold inf/NaN: the kernel unscales and
        skips by itself, told through these two attributes."""
        optimizer = self.monitor.optimizer
        found_inf = getattr(optimizer, "found_inf", None)
        if not isinstance(found_inf, torch.Tensor):
            return None
        scale = getattr(optimizer, "grad_scale", None)
        return found_inf, scale if isinstance(scale, torch.Tensor) else None

    def count_fused(self, amp: AmpStep | None) -> None:
        """Before each step: one more skip on the device when the kernel will skip."""
        if amp is None:
            return
        skipped = (amp[0].detach().reshape(-1)[0] != 0).to(torch.int64)
        self.fused = skipped if self.fused is None else self.fused + skipped

    def report_fused(self) -> None:
        """At a watched step: a `skip` event for each fused skip since the last one."""
        if self.fused is None:
            return
        count = int(self.fused)  # a sync, on watched steps of fused+GradScaler runs only
        new = count - self.fused_reported
        if new <= 0:
            return
        m = self.monitor
        # How many of the new skips each parameter's gradient was inf/NaN on: it is
        # listed on that many of the skip events, so its count comes out exact.
        blamed: dict[int, int] = {}
        for bucket in m.buckets:
            counts = bucket.skip_nonfinite.tolist()
            for k, c in enumerate(counts):
                delta = c - self.blamed.get(bucket.positions[k], 0)
                if delta > 0:
                    blamed[bucket.positions[k]] = delta
                    self.blamed[bucket.positions[k]] = c
        cause = getattr(m.optimizer, "skip_cause", None) or (
            "GradScaler found inf/NaN gradients and the fused optimizer skipped its update"
        )
        for j in range(new):
            bad = sorted(pos for pos, c in blamed.items() if c > j)
            m.emit(
                {
                    "event": "skip",
                    "optimizer": m.index,
                    "step": m.step,
                    "cause": f"{cause} (counted at this watched step)",
                    "nonfinite": bad[:MAX_SKIP_NAMES],
                    "nonfinite_count": len(bad),
                    # step() was called (the kernel skipped), so it is among the steps
                    "counted_as_step": True,
                }
            )
        self.fused_reported = count

    def skipped(self) -> None:
        """The scaler did not call optimizer.step(): a `skip` event naming the
        parameters whose gradient held inf/NaN."""
        m = self.monitor
        bad = self.nonfinite_grads()
        m.emit(
            {
                "event": "skip",
                "optimizer": m.index,
                "step": m.step,
                "cause": "GradScaler found inf/NaN gradients and skipped optimizer.step()",
                "nonfinite": bad[:MAX_SKIP_NAMES],
                "nonfinite_count": len(bad),
            }
        )

    def nonfinite_grads(self) -> list[int]:
        """The positions of the parameters whose gradient holds inf/NaN, read on a step
        the scaler skipped (it has unscaled them by then, and synced to decide): one
        check per parameter and one transfer per device, on skipped steps only."""
        m = self.monitor
        by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
        for k, p in enumerate(m.params):
            g = m.grad_of(p)
            if g is None or g.is_sparse:
                continue
            local = distributed.local_tensor(g)
            by_device.setdefault(local.device, []).append((k, local))
        bad: list[int] = []
        for items in by_device.values():
            finite = torch.stack([torch.isfinite(g).all() for _, g in items]).tolist()
            bad += [k for (k, _), ok in zip(items, finite, strict=True) if not ok]
        return sorted(bad)
