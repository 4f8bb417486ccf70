"""Every hook a watch installs, and their removal when it closes.

A watch adds nothing to the training loop but these: a pre and a post hook on each
watched optimizer's `step`, a counter of backward passes on two parameters of each
(a gradient-accumulation hook), a wrapper around a scaler's `step` that is not a
torch GradScaler's (those reach `scaler_steps`' class-level wrapper), and, under
`deadweight run`, the patches `GlobalWatch` adds. Each is removable: `remove()`
takes them all away, and an exception while removing one leaves the others removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.hooks import RemovableHandle

if TYPE_CHECKING:
    from deadweight.watching.step_monitor import StepMonitor

StepHook = Callable[[torch.optim.Optimizer, Any, Any], Any]


class OptimizerHooks:
    """The hooks and patches of one watch, each with its undo."""

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []
        self.undo: list[Callable[[], None]] = []
        # Backward passes, counted at the first and last parameter of each optimizer:
        # a run whose optimizer never stepped while backward ran is reported (DW309).
        self.backward_counts: dict[int, int] = {}

    def install(
        self,
        optimizer: torch.optim.Optimizer,
        pre: StepHook,
        post: StepHook,
        main_copies: Mapping[int, torch.Tensor],
    ) -> None:
        """Call `pre` and `post` around every `optimizer.step()`, and count the
        backward passes that reach its parameters (`main_copies`: id(main copy) -> its
        parameter, which backward reaches instead)."""
        self.handles.append(optimizer.register_step_pre_hook(pre))
        self.handles.append(optimizer.register_step_post_hook(post))
        self._count_backwards(optimizer, main_copies)

    def _count_backwards(
        self, optimizer: torch.optim.Optimizer, main_copies: Mapping[int, torch.Tensor]
    ) -> None:
        # A main copy never takes part in backward: its parameter is counted instead.
        tensors = [main_copies.get(id(p), p) for g in optimizer.param_groups for p in g["params"]]
        trainable = [p for p in tensors if p.requires_grad and p.is_leaf]
        for p in {id(p): p for p in (trainable[:1] + trainable[-1:])}.values():
            if id(p) in self.backward_counts:
                continue
            self.backward_counts[id(p)] = 0
            counts, key = self.backward_counts, id(p)

            def counted(_: torch.Tensor, counts: dict[int, int] = counts, key: int = key) -> None:
                counts[key] += 1

            with contextlib.suppress(Exception):  # a tensor subclass without hooks
                self.handles.append(p.register_post_accumulate_grad_hook(counted))

    @property
    def backwards(self) -> int:
        """Backward passes seen so far (at the first or last parameter of an optimizer)."""
        return max(self.backward_counts.values(), default=0)

    def wrap_scaler(self, scaler: Any, monitors: Mapping[int, StepMonitor]) -> None:
        """See the steps a scaler skips: it does not call optimizer.step() then."""
        original = scaler.step

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

        self.undo.append(restore)

    def remove(self) -> None:
        """Remove every hook, then undo every patch (in the order they were made)."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for restore in self.undo:
            with contextlib.suppress(Exception):
                restore()
        self.undo.clear()


def begin_step(monitor: StepMonitor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
