"""`deadweight.watch`: a training-time monitor that lives in optimizer step hooks.

    with deadweight.watch(model, optimizer, log="run.jsonl") as w:
        for batch in data:
            ...                      # the training loop, unchanged
    print(w.report())

Nothing is added to the loop but removable optimizer step hooks, a counter of
backward passes on two parameters, and, while any watch is open, one wrapper around
`GradScaler.step` to see the steps a scaler skips. Framework wrappers (accelerate,
Lightning, Fabric, DeepSpeed, torch.compile, DDP) are looked through: the optimizer
that really steps is watched and parameters keep the names the user gave them.
`watch_all()` is the zero-code variant behind `deadweight run`: global optimizer
hooks that pick up every optimizer a script creates.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from deadweight import wrappers
from deadweight.config import ConfigLike, Settings, settings_for
from deadweight.distributed import ranks as distributed
from deadweight.report import Report
from deadweight.thresholds import Thresholds, using
from deadweight.watching import deepspeed_partitions, scaler_steps
from deadweight.watching.event_log import log_path_for_rank, start_event
from deadweight.watching.event_writer import EventWriter
from deadweight.watching.loss_log import LossLog
from deadweight.watching.optimizer_hooks import OptimizerHooks, begin_step
from deadweight.watching.optimizer_monitors import OptimizerMonitors
from deadweight.watching.step_monitor import MonitorConfig
from deadweight.watching.watch_report import report_from_stats
from deadweight.watching.watch_stats import WatchStats

log = logging.getLogger(__name__)


def exit_reason(exc: BaseException | None) -> str:
    """The `end` event's reason for a run that ended with `exc` (None: normally)."""
    if exc is None:
        return "closed"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return f"raised {type(exc).__name__}: {exc}"


def _as_list(x: Any, kind: type) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, kind):
        return [x]
    items = list(x)
    bad = [type(i).__name__ for i in items if not isinstance(i, kind)]
    if bad:
        raise TypeError(f"expected {kind.__name__} objects, got {', '.join(bad)}")
    return items


def _optimizer_list(x: Any) -> list[Any]:
    """One optimizer (or a framework's object holding one), or an iterable of them."""
    if x is None:
        return []
    if isinstance(x, torch.optim.Optimizer) or wrappers.torch_optimizer(x) is not None:
        return [x]
    try:
        return list(x)
    except TypeError:
        return [x]  # not iterable: reported by _torch_optimizer_or_error


def _stepping(optimizer: Any) -> Any:
    """What `scaler.step(opt)` was handed, as watched: the torch optimizer inside a
    framework's wrapper (accelerate's, stepped through the scaler by the user)."""
    return wrappers.torch_optimizer(optimizer) or optimizer


def _torch_optimizer_or_error(x: Any) -> torch.optim.Optimizer:
    """The optimizer whose steps are watched: a DeepSpeed ZeRO optimizer's view over
    the user's parameters (watching/deepspeed_partitions.py), else the torch optimizer that
    steps inside `x`."""
    view = deepspeed_partitions.view_of(x)
    if view is not None:
        return view
    found = wrappers.torch_optimizer(x)
    if found is None:
        raise TypeError(
            f"expected a torch.optim.Optimizer or a framework's wrapper holding one "
            f"(accelerate, Lightning, Fabric, DeepSpeed), got {type(x).__name__}"
        )
    return found


class Watch:
    """A running monitor. `report()` at any time; `close()` (or leaving the `with`
    block) removes every hook and ends the log.

    It wires four collaborators: `OptimizerMonitors` (what watches each optimizer),
    `OptimizerHooks` (every hook installed, and their removal), `EventWriter` (the
    statistics, the log and the listeners every event goes to) and `LossLog` (the
    loss curve's values)."""

    # The project's select/ignore and thresholds its reports use (`watch(config=...)`).
    settings: Settings = Settings()

    def __init__(
        self,
        models: Sequence[nn.Module] = (),
        optimizers: Sequence[torch.optim.Optimizer] = (),
        *,
        config: MonitorConfig,
        log: str | os.PathLike[str] | None = None,
        scaler: Any = None,
        argv: list[str] | None = None,
        lazy_log: bool = False,
    ) -> None:
        if scaler is not None and not callable(getattr(scaler, "step", None)):
            # Checked before anything is installed, so the error leaves no hook behind.
            raise TypeError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.config = config
        for model in models:  # a DDP model whose process group is gone: say so now
            distributed.ranks_for(model)
        dp_ranks = {
            id(p): group
            for model in models
            if (group := distributed.ddp_ranks(model)) is not None
            for p in model.parameters()
        }
        # Parameters are named as in the user's own module: no `module.` (DDP) or
        # `_orig_mod.` (torch.compile) prefix.
        self.models = [wrappers.user_model(m) for m in models]
        self.stats = WatchStats()
        self._events = EventWriter(
            self.stats, os.fspath(log) if log is not None else None, lazy=lazy_log
        )
        self._hooks = OptimizerHooks()
        self._closed = False
        self._optimizers = OptimizerMonitors(
            self.models, dp_ranks, config, self._events, self._hooks.undo.append
        )
        # The tables the step hooks read, held here too: one lookup each per step.
        self._monitors = self._optimizers.monitors
        self._loop_checks = self._optimizers.loop_checks
        self._replicas = self._optimizers.replicas
        # The loss for the report's curve, read back in one transfer per watched step.
        self._losses = LossLog(self._events, self._monitors)
        self._events.emit(start_event(config.to_dict(), argv))
        main_copies = self._optimizers.main_copies
        watched = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
        for opt in optimizers:  # DeepSpeed's view watches the parameters' fp32 masters
            if isinstance(opt, deepspeed_partitions.ZeroView):
                watched.update(id(p) for p in opt.owners.values())
        # and megatron-core's optimizers their fp32 main copies
        watched.update(id(p) for copy, p in main_copies.items() if copy in watched)
        passengers = [
            (n, p)
            for model in self.models
            for n, p in model.named_parameters()
            if p.requires_grad and id(p) not in watched and not wrappers.zero3_placeholder(p)
        ]
        for k, opt in enumerate(optimizers):
            self.add(opt, passengers=passengers if k == 0 else ())
        # Every torch GradScaler's skipped steps reach the class-level wrapper; any
        # other object with a `step(optimizer)`, or a scaler whose instance has its own
        # `step`, is wrapped itself (a skip both see is counted once).
        if scaler is not None and (
            not scaler_steps.is_torch_scaler(scaler) or "step" in vars(scaler)
        ):
            self._hooks.wrap_scaler(scaler, self._monitors)
        self._hooks.undo.append(scaler_steps.listen(self))

    # -- wiring ----------------------------------------------------------------------------

    def add(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        passengers: Sequence[tuple[str, torch.Tensor]] = (),
    ) -> None:
        """Watch one more optimizer (its parameters are named from the watched models).
        A framework's wrapper is looked through to the torch optimizer inside it."""
        optimizer = _torch_optimizer_or_error(optimizer)
        if self._closed:  # its hooks would never be removed
            raise RuntimeError("this watch is closed; start a new one with deadweight.watch()")
        if id(optimizer) in self._monitors or optimizer in self._optimizers.unwatched:
            return
        if self._optimizers.add(optimizer, passengers) is not None:
            self._hooks.install(
                optimizer, self._pre_hook, self._post_hook, self._optimizers.main_copies
            )

    @property
    def backwards(self) -> int:
        """Backward passes seen so far (at the first or last parameter of an optimizer)."""
        return self._hooks.backwards

    @property
    def log_path(self) -> str | None:
        """Where the log is written (None: no log)."""
        return self._events.path

    # -- GradScaler steps (watching/scaler_steps.py) ---------------------------------------

    def scaler_before(self, optimizer: Any) -> tuple[int, int]:
        monitor = self._monitors.get(id(_stepping(optimizer)))
        return (0, 0) if monitor is None else monitor.scaler_token()

    def scaler_after(self, optimizer: Any, before: tuple[int, int]) -> None:
        # The step may have discovered it.
        monitor = self._monitors.get(id(_stepping(optimizer)))
        if monitor is not None and monitor.skipped_since(before):
            monitor.skipped_by_scaler()

    # -- each step -------------------------------------------------------------------------

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        monitor = self._optimizers.current(optimizer)
        return None if monitor is None else begin_step(monitor, args, kwargs)

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        with contextlib.suppress(Exception):  # never let deadweight stop training
            monitor = self._monitors.get(id(optimizer))
            if monitor is not None:
                monitor.after_step()
                checks = self._loop_checks.get(id(optimizer))
                if checks is not None:
                    checks.after_step(monitor.step)
                    if monitor.window == 0:  # it recorded: a watched step
                        checks.watched_step()
                replica = self._replicas.get(id(optimizer))
                if replica is not None:
                    replica.after_step(monitor.step, monitor.start_step)
                if monitor.window == 0 and self._losses:  # it recorded: a watched step
                    self._losses.flush()

    # -- the loss ---------------------------------------------------------------------------

    def log_loss(self, loss: torch.Tensor | float, *, step: int | None = None) -> None:
        """Record the training loss, for the loss curve of `deadweight report -o`.

        Costs a `detach()` and two list appends: no host sync. The values stay on their
        device until the next watched step, where they are read back in one transfer.
        A loss with several elements is averaged; several losses of one step (gradient
        accumulation) are averaged in the report.

        step: the optimizer step the loss belongs to, counted from 1 when watching
            began. By default the step in progress (a closure) or, between steps, the
            coming one when the loop logs before `optimizer.step()` and the one just
            taken when it logs after it; which of the two is seen at the first call (no
            step taken yet: before).
        """
        losses = self._losses
        if self._closed or losses.off:
            return
        try:
            losses.record(loss, losses.step_for(before=None) if step is None else int(step))
        except Exception as exc:  # never let deadweight stop training
            losses.failed(exc)

    @property
    def writes_log(self) -> bool:
        """Whether the log is open and writable (False before the first step in zero-code
        mode, without a log, or after writing failed)."""
        return self._events.writes_log

    @property
    def steps_taken(self) -> int:
        """Optimizer steps since watching began (of the optimizer that stepped most):
        the step numbers of the log and of `log_loss`."""
        return max((m.step for m in self._monitors.values()), default=0)

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener(event)` with every event after it is recorded (integrations use
        this to forward scalars to TensorBoard or W&B). A listener that raises is
        dropped and the error shown in the report; training goes on."""
        self._events.add_listener(listener)

    def _open_log(self) -> None:
        """Open a lazy log now (zero-code mode: at the first step)."""
        self._events.open_log()

    # -- results ---------------------------------------------------------------------------

    def report(
        self,
        *,
        select: Iterable[str] | str | None = None,
        ignore: Iterable[str] | str | None = None,
    ) -> Report:
        """The findings so far (as of the last watched step)."""
        select, ignore = self.settings.rules(select, ignore)
        if not self._closed:
            self.stats.backwards = self.backwards
        with using(self.settings.thresholds):
            return report_from_stats(self.stats, select=select, ignore=ignore, log=self.log_path)

    def _repr_html_(self) -> str:
        """How Jupyter shows the watch: its report so far and the steps taken; a report
        that cannot be built shows as a message, never as an exception."""
        from deadweight.report.notebook import watch_html

        return watch_html(self.report, steps=self.steps_taken, running=not self._closed)

    def close(self, reason: str = "closed") -> None:
        if self._closed:
            return
        self._closed = True
        self._hooks.remove()
        self._optimizers.finish()
        self._losses.flush()
        self._events.emit(
            {
                "event": "end",
                "reason": reason,
                "steps": self.stats.steps,
                "backwards": self.backwards,
            }
        )
        self._events.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exit_reason(exc))


def watch(
    model: nn.Module | Iterable[nn.Module] | None = None,
    optimizer: Any = None,
    *,
    every: int = 20,
    log: str | os.PathLike[str] | None = None,
    full: bool = False,
    scaler: Any = None,
    small: int | None = None,
    config: ConfigLike = None,
    thresholds: Thresholds | Mapping[str, Any] | None = None,
) -> Watch:
    """Watch training: install optimizer step hooks and return the running `Watch`.

    model: the model(s) whose parameters are named (and checked for movement even if
        no watched optimizer holds them).
    optimizer: the optimizer(s) whose steps are watched; more with `Watch.add`. A
        framework's wrapper (accelerate's AcceleratedOptimizer, Lightning's and
        Fabric's optimizers, a DeepSpeed engine, a Trainer after create_optimizer)
        is looked through to the torch optimizer that steps.
    every: fuller statistics every `every` optimizer steps (the cheap checks run
        every step).
    log: write the versioned JSONL event log here (`deadweight report` reads it).
    full: copy every large parameter on watched steps, for exact update norms of all
        (costs a copy of the parameters each watched step).
    scaler: not needed for a `torch.amp.GradScaler`, whose skipped steps are always
        counted; any other object with `step(optimizer)` that may skip steps.
    small: parameters with at most this many elements get exact per-step statistics.
    config, thresholds: the project configuration and thresholds its reports judge by,
        as for `deadweight.check`.
    """
    settings = settings_for(config, thresholds)  # a bad configuration fails before any hook
    models = _as_list(model, nn.Module)
    optimizers = [_torch_optimizer_or_error(o) for o in _optimizer_list(optimizer)]
    if not optimizers:
        raise TypeError("watch() needs at least one optimizer: its step hooks do the watching")
    monitor = MonitorConfig(
        every=every, full=full, **({"small": small} if small is not None else {})
    )
    ranks = distributed.ranks_for()
    if log is not None and ranks is not None:
        # Rank 0 writes LOG, the others LOG.rankN, as under `deadweight run`.
        log = log_path_for_rank(os.fspath(log), str(ranks.rank))
    w = Watch(models, optimizers, config=monitor, log=log, scaler=scaler, argv=list(sys.argv))
    w.settings = settings
    return w
