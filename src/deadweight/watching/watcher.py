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
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from deadweight import owners, wrappers
from deadweight.config import ConfigLike, Settings, settings_for
from deadweight.distributed import ranks as distributed
from deadweight.distributed.replicas import ReplicaCheck
from deadweight.errors import InputError
from deadweight.report import Report
from deadweight.thresholds import Thresholds, using
from deadweight.watching import deepspeed_partitions, scaler_steps
from deadweight.watching.event_log import LogWriter, log_path_for_rank, start_event
from deadweight.watching.loop_checks import LoopChecks
from deadweight.watching.step_monitor import MonitorConfig, StepMonitor
from deadweight.watching.watch_report import report_from_stats
from deadweight.watching.watch_stats import WatchStats

log = logging.getLogger(__name__)

# Losses held on their device between watched steps. A loop that logs more often than
# it steps (evaluation inside the loop), or a process that never steps, must not hold
# memory without bound: at this many the values are read back (one sync) or, with no
# optimizer watched yet, dropped. 4096 0-d tensors are 2 MB of 512-byte CUDA blocks.
MAX_PENDING_LOSSES = 4096


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
    block) removes every hook and ends the log."""

    # The project's select/ignore and thresholds its reports use (`watch(config=...)`).
    settings: Settings = Settings()
    # Append to the log instead of replacing it: `deadweight run`'s process continuing,
    # after os.execv, the log its earlier image wrote.
    log_append: bool = False

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
        # id(parameter) -> the ranks of its DDP wrapper's process group, when that
        # group is not the whole world: its copies are compared within that group.
        self._dp_ranks: dict[int, tuple[int, ...]] = {
            id(p): group
            for model in models
            if (group := distributed.ddp_ranks(model)) is not None
            for p in model.parameters()
        }
        # Parameters are named as in the user's own module: no `module.` (DDP) or
        # `_orig_mod.` (torch.compile) prefix.
        self.models = [wrappers.user_model(m) for m in models]
        self._ranks: distributed.Ranks | None = None
        self._ranks_known = False
        self._replicas: dict[int, ReplicaCheck] = {}
        self.stats = WatchStats()
        self.log_path: str | None = os.fspath(log) if log is not None else None
        self._writer: LogWriter | None = None
        # Events before the log is opened (zero-code mode opens it at the first step, so
        # processes that never step, such as a launcher or data workers, write nothing).
        self._pending: list[dict[str, Any]] | None = [] if self.log_path is not None else None
        if self.log_path is not None and not lazy_log:
            self._open_log()
        self._monitors: dict[int, StepMonitor] = {}
        # id(optimizer) -> the checks of the loop around its steps (zero_grad, train mode)
        self._loop_checks: dict[int, LoopChecks] = {}
        # the models zero-code mode found when naming parameters (not kept alive by this)
        self._found_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._next_index = 0
        self._handles: list[RemovableHandle] = []
        self._restore: list[Any] = []
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        # Optimizers whose monitor could not be built: left unwatched, not retried.
        self._unwatched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._closed = False
        # The loss for the report's curve: detached values and their steps, read back
        # in one transfer per watched step (`log_loss`).
        self._losses: list[torch.Tensor | float] = []
        self._loss_steps: list[int] = []
        self._loss_after_step: bool | None = None  # how the loop logs, seen at its first call
        self._loss_off = False  # set when recording the loss failed once
        self._names: dict[int, str] = owners.parameter_names(self.models)
        # id(main copy) -> its parameter, for megatron-core's mixed-precision optimizers
        self._main_copies: dict[int, torch.Tensor] = wrappers.main_copies(self.models)
        self._emit(start_event(config.to_dict(), argv))
        watched = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
        for opt in optimizers:  # DeepSpeed's view watches the parameters' fp32 masters
            if isinstance(opt, deepspeed_partitions.ZeroView):
                watched.update(id(p) for p in opt.owners.values())
        # and megatron-core's optimizers their fp32 main copies
        watched.update(id(p) for copy, p in self._main_copies.items() if copy in watched)
        passengers = [
            (n, p)
            for model in self.models
            for n, p in model.named_parameters()
            if p.requires_grad and id(p) not in watched and not wrappers.zero3_placeholder(p)
        ]
        # Backward passes, counted at the first and last parameter of each optimizer:
        # a run whose optimizer never stepped while backward ran is reported (DW309).
        self._backward_counts: dict[int, int] = {}
        for k, opt in enumerate(optimizers):
            self.add(opt, passengers=passengers if k == 0 else ())
        # Every torch GradScaler's skipped steps reach the class-level wrapper; any
        # other object with a `step(optimizer)`, or a scaler whose instance has its own
        # `step`, is wrapped itself (a skip both see is counted once).
        if scaler is not None and (
            not scaler_steps.is_torch_scaler(scaler) or "step" in vars(scaler)
        ):
            self._wrap_scaler(scaler)
        self._restore.append(scaler_steps.listen(self))

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
        if id(optimizer) in self._monitors or optimizer in self._unwatched:
            return
        self._adopt(optimizer)
        monitor = self._monitor_or_none(optimizer, passengers)
        if monitor is None:
            return
        self._handles.append(optimizer.register_step_pre_hook(self._pre_hook))
        self._handles.append(optimizer.register_step_post_hook(self._post_hook))
        self._count_backwards(optimizer)

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """A DeepSpeed ZeRO view: name its tensors after the user's parameters, give
        DeepSpeed its step back when the watch closes, and say what it cannot see."""
        if not isinstance(optimizer, deepspeed_partitions.ZeroView):
            return
        self._restore.append(optimizer.release)
        for view_id, param in optimizer.owners.items():
            name = self._names.get(id(param))
            if name is not None:
                self._names[view_id] = name
        if optimizer.limit is not None:
            self._emit(
                {
                    "event": "error",
                    "optimizer": None,
                    "step": self.stats.steps,
                    "detector": "deepspeed",
                    "message": f"DeepSpeed ZeRO's partitions cannot be mapped to the "
                    f"parameters ({optimizer.limit}): the parameters are watched for "
                    "movement only",
                }
            )

    def _count_backwards(self, optimizer: torch.optim.Optimizer) -> None:
        # A main copy never takes part in backward: its parameter is counted instead.
        tensors = [
            self._main_copies.get(id(p), p) for g in optimizer.param_groups for p in g["params"]
        ]
        trainable = [p for p in tensors if p.requires_grad and p.is_leaf]
        for p in {id(p): p for p in (trainable[:1] + trainable[-1:])}.values():
            if id(p) in self._backward_counts:
                continue
            self._backward_counts[id(p)] = 0
            counts, key = self._backward_counts, id(p)

            def counted(_: torch.Tensor, counts: dict[int, int] = counts, key: int = key) -> None:
                counts[key] += 1

            with contextlib.suppress(Exception):  # a tensor subclass without hooks
                self._handles.append(p.register_post_accumulate_grad_hook(counted))

    @property
    def backwards(self) -> int:
        """Backward passes seen so far (at the first or last parameter of an optimizer)."""
        return max(self._backward_counts.values(), default=0)

    # -- GradScaler steps (watching/scaler_steps.py) ---------------------------------------

    def scaler_before(self, optimizer: Any) -> tuple[int, int]:
        monitor = self._monitors.get(id(_stepping(optimizer)))
        return (0, 0) if monitor is None else monitor.scaler_token()

    def scaler_after(self, optimizer: Any, before: tuple[int, int]) -> None:
        # The step may have discovered it.
        monitor = self._monitors.get(id(_stepping(optimizer)))
        if monitor is not None and monitor.skipped_since(before):
            monitor.skipped_by_scaler()

    def _monitor(
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
        shards = distributed.Shards(self._job_ranks()) if sharded else None
        index = self._next_index
        self._next_index += 1
        positions: dict[int, tuple[int, int]] = {}
        for g, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                positions.setdefault(id(p), (g, j))
        for name, p in passengers:
            self._names.setdefault(id(p), name)

        def name_of(p: torch.Tensor) -> str:
            name = self._names.get(id(p))
            if name is None:
                g, j = positions.get(id(p), (0, 0))
                name = owners.fallback_name(index, g, j, p)
            return name

        monitor = StepMonitor(
            index, optimizer, name_of, self._emit, self.config, passengers, start_step, shards,
            main_copies=self._main_copies,
        )  # fmt: skip
        self._monitors[id(optimizer)] = monitor
        self._check_loop(optimizer, monitor)
        ranks = self._job_ranks()
        if ranks is not None:
            self._replicas[id(optimizer)] = ReplicaCheck(
                ranks,
                index,
                monitor.names,
                monitor.params,
                [g is not None for g in monitor.groups],
                self._emit,
                self.config.every,
                [self._holders(p) for p in monitor.params],
            )
        return monitor

    def _check_loop(self, optimizer: torch.optim.Optimizer, monitor: StepMonitor) -> None:
        """Attach the loop checks of this optimizer (replacing those of a monitor it
        replaces); a failure leaves them off, with an error event, and training goes on."""
        old = self._loop_checks.pop(id(optimizer), None)
        if old is not None:
            old.close()
        try:
            held = [g is not None for g in monitor.groups]
            mine = {id(p) for p, h in zip(monitor.params, held, strict=True) if h}
            known = [*self.models, *self._found_models]
            models = [m for m in known if any(id(p) in mine for p in m.parameters())]
            if not models:  # one scan of the live modules, once per optimizer
                models = owners.owning_models(monitor.params)
            prefixes = owners.model_prefixes(models)
            self._loop_checks[id(optimizer)] = LoopChecks(
                monitor.index,
                monitor.params,
                held,
                list(zip(prefixes, models, strict=True)),
                self._emit,
                gradients_in_grad=not isinstance(optimizer, deepspeed_partitions.ZeroView),
            )
        except Exception as exc:
            self._error("loop checks", exc)

    def _holders(self, p: torch.Tensor) -> tuple[int, ...] | None:
        """The ranks holding copies of this rank's `p` (None: every rank)."""
        shard_replicas = distributed.replica_ranks(p)
        return shard_replicas if shard_replicas is not None else self._dp_ranks.get(id(p))

    def _job_ranks(self) -> distributed.Ranks | None:
        """This job's ranks, looked up when the first optimizer is watched (zero-code
        mode starts before the script initialises its process group)."""
        if not self._ranks_known:
            self._ranks_known = True
            self._ranks = distributed.ranks_for()
            if self._ranks is not None:
                self._emit({"event": "ranks", **self._ranks.describe()})
        return self._ranks

    def _monitor_or_none(
        self,
        optimizer: torch.optim.Optimizer,
        passengers: Sequence[tuple[str, torch.Tensor]] = (),
        start_step: int = 0,
    ) -> StepMonitor | None:
        """The optimizer's monitor, or None (and an error event) when building it fails:
        a deadweight bug, such as a dtype it cannot fingerprint, must not stop training."""
        try:
            return self._monitor(optimizer, passengers, start_step)
        except Exception as exc:
            self._unwatched.add(optimizer)
            self._emit(
                {
                    "event": "error",
                    "optimizer": None,
                    "step": self.stats.steps,
                    "detector": "setup",
                    "message": f"{type(optimizer).__name__} left unwatched: "
                    f"{type(exc).__name__}: {exc}",
                }
            )
            return None

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        monitor = self._current_monitor(optimizer)
        return None if monitor is None else _begin_step(monitor, args, kwargs)

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
                    self._flush_losses()

    def _current_monitor(self, optimizer: torch.optim.Optimizer) -> StepMonitor | None:
        """The optimizer's monitor; a new one when parameters were added to the optimizer
        (`add_param_group`) since it was built, so they are watched too. The statistics
        carry each parameter's history over by name."""
        monitor = self._monitors.get(id(optimizer))
        try:
            if monitor is not None and monitor.structure_changed():
                monitor.finish()
                old = monitor
                del self._monitors[id(optimizer)]
                monitor = self._monitor_or_none(optimizer, old.passengers, start_step=old.step)
        except Exception as exc:
            self._error("setup", exc)
        return monitor

    def _wrap_scaler(self, scaler: Any) -> None:
        """See the steps a GradScaler skips: it does not call optimizer.step() then."""
        original = scaler.step
        monitors = self._monitors

        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            monitor = monitors.get(id(optimizer))
            before = monitor.scaler_token() if monitor is not None else (0, 0)
            result = original(optimizer, *args, **kwargs)
            if monitor is not None and monitor.skipped_since(before):
                with contextlib.suppress(Exception):
                    monitor.skipped_by_scaler()
            return result

        had_own = "step" in vars(scaler)
        scaler.step = step

        def restore() -> None:
            if had_own:
                scaler.step = original
            else:
                del scaler.step

        self._restore.append(restore)

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
        if self._closed or self._loss_off:
            return
        try:
            self._record_loss(loss, self._loss_step(before=None) if step is None else int(step))
        except Exception as exc:  # never let deadweight stop training
            self._loss_failed(exc)

    @property
    def writes_log(self) -> bool:
        """Whether the log is open and writable (False before the first step in zero-code
        mode, without a log, or after writing failed)."""
        return self._writer is not None

    @property
    def steps_taken(self) -> int:
        """Optimizer steps since watching began (of the optimizer that stepped most):
        the step numbers of the log and of `log_loss`."""
        return max((m.step for m in self._monitors.values()), default=0)

    def _loss_step(self, *, before: bool | None) -> int:
        """The step a loss recorded now belongs to (`before`: the loop logs before its
        `optimizer.step()`; None: decide at the first call)."""
        taken = self.steps_taken
        if any(m._began for m in self._monitors.values()):
            return taken  # inside optimizer.step(closure): the step in progress
        if before is None:
            if self._loss_after_step is None:
                self._loss_after_step = taken > 0
            before = not self._loss_after_step
        return taken + 1 if before else taken

    def _record_loss(self, loss: torch.Tensor | float, step: int) -> None:
        value: torch.Tensor | float
        if isinstance(loss, torch.Tensor):
            value = loss.detach() if loss.numel() == 1 else loss.detach().float().mean()
        else:
            value = float(loss)
        self._losses.append(value)
        self._loss_steps.append(step)
        if len(self._losses) >= MAX_PENDING_LOSSES:
            if self._monitors:
                self._flush_losses()
            else:
                self._losses.clear()
                self._loss_steps.clear()

    def _flush_losses(self) -> None:
        """One `loss` event with everything recorded since the last one."""
        losses, steps = self._losses, self._loss_steps
        if not losses:
            return
        self._losses, self._loss_steps = [], []
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
            self._emit(
                {
                    "event": "loss",
                    "steps": steps,
                    # 7 significant digits: the curve needs no more, and the log stays small.
                    "values": [float(f"{v:.7g}") if v is not None else None for v in values],
                }
            )
        except Exception as exc:
            self._loss_failed(exc)

    def _loss_failed(self, exc: Exception) -> None:
        self._loss_off = True
        self._losses, self._loss_steps = [], []
        self._emit(
            {
                "event": "error",
                "optimizer": None,
                "step": self.stats.steps,
                "detector": "loss",
                "message": f"{type(exc).__name__}: {exc}",
            }
        )

    def add_listener(self, listener: Callable[[dict[str, Any]], None]) -> None:
        """Call `listener(event)` with every event after it is recorded (integrations use
        this to forward scalars to TensorBoard or W&B). A listener that raises is
        dropped and the error shown in the report; training goes on."""
        self._listeners.append(listener)

    def _open_log(self) -> None:
        if self.log_path is None or self._writer is not None or self._pending is None:
            return
        pending, self._pending = self._pending, None
        try:
            self._writer = LogWriter(self.log_path, append=self.log_append)
            for event in pending:
                self._writer.write(event)
        except (OSError, InputError) as exc:  # InputError: a path no log may be written to
            self._error("log", exc)
            self._writer = None

    def _error(self, detector: str, exc: Exception) -> None:
        """An error that cannot go through `_emit` (the log or a listener failed): into
        the statistics, and into the log when the log itself still works."""
        event = {
            "event": "error",
            "optimizer": None,
            "step": self.stats.steps,
            "detector": detector,
            "message": f"{type(exc).__name__}: {exc}",
        }
        self.stats.apply(event)
        if self._writer is not None and detector != "log":
            with contextlib.suppress(Exception):
                self._writer.write(event)
        elif self._pending is not None:
            self._pending.append(event)

    def _emit(self, event: dict[str, Any]) -> None:
        try:
            self.stats.apply(event)
        except Exception as exc:
            self._error("statistics", exc)
        if self._pending is not None:
            self._pending.append(event)
        elif self._writer is not None:
            try:
                self._writer.write(event)
            except Exception as exc:  # a full disk must not stop training either
                self._error("log", exc)
                self._writer = None
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception as exc:
                self._listeners.remove(listener)
                self._error(f"listener {listener!r}", exc)

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
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for restore in self._restore:
            with contextlib.suppress(Exception):
                restore()
        self._restore.clear()
        for monitor in self._monitors.values():
            with contextlib.suppress(Exception):
                monitor.finish()
        for checks in self._loop_checks.values():
            with contextlib.suppress(Exception):
                checks.close()
        self._flush_losses()
        self._emit(
            {
                "event": "end",
                "reason": reason,
                "steps": self.stats.steps,
                "backwards": self.backwards,
            }
        )
        if self._writer is not None:
            with contextlib.suppress(Exception):  # a failing flush must not end the script
                self._writer.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(exit_reason(exc))


def _begin_step(monitor: StepMonitor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The body of a step pre-hook: measure the gradients this step will use.

    With a closure (`optimizer.step(closure)`: Lightning, LBFGS) backward runs inside
    `step`, after the pre-hooks, so measuring now would see the previous step's
    gradients. The closure is then wrapped to measure right after its first call,
    which the optimizer makes before it changes anything; the wrapper returns the
    closure's own result, and later calls (LBFGS) go straight through.
    """
    closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
    if not callable(closure):
        with contextlib.suppress(Exception):  # never let deadweight stop training
            monitor.before_step()
        return None
    measured = False

    def measured_closure() -> Any:
        nonlocal measured
        result = closure()
        if not measured:
            measured = True
            with contextlib.suppress(Exception):
                monitor.before_step()
        return result

    if "closure" in kwargs:
        return args, {**kwargs, "closure": measured_closure}
    return (args[0], measured_closure, *args[2:]), kwargs


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
