"""The pieces a torchtune config names by `_component_` that a real run would download
(a tokenizer model file, a dataset from the hub), made here at a tiny size, and a
random base checkpoint for torchtune's own checkpointer."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
SEQ = 32
DIMS = dict(
    vocab_size=VOCAB, num_layers=2, num_heads=2, num_kv_heads=2, embed_dim=32, max_seq_len=SEQ
)


class TinyTokenizer:
    """Enough of torchtune's ModelTokenizer for the SFT collate: ids are the tokens."""

    pad_id = 0
    eos_id = 1
    bos_id = 2
    max_seq_len = SEQ

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        ids = [3 + (ord(c) % (VOCAB - 3)) for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def tiny_tokenizer() -> TinyTokenizer:
    return TinyTokenizer()


class RandomTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, count: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(3, VOCAB, (count, SEQ), generator=gen).tolist()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"tokens": self.rows[i], "labels": self.rows[i]}


def random_tokens(tokenizer: Any, count: int = 256, seed: int = 0) -> RandomTokens:
    return RandomTokens(count, seed)


def write_base_checkpoint(path: str) -> None:
    """A random Llama-2-architecture model of these dimensions, in torchtune's format."""
    from torchtune.models.llama2 import llama2

    torch.manual_seed(0)
    torch.save(llama2(**DIMS).state_dict(), path)


def lora_llama2_first_layer_detached(**kwargs: Any) -> Any:
    """torchtune's LoRA Llama 2 with layer 0's output detached: the seeded bug, as a
    user's own model component would carry it."""
    from torchtune.models.llama2 import lora_llama2

    model = lora_llama2(**kwargs)
    model.layers[0].register_forward_hook(lambda _m, _i, out: out.detach())
    return model
