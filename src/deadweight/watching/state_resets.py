"""Optimizer-state resets: the Adam-family moments of some parameters start from zero
again (the state was emptied or loaded without state, or a new optimizer took over
parameters another one had trained). Each is a `reset` event, and, once its burst of
fully watched steps is over, a `reset_effect` event comparing the small parameters'
update sizes right after it with those right before it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from deadweight.distributed import ranks as distributed
from deadweight.watching.device_buckets import RING
from deadweight.watching.optimizer_settings import predicted_reset_amplification

if TYPE_CHECKING:
    from deadweight.watching.step_monitor import StepMonitor

# Parameters that had optimizer state under any monitored optimizer: a new optimizer
# over them (zero-code mode sees every optimizer a script creates) starts their
# moments from zero again, which is a reset.
# (Keyed by identity: a tensor's == is elementwise, so a plain WeakKeyDictionary breaks.)
_HAD_STATE: WeakIdKeyDictionary = WeakIdKeyDictionary()


class StateResets:
    """The state resets of one monitor's optimizer, checked at each step before it."""

    def __init__(self, monitor: StepMonitor) -> None:
        self.monitor = monitor
        self.had_state = [bool(_HAD_STATE.get(p)) for p in monitor.params]
        self.pending: list[dict[str, Any]] = []  # resets whose effect is not measured yet
        self.burst_until = 0  # the last step of the latest reset's burst

    def check(self) -> bool:
        """Whether the state of some parameters was reset for the step in progress."""
        m = self.monitor
        state = m.optimizer.state
        fresh = []
        for i in m.stateful_positions:
            p = m.params[i]
            has = bool(state.get(p))
            if has:
                if not self.had_state[i]:
                    self.had_state[i] = True
                    _HAD_STATE[p] = True
            elif self.had_state[i] and m.grad_of(p) is not None:
                fresh.append(i)
        if not fresh:
            return False
        groups = sorted({g for i in fresh if (g := m.groups[i]) is not None})
        predicted = [predicted_reset_amplification(m.optimizer.param_groups[g]) for g in groups]
        event = {
            "event": "reset",
            "optimizer": m.index,
            "step": m.step,
            "params": fresh,
            "predicted_amplification": max((p for p in predicted if p is not None), default=None),
            "cause": "a new optimizer took over parameters another one had trained"
            if m.step == m.start_step + 1
            else "the optimizer's state was emptied (cleared, or loaded without state)",
        }
        m.emit(event)
        # Measure every step of the burst in full, and compare the update sizes of the
        # small parameters right after the reset with those right before it.
        self.burst_until = m.step + m.config.burst - 1
        before = list(range(max(1, m.step - RING + 1), m.step))
        self.pending.append(
            {
                "step": m.step,
                "before_steps": len(before),
                "before": [b.ring_mean(before) if before and b.small else None for b in m.buckets],
            }
        )
        return True

    def effects(self) -> None:
        """The `reset_effect` of each reset whose burst ended with this step."""
        m = self.monitor
        done = [r for r in self.pending if m.step >= r["step"] + m.config.burst - 1]
        for reset in done:
            self.pending.remove(reset)
            after = list(range(reset["step"], reset["step"] + m.config.burst))
            small, before, first, mean_after = [], [], [], []
            for bucket, b_before in zip(m.buckets, reset["before"], strict=True):
                if not bucket.small:
                    continue
                rows = torch.stack(
                    [
                        b_before
                        if b_before is not None
                        else torch.full_like(bucket.path, math.nan),
                        bucket.ring[reset["step"] % RING],
                        bucket.ring_mean(after),
                    ]
                )
                if m.shards is not None and m.shards.ranks is not None:
                    # Norms of the slices -> norms of the parameters (exact per step).
                    world = m.shards.ranks.world_size
                    w = torch.tensor(
                        [distributed.share_of_sum(bucket.params[i], world) for i in bucket.small],
                        dtype=torch.float64,
                    )
                    rows = distributed.all_reduce(
                        m.shards.ranks, rows.cpu() ** 2 * w, "sum", "watch: reset effects"
                    ).sqrt()
                rows_list = rows.tolist()
                small += [bucket.positions[i] for i in bucket.small]
                before += rows_list[0]
                first += rows_list[1]
                mean_after += rows_list[2]
            m.emit(
                {
                    "event": "reset_effect",
                    "optimizer": m.index,
                    "step": reset["step"],
                    "before_steps": reset["before_steps"],
                    "after_steps": len(after),
                    "params": small,
                    "before": before,
                    "first": first,
                    "after": mean_after,
                }
            )
