"""DW101/DW102 on real model code from transformers (tiny random configs, no download)."""

from __future__ import annotations

import warnings

import pytest
import torch

import deadweight

transformers = pytest.importorskip("transformers")


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config).train()


def enable_checkpointing(model: torch.nn.Module, reentrant: bool) -> None:
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def test_reentrant_checkpointing_with_frozen_embeddings():
    # The adapter-tuning set-up: embeddings frozen, checkpointing switched on with
    # use_reentrant=True, and nothing making the layer inputs require grad
    # (transformers adds an input hook for this itself; other wrappers remove it).
    model = tiny_llama()
    enable_checkpointing(model, reentrant=True)
    model.disable_input_require_grads()
    model.get_input_embeddings().weight.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = deadweight.check(model, lambda: model(input_ids=IDS, labels=IDS).loss)
    (dw102,) = report.by_code("DW102")
    assert dw102.evidence["kind"] == "reentrant-checkpoint"
    assert dw102.evidence["modules"] == ["model.layers.0", "model.layers.1"]
    layer_params = {n for n, _ in model.named_parameters() if n.startswith("model.layers.")}
    (dw101,) = report.by_code("DW101")
    assert set(dw101.params) == layer_params == set(dw102.params)


@pytest.mark.parametrize("fix", ["non-reentrant", "input-grads"])
def test_the_documented_fixes_clear_it(fix):
    model = tiny_llama()
    reentrant = fix != "non-reentrant"
    enable_checkpointing(model, reentrant)
    model.disable_input_require_grads()
    if fix == "input-grads":
        model.enable_input_require_grads()
    model.get_input_embeddings().weight.requires_grad_(False)
    report = deadweight.check(model, lambda: model(input_ids=IDS, labels=IDS).loss)
    assert report.findings == ()
