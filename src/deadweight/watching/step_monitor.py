"""Measure what one optimizer does to its parameters, step by step, without a sync per step.

`StepMonitor` is driven by optimizer step hooks (`before_step` / `after_step`) and
emits plain event dicts (see `event_log` for the schema). It never writes to a
parameter, a gradient or the optimizer's state, and it draws no random numbers, so
training with it is bitwise identical to training without it.

Two cadences:

* every step, cheap: which gradients are missing (Python), one fused
  `torch._foreach_norm` over the present gradients whose squares and non-finite
  flags accumulate *on the device*, the learning rate of each group, optimizer-state
  resets (Python dict lookups), and exact update statistics of the small parameters
  (layer scalars, norm gains, biases: one `cat` before and after the step);
* every `every` steps (a "watched" step): parameter norms, update norms of a
  rotating slice of the large parameters (a copy of at most `copy_fraction` of the
  parameter bytes, or all of them with `full=True`), bitwise-unchanged checks, and
  one host transfer of everything accumulated since the last watched step.

The statistics themselves accumulate in one `DeviceBucket` per device
(`device_buckets.py`); optimizer-state resets and their effects are `StateResets`'
(`state_resets.py`), the steps a GradScaler skipped `ScalerSkips'` (`scaler_skips.py`);
this class runs each step's cheap checks, decides which steps
are watched, and turns each watched step into a `step` event.

Each detector runs under a guard: an exception disables that detector, is reported
as an `error` event, and never reaches the training loop.

Under FSDP2 (DTensor parameters) everything above is measured on the rank's local
slices, and the watched step's record combines the ranks' slices in one collective
(`shard_record.ShardRecord`); nothing else talks to the other ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from deadweight import owners
from deadweight.distributed import ranks as distributed
from deadweight.watching.device_buckets import RING, AmpStep, DeviceBucket, GradOf, own_grad
from deadweight.watching.optimizer_settings import group_settings, host_float
from deadweight.watching.scaler_skips import ScalerSkips
from deadweight.watching.shard_record import VALUES_MAX
from deadweight.watching.state_resets import StateResets

Emit = Callable[[dict[str, Any]], None]

# Parameters with more elements than this are "large": they get norms, not exact
# update statistics. Layer scalars, norm gains and biases of models up to ~4k width fit.
SMALL_DEFAULT = 4096


@dataclass(frozen=True)
class MonitorConfig:
    every: int = 20  # a watched step every `every` optimizer steps
    small: int = SMALL_DEFAULT
    full: bool = False  # copy every large parameter on watched steps (exact update norms)
    # Share of the parameter bytes copied per watched step when `full` is off: the
    # large parameters are measured round-robin, so memory stays within ~10% of
    # params + grads + optimizer state (params alone are about a quarter of that with Adam).
    copy_fraction: float = 0.1
    # Steps measured after an optimizer-state reset. Adam's second moment forgets
    # with time constant 1/(1 - beta2) = 20 steps at the incident's beta2 = 0.95.
    burst: int = 20

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if not 0 < self.copy_fraction <= 1:
            raise ValueError(f"copy_fraction must be in (0, 1], got {self.copy_fraction}")
        if self.burst < 1 or self.burst > RING // 2:
            raise ValueError(f"burst must be in [1, {RING // 2}], got {self.burst}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _g7(value: float) -> float:
    """Seven significant digits: plenty for a norm, and ~40% less log than `repr`."""
    return float(f"{value:.7g}") if math.isfinite(value) else value


def _signature(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """Parameters per group: changes when `add_param_group` adds some."""
    return tuple(len(g["params"]) for g in optimizer.param_groups)


def _watched_params(
    index: int,
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str],
    passengers: Sequence[tuple[str, torch.Tensor]],
    main_copies: Collection[int],
) -> tuple[list[torch.Tensor], list[int | None], list[str]]:
    """The tensors a monitor watches, each once: the optimizer's trainable parameters
    (and main copies), then the passengers it does not hold; with each one's group
    (None for a passenger) and name."""
    params: list[torch.Tensor] = []
    groups: list[int | None] = []
    named: list[str] = []
    seen: set[int] = set()
    for g_index, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if id(p) not in seen and (p.requires_grad or id(p) in main_copies):
                seen.add(id(p))
                params.append(p)
                groups.append(g_index)
                name = names.get(id(p))
                named.append(
                    name if name is not None else owners.fallback_name(index, g_index, j, p)
                )
    # Trainable parameters of the watched models that this optimizer (or any other
    # watched one) does not hold: checked for movement only.
    for _, p in passengers:
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
            groups.append(None)
            name = names.get(id(p))  # (a passenger always has one)
            named.append(name if name is not None else owners.fallback_name(index, 0, 0, p))
    return params, groups, named


class StepMonitor:
    """Watches one optimizer. `before_step` / `after_step` are its step hooks' bodies."""

    def __init__(
        self,
        index: int,
        optimizer: torch.optim.Optimizer,
        names: Mapping[int, str],
        emit: Emit,
        config: MonitorConfig,
        passengers: Sequence[tuple[str, torch.Tensor]] = (),
        start_step: int = 0,
        shards: distributed.Shards | None = None,
        main_copies: Collection[int] = (),
    ) -> None:
        """`names`: id(parameter) -> its name; a parameter without one is named after
        its place in the optimizer (`owners.fallback_name`).
        `shards`: the parameters are DTensors (FSDP2); every rank must then watch
        the same optimizer, since each watched step combines the ranks' slices.
        `main_copies`: ids of the optimizer's tensors that are main copies of
        parameters (`wrappers.main_copy`): watched although they need no gradient."""
        self.index = index
        self.shards = shards
        self.optimizer = optimizer
        # Where each parameter's gradient is read: its `.grad`, or, for an optimizer
        # that steps with gradients kept elsewhere (DeepSpeed's, through its view in
        # watching/deepspeed_partitions.py), what the optimizer's `grad_of` says.
        grad_of = getattr(optimizer, "grad_of", None)
        self.grad_of: GradOf = grad_of if callable(grad_of) else own_grad
        self.config = config
        self.emit = emit
        # A monitor that replaces one of the same optimizer (parameters were added)
        # continues its step numbers.
        self.start_step = start_step
        self.step = start_step
        self.calls_finished = 0  # after_step calls: a GradScaler skip leaves it unchanged
        self.scaler_skips = 0  # skipped_by_scaler calls, so two wrappers count a skip once
        self.disabled: dict[str, str] = {}
        params, groups, self.names = _watched_params(
            index, optimizer, names, passengers, main_copies
        )
        self.params = params
        self.groups = groups
        self.passengers = list(passengers)
        self.signature = _signature(optimizer)
        self.stateful_positions = [i for i, g in enumerate(groups) if g is not None]
        self.present_count = [0] * len(params)
        self.present_window = [0] * len(params)
        self.lr0_steps = [0] * len(params)
        self.window = 0  # steps since the last record
        self.lr_sum = [0.0] * len(optimizer.param_groups)
        self.reported_bad: set[tuple[int, str]] = set()
        self.rotation = 0
        self.small_steps = 0
        by_device: dict[torch.device, list[int]] = {}
        for i, p in enumerate(params):
            by_device.setdefault(p.device, []).append(i)
        self.buckets = [
            DeviceBucket(device, pos, [params[i] for i in pos], config.small, shards, self.grad_of)
            for device, pos in by_device.items()
        ]
        self.resets = StateResets(self)
        self._present: list[int] = []
        self._watched = False
        self._began = False  # before_step ran for the step in progress
        self._amp: AmpStep | None = None
        self.skips = ScalerSkips(self)
        emit(self.describe())

    # -- the event that introduces this optimizer ----------------------------------------

    def describe(self) -> dict[str, Any]:
        groups = [group_settings(group) for group in self.optimizer.param_groups]
        small_order = [b.positions[i] for b in self.buckets for i in b.small]
        return {
            "event": "optimizer",
            "optimizer": self.index,
            "start_step": self.start_step,
            "class": getattr(self.optimizer, "display_name", None) or type(self.optimizer).__name__,
            "groups": groups,
            "params": [
                {
                    "name": name,
                    "shape": list(p.shape),
                    "dtype": str(p.dtype).removeprefix("torch."),
                    "device": str(p.device),
                    "group": group,
                    "pinned": getattr(p, "_deadweight_pin", None) is not None,
                }
                for name, p, group in zip(self.names, self.params, self.groups, strict=True)
            ],
            "small": small_order,
            "values": [i for i in small_order if self.params[i].numel() <= VALUES_MAX],
        }

    # -- guards --------------------------------------------------------------------------

    def _guarded(self, detector: str, fn: Callable[..., Any], *args: Any) -> Any:
        if detector in self.disabled:
            return None
        try:
            return fn(*args)
        except Exception as exc:  # a deadweight bug must never stop training
            reason = f"{type(exc).__name__}: {exc}"
            self.disabled[detector] = reason
            with contextlib.suppress(Exception):
                self.emit(
                    {
                        "event": "error",
                        "optimizer": self.index,
                        "step": self.step,
                        "detector": detector,
                        "message": reason,
                    }
                )
            return None

    # -- hooks ---------------------------------------------------------------------------

    def before_step(self) -> None:
        self._began = True
        self.step += 1
        self.window += 1
        cfg = self.config
        self._watched = (
            self.step == self.start_step + 1  # the baseline record
            or self.step % cfg.every == 0
            or self.step <= self.resets.burst_until
        )
        self._amp = self._guarded("amp", self.skips.amp_step)
        self._guarded("scaler", self.skips.count_fused, self._amp)
        self._guarded("gradients", self._gradients)
        self._guarded("learning-rate", self._learning_rates)
        if self._guarded("resets", self.resets.check):
            self._watched = True  # every step of the burst, in full
        self._guarded("small-parameters", self._small_before)
        if self._watched:
            self._guarded("update-norms", self._copy_before)

    def after_step(self) -> None:
        self.calls_finished += 1
        if not self._began:  # a closure that step() never called: nothing was measured
            return
        self._began = False
        self._guarded("small-parameters", self._small_after)
        self._guarded("resets", self.resets.effects)
        if self._watched:
            self._guarded("scaler", self.skips.report_fused)
            self._guarded("record", self._record)

    def structure_changed(self) -> bool:
        return _signature(self.optimizer) != self.signature

    def finish(self) -> None:
        """Record the steps since the last watched step (watching ends): without this a
        run of 59 steps watched every 20 would be judged on its first 40."""
        if self.window:
            self._guarded("scaler", self.skips.report_fused)
            self._guarded("record", self._record)

    def skipped_by_scaler(self) -> None:
        """The GradScaler found inf/NaN gradients and did not call optimizer.step()."""
        self.scaler_skips += 1
        self._guarded("scaler", self.skips.skipped)

    def scaler_token(self) -> tuple[int, int]:
        """Taken before a scaler step; `skipped_since` tells after it whether it skipped."""
        return self.calls_finished, self.scaler_skips

    def skipped_since(self, token: tuple[int, int]) -> bool:
        """No step finished and no skip was counted (by another wrapper) since `token`."""
        return (self.calls_finished, self.scaler_skips) == token

    # -- detectors -----------------------------------------------------------------------

    def _gradients(self) -> None:
        present = [i for i, p in enumerate(self.params) if self.grad_of(p) is not None]
        self._present = present
        for i in present:
            self.present_count[i] += 1
            self.present_window[i] += 1
        for bucket in self.buckets:  # (every step: the position map is built once)
            local = bucket.local
            bucket.grads_before(self.step, [local[i] for i in present if i in local], self._amp)

    def _learning_rates(self) -> None:
        zero_groups = set()
        for g_index, group in enumerate(self.optimizer.param_groups):
            lr = host_float(group.get("lr"))
            if lr is not None:
                self.lr_sum[g_index] += lr
                if lr == 0:
                    zero_groups.add(g_index)
        if zero_groups:
            for i in self._present:
                if self.groups[i] in zero_groups:
                    self.lr0_steps[i] += 1

    def _small_before(self) -> None:
        for bucket in self.buckets:
            bucket.small_before(self._amp)

    def _small_after(self) -> None:
        for bucket in self.buckets:
            bucket.small_after(self.step)
        self.small_steps += 1

    def _copy_before(self) -> None:
        total = sum(self.params[b.positions[i]].numel() for b in self.buckets for i in b.large)
        budget = total if self.config.full else max(1, int(total * self.config.copy_fraction))
        # Round-robin over the large parameters, at least one per watched step.
        order = [(b, i) for b in self.buckets for i in b.large]
        if not order:
            return
        chosen: dict[int, list[int]] = {}
        used = taken = 0
        for k in range(len(order)):
            bucket, i = order[(self.rotation + k) % len(order)]
            size = bucket.params[i].numel()
            if used and used + size > budget:
                break
            chosen.setdefault(id(bucket), []).append(i)
            used += size
            taken = k + 1
        self.rotation = (self.rotation + taken) % len(order)
        for bucket in self.buckets:
            bucket.copy_before(chosen.get(id(bucket), []))

    def _record(self) -> None:
        n = len(self.params)
        grad_rms: list[float | None] = [None] * n
        pnorm: list[float | None] = [None] * n
        unorm: list[float | None] = [None] * n
        moved: list[bool | None] = [None] * n
        small_stats: dict[str, list[float]] = {
            k: [] for k in ("path", "rpos", "rneg", "sens", "gsum", "zero_upd", "drift")
        }
        values: list[float] = []
        window_present = self.present_window
        for bucket in self.buckets:
            m = bucket.measure_after()
            for k, pos in enumerate(bucket.positions):
                count = window_present[pos]
                grad_rms[pos] = _g7(math.sqrt(m["gsq"][k] / count)) if count else None
                pnorm[pos] = _g7(m["pnorm"][k])
                moved[pos] = m["moved"][k]
                if m["bad_grad"][k] >= 0:
                    self._nonfinite(pos, "grad", int(m["bad_grad"][k]))
                if not math.isfinite(m["pnorm"][k]):
                    self._nonfinite(pos, "value", self.step)
            for k, u in m["unorm"].items():
                unorm[bucket.positions[k]] = _g7(u)
            for key in small_stats:
                small_stats[key] += m[key]
            values += m["values"]
        lrs = [host_float(g.get("lr")) for g in self.optimizer.param_groups]
        self.emit(
            {
                "event": "step",
                "optimizer": self.index,
                "step": self.step,
                "window": self.window,
                "lr": lrs,
                "lr_sum": list(self.lr_sum),
                "grad_present": list(self.present_count),
                "lr0_steps": list(self.lr0_steps),
                "grad_rms": grad_rms,
                "param_norm": pnorm,
                "update_norm": unorm,
                "moved": moved,
                "small_steps": self.small_steps,
                **{f"small_{k}": v for k, v in small_stats.items()},
                "values": values,
            }
        )
        self.window = 0
        self.present_window = [0] * len(self.params)

    def _nonfinite(self, pos: int, what: str, step: int) -> None:
        if (pos, what) in self.reported_bad:
            return
        self.reported_bad.add((pos, what))
        self.emit(
            {
                "event": "nonfinite",
                "optimizer": self.index,
                "step": step,
                "param": pos,
                "what": what,
            }
        )
