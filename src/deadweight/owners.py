"""Name the parameters an optimizer holds, from the modules that own them.

In zero-code mode (`deadweight run`) nobody hands us the model: the first time an
optimizer steps, the live `nn.Module` objects are found through the garbage
collector and the roots that own its parameters give the names, exactly as
`model.named_parameters()` spells them.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from deadweight import wrappers


def owning_models(params: Iterable[torch.Tensor]) -> list[nn.Module]:
    """The root modules (not a child of another live module) that hold any of `params`,
    the one holding most of them first."""
    wanted = {id(p) for p in params}
    with warnings.catch_warnings():  # isinstance() touches deprecated module proxies
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if _is_module(o)]
    children = {id(c) for m in modules for c in m.children()}
    roots = []
    for module in modules:
        if id(module) in children:
            continue
        # megatron-core's mixed-precision optimizers hold fp32 copies of the parameters
        held = sum(
            1 for p in module.parameters() if id(p) in wanted or id(wrappers.main_copy(p)) in wanted
        )
        if held:
            roots.append((held, module))
    roots.sort(key=lambda hm: -hm[0])
    # Named as in the user's own module: no `module.` (DDP) or `_orig_mod.` (compile).
    return [wrappers.user_model(m) for _, m in roots]


def live_optimizers(first: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """`first` and every other live torch optimizer (found through the garbage collector)."""
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


def _is_module(obj: object) -> bool:
    try:
        return isinstance(obj, nn.Module)
    except Exception:  # lazy proxies can raise on __class__
        return False


def parameter_names(models: Sequence[nn.Module]) -> dict[int, str]:
    """id(param) -> name. With several models, names get the model's class as a prefix
    (`Generator:net.0.weight`) so two `weight`s never collide. A parameter's main copy
    (`wrappers.main_copy`: what megatron-core's mixed-precision optimizers step) is
    named after the parameter."""
    names: dict[int, str] = {}
    prefixes = model_prefixes(models)
    for prefix, model in zip(prefixes, models, strict=True):
        for name, p in model.named_parameters():
            names.setdefault(id(p), prefix + name)
            copy = wrappers.main_copy(p)
            if copy is not None:
                names.setdefault(id(copy), prefix + name)
    return names


def model_prefixes(models: Sequence[nn.Module]) -> list[str]:
    """What names of each model's parameters and modules start with: nothing for one
    model, its class (`Generator:`) for several."""
    if len(models) <= 1:
        return [""] * len(models)
    classes = [type(m).__name__ for m in models]
    out = []
    for i, cls in enumerate(classes):
        out.append(
            f"{cls}:" if classes.count(cls) == 1 else f"{cls}[{classes[: i + 1].count(cls) - 1}]:"
        )
    return out


def fallback_name(optimizer_index: int, group: int, position: int, p: torch.Tensor) -> str:
    shape = "x".join(str(d) for d in p.shape) or "scalar"
    return f"optimizer{optimizer_index}.group{group}.param{position}[{shape}]"
