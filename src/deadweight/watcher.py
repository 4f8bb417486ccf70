"""`deadweight.watch`: a training-time monitor that lives in optimizer step hooks.

    with deadweight.watch(model, optimizer, log="run.jsonl") as w:
        for batch in data:
            ...                      # the training loop, unchanged
    print(w.report())

Nothing is added to the loop but removable optimizer step hooks (and, when a
GradScaler is passed, a wrapper around that scaler's `step` to see the steps it
skips). `watch_all()` is the zero-code variant behind `deadweight run`: global
optimizer hooks that pick up every optimizer a script creates.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from deadweight.errors import InputError
from deadweight.probes import distributed, owners
from deadweight.probes.event_log import LogWriter, log_path_for_rank, start_event
from deadweight.probes.replicas import ReplicaCheck
from deadweight.probes.step_monitor import MonitorConfig, StepMonitor
from deadweight.probes.watch_stats import WatchStats
from deadweight.registry import Selection, rules_consuming
from deadweight.report import Report

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


class Watch:
    """A running monitor. `report()` at any time; `close()` (or leaving the `with`
    block) removes every hook and ends the log."""

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
        # A DDP wrapper's parameters are named as in a single process.
        self.models = [distributed.unwrap(m) for m in models]
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
        self._next_index = 0
        self._handles: list[RemovableHandle] = []
        self._restore: list[Any] = []
        self._listeners: list[Callable[[dict[str, Any]], None]] = []
        # Optimizers whose monitor could not be built: left unwatched, not retried.
        self._unwatched: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._closed = False
        self._names: dict[int, str] = owners.parameter_names(self.models)
        self._emit(start_event(config.to_dict(), argv))
        watched = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
        passengers = [
            (n, p)
            for model in self.models
            for n, p in model.named_parameters()
            if p.requires_grad and id(p) not in watched
        ]
        for k, opt in enumerate(optimizers):
            self.add(opt, passengers=passengers if k == 0 else ())
        if scaler is not None:
            self._wrap_scaler(scaler)

    # -- wiring ----------------------------------------------------------------------------

    def add(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        passengers: Sequence[tuple[str, torch.Tensor]] = (),
    ) -> None:
        """Watch one more optimizer (its parameters are named from the watched models)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if self._closed:  # its hooks would never be removed
            raise RuntimeError("this watch is closed; start a new one with deadweight.watch()")
        if id(optimizer) in self._monitors or optimizer in self._unwatched:
            return
        monitor = self._monitor_or_none(optimizer, passengers)
        if monitor is None:
            return
        self._handles.append(optimizer.register_step_pre_hook(self._pre_hook))
        self._handles.append(optimizer.register_step_post_hook(self._post_hook))

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
        if sharded:
            raise InputError(f"{distributed.FSDP2_WATCH_UNSUPPORTED} ({len(sharded)} sharded)")
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
            index, optimizer, name_of, self._emit, self.config, passengers, start_step
        )
        self._monitors[id(optimizer)] = monitor
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
            )
        return monitor

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
                replica = self._replicas.get(id(optimizer))
                if replica is not None:
                    replica.after_step(monitor.step, monitor.start_step)

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
            before = monitor.calls_finished if monitor is not None else 0
            result = original(optimizer, *args, **kwargs)
            if monitor is not None and monitor.calls_finished == before:
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
            self._writer = LogWriter(self.log_path)
            for event in pending:
                self._writer.write(event)
        except OSError as exc:
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
        return report_from_stats(self.stats, select=select, ignore=ignore, log=self.log_path)

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
        self._emit({"event": "end", "reason": reason, "steps": self.stats.steps})
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


class GlobalWatch(Watch):
    """Watches every optimizer that steps while it is open (zero-code mode)."""

    def __init__(self, *, config: MonitorConfig, log: str | None, argv: list[str] | None) -> None:
        super().__init__(config=config, log=log, argv=argv, lazy_log=True)
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._handles.append(register_optimizer_step_pre_hook(self._global_pre))
        self._handles.append(register_optimizer_step_post_hook(self._global_post))
        self._patch_grad_scaler()

    def _global_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            monitor = self._current_monitor(optimizer)
            if monitor is None:
                if optimizer in self._unwatched:
                    return None
                monitor = self._discover(optimizer)
                if monitor is None:
                    return None
            return _begin_step(monitor, args, kwargs)
        return None

    def _global_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._post_hook(optimizer, args, kwargs)

    def _discover(self, optimizer: torch.optim.Optimizer) -> StepMonitor | None:
        self._open_log()
        try:
            # Name from every model that a live optimizer trains, not only this one's: a
            # GAN's generator and discriminator both have a `net.0.weight`, and the names
            # must differ (by class prefix) from the first step, before the other steps.
            params = [
                p
                for opt in _live_optimizers(optimizer)
                for g in opt.param_groups
                for p in g["params"]
            ]
            models = owners.owning_models(params)
            for name_id, name in owners.parameter_names(models).items():
                self._names.setdefault(name_id, name)
        except Exception as exc:  # unnamed parameters are still watched
            self._error("names", exc)
        # An optimizer built over parameters another one trained (a new stage, a load
        # without optimizer state) takes them over: record the old one's last steps now.
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for other in self._monitors.values():
            if any(id(p) in mine for p in other.params):
                with contextlib.suppress(Exception):
                    other.finish()
        return self._monitor_or_none(optimizer)

    def _patch_grad_scaler(self) -> None:
        try:
            from torch.amp.grad_scaler import GradScaler
        except ImportError:  # pragma: no cover - torch without amp
            return
        original = GradScaler.step
        monitors = self._monitors

        def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            monitor = monitors.get(id(optimizer))
            before = monitor.calls_finished if monitor is not None else 0
            result = original(scaler, optimizer, *args, **kwargs)
            monitor = monitors.get(id(optimizer))  # the first step may have discovered it
            if monitor is not None and monitor.calls_finished == before:
                with contextlib.suppress(Exception):
                    monitor.skipped_by_scaler()
            return result

        GradScaler.step = step  # type: ignore[method-assign,assignment]

        def restore() -> None:
            GradScaler.step = original  # type: ignore[method-assign]

        self._restore.append(restore)


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


def _live_optimizers(first: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    found = [first]
    with warnings.catch_warnings():  # isinstance() touches deprecated module proxies
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.optim.Optimizer) and obj is not first:
                    found.append(obj)
            except Exception:  # lazy proxies can raise on __class__
                continue
    return found


def report_from_stats(
    stats: WatchStats,
    *,
    select: Iterable[str] | str | None = None,
    ignore: Iterable[str] | str | None = None,
    log: str | None = None,
) -> Report:
    from deadweight.probes.distributed import RankPresence
    from deadweight.rules.distributed import presence_from_watch

    selection = Selection.of(select, ignore)
    findings = [f for r in rules_consuming(WatchStats) for f in r.judge(stats)]
    presence = presence_from_watch(stats)
    if presence is not None:
        findings += [f for r in rules_consuming(RankPresence) for f in r.judge(presence)]
    subject = {
        "log": log,
        "steps": stats.steps,
        "optimizers": [f"{o.cls}#{o.index}" for o in stats.optimizers.values()],
        "parameters": len(stats.params),
        "complete": stats.complete,
        "end": (stats.end or {}).get("reason"),
        "detector_errors": stats.errors,
        "problems": stats.problems,
    }
    if stats.ranks is not None:
        subject["distributed"] = {**stats.ranks, "complete": stats.ranks_complete}
    return Report.of("watch", selection.filter(findings), subject)


def watch(
    model: nn.Module | Iterable[nn.Module] | None = None,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    *,
    every: int = 20,
    log: str | os.PathLike[str] | None = None,
    full: bool = False,
    scaler: Any = None,
    small: int | None = None,
) -> Watch:
    """Watch training: install optimizer step hooks and return the running `Watch`.

    model: the model(s) whose parameters are named (and checked for movement even if
        no watched optimizer holds them).
    optimizer: the optimizer(s) whose steps are watched; more with `Watch.add`.
    every: fuller statistics every `every` optimizer steps (the cheap checks run
        every step).
    log: write the versioned JSONL event log here (`deadweight report` reads it).
    full: copy every large parameter on watched steps, for exact update norms of all
        (costs a copy of the parameters each watched step).
    scaler: a `torch.amp.GradScaler` whose skipped steps should be counted.
    small: parameters with at most this many elements get exact per-step statistics.
    """
    models = _as_list(model, nn.Module)
    optimizers = _as_list(optimizer, torch.optim.Optimizer)
    if not optimizers:
        raise TypeError("watch() needs at least one optimizer: its step hooks do the watching")
    sharded = distributed.sharded_names(
        [(n, p) for m in models for n, p in m.named_parameters()]
        + [(f"optimizer param {j}", p) for o in optimizers for g in o.param_groups
           for j, p in enumerate(g["params"])]
    )  # fmt: skip
    if sharded:
        raise InputError(
            f"{distributed.FSDP2_WATCH_UNSUPPORTED} (sharded: {', '.join(sharded[:3])})"
        )
    config = MonitorConfig(
        every=every, full=full, **({"small": small} if small is not None else {})
    )
    ranks = distributed.ranks_for()
    if log is not None and ranks is not None:
        # Rank 0 writes LOG, the others LOG.rankN, as under `deadweight run`.
        log = log_path_for_rank(os.fspath(log), str(ranks.rank))
    return Watch(models, optimizers, config=config, log=log, scaler=scaler, argv=list(sys.argv))


@contextlib.contextmanager
def watch_all(
    *, every: int = 20, log: str | None = None, full: bool = False, argv: list[str] | None = None
) -> Iterator[GlobalWatch]:
    """Watch every optimizer that steps inside the block (what `deadweight run` uses)."""
    w = GlobalWatch(config=MonitorConfig(every=every, full=full), log=log, argv=argv)
    try:
        yield w
    except BaseException as exc:
        w.close(exit_reason(exc))
        raise
    else:
        w.close()
