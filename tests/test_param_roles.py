"""Parameter roles, against the walk they read from the modules' own registries."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from deadweight import param_roles
from tests.tiny_transformers import gpt2_config, llama_config


def _reference(model: nn.Module) -> dict[str, tuple[str, str]]:
    """`parameter_roles` through nn.Module's public walk, one module at a time."""
    owners: dict[int, tuple[nn.Module, str]] = {}
    for _, module in model.named_modules():
        for local, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), (module, local))
    out = {}
    for name, p in model.named_parameters():
        module, local = owners[id(p)]
        if getattr(p, "_no_weight_decay", False):
            role = param_roles.TAGGED
        elif local == "bias" or local.endswith("_bias"):
            role = param_roles.BIAS
        elif param_roles.is_norm_module(module):
            role = param_roles.NORM_WEIGHT
        elif param_roles.is_embedding_module(module):
            role = param_roles.EMBEDDING
        else:
            role = param_roles.OTHER
        out[name] = (role, type(module).__name__)
    return out


class _Renamed(nn.Module):
    """A module that lists its parameters its own way (as wrappers do)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner_weight = nn.Parameter(torch.ones(3))

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        yield from super().named_parameters(prefix, recurse, remove_duplicate)


class _Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(3)
        self.emb = nn.Embedding(4, 3)
        self.head = nn.Linear(3, 4)
        self.head.weight = self.emb.weight  # tied: named once, by its first owner
        self.register_parameter("absent", None)  # a None entry in the registry
        self.twice = nn.Parameter(torch.ones(2))
        self.register_parameter("again", self.twice)  # one tensor, two local names
        self.gate_bias = nn.Parameter(torch.zeros(1))
        self.scale = nn.Parameter(torch.ones(1))
        self.scale._no_weight_decay = True  # type: ignore[attr-defined]
        self.renamed = _Renamed()


def test_roles_match_the_public_walk() -> None:
    transformers = pytest.importorskip("transformers")
    models = [
        _Odd(),
        transformers.GPT2LMHeadModel(gpt2_config()),
        transformers.LlamaForCausalLM(llama_config()),
    ]
    for model in models:
        roles = param_roles.parameter_roles(model)
        assert roles == _reference(model), type(model).__name__
    odd = param_roles.parameter_roles(models[0])
    assert odd["emb.weight"] == (param_roles.EMBEDDING, "Embedding")
    assert "head.weight" not in odd and "absent" not in odd and "again" not in odd
    assert odd["gate_bias"][0] == param_roles.BIAS
    assert odd["scale"][0] == param_roles.TAGGED
    assert odd["norm.weight"][0] == param_roles.NORM_WEIGHT
    assert odd["renamed.inner_weight"] == (param_roles.OTHER, "_Renamed")
