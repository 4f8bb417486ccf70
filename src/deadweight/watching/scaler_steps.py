"""The steps a GradScaler skips, seen for every open watch without `scaler=`.

`scaler.step(optimizer)` does not call `optimizer.step()` when it found inf/NaN
gradients, so the optimizer's step hooks never hear of that step. One wrapper around
`torch.amp.GradScaler.step` (the class, so accelerate's, Lightning's and Fabric's
scalers are all seen) tells each listener before and after every scaler step; it is
installed while at least one watch listens and removed with the last one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol


class Listener(Protocol):
    def scaler_before(self, optimizer: Any) -> Any:
        """Called before the scaler steps `optimizer`; what it returns comes back to
        `scaler_after`."""

    def scaler_after(self, optimizer: Any, token: Any) -> None:
        """Called after the scaler stepped (or skipped) `optimizer`."""


_lock = threading.Lock()
# Weak references: a watch that is never closed must not live on through the class.
_listeners: list[weakref.ref[Listener]] = []
_installed: tuple[Any, Any, Any] | None = None  # (class, original step, our step)


def _grad_scaler_class() -> Any:
    try:
        from torch.amp.grad_scaler import GradScaler
    except ImportError:  # pragma: no cover - torch without amp
        return None
    return GradScaler


def _live() -> list[Listener]:
    """The listeners still alive; the dead are dropped, and with none left the class
    gets its own `step` back. Called with the lock held."""
    global _installed
    alive = []
    for ref in list(_listeners):
        each = ref()
        if each is None:
            _listeners.remove(ref)
        else:
            alive.append(each)
    if not alive and _installed is not None:
        owner, original, ours = _installed
        if owner.step is ours:  # not if someone wrapped it after us
            owner.step = original
            _installed = None
    return alive


def _wrapper(original: Any) -> Any:
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            listeners = _live()
        tokens = []
        for each in listeners:
            try:
                tokens.append((each, each.scaler_before(optimizer)))
            except Exception:  # never let deadweight stop training
                continue
        result = original(scaler, optimizer, *args, **kwargs)
        for each, token in tokens:
            try:
                each.scaler_after(optimizer, token)
            except Exception:
                continue
        return result

    step.__doc__ = original.__doc__
    return step


def listen(listener: Listener) -> Callable[[], None]:
    """Tell `listener` of every GradScaler step from now on; returns the undo."""
    global _installed
    cls = _grad_scaler_class()
    if cls is None:  # pragma: no cover
        return lambda: None
    ref = weakref.ref(listener)
    with _lock:
        _live()
        _listeners.append(ref)
        if _installed is None:
            original = cls.step
            ours = _wrapper(original)
            cls.step = ours
            _installed = (cls, original, ours)

    def undo() -> None:
        with _lock:
            if ref in _listeners:
                _listeners.remove(ref)
            _live()

    return undo


def installed() -> bool:
    """Whether GradScaler.step is wrapped now (for any live listener)."""
    with _lock:
        _live()
        return _installed is not None


def is_torch_scaler(scaler: Any) -> bool:
    """A torch GradScaler (or subclass): its steps reach the class-level wrapper."""
    cls = _grad_scaler_class()
    return cls is not None and isinstance(scaler, cls)
