"""The user's own model and optimizer inside the wrappers that frameworks hand back.

`check`, `watch`, `run` and `pin` all take what the training script holds, which is
often a wrapper: accelerate's `AcceleratedOptimizer`, Lightning's `LightningOptimizer`,
Fabric's `_FabricOptimizer` and `_FabricModule`, a DeepSpeed engine, a DDP module, a
`torch.compile`d module, a PEFT model. Such an optimizer wrapper may pass `isinstance(x, Optimizer)`
without ever running `Optimizer.__init__`, so it has no step hooks of its own; its
`step` calls the inner optimizer's, whose hooks do run. So the first real optimizer
inside is watched, and parameters are named from the innermost module, as the user
wrote it.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

# Wrappers of wrappers are followed this deep, and never round a cycle.
MAX_DEPTH = 16

# Where each known optimizer wrapper keeps the optimizer it steps.
_INNER_OPTIMIZER = ("optimizer", "_optimizer")
# megatron-core's module wrappers (megatron.core.distributed, megatron.core.transformer.module).
_MEGATRON_WRAPPERS = ("DistributedDataParallel", "Float16Module")


def _initialised(optimizer: Any) -> bool:
    """An Optimizer whose own __init__ ran: it has step hooks and steps itself."""
    return isinstance(optimizer, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(
        optimizer
    )


def torch_optimizer(obj: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer whose step hooks run inside `obj`, or None if there is none.

    Follows `.optimizer` / `._optimizer` (accelerate, Lightning, Fabric, DeepSpeed's
    engine and ZeRO wrappers, transformers' Trainer once it has built its optimizer)
    to the first `torch.optim.Optimizer` whose own `__init__` ran. A plain optimizer
    is returned as it is, and so is one that wraps another but is a real optimizer
    itself (a Lookahead): its step is the whole update.
    """
    seen: set[int] = set()
    for _ in range(MAX_DEPTH):
        if obj is None or id(obj) in seen:
            return None
        seen.add(id(obj))
        if _initialised(obj):
            return obj
        obj = _inner_optimizer(obj)
    return None


def _inner_optimizer(obj: Any) -> Any:
    for attr in _INNER_OPTIMIZER:
        try:
            inner = getattr(obj, attr, None)
        except Exception:  # a property that raises before the wrapper is ready
            inner = None
        if inner is not None and inner is not obj:
            return inner
    return None


def _inner_module(model: nn.Module) -> nn.Module | None:
    """The module one wrapper holds, for the wrappers that only add behaviour."""
    orig = vars(model).get("_modules", {}).get("_orig_mod")  # torch.compile
    if isinstance(orig, nn.Module):
        return orig
    if isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
        return model.module
    classes = {c.__name__ for c in type(model).__mro__}
    # PEFT: PeftModel holds a tuner (LoraModel, ...) that holds the user's model with
    # the adapters injected, so names read `model.layers.0...lora_A.default.weight`.
    if "PeftModel" in classes or "BaseTuner" in classes:
        inner = getattr(model, "base_model" if "PeftModel" in classes else "model", None)
        if isinstance(inner, nn.Module) and inner is not model:
            return inner
    cls = type(model).__name__
    # megatron-core's DDP and its bf16/fp16 wrapper keep the user's module in `.module`.
    if cls in _MEGATRON_WRAPPERS and type(model).__module__.startswith("megatron."):
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module):
            return inner
    # DeepSpeed's engine and Fabric's module wrapper keep the user's module in
    # `.module` (Fabric also in `._forward_module`, possibly compiled or DDP).
    if cls in ("DeepSpeedEngine", "PipelineEngine", "_FabricModule"):
        inner = getattr(model, "_original_module", None) or getattr(model, "module", None)
        if isinstance(inner, nn.Module):
            return inner
    return None


def user_model(model: nn.Module) -> nn.Module:
    """The module as the user wrote it, inside compile / DDP / DeepSpeed / Fabric /
    PEFT wrappers, so parameter names carry no `_orig_mod.`, `module.` or
    `base_model.model.` prefix."""
    seen: set[int] = set()
    for _ in range(MAX_DEPTH):
        if id(model) in seen:
            break
        seen.add(id(model))
        inner = _inner_module(model)
        if inner is None:
            break
        model = inner
    return model


@contextlib.contextmanager
def own_backward(model: Any) -> Iterator[None]:
    """Inside: deadweight's own backward passes through a framework that guards them.

    Fabric, under mixed precision, makes any backward through its module raise unless
    it runs inside `fabric.backward` (so that its scaler scales the loss). The check's
    single backward of the unscaled loss measures the graph only and never steps, so
    Fabric's flag is set around it, as `fabric.backward` sets it."""
    fabric_wrappers = sys.modules.get("lightning.fabric.wrappers")
    guarded = fabric_wrappers is not None and any(
        type(m).__name__ == "_FabricModule" for m in _chain(model)
    )
    if not guarded:
        yield
        return
    before = getattr(fabric_wrappers, "_in_fabric_backward", False)
    fabric_wrappers._in_fabric_backward = True  # type: ignore[union-attr]
    try:
        yield
    finally:
        fabric_wrappers._in_fabric_backward = before  # type: ignore[union-attr]


def _chain(model: Any) -> Iterator[nn.Module]:
    """The model and every wrapper or wrapped module between it and the user's."""
    seen: set[int] = set()
    while isinstance(model, nn.Module) and id(model) not in seen and len(seen) < MAX_DEPTH:
        seen.add(id(model))
        yield model
        model = _inner_module(model)


def zero3_placeholder(p: torch.Tensor) -> bool:
    """A DeepSpeed ZeRO-3 parameter: an empty placeholder on this rank (its values
    live in the partition the optimizer steps), so it cannot be seen to move."""
    return hasattr(p, "ds_tensor") and p.numel() == 0


def deepspeed_engine(model: Any) -> bool:
    """A DeepSpeed engine anywhere in the wrappers around the user's model."""
    return any(type(m).__name__ in ("DeepSpeedEngine", "PipelineEngine") for m in _chain(model))


# -- megatron-core: main copies and gradient buffers ---------------------------------


def main_copy(p: torch.Tensor) -> torch.Tensor | None:
    """The fp32 main copy an optimizer steps in place of `p`, when there is one.

    megatron-core's mixed-precision optimizers (`Float16OptimizerWithFloat16Params`,
    and the distributed optimizer, whose copy is this rank's flat shard of `p`) hand
    the inner torch optimizer fp32 copies of the bf16/fp16 parameters, step those and
    copy them back, and keep each copy on its parameter as `p.main_param`.
    """
    copy = getattr(p, "main_param", None)
    return copy if isinstance(copy, torch.Tensor) and copy is not p else None


def main_copies(models: Iterable[nn.Module]) -> dict[int, torch.Tensor]:
    """id(main copy) -> the parameter it stands for, over every parameter of `models`."""
    found: dict[int, torch.Tensor] = {}
    for model in models:
        for p in model.parameters():
            copy = main_copy(p)
            if copy is not None:
                found.setdefault(id(copy), p)
    return found


def gradient(p: torch.Tensor) -> torch.Tensor | None:
    """`p.grad`, or, where megatron-core's DDP has moved it (its backward hook adds
    each gradient into the parameter's slice of a bucket buffer, `p.main_grad`, and
    sets `.grad` to None), that buffer slice."""
    grad = p.grad
    if grad is None:
        main = getattr(p, "main_grad", None)
        if isinstance(main, torch.Tensor):
            return main
    return grad


@contextlib.contextmanager
def megatron_grad_hooks_suspended(params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Inside: megatron-core's DDP leaves these parameters' gradients in `.grad`.

    Its hook on each parameter's gradient accumulator moves `.grad` into `main_grad`
    (adding to what the training step accumulated there) for the parameters in its
    `param_to_bucket_group`; check's own backward must neither lose its gradients nor
    add them to the script's. So each DDP holding any of `params` gets an empty map
    for the duration (its hook then does nothing), and its own back on exit.
    """
    wanted = {id(p) for p in params}
    suspended = [
        d for d in _megatron_ddps() if any(id(p) in wanted for p in d.param_to_bucket_group)
    ]
    saved = [(d, d.param_to_bucket_group) for d in suspended]
    for d in suspended:
        d.param_to_bucket_group = {}
    try:
        yield
    finally:
        for d, buckets in saved:
            d.param_to_bucket_group = buckets


def _megatron_ddps() -> list[Any]:
    """Every live megatron-core DDP (a scan of the heap, only once megatron-core's
    distributed package is imported)."""
    if "megatron.core.distributed" not in sys.modules:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [
            o
            for o in gc.get_objects()
            if type(o).__name__ == "DistributedDataParallel"
            and type(o).__module__.startswith("megatron.")
            and isinstance(getattr(o, "param_to_bucket_group", None), dict)
        ]
