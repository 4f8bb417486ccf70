"""`deadweight.param_groups`: weight-decay groups decided by what a parameter is, not its shape."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, overload

from torch import nn

from deadweight import param_roles

NoDecay = Literal["bias", "norm", "embedding"]
_ROLE_OF = {
    "bias": param_roles.BIAS,
    "norm": param_roles.NORM_WEIGHT,
    "embedding": param_roles.EMBEDDING,
}


@overload
def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    no_decay: Iterable[NoDecay] = ...,
    explain: Literal[False] = ...,
) -> list[dict[str, Any]]: ...


@overload
def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    no_decay: Iterable[NoDecay] = ...,
    explain: Literal[True],
) -> tuple[list[dict[str, Any]], dict[str, str]]: ...


def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    no_decay: Iterable[NoDecay] = ("bias", "norm"),
    explain: bool = False,
) -> list[dict[str, Any]] | tuple[list[dict[str, Any]], dict[str, str]]:
    """Two param groups for any torch optimizer: decayed, and not decayed.

    A parameter is not decayed when it is a bias, a weight of a normalization
    module (torch's, or any class whose name contains "Norm", such as LlamaRMSNorm)
    or an embedding's weight, as chosen by `no_decay`, or when it carries
    `_no_weight_decay = True` (set by `deadweight.pin`, or by hand). Everything
    else is decayed, whatever its shape: a shape-[1] layer scalar is decayed like
    any other weight unless it is tagged. Frozen parameters are left out; tied
    parameters appear once.

    With `explain=True`, also returns `{name: reason}` for every parameter.

        opt = torch.optim.AdamW(deadweight.param_groups(model, 0.1), lr=3e-4)
    """
    chosen = set(no_decay)
    unknown = chosen - set(_ROLE_OF)
    if unknown:
        raise ValueError(
            f"no_decay takes {sorted(_ROLE_OF)}, got {sorted(unknown)}; tag other parameters "
            "with `p._no_weight_decay = True`"
        )
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    exempt = {_ROLE_OF[c] for c in chosen} | {param_roles.TAGGED}
    roles = param_roles.parameter_roles(model)
    decay, keep = [], []
    reasons = {}
    for name, p in model.named_parameters():
        role, owner = roles[name]
        if not p.requires_grad:
            reasons[name] = "left out: frozen (requires_grad=False)"
            continue
        if role in exempt:
            keep.append(p)
            reasons[name] = f"no decay: {role} ({owner})"
        else:
            decay.append(p)
            why = "" if role == param_roles.OTHER else f", {role} decay was not excluded"
            reasons[name] = f"decay {weight_decay}: weight of {owner}{why}"
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    return (groups, reasons) if explain else groups
