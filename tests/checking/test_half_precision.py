"""check's verdicts in half precision: bf16 and fp16 parameters, bf16 autocast, with the
upcasting RMSNorm of real LLM code (transformers' Llama, Qwen2 and Gemma compute the
norm in float32 and cast back), as large models train."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight import Severity
from deadweight.checking.rules._effective import lost_updates, smallest_step

transformers = pytest.importorskip("transformers")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SETTINGS = ["fp32", "bf16_autocast", "bf16", "fp16"]


def _config(family: str) -> Any:
    common = dict(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "qwen2":
        return transformers.Qwen2Config(**common)
    return transformers.GemmaConfig(**common, head_dim=16)


def _causal_lm(family: str, scalar: bool, setting: str) -> tuple[nn.Module, Any]:
    """A tiny random LM of the family's real code; with `scalar`, the incident's
    shape-[1] layer scalar multiplies the stream right before the final norm."""
    torch.manual_seed(0)
    cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "gemma": transformers.GemmaForCausalLM,
    }[family]
    model = cls(_config(family)).train()
    if scalar:
        inner = model.model
        inner.layer_scalar = nn.Parameter(torch.ones(1))
        norm = inner.norm
        forward = type(norm).forward
        norm.forward = lambda x: forward(norm, x * inner.layer_scalar)  # type: ignore[method-assign]
    if setting in DTYPES:
        model.to(DTYPES[setting])
    ids = torch.randint(0, 100, (4, 24), generator=torch.Generator().manual_seed(1))

    def loss_fn() -> torch.Tensor:
        if setting == "bf16_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(input_ids=ids, labels=ids).loss.float()
        return model(input_ids=ids, labels=ids).loss

    return model, loss_fn


def _shape_rule_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Decay chosen by shape, as in the incident: `p.ndim < 2` -> no decay."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3)


def _on_scalar(report: deadweight.Report) -> dict[str, Any]:
    return {f.code: f for f in report.findings if "model.layer_scalar" in f.params}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma"])
def test_the_scalar_before_the_upcasting_norm_is_found_in_every_dtype(family, setting):
    model, loss_fn = _causal_lm(family, scalar=True, setting=setting)
    report = deadweight.check(model, loss_fn, _shape_rule_adamw(model))
    found = _on_scalar(report)
    assert {"DW104", "DW203", "DW204"} <= set(found), str(report)
    assert all(found[c].severity is Severity.WARNING for c in ("DW104", "DW203", "DW204"))
    # named as in fp32: the norm's own module and line in transformers' code
    (mechanism,) = found["DW104"].evidence["params"]["model.layer_scalar"]["mechanism"]
    assert mechanism["module"] == "model.norm"
    assert f"models/{family}/modeling_{family}.py" in mechanism["site"]
    entry = found["DW104"].evidence["params"]["model.layer_scalar"]
    assert entry["confirmed"] is True and entry["probe"].startswith("x16")
    # the healthy parameters around it: nothing at warning
    others = [
        f
        for f in report.findings
        if f.severity is not Severity.INFO and "model.layer_scalar" not in f.params
    ]
    assert not others, str(report)


@pytest.mark.parametrize("setting", ["bf16", "fp16", "bf16_autocast"])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_the_healthy_twins_get_no_warning_in_half_precision(family, setting):
    model, loss_fn = _causal_lm(family, scalar=False, setting=setting)
    report = deadweight.check(model, loss_fn, _shape_rule_adamw(model))
    assert not [f for f in report.findings if f.severity is not Severity.INFO], str(report)


def _scalar_grad(family: str, dtype: torch.dtype) -> float:
    """Slow reference: the scalar's gradient from a plain backward in `dtype`."""
    model, _ = _causal_lm(family, scalar=True, setting="fp32")
    twin = copy.deepcopy(model).to(dtype)
    inner = twin.model
    forward = type(inner.norm).forward
    inner.norm.forward = lambda x: forward(inner.norm, x * inner.layer_scalar)  # type: ignore[method-assign]
    ids = torch.randint(0, 100, (4, 24), generator=torch.Generator().manual_seed(1))
    twin(input_ids=ids, labels=ids).loss.backward()
    return float(inner.layer_scalar.grad.double())


def test_the_message_says_what_the_gradient_is():
    # float32: the scalar's gradient is the norm's eps residue, deterministic: float64
    # gives the same. bfloat16: rounding noise, far from the float64 value.
    exact = _scalar_grad("llama", torch.float64)
    assert _scalar_grad("llama", torch.float32) == pytest.approx(exact, rel=0.05)
    assert abs(_scalar_grad("llama", torch.bfloat16) - exact) > 0.5 * abs(exact)

    by_setting = {}
    for setting in ("fp32", "bf16"):
        model, loss_fn = _causal_lm("llama", scalar=True, setting=setting)
        report = deadweight.check(model, loss_fn, _shape_rule_adamw(model))
        by_setting[setting] = _on_scalar(report)["DW104"].message
    assert "is the residue of the hand-written normalization's eps" in by_setting["fp32"]
    assert "bfloat16 rounding noise" in by_setting["bf16"]
    for message in by_setting.values():
        assert "the loss by" in message  # how much the probe moved the loss


def test_dw204_says_when_bf16_updates_are_lost_and_judges_as_in_fp32():
    model, loss_fn = _causal_lm("llama", scalar=True, setting="bf16")
    optimizer = _shape_rule_adamw(model)
    report = deadweight.check(model, loss_fn, optimizer)
    dw204 = _on_scalar(report)["DW204"]
    ev = dw204.evidence
    assert ev["updates_lost"] == "all" and ev["param_dtype"] == "bfloat16"
    assert ev["smallest_step"] == 2.0**-9  # half the gap below 1.0 in bfloat16
    assert "is lost, so it stays put while stored in bfloat16" in dw204.message
    assert "with float32 master weights" in dw204.message
    # the same verdict as for the fp32 model: the drift a master copy would show
    fp32_model, fp32_loss = _causal_lm("llama", scalar=True, setting="fp32")
    fp32 = _on_scalar(deadweight.check(fp32_model, fp32_loss, _shape_rule_adamw(fp32_model)))
    assert fp32["DW204"].severity is dw204.severity
    assert "updates_lost" not in fp32["DW204"].evidence
    # slow reference: bfloat16 AdamW steps really leave it where it is
    for _ in range(20):
        optimizer.zero_grad()
        loss_fn().backward()
        optimizer.step()
    assert model.model.layer_scalar.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", [1.0, 0.75, 3.0, 1e-3, 56.25])
def test_smallest_step_matches_what_rounding_keeps(dtype, value):
    name = str(dtype).removeprefix("torch.")
    step = smallest_step(value, name)
    assert step is not None
    x = torch.tensor(value, dtype=dtype)
    stored = float(x)
    step = smallest_step(stored, name)
    assert step is not None
    below = float(torch.nextafter(x, torch.tensor(-math.inf, dtype=dtype)))
    # Just above the smallest step: kept; just below it: rounded away (both directions
    # checked where the step is smallest, downwards).
    assert float(x - torch.tensor(step * 1.01, dtype=torch.float64).to(dtype)) == below
    nudged = (torch.tensor(stored, dtype=torch.float64) - step * 0.99).to(dtype)
    assert float(nudged) == stored


def test_lost_updates_classification():
    assert lost_updates(2e-4, 1e-3, 1.0, "bfloat16") == "all"
    assert lost_updates(2e-4, 1e-3, 1.0, "float16") == "some"
    assert lost_updates(2e-4, 1e-3, 1.0, "float32") == "none"
    assert lost_updates(2e-4, 1e-3, 0.0, "bfloat16") is None


class _Opaque(torch.autograd.Function):
    """A call the structure pass cannot see into: every parameter before it goes to the
    numerical screens."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            return torch.autograd.grad(F.gelu(leaf), leaf, g)[0]


class _OpaqueMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 64)
        self.norm, self.head = nn.LayerNorm(64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(_Opaque.apply(self.b(_Opaque.apply(self.a(x))))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_loss_does_not_call_small_real_gradients_noise(dtype):
    # The numerical screens' floor at the bf16 loss's own resolution (16 of its ulps:
    # 12% of the loss) called a.bias's healthy gradient noise; the floor is float32's,
    # and the report says what that leaves unseen.
    torch.manual_seed(0)
    model = _OpaqueMLP().to(dtype)
    x = torch.randn(16, 32).to(dtype)
    y = torch.randint(0, 10, (16,))
    report = deadweight.check(model, lambda: F.cross_entropy(model(x), y))
    assert not [f for f in report.findings if f.severity is not Severity.INFO], str(report)
    (note,) = report.subject["notes"]
    assert "reach the" in note and "float32's resolution" in note
    assert "note: " in str(report)
