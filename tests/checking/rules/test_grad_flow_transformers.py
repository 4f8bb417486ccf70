"""DW101/DW102 on real model code from transformers (tiny random configs, no download)."""

from __future__ import annotations

import warnings

import pytest
import torch

import deadweight
from tests.tiny_transformers import tiny_llama

transformers = pytest.importorskip("transformers")


def _quiet(report: deadweight.Report) -> bool:
    """Nothing found but info-level notes on scale/shift invariance (DW103-DW105),
    which healthy models with normalization layers have."""
    return all(
        f.code in ("DW103", "DW104", "DW105") and f.severity is deadweight.Severity.INFO
        for f in report.findings
    )


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
    assert _quiet(report)


def test_fused_layernorms_in_gpt2_are_two_causes_not_one_per_layer():
    # Every LayerNorm run under no_grad: the final ln_f cuts everything before it, and
    # each block's ln_1/ln_2 cut their own weights. Two causes, two findings each.
    config = transformers.GPT2Config(
        vocab_size=100,
        n_positions=32,
        n_embd=32,
        n_layer=3,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).train()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    for norm in norms:
        norm.forward = torch.no_grad()(norm.forward)
    ids = IDS[:, :16]
    report = deadweight.check(model, lambda: model(input_ids=ids, labels=ids).loss)

    by_function = {f.location.function: set(f.params) for f in report.by_code("DW102")}
    assert set(by_function) == {"GPT2Model.forward", "GPT2Block.forward"}
    block_norms = {n for n, _ in model.named_parameters() if ".ln_1." in n or ".ln_2." in n}
    assert by_function["GPT2Block.forward"] == block_norms
    everything = {n for n, _ in model.named_parameters()}
    # wte still learns through the tied lm_head
    assert by_function["GPT2Model.forward"] == everything - block_norms - {"transformer.wte.weight"}
    dw101 = report.by_code("DW101")
    assert len(dw101) == 2
    assert {frozenset(f.params) for f in dw101} == {frozenset(p) for p in by_function.values()}
