"""Gates that start at zero (ReZero, adaLN-Zero, tanh gates, LoRA's B = 0) or near it
(LayerScale): what sits behind them is gated at init, info at most, with the gate
named; never DW104/DW105, never a warning; and watch does not call it never-moved."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight.checking import gates
from tests.gated_models import DiT, ReZero, TanhGated

WARNING_OR_WORSE = ("warning", "error")


def _rezero() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model, ids = ReZero(), torch.randint(0, 64, (2, 8))
    return model, lambda: F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def _dit() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = DiT()
    x, t, noise = torch.randn(2, 6, 8), torch.rand(2, 1), torch.randn(2, 6, 8)
    return model, lambda: F.mse_loss(model(x, t), noise)


def _tanh() -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model, ids, media = TanhGated(), torch.randint(0, 64, (2, 8)), torch.randn(2, 5, 32)
    return model, lambda: F.cross_entropy(model(ids, media).flatten(0, 1), ids.flatten())


def _lora() -> tuple[nn.Module, object]:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), lora).train()
    ids = torch.randint(3, 256, (2, 16))
    return model, lambda: model(input_ids=ids, labels=ids).loss


def _convnext() -> tuple[nn.Module, object]:
    transformers = pytest.importorskip("transformers")
    config = transformers.ConvNextConfig(
        hidden_sizes=[16, 32], depths=[2, 2], num_stages=2, image_size=32, num_labels=10
    )
    torch.manual_seed(0)
    model = transformers.ConvNextForImageClassification(config).train()
    pixels, labels = torch.randn(2, 3, 32, 32), torch.tensor([1, 2])
    return model, lambda: model(pixel_values=pixels, labels=labels).loss


# block 0's attention sits behind block 0's alpha, not also behind block 2's: block 2
# sees it only through block 0's zero branch
EXPECTED_GATE = {
    "rezero": ("blocks.0.attn.in_proj_weight", "blocks.0.alpha"),
    "dit": ("blocks.0.attn.in_proj_weight", "out.weight"),
    "tanh": ("xattn.in_proj_weight", "attn_gate"),
    "lora": (
        "model.layers.0.self_attn.q_proj.lora_A.default.weight",
        "model.layers.0.self_attn.q_proj.lora_B.default.weight",
    ),
}
BUILDERS = {"rezero": _rezero, "dit": _dit, "tanh": _tanh, "lora": _lora, "convnext": _convnext}


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """transformers' Trainer recipe: no decay for biases and norms."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (rest if p.ndim < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_gated_models_get_no_warning_at_step_0(arch: str) -> None:
    model, loss_fn = BUILDERS[arch]()
    report = deadweight.check(model, loss_fn, _optimizer(model))
    loud = [(f.code, f.params[:2]) for f in report.findings if f.severity.value in WARNING_OR_WORSE]
    assert loud == []
    assert not report.by_code("DW104") and not report.by_code("DW105")
    if arch in EXPECTED_GATE:
        param, gate = EXPECTED_GATE[arch]
        (behind,) = [f for f in report.by_code("DW103") if param in f.params]
        assert behind.evidence["gated_by"][0] == gate
        assert gate in behind.message


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_gated_models_after_fifty_watched_steps(arch: str) -> None:
    model, loss_fn = BUILDERS[arch]()
    optimizer = _optimizer(model)
    with deadweight.watch(model, optimizer) as watch:
        for _ in range(50):
            loss_fn().backward()  # type: ignore[operator]
            optimizer.step()
            optimizer.zero_grad()
    report = watch.report()
    assert not report.by_code("DW301")
    assert [f.code for f in report.findings if f.severity.value in WARNING_OR_WORSE] == []


def test_a_zero_parameter_that_multiplies_nothing_is_no_gate() -> None:
    """An exactly zero gradient from a dead ReLU is not put on a zero bias elsewhere."""

    class DeadRelu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 1)
            nn.init.zeros_(self.b.bias)
            with torch.no_grad():
                self.a.bias.fill_(-100.0)  # every unit dead

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x))) + x.sum(-1, keepdim=True)

    torch.manual_seed(0)
    model, x = DeadRelu(), torch.randn(8, 4)
    report = deadweight.check(model, lambda: model(x).pow(2).mean())
    zero = [f for f in report.by_code("DW103") if "a.weight" in f.params]
    assert zero and "gated_by" not in zero[0].evidence


def test_gated_by_reads_the_graph_only() -> None:
    """The slow reference: the gate found is the parameter whose zero, once made
    nonzero, gives the gated parameter a gradient."""
    model, loss_fn = _rezero()
    named = dict(model.named_parameters())
    loss = loss_fn()  # type: ignore[operator]
    loss.backward()
    silent = {id(p): n for n, p in named.items() if p.grad is not None and not p.grad.any()}
    live = [(n, p) for n, p in named.items() if p.grad is not None and p.grad.any()]
    zero = gates.zero_valued(live)
    found = gates.gated_by(loss, {id(p): n for n, p in live if id(p) in zero}, silent)
    for name, (gate, *_) in found.items():
        model.zero_grad()
        with torch.no_grad():
            named[gate].fill_(0.5)
        loss_fn().backward()  # type: ignore[operator]
        assert named[name].grad is not None and named[name].grad.any(), (name, gate)
        with torch.no_grad():
            named[gate].zero_()
    assert len(found) == 24
