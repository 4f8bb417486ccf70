"""Tiny random-initialised configs of transformers' real model code, shared by the tests.

Nothing is downloaded: each config is built here and the model from it.
Overrides change single fields where a test needs a variant.
"""

from __future__ import annotations

from typing import Any

import pytest


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def gpt2_config(**overrides: Any) -> Any:
    fields = dict(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=2, n_inner=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _transformers().GPT2Config(**{**fields, **overrides})


def llama_config(**overrides: Any) -> Any:
    fields = dict(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return _transformers().LlamaConfig(**{**fields, **overrides})


def bert_config(**overrides: Any) -> Any:
    fields = dict(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=3, pad_token_id=0,
    )  # fmt: skip
    return _transformers().BertConfig(**{**fields, **overrides})


def tiny_llama() -> Any:
    return _transformers().LlamaForCausalLM(llama_config()).train()
