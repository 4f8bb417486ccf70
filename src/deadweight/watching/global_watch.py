"""`deadweight run`'s watch: every optimizer that steps in the process, found as it
steps, with the loss of every `.backward()` and the step-0 check at the first step
(`watch_all`; `run_in_script` starts it inside the user's script)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from deadweight import owners, wrappers
from deadweight.watching import deepspeed_partitions
from deadweight.watching.first_step_check import FirstStep
from deadweight.watching.optimizer_hooks import begin_step
from deadweight.watching.step_monitor import MonitorConfig, StepMonitor
from deadweight.watching.watcher import Watch, _stepping, exit_reason


class GlobalWatch(Watch):
    """Watches every optimizer that steps while it is open (zero-code mode)."""

    def __init__(
        self,
        *,
        config: MonitorConfig,
        log: str | None,
        argv: list[str] | None,
        loss: bool = True,
        check: bool = False,
    ) -> None:
        """`loss`: record the loss at each `.backward()` (counted either way); `check`:
        run `deadweight.check` on the first training batch at the first optimizer step
        (watching/first_step_check.py)."""
        super().__init__(config=config, log=log, argv=argv, lazy_log=True)
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        # The unscaled loss behind the tensor a GradScaler returned last, so the loss
        # seen at backward is the script's own (scale() output, detached loss).
        self._scaled: tuple[weakref.ref[torch.Tensor], torch.Tensor] | None = None
        self._hooks.handles.append(register_optimizer_step_pre_hook(self._global_pre))
        self._hooks.handles.append(register_optimizer_step_post_hook(self._global_post))
        self._tensor_backwards = 0  # scalar `.backward()` calls, when the loss is recorded
        self._record_losses = loss
        self._checking = False  # inside the step-0 check, whose backward is deadweight's
        self._first: FirstStep | None = None
        if check:
            self._first = FirstStep()
            self._hooks.undo.append(self._first.close)
        if loss:
            self._patch_scale()
        # Always: the backward passes it counts tell `deadweight run` a process that
        # trained without any optimizer step it could watch (watching/run_status.py).
        self._patch_backward()

    @property
    def backwards(self) -> int:
        return max(super().backwards, self._tensor_backwards)

    def scaler_before(self, optimizer: Any) -> tuple[int, int]:
        # A scaler that skips from the first step on is the only sign of its optimizer.
        optimizer = _stepping(optimizer)
        if (
            not self._closed
            and isinstance(optimizer, torch.optim.Optimizer)
            and id(optimizer) not in self._monitors
            and optimizer not in self._optimizers.unwatched
        ):
            self._discover(optimizer)
        return super().scaler_before(optimizer)

    def _patch_backward(self) -> None:
        """Record the loss of a script that does not log it: the scalar on which
        `.backward()` is called. The wrapper costs a Python call and a detach per
        backward (benchmarks/README.md); it is removed when the watch closes.
        `torch.autograd.backward(loss)` and `torch.autograd.grad` are not seen."""
        original = torch.Tensor.backward
        record = self._loss_from_backward
        first = self._first

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # While the graph is whole; the step-0 check's own backward is not the script's.
            if first is not None and not first.done and not self._checking:
                self._loss_to_check(first, tensor, args, kwargs)
            result = original(tensor, *args, **kwargs)
            if self._checking:  # the step-0 check's own backward is not the script's
                return result
            self._tensor_backwards += 1
            # After backward returned: a backward that raises records nothing.
            record(tensor, args, kwargs)
            return result

        backward.__doc__ = original.__doc__
        torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]

        def restore() -> None:
            if torch.Tensor.backward is backward:  # not if someone wrapped it after us
                torch.Tensor.backward = original  # type: ignore[method-assign]

        self._hooks.undo.append(restore)

    def _loss_from_backward(
        self, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if self._closed or self._losses.off or not self._record_losses:
            return
        try:
            if not _is_loss(tensor, args, kwargs):
                return
            scaled = self._scaled
            if scaled is not None and scaled[0]() is tensor:
                tensor = scaled[1]
            # backward runs before optimizer.step(), or inside its closure.
            self._losses.record(tensor, self._losses.step_for(before=True))
        except Exception as exc:  # never let deadweight stop training
            self._losses.failed(exc)

    def _loss_to_check(
        self, first: FirstStep, tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):  # never let deadweight stop training
            if _is_loss(tensor, args, kwargs):  # a GradScaler's scaled loss leads back too
                first.on_backward(tensor)

    def _global_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        monitor: StepMonitor | None = None
        with contextlib.suppress(Exception):
            monitor = self._optimizers.current(optimizer)
            if (
                monitor is None
                and optimizer not in self._optimizers.unwatched
                and not self._zero_inner(optimizer)
            ):
                monitor = self._discover(optimizer)
        # After discovery, so the check names the parameters as the watch does.
        first = self._first
        if first is not None and not first.done and first.before_step(optimizer, args, kwargs):
            self._first_step_check(first, optimizer)
        if monitor is None:
            return None
        with contextlib.suppress(Exception):
            return begin_step(monitor, args, kwargs)
        return None

    def _global_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        first = self._first
        if first is not None and first.after_step(optimizer):  # backward ran in step(closure)
            self._first_step_check(first, optimizer)
        self._post_hook(optimizer, args, kwargs)

    def _first_step_check(self, first: FirstStep, optimizer: torch.optim.Optimizer) -> None:
        """The step-0 check of this optimizer, into the log; never stops the script."""
        self._checking = True
        try:
            event = first.run(optimizer, self._optimizers.names)
        except Exception as exc:
            self._events.error("step-0 check", exc)
            return
        finally:
            self._checking = False
        try:
            self._open_log()
            self._events.emit({"event": "check", "step": 0, **event})
        except Exception as exc:
            self._events.error("step-0 check", exc)

    def _zero_inner(self, optimizer: torch.optim.Optimizer) -> bool:
        """The torch optimizer inside a DeepSpeed ZeRO optimizer, stepped once per
        parameter group on flat partitions: never watched itself. Its ZeRO optimizer
        is watched through its view instead, from the next training step on (the
        view's hooks run around DeepSpeed's whole step)."""
        zero = deepspeed_partitions.owner_of(optimizer)
        if zero is None:
            return False
        self._optimizers.unwatched.add(optimizer)
        self._hooks.undo.append(deepspeed_partitions.on_next_step(zero, self._watch_zero))
        return True

    def _watch_zero(self, zero: Any) -> deepspeed_partitions.ZeroView | None:
        if self._closed:
            return None
        view = deepspeed_partitions.view_of(zero)
        if view is not None and id(view) not in self._monitors:
            self._open_log()
            self._name_from_models(list(view.owners.values()))
            self._optimizers.add(view)
        return view

    def _name_from_models(self, params: list[torch.Tensor]) -> None:
        try:
            models = owners.owning_models(params)
            for model in models:  # a weakref.proxy to a module (Lightning's) has no weakref
                with contextlib.suppress(TypeError):
                    self._optimizers.found_models.add(model)
            for name_id, name in owners.parameter_names(models).items():
                self._optimizers.names.setdefault(name_id, name)
            for copy_id, p in wrappers.main_copies(models).items():
                self._optimizers.main_copies.setdefault(copy_id, p)
        except Exception as exc:  # unnamed parameters are still watched
            self._events.error("names", exc)

    def _discover(self, optimizer: torch.optim.Optimizer) -> StepMonitor | None:
        self._open_log()
        # Name from every model that a live optimizer trains, not only this one's: a
        # GAN's generator and discriminator both have a `net.0.weight`, and the names
        # must differ (by class prefix) from the first step, before the other steps.
        with contextlib.suppress(Exception):
            self._name_from_models(
                [
                    p
                    for opt in owners.live_optimizers(optimizer)
                    for g in opt.param_groups
                    for p in g["params"]
                ]
            )
        # An optimizer built over parameters another one trained (a new stage, a load
        # without optimizer state) takes them over: record the old one's last steps now.
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for other in self._monitors.values():
            if any(id(p) in mine for p in other.params):
                with contextlib.suppress(Exception):
                    other.finish()
        return self._optimizers.build_or_none(optimizer)

    def _patch_scale(self) -> None:
        """The loss a GradScaler scaled, for the loss curve (its `scale` output is what
        `.backward()` is called on)."""
        try:
            from torch.amp.grad_scaler import GradScaler as scaler_class
        except ImportError:  # pragma: no cover - torch without amp
            return
        original = scaler_class.scale

        def scale(scaler: Any, outputs: Any) -> Any:
            result = original(scaler, outputs)
            if isinstance(outputs, torch.Tensor) and result is not outputs:
                with contextlib.suppress(Exception):
                    self._scaled = (weakref.ref(result), outputs.detach())
            return result

        scaler_class.scale = scale  # type: ignore[method-assign,assignment]

        def restore() -> None:
            scaler_class.scale = original  # type: ignore[method-assign]

        self._hooks.undo.append(restore)


def _is_loss(tensor: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """`.backward()` on a scalar with no gradient given: a loss, not a vector-Jacobian."""
    gradient = args[0] if args else kwargs.get("gradient")
    return gradient is None and tensor.numel() == 1


@contextlib.contextmanager
def watch_all(
    *,
    every: int = 20,
    log: str | None = None,
    full: bool = False,
    argv: list[str] | None = None,
    loss: bool = True,
) -> Iterator[GlobalWatch]:
    """Watch every optimizer that steps inside the block (what `deadweight run` uses);
    with `loss`, record the loss of every scalar `.backward()` for the report's curve."""
    w = GlobalWatch(config=MonitorConfig(every=every, full=full), log=log, argv=argv, loss=loss)
    try:
        yield w
    except BaseException as exc:
        w.close(exit_reason(exc))
        raise
    else:
        w.close()
