"""What a parameter *is*, by the module that owns it and its name, never by its shape.

Shared by the optimizer audit (which parameters must not be decayed) and by the
`param_groups` fix.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the rules read the role names below without importing torch
    from torch import nn


@functools.cache
def _norm_types() -> tuple[type, ...]:
    from torch import nn

    return (
        nn.LayerNorm,
        nn.GroupNorm,
        nn.LocalResponseNorm,
        nn.modules.batchnorm._NormBase,  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d
        *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
    )


@functools.cache
def _stock_named_parameters() -> object:
    from torch import nn

    return nn.Module.named_parameters


@functools.cache
def _embedding_types() -> tuple[type, ...]:
    from torch import nn

    return (nn.Embedding, nn.EmbeddingBag)


BIAS = "bias"
NORM_WEIGHT = "normalization weight"
EMBEDDING = "embedding"
TAGGED = "tagged _no_weight_decay"
OTHER = "other"


def is_norm_module(module: nn.Module) -> bool:
    # Custom classes (LlamaRMSNorm, T5LayerNorm, FusedRMSNorm...) are recognised by
    # name: a normalization layer that is not a subclass of torch's is the rule.
    return isinstance(module, _norm_types()) or "norm" in type(module).__name__.lower()


def is_embedding_module(module: nn.Module) -> bool:
    return isinstance(module, _embedding_types()) or "embedding" in type(module).__name__.lower()


def _own_parameters(module: nn.Module) -> Iterable[tuple[str, nn.Parameter]]:
    """`module.named_parameters(recurse=False)`: read from its registry where the class
    keeps nn.Module's own, whose generators cost 0.6 us a module (parameter_roles of a
    48-layer GPT-2: 2.1 ms through them, 1.7 ms from the registries)."""
    if type(module).named_parameters is not _stock_named_parameters():
        return module.named_parameters(recurse=False)
    return [(name, p) for name, p in module._parameters.items() if p is not None]


def parameter_roles(model: nn.Module) -> dict[str, tuple[str, str]]:
    """name -> (role, owner module class) for every parameter, tied ones once."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    for _, module in model.named_modules():
        for local, p in _own_parameters(module):
            owners.setdefault(id(p), (module, local))
    roles = {}
    for name, p in model.named_parameters():
        # By identity: the name need not be the module path and the local name joined
        # (`deadweight run` names the parameters of several models `Encoder:fc.weight`).
        module, local = owners[id(p)]
        if getattr(p, "_no_weight_decay", False):
            role = TAGGED
        elif local == "bias" or local.endswith("_bias"):
            role = BIAS
        elif is_norm_module(module):
            role = NORM_WEIGHT
        elif is_embedding_module(module):
            role = EMBEDDING
        else:
            role = OTHER
        roles[name] = (role, type(module).__name__)
    return roles
