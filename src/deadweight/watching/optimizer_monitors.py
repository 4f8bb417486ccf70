"""What watches each optimizer: its `StepMonitor`, the checks of the loop around its
steps (`LoopChecks`) and, under torch.distributed, the comparison of its parameters'
copies across ranks (`ReplicaCheck`). Built when the optimizer is first watched,
rebuilt when parameters are added to it, finished when the watch closes; a monitor
that cannot be built leaves its optimizer unwatched, with an error event.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from deadweight import owners, wrappers
from deadweight.distributed import ranks as distributed
from deadweight.distributed.replicas import ReplicaCheck
from deadweight.watching import deepspeed_partitions
from deadweight.watching.event_writer import EventWriter
from deadweight.watching.loop_checks import LoopChecks
from deadweight.watching.step_monitor import MonitorConfig, StepMonitor


class OptimizerMonitors:
    """The monitors of one watch, by `id(optimizer)`."""

    def __init__(
        self,
        models: Sequence[nn.Module],
        dp_ranks: dict[int, tuple[int, ...]],
        config: MonitorConfig,
        events: EventWriter,
        on_close: Callable[[Callable[[], None]], None],
    ) -> None:
        """`models`: the user's own modules (wrappers looked through); `dp_ranks`:
        id(parameter) -> the ranks of its DDP wrapper's process group, when that group
        is not the whole world; `on_close`: registers what to undo when the watch
        closes."""
        self.models = models
        self.dp_ranks = dp_ranks
        self.config = config
        self.events = events
        self.on_close = on_close
        self.ranks: distributed.Ranks | None = None
        self.ranks_known = False
        self.monitors: dict[int, StepMonitor] = {}
        self.replicas: dict[int, ReplicaCheck] = {}
        # id(optimizer) -> the checks of the loop around its steps (zero_grad, train mode)
        self.loop_checks: dict[int, LoopChecks] = {}
        # the models zero-code mode found when naming parameters (not kept alive by this)
        self.found_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.next_index = 0
        # Optimizers whose monitor could not be built: left unwatched, not retried.
        self.unwatched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.names: dict[int, str] = owners.parameter_names(self.models)
        # id(main copy) -> its parameter, for megatron-core's mixed-precision optimizers
        self.main_copies: dict[int, torch.Tensor] = wrappers.main_copies(self.models)

    def add(
        self,
        optimizer: torch.optim.Optimizer,
        passengers: Sequence[tuple[str, torch.Tensor]] = (),
    ) -> StepMonitor | None:
        """Watch one more optimizer: its monitor, or None when it cannot be built."""
        self.adopt(optimizer)
        return self.build_or_none(optimizer, passengers)

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """A DeepSpeed ZeRO view: name its tensors after the user's parameters, give
        DeepSpeed its step back when the watch closes, and say what it cannot see."""
        if not isinstance(optimizer, deepspeed_partitions.ZeroView):
            return
        self.on_close(optimizer.release)
        for view_id, param in optimizer.owners.items():
            name = self.names.get(id(param))
            if name is not None:
                self.names[view_id] = name
        if optimizer.limit is not None:
            self.events.emit(
                {
                    "event": "error",
                    "optimizer": None,
                    "step": self.events.stats.steps,
                    "detector": "deepspeed",
                    "message": f"DeepSpeed ZeRO's partitions cannot be mapped to the "
                    f"parameters ({optimizer.limit}): the parameters are watched for "
                    "movement only",
                }
            )

    def build(
        self,
        optimizer: torch.optim.Optimizer,
        passengers: Sequence[tuple[str, torch.Tensor]] = (),
        start_step: int = 0,
    ) -> StepMonitor:
        sharded = distributed.sharded_names(
            [(f"param {j} of group {g}", p) for g, group in enumerate(optimizer.param_groups)
             for j, p in enumerate(group["params"])]
        )  # fmt: skip
        # FSDP2 (DTensor parameters): each watched step combines the ranks' slices.
        shards = distributed.Shards(self.job_ranks()) if sharded else None
        index = self.next_index
        self.next_index += 1
        for name, p in passengers:
            self.names.setdefault(id(p), name)
        emit = self.events.emit
        monitor = StepMonitor(
            index, optimizer, self.names, emit, self.config, passengers, start_step, shards,
            main_copies=self.main_copies,
        )  # fmt: skip
        self.monitors[id(optimizer)] = monitor
        self.check_loop(optimizer, monitor)
        ranks = self.job_ranks()
        if ranks is not None:
            self.replicas[id(optimizer)] = ReplicaCheck(
                ranks,
                index,
                monitor.names,
                monitor.params,
                [g is not None for g in monitor.groups],
                emit,
                self.config.every,
                [self.holders(p) for p in monitor.params],
            )
        return monitor

    def check_loop(self, optimizer: torch.optim.Optimizer, monitor: StepMonitor) -> None:
        """Attach the loop checks of this optimizer (replacing those of a monitor it
        replaces); a failure leaves them off, with an error event, and training goes on."""
        old = self.loop_checks.pop(id(optimizer), None)
        if old is not None:
            old.close()
        try:
            held = [g is not None for g in monitor.groups]
            mine = {id(p) for p, h in zip(monitor.params, held, strict=True) if h}
            known = [*self.models, *self.found_models]
            models = [m for m in known if any(id(p) in mine for p in m.parameters())]
            if not models:  # one scan of the live modules, once per optimizer
                models = owners.owning_models(monitor.params)
            prefixes = owners.model_prefixes(models)
            self.loop_checks[id(optimizer)] = LoopChecks(
                monitor.index,
                monitor.params,
                held,
                list(zip(prefixes, models, strict=True)),
                self.events.emit,
                gradients_in_grad=not isinstance(optimizer, deepspeed_partitions.ZeroView),
            )
        except Exception as exc:
            self.events.error("loop checks", exc)

    def holders(self, p: torch.Tensor) -> tuple[int, ...] | None:
        """The ranks holding copies of this rank's `p` (None: every rank)."""
        shard_replicas = distributed.replica_ranks(p)
        return shard_replicas if shard_replicas is not None else self.dp_ranks.get(id(p))

    def job_ranks(self) -> distributed.Ranks | None:
        """This job's ranks, looked up when the first optimizer is watched (zero-code
        mode starts before the script initialises its process group)."""
        if not self.ranks_known:
            self.ranks_known = True
            self.ranks = distributed.ranks_for()
            if self.ranks is not None:
                self.events.emit({"event": "ranks", **self.ranks.describe()})
        return self.ranks

    def build_or_none(
        self,
        optimizer: torch.optim.Optimizer,
        passengers: Sequence[tuple[str, torch.Tensor]] = (),
        start_step: int = 0,
    ) -> StepMonitor | None:
        """The optimizer's monitor, or None (and an error event) when building it fails:
        a deadweight bug, such as a dtype it cannot fingerprint, must not stop training."""
        try:
            return self.build(optimizer, passengers, start_step)
        except Exception as exc:
            self.unwatched.add(optimizer)
            self.events.emit(
                {
                    "event": "error",
                    "optimizer": None,
                    "step": self.events.stats.steps,
                    "detector": "setup",
                    "message": f"{type(optimizer).__name__} left unwatched: "
                    f"{type(exc).__name__}: {exc}",
                }
            )
            return None

    def current(self, optimizer: torch.optim.Optimizer) -> StepMonitor | None:
        """The optimizer's monitor; a new one when parameters were added to the optimizer
        (`add_param_group`) since it was built, so they are watched too. The statistics
        carry each parameter's history over by name."""
        monitor = self.monitors.get(id(optimizer))
        try:
            if monitor is not None and monitor.structure_changed():
                monitor.finish()
                old = monitor
                del self.monitors[id(optimizer)]
                monitor = self.build_or_none(optimizer, old.passengers, start_step=old.step)
        except Exception as exc:
            self.events.error("setup", exc)
        return monitor

    def finish(self) -> None:
        """Record each monitor's last steps and close the loop checks (the watch closes)."""
        for monitor in self.monitors.values():
            with contextlib.suppress(Exception):
                monitor.finish()
        for checks in self.loop_checks.values():
            with contextlib.suppress(Exception):
                checks.close()
