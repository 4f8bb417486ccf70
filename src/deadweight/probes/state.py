"""Leave the model exactly as we found it: modes, buffers, grads and RNG states."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn


@contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """Snapshot everything a forward+backward may change, restore it on exit (also on error).

    - train/eval flag of every submodule (a forward may toggle them);
    - buffers (BatchNorm running stats, counters), restored in place so tensor identity holds;
    - each parameter's `.grad` object, which is set aside so backward cannot accumulate into it;
    - the torch CPU and CUDA, Python `random` and NumPy global RNG states (dropout draws).
    """
    modes = [(m, m.training) for m in model.modules()]
    buffers = _snapshot_buffers(model)
    params = list(model.parameters())
    grads = [p.grad for p in params]
    rng = _rng_state()
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        _restore_buffers(buffers)
        for m, training in modes:
            m.training = training
        _set_rng_state(rng)


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
