"""`deadweight.pin`: keep a parameter fixed while it stays trainable.

The incident's final fix, made safe: `requires_grad` stays True (DDP buckets and
checkpoints unchanged), a post-accumulate-grad hook zeroes the gradient after every
backward (so Adam's moments decay to exactly 0 and its update is exactly 0), and
`_no_weight_decay` is set so `deadweight.param_groups` keeps it out of decay (decay
would pull it towards 0 even with a zero gradient).

Under megatron-core's DDP the hook still acts first: the hook its DDP puts on each
parameter's gradient accumulator, which adds `.grad` into the parameter's slice of
the gradient buffer (`main_grad`), runs after the tensor's post-accumulate-grad hooks,
so it adds zeros. With megatron-core's mixed-precision optimizers, the fp32 main copy
the optimizer steps (`p.main_param`) is what `optimizer=` clears and checks for decay.
"""

from __future__ import annotations

import difflib
from typing import Any

import torch
from torch import nn

from deadweight import wrappers
from deadweight.errors import InputError

_NO_ATTR = object()


def _zero_grad(param: torch.Tensor) -> None:
    # Post-accumulate-grad hooks must return None: `lambda p: p.grad.zero_()` returns
    # the tensor and raises.
    if param.grad is not None:
        param.grad.zero_()


class PinHandle:
    """Undo a pin with `remove()`; `moved()` tells how far the value has moved since."""

    def __init__(self, name: str, param: nn.Parameter, hook: Any, previous_tag: object) -> None:
        self.name = name
        self.param = param
        self.value = param.detach().clone()
        self._hook = hook
        self._previous_tag = previous_tag

    def moved(self) -> float:
        """Largest absolute change of any entry since the pin (0.0: bit-exactly in place)."""
        return float((self.param.detach() - self.value).abs().max())

    def remove(self) -> None:
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        if self._previous_tag is _NO_ATTR:
            del self.param._no_weight_decay  # type: ignore[attr-defined]
        else:
            self.param._no_weight_decay = self._previous_tag  # type: ignore[attr-defined]
        del self.param._deadweight_pin  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        state = "active" if self._hook is not None else "removed"
        return f"PinHandle({self.name!r}, {state}, moved={self.moved():.3g})"


def pin(model: nn.Module, name: str, *, optimizer: Any = None) -> PinHandle:
    """Pin the parameter called exactly `name` (as in `model.named_parameters()`).

    With `optimizer`, its state for the parameter is cleared (so old Adam moments do
    not keep moving it) and a parameter sitting in a group with weight decay is an
    error: decay would pull it away from its value. A compiled or wrapped model takes
    its own module's names too (`blocks.0.scale` for `_orig_mod.blocks.0.scale`), and
    a framework's optimizer wrapper is looked through.
    """
    # Tied parameters answer to every name they have (lm_head.weight and wte.weight);
    # a wrapped model (compile, DDP, Fabric) to its own module's names and its own.
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(wrappers.user_model(model).named_parameters(remove_duplicate=False))
    if optimizer is not None:
        optimizer = wrappers.torch_optimizer(optimizer) or optimizer
    param = params.get(name)
    if param is None:
        close = difflib.get_close_matches(name, list(params), n=5, cutoff=0.5)
        hint = f"; nearest: {', '.join(close)}" if close else ""
        raise InputError(f"{type(model).__name__} has no parameter named {name!r}{hint}")
    if hasattr(param, "_deadweight_pin"):
        raise InputError(f"{name} is already pinned")
    if not param.requires_grad:
        raise InputError(
            f"{name} is frozen (requires_grad=False); pin is for parameters that must stay "
            "trainable, e.g. under DDP"
        )
    if optimizer is not None:
        # megatron-core's mixed-precision optimizers step an fp32 main copy instead
        copy = wrappers.main_copy(param)
        stepped = param if copy is None else copy
        for index, group in enumerate(optimizer.param_groups):
            if any(p is stepped for p in group["params"]) and group.get("weight_decay", 0) > 0:
                raise InputError(
                    f"{name} is in param group {index} with weight_decay="
                    f"{group['weight_decay']}, which would pull it away from its value; build "
                    "the optimizer with deadweight.param_groups after pinning"
                )
        optimizer.state.pop(stepped, None)
    previous = getattr(param, "_no_weight_decay", _NO_ATTR)
    hook = param.register_post_accumulate_grad_hook(_zero_grad)
    param._no_weight_decay = True  # type: ignore[attr-defined]
    handle = PinHandle(name, param, hook, previous)
    param._deadweight_pin = handle  # type: ignore[attr-defined]
    return handle
