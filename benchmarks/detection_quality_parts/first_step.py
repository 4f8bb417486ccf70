"""Part 2b of the detection-quality benchmark: architectures whose first step is
special (random layer skipping, gates that start at zero), each checked over several
random draws, and two seeded bugs inside such models that must still be found."""

from __future__ import annotations

import sys
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from detection_quality_parts.common import (
    REPO_SRC,
    finding_record,
    make_optimizer,
    seed_everything,
    short_error,
    table,
)
from detection_quality_parts.models import ARCHS, Arch, build_arch, hf_inputs

# ---------------------------------------------------------------------------------------
# Part 2b: architectures whose first step is special (random layer skipping, gates
# that start at zero), each checked over several random draws, and two seeded bugs
# inside such models that must still be found.

FIRST_STEP_SEEDS = range(10)
WATCH_STEPS = 50


@dataclass
class FirstStep:
    name: str
    what: str  # the special first step
    build: Callable[[], tuple[nn.Module, Callable[[], torch.Tensor]]]
    bug: str | None = None  # the seeded bug's parameter, which must get a warning or error
    watch: bool = False  # also watch 50 steps (DW301 and warnings)


def _arch(name: str) -> Arch:
    return next(a for a in ARCHS if a.name == name)


def _hf_case(arch: Arch, layerdrop: dict[str, float] | None = None) -> Callable[[], Any]:
    def build() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
        model, _ = build_arch(arch, layerdrop)
        inputs = hf_inputs(arch, model, torch.Generator().manual_seed(0))
        return model, lambda: model(**inputs).loss

    return build


HUBERT = Arch(
    "hubert",
    "audio",
    "HubertForCTC",
    "HubertConfig",
    {**_arch("wav2vec2").config},
    "ctc",
)


def _detached_layer() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """wav2vec2 with LayerDrop whose second encoder layer detaches its input: every
    parameter before it gets no gradient (in a draw where that layer runs)."""
    model, loss_fn = _hf_case(_arch("wav2vec2"), {"layerdrop": 0.1})()
    layer: Any = model.wav2vec2.encoder.layers[1]  # type: ignore[union-attr,index]
    forward = layer.forward
    layer.forward = lambda hidden, *a, **k: forward(hidden.detach(), *a, **k)
    return model, loss_fn


class _ScaledNorm(nn.Module):
    """A shape-[1] scalar right before the final LayerNorm, which cancels it."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.scale * x)


def _convnext_scalar() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    model, loss_fn = _hf_case(_arch("convnext"))()
    inner: Any = model.convnext  # type: ignore[union-attr]
    inner.layernorm = _ScaledNorm(inner.layernorm)
    return model, loss_fn


def _gated(cls_name: str) -> Callable[[], tuple[nn.Module, Callable[[], torch.Tensor]]]:
    def build() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
        sys.path.insert(0, str(REPO_SRC.parent))
        import tests.gated_models as gm

        torch.manual_seed(0)
        model: nn.Module = getattr(gm, cls_name)()
        if cls_name == "DiT":
            x, t, noise = torch.randn(2, 6, 8), torch.rand(2, 1), torch.randn(2, 6, 8)
            return model, lambda: F.mse_loss(model(x, t), noise)
        ids = torch.randint(0, 64, (2, 8))
        media = torch.randn(2, 5, 32)
        args = (ids, media) if cls_name == "TanhGated" else (ids,)
        return model, lambda: F.cross_entropy(model(*args).flatten(0, 1), ids.flatten())

    return build


def _lora() -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    import peft

    base, loss_of = _hf_case(_arch("llama"))()
    del loss_of
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(base, lora).train()  # type: ignore[arg-type]
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, lambda: model(input_ids=ids, labels=ids).loss


FIRST_STEP: list[FirstStep] = [
    FirstStep("wav2vec2", "layerdrop=0.1", _hf_case(_arch("wav2vec2"), {"layerdrop": 0.1})),
    FirstStep("hubert", "layerdrop=0.1", _hf_case(HUBERT, {"layerdrop": 0.1})),
    FirstStep(
        "whisper",
        "encoder/decoder_layerdrop=0.2",
        _hf_case(_arch("whisper"), {"encoder_layerdrop": 0.2, "decoder_layerdrop": 0.2}),
    ),
    FirstStep("convnext", "LayerScale 1e-6", _hf_case(_arch("convnext")), watch=True),
    FirstStep("dit", "adaLN-Zero", _gated("DiT"), watch=True),
    FirstStep("rezero", "alpha = 0", _gated("ReZero"), watch=True),
    FirstStep("flamingo-gate", "tanh(0) gates", _gated("TanhGated"), watch=True),
    FirstStep("lora", "PEFT LoRA, B = 0", _lora, watch=True),
    FirstStep(
        "wav2vec2 + detached layer",
        "layerdrop=0.1, seeded cut",
        _detached_layer,
        bug="wav2vec2.encoder.layers.0.attention.q_proj.weight",
    ),
    FirstStep(
        "convnext + scalar before norm",
        "LayerScale, seeded scalar",
        _convnext_scalar,
        bug="convnext.layernorm.scale",
    ),
]


def run_first_step(case: FirstStep) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.name, "what": case.what, "status": "ok", "bug": case.bug}
    try:
        model, loss_fn = case.build()
        optimizer = make_optimizer(model)
        per_seed = []
        for seed in FIRST_STEP_SEEDS:
            seed_everything(seed)
            records = [
                finding_record(f) for f in deadweight.check(model, loss_fn, optimizer).findings
            ]
            per_seed.append(records)
        row["checks"] = len(per_seed)
        loud = [[r for r in recs if r["severity"] in ("warning", "error")] for recs in per_seed]
        if case.bug is None:
            row["warning_draws"] = sum(1 for w in loud if w)
            row["warning_codes"] = sorted(Counter(r["code"] for w in loud for r in w).items())
        else:
            row["bug_found"] = sum(1 for w in loud if any(case.bug in r["params"] for r in w))
        row["dw101_draws"] = sum(1 for recs in per_seed if any(r["code"] == "DW101" for r in recs))
        row["dw110_draws"] = sum(1 for recs in per_seed if any(r["code"] == "DW110" for r in recs))
        row["gate_named"] = any(
            "gated_by" in r["evidence"] for recs in per_seed for r in recs if r["code"] == "DW103"
        )
        if case.watch:
            seed_everything(0)
            with deadweight.watch(model, optimizer) as w:
                for _ in range(WATCH_STEPS):
                    loss_fn().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            found = [finding_record(f) for f in w.report().findings]
            row["watch_dw301"] = sum(1 for r in found if r["code"] == "DW301")
            row["watch_warnings"] = sorted(
                r["code"] for r in found if r["severity"] in ("warning", "error")
            )
    except Exception as exc:
        row.update(status="error", error=short_error(exc), traceback=traceback.format_exc())
    return row


def print_first_step(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"\n== Part 2b: first steps that are special ({len(FIRST_STEP_SEEDS)} random draws "
        f"each; watch: {WATCH_STEPS} steps of AdamW) =="
    )
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append([r["case"], r["what"], f"error: {r['error']}", "", "", "", ""])
            continue
        n = r["checks"]
        if r["bug"] is None:
            codes = " ".join(f"{c}x{k}" for c, k in r["warning_codes"])
            verdict = f"{r['warning_draws']}/{n} warned" + (f" ({codes})" if codes else "")
        else:
            verdict = f"bug found {r['bug_found']}/{n}"
        watch = (
            f"DW301 {r['watch_dw301']}, warnings {' '.join(r['watch_warnings']) or '-'}"
            if "watch_dw301" in r
            else "-"
        )
        gate = "yes" if r["gate_named"] else "-"
        out.append(
            [r["case"], r["what"], verdict, f"{r['dw101_draws']}/{n}", f"{r['dw110_draws']}/{n}",
             gate, watch]
        )  # fmt: skip
    print(
        table(
            ("case", "first step", "check (warning or error)", "DW101", "DW110", "gate named",
             "watch"),
            out,
        )
    )  # fmt: skip
