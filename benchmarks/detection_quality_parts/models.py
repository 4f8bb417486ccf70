"""The model builders the precision and first-step parts share: stock transformers
architectures from tiny random configs (no hub), their inputs, and their loss in a
given dtype."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from detection_quality_parts.common import N_CLASSES, PARAM_DTYPES, in_dtype, seed_everything

# ---------------------------------------------------------------------------------------
# Part 2: precision on stock transformers architectures

LAYERDROP_ATTRS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
TINY_TEXT = {"vocab_size": 256}
TINY_DEC = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}


@dataclass
class Arch:
    name: str
    family: str
    model_cls: str
    config_cls: str
    config: dict[str, Any]
    inputs: str  # causal | masked | seq2seq | image | whisper | ctc | clip
    real_width: bool = False
    note: str = ""


def _causal_llama_like(**extra: Any) -> dict[str, Any]:
    return {
        **TINY_TEXT,
        **TINY_DEC,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        **extra,
    }


def _encoder_like(**extra: Any) -> dict[str, Any]:
    return {
        **TINY_TEXT,
        **TINY_DEC,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        **extra,
    }


def _bart_like(**extra: Any) -> dict[str, Any]:
    return {
        **TINY_TEXT,
        "d_model": 32,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "max_position_embeddings": 64,
        **extra,
    }


ARCHS: list[Arch] = [
    # causal LM
    Arch(
        "gpt2",
        "causal",
        "GPT2LMHeadModel",
        "GPT2Config",
        {**TINY_TEXT, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 2},
        "causal",
    ),
    Arch(
        "gpt_neo",
        "causal",
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        {
            **TINY_TEXT,
            "max_position_embeddings": 64,
            "hidden_size": 32,
            "num_layers": 2,
            "num_heads": 2,
            "attention_types": [[["global", "local"], 1]],
            "window_size": 8,
        },
        "causal",
    ),
    Arch(
        "gptj",
        "causal",
        "GPTJForCausalLM",
        "GPTJConfig",
        {**TINY_TEXT, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4},
        "causal",
    ),
    Arch(
        "gpt_neox",
        "causal",
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        _encoder_like(),
        "causal",
    ),
    Arch("llama", "causal", "LlamaForCausalLM", "LlamaConfig", _causal_llama_like(), "causal"),
    Arch(
        "mistral", "causal", "MistralForCausalLM", "MistralConfig", _causal_llama_like(), "causal"
    ),
    Arch("qwen2", "causal", "Qwen2ForCausalLM", "Qwen2Config", _causal_llama_like(), "causal"),
    Arch(
        "qwen3",
        "causal",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        _causal_llama_like(head_dim=8),
        "causal",
        note="QK-norm",
    ),
    Arch(
        "gemma",
        "causal",
        "GemmaForCausalLM",
        "GemmaConfig",
        _causal_llama_like(head_dim=8),
        "causal",
    ),
    Arch(
        "gemma2",
        "causal",
        "Gemma2ForCausalLM",
        "Gemma2Config",
        _causal_llama_like(head_dim=8, query_pre_attn_scalar=8, sliding_window=8),
        "causal",
    ),
    Arch(
        "phi",
        "causal",
        "PhiForCausalLM",
        "PhiConfig",
        {**_encoder_like()},
        "causal",
    ),
    Arch(
        "phi3",
        "causal",
        "Phi3ForCausalLM",
        "Phi3Config",
        _causal_llama_like(pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "causal",
    ),
    Arch(
        "opt",
        "causal",
        "OPTForCausalLM",
        "OPTConfig",
        {
            **TINY_TEXT,
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 64,
            "word_embed_proj_dim": 32,
        },
        "causal",
    ),
    Arch(
        "bloom",
        "causal",
        "BloomForCausalLM",
        "BloomConfig",
        {**TINY_TEXT, "hidden_size": 32, "n_layer": 2, "n_head": 4},
        "causal",
    ),
    Arch(
        "falcon",
        "causal",
        "FalconForCausalLM",
        "FalconConfig",
        {**TINY_TEXT, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4},
        "causal",
    ),
    Arch(
        "mpt",
        "causal",
        "MptForCausalLM",
        "MptConfig",
        {**TINY_TEXT, "d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 64},
        "causal",
    ),
    # masked LM
    Arch("bert", "masked", "BertForMaskedLM", "BertConfig", _encoder_like(), "masked"),
    Arch("roberta", "masked", "RobertaForMaskedLM", "RobertaConfig", _encoder_like(), "masked"),
    Arch(
        "xlm-roberta",
        "masked",
        "XLMRobertaForMaskedLM",
        "XLMRobertaConfig",
        _encoder_like(),
        "masked",
    ),
    Arch(
        "camembert", "masked", "CamembertForMaskedLM", "CamembertConfig", _encoder_like(), "masked"
    ),
    Arch(
        "distilbert",
        "masked",
        "DistilBertForMaskedLM",
        "DistilBertConfig",
        {
            **TINY_TEXT,
            "dim": 32,
            "hidden_dim": 64,
            "n_layers": 2,
            "n_heads": 4,
            "max_position_embeddings": 64,
        },
        "masked",
    ),
    Arch(
        "albert",
        "masked",
        "AlbertForMaskedLM",
        "AlbertConfig",
        _encoder_like(embedding_size=16),
        "masked",
    ),
    Arch(
        "electra",
        "masked",
        "ElectraForMaskedLM",
        "ElectraConfig",
        _encoder_like(embedding_size=16),
        "masked",
    ),
    Arch(
        "deberta-v2",
        "masked",
        "DebertaV2ForMaskedLM",
        "DebertaV2Config",
        _encoder_like(),
        "masked",
    ),
    Arch(
        "deberta-v3-style",
        "masked",
        "DebertaV2ForMaskedLM",
        "DebertaV2Config",
        _encoder_like(
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_biased_input=False,
            position_buckets=16,
            max_relative_positions=-1,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
        ),
        "masked",
        note="relative attention: key bias not invariant",
    ),
    Arch("mpnet", "masked", "MPNetForMaskedLM", "MPNetConfig", _encoder_like(), "masked"),
    # seq2seq
    Arch("bart", "seq2seq", "BartForConditionalGeneration", "BartConfig", _bart_like(), "seq2seq"),
    Arch(
        "t5",
        "seq2seq",
        "T5ForConditionalGeneration",
        "T5Config",
        {
            **TINY_TEXT,
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 64,
            "num_layers": 2,
            "num_decoder_layers": 2,
            "num_heads": 4,
            "decoder_start_token_id": 0,
        },
        "seq2seq",
    ),
    Arch(
        "pegasus",
        "seq2seq",
        "PegasusForConditionalGeneration",
        "PegasusConfig",
        _bart_like(pad_token_id=0, decoder_start_token_id=0, eos_token_id=1),
        "seq2seq",
    ),
    Arch(
        "mbart",
        "seq2seq",
        "MBartForConditionalGeneration",
        "MBartConfig",
        _bart_like(),
        "seq2seq",
    ),
    Arch(
        "marian",
        "seq2seq",
        "MarianMTModel",
        "MarianConfig",
        _bart_like(
            pad_token_id=0, decoder_start_token_id=0, eos_token_id=1, decoder_vocab_size=256
        ),
        "seq2seq",
    ),
    # vision
    Arch(
        "vit",
        "vision",
        "ViTForImageClassification",
        "ViTConfig",
        {
            "image_size": 32,
            "patch_size": 8,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 64,
            "num_labels": N_CLASSES,
        },
        "image",
    ),
    Arch(
        "swin",
        "vision",
        "SwinForImageClassification",
        "SwinConfig",
        {
            "image_size": 32,
            "patch_size": 4,
            "embed_dim": 16,
            "depths": [2, 2],
            "num_heads": [2, 4],
            "window_size": 4,
            "num_labels": N_CLASSES,
        },
        "image",
    ),
    Arch(
        "convnext",
        "vision",
        "ConvNextForImageClassification",
        "ConvNextConfig",
        {
            "hidden_sizes": [16, 32],
            "depths": [1, 1],
            "num_stages": 2,
            "image_size": 32,
            "num_labels": N_CLASSES,
        },
        "image",
    ),
    Arch(
        "resnet",
        "vision",
        "ResNetForImageClassification",
        "ResNetConfig",
        {
            "embedding_size": 16,
            "hidden_sizes": [16, 32],
            "depths": [1, 1],
            "layer_type": "basic",
            "num_labels": N_CLASSES,
        },
        "image",
    ),
    # audio
    Arch(
        "whisper",
        "audio",
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        {
            **_bart_like(),
            "num_mel_bins": 16,
            "max_source_positions": 16,
            "max_target_positions": 32,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "decoder_start_token_id": 1,
            "suppress_tokens": None,
            "begin_suppress_tokens": None,
        },
        "whisper",
    ),
    Arch(
        "wav2vec2",
        "audio",
        "Wav2Vec2ForCTC",
        "Wav2Vec2Config",
        {
            "vocab_size": 32,
            **TINY_DEC,
            "num_attention_heads": 4,
            "conv_dim": [16, 16, 16],
            "conv_stride": [5, 2, 2],
            "conv_kernel": [10, 3, 3],
            "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 4,
            "pad_token_id": 0,
            "ctc_loss_reduction": "mean",
        },
        "ctc",
    ),
    # multimodal
    Arch(
        "clip",
        "multimodal",
        "CLIPModel",
        "CLIPConfig",
        {
            "text_config": {
                **TINY_TEXT,
                **TINY_DEC,
                "num_attention_heads": 4,
                "max_position_embeddings": 32,
            },
            "vision_config": {
                **TINY_DEC,
                "num_attention_heads": 4,
                "image_size": 32,
                "patch_size": 8,
            },
            "projection_dim": 16,
        },
        "clip",
    ),
    # real width, 2 layers
    Arch(
        "gpt2-768",
        "real width",
        "GPT2LMHeadModel",
        "GPT2Config",
        {"vocab_size": 1000, "n_positions": 64, "n_embd": 768, "n_layer": 2, "n_head": 12},
        "causal",
        real_width=True,
    ),
    Arch(
        "bert-768",
        "real width",
        "BertForMaskedLM",
        "BertConfig",
        {
            "vocab_size": 1000,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 2,
            "num_attention_heads": 12,
            "max_position_embeddings": 64,
        },
        "masked",
        real_width=True,
    ),
    Arch(
        "llama-768",
        "real width",
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "vocab_size": 1000,
            "hidden_size": 768,
            "intermediate_size": 2048,
            "num_hidden_layers": 2,
            "num_attention_heads": 12,
            "num_key_value_heads": 12,
            "max_position_embeddings": 64,
        },
        "causal",
        real_width=True,
    ),
]

HF_BATCH = 2
HF_SEQ = 16
HF_DEC_SEQ = 8


def hf_inputs(arch: Arch, model: nn.Module, gen: torch.Generator) -> dict[str, Any]:
    config: Any = model.config  # a PretrainedConfig; its fields vary by architecture
    kind = arch.inputs
    if kind in ("causal", "masked"):
        vocab = config.vocab_size
        ids = torch.randint(3, vocab, (HF_BATCH, HF_SEQ), generator=gen)
        return {"input_ids": ids, "labels": ids.clone()}
    if kind == "seq2seq":
        vocab = config.vocab_size
        ids = torch.randint(3, vocab, (HF_BATCH, HF_SEQ), generator=gen)
        labels = torch.randint(3, vocab, (HF_BATCH, HF_DEC_SEQ), generator=gen)
        return {"input_ids": ids, "labels": labels}
    if kind == "image":
        size = getattr(config, "image_size", 32)
        size = size if isinstance(size, int) else 32
        pixels = torch.randn(HF_BATCH, 3, size, size, generator=gen)
        return {
            "pixel_values": pixels,
            "labels": torch.randint(0, N_CLASSES, (HF_BATCH,), generator=gen),
        }
    if kind == "whisper":
        frames = 2 * config.max_source_positions
        feats = torch.randn(HF_BATCH, config.num_mel_bins, frames, generator=gen)
        labels = torch.randint(3, config.vocab_size, (HF_BATCH, HF_DEC_SEQ), generator=gen)
        return {"input_features": feats, "labels": labels}
    if kind == "ctc":
        audio = torch.randn(HF_BATCH, 1600, generator=gen)
        labels = torch.randint(1, config.vocab_size, (HF_BATCH, 5), generator=gen)
        return {"input_values": audio, "labels": labels}
    if kind == "clip":
        batch = 4  # a contrastive loss needs more than one pair per side
        tc, vc = config.text_config, config.vision_config
        ids = torch.randint(3, tc.vocab_size, (batch, 8), generator=gen)
        pixels = torch.randn(batch, 3, vc.image_size, vc.image_size, generator=gen)
        return {"input_ids": ids, "pixel_values": pixels, "return_loss": True}
    raise ValueError(kind)


def build_arch(
    arch: Arch, layerdrop: dict[str, float] | None = None
) -> tuple[nn.Module, dict[str, list[str]]]:
    """The model in train mode. Random layer skipping is set to 0 (Part 2), or to
    `layerdrop`'s values where given (the first-step part)."""
    import transformers

    config_cls = getattr(transformers, arch.config_cls)
    config = config_cls(**arch.config)
    present, nonzero = set(), set()
    for sub in [config, *(getattr(config, k, None) for k in ("text_config", "vision_config"))]:
        if sub is None:
            continue
        for attr in LAYERDROP_ATTRS:
            if hasattr(sub, attr):
                present.add(attr)
                if getattr(sub, attr):
                    nonzero.add(f"{attr}={getattr(sub, attr):g}")
                setattr(sub, attr, (layerdrop or {}).get(attr, 0.0))
    torch.manual_seed(0)
    model = getattr(transformers, arch.model_cls)(config)
    model.train()
    return model, {"present": sorted(present), "nonzero_default": sorted(nonzero)}


def grads_none_after_backward(model: nn.Module, inputs: dict[str, Any]) -> set[str]:
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    seed_everything(1234)
    twin(**inputs).loss.backward()
    return {n for n, p in twin.named_parameters() if p.requires_grad and p.grad is None}


FLOAT_INPUTS = ("pixel_values", "input_features", "input_values")


def arch_in_dtype(
    model: nn.Module, inputs: dict[str, Any], dtype: str
) -> tuple[nn.Module, dict[str, Any]]:
    """The stock model as the dtype case trains it; float inputs cast with it."""
    if dtype in PARAM_DTYPES:
        cast = {
            k: v.to(PARAM_DTYPES[dtype]) if k in FLOAT_INPUTS and torch.is_tensor(v) else v
            for k, v in inputs.items()
        }
        return model.to(PARAM_DTYPES[dtype]), cast
    model, _ = in_dtype(model, torch.empty(0), dtype)
    return model, inputs
