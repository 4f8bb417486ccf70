"""Leave the model exactly as we found it: modes, buffers, grads and RNG states."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn


class ParamGuard:
    """Copies of parameters taken just before something writes to them in place, and the
    RNG state at entry, so a loss function can be re-run on the same random draws."""

    def __init__(self, rng: dict[str, Any] | None = None) -> None:
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rng = rng

    def reset_rng(self) -> None:
        if self._rng is not None:
            _set_rng_state(self._rng)

    def before_write(self, param: torch.Tensor) -> None:
        if id(param) not in self._copies:
            self._copies[id(param)] = (param, param.detach().clone())

    def guards(self, param: torch.Tensor) -> bool:
        return id(param) in self._copies

    def restore(self) -> None:
        with torch.no_grad():
            for param, saved in self._copies.values():
                param.copy_(saved)


@contextmanager
def preserved(model: nn.Module) -> Iterator[ParamGuard]:
    """Snapshot everything a forward+backward may change, restore it on exit (also on error).

    - train/eval flag of every submodule (a forward may toggle them);
    - buffers (BatchNorm running stats, counters), restored in place so tensor identity holds;
    - each parameter's `.grad` object, which is set aside so backward cannot accumulate into it;
    - the torch CPU and CUDA, Python `random` and NumPy global RNG states (dropout draws);
    - parameter values, through the yielded `ParamGuard`, which the op tracer calls before
      an in-place write to a parameter (copying every parameter up front would double
      the model's memory; deadweight itself never writes one).
    """
    modes = [(m, m.training) for m in model.modules()]
    buffers = _snapshot_buffers(model)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    rng = _rng_state()
    for p in params:
        p.grad = None
    guard = ParamGuard(rng)
    try:
        yield guard
    finally:
        guard.restore()
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        _restore_buffers(buffers)
        for m, training in modes:
            m.training = training
        _set_rng_state(rng)


@contextmanager
def grads_set_aside(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Give `tensors` a None .grad for the duration, then put their own .grad back."""
    saved = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    try:
        yield
    finally:
        for t, g in zip(tensors, saved, strict=True):
            t.grad = g


@contextmanager
def post_accumulate_hooks_suspended(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Empty each parameter's post-accumulate-grad hook dict, refill it on exit.

    Such hooks exist for side effects (optimizer-in-backward steps and zeroes there);
    the check must not trigger them. The dict object itself stays, so the user's
    RemovableHandles keep working.
    """
    suspended = []
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks:
            suspended.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in suspended:
            hooks.update(saved)


_BufferSnapshot = list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]


def _snapshot_buffers(model: nn.Module) -> _BufferSnapshot:
    clones: dict[int, torch.Tensor] = {}  # shared buffers are cloned once
    snapshot: _BufferSnapshot = []
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is None or buf.is_meta:
                continue
            if id(buf) not in clones:
                clones[id(buf)] = buf.detach().clone()
            snapshot.append((module, name, buf, clones[id(buf)]))
    return snapshot


def _restore_buffers(snapshot: _BufferSnapshot) -> None:
    with torch.no_grad():
        for module, name, buf, saved in snapshot:
            # A forward may rebind a buffer to a new tensor; put the user's object back.
            module._buffers[name] = buf
            if buf.shape == saved.shape:
                buf.copy_(saved)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    # Only touch CUDA if the user's process already initialised it: querying it would.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
