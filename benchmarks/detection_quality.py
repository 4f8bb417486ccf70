"""How well `deadweight.check` finds parameters that a normalization cancels, and how often
it warns about healthy stock models.

Three parts, each printed as plain-text tables (``--json PATH`` also writes every raw
per-case result):

1. **recall**: small models, built in code from random initialisation, each with a
   planted parameter that an operation after it provably cancels (a scalar or
   per-channel gain before a normalization, a conv bias before BatchNorm, an attention
   key bias before softmax, a single bias on every logit before cross-entropy). The
   sweep crosses placement x norm kind x eps x width x loss form x dtype x seed.
   A case is *found* when some DW103/DW104/DW105 finding names the planted parameter,
   at any severity; the tables split the found cases by the severity they got. Read
   "recall" as found / (cases that ran); "at warning" is the share of those cases
   reported at warning or above, the level that fails a test or a CI run.
   "mechanism named" is, among found cases, the share whose finding names what cancels
   the parameter: its message, location or evidence contains a normalization's op or
   class (layer_norm, RMSNorm, GroupNorm, batch_norm, instance_norm, rsqrt, normalize,
   softmax, cross_entropy) or a ``file.py:line`` reference (a heuristic; the generic
   word "normalization" does not count). "DW204" is the share of found cases with a
   drift-risk warning on the planted parameter (they all sit in AdamW's zero-decay
   group). False positives of this part: in placement (c) the per-block branch scalars
   are healthy, so any warning naming one is counted; other parameters reported at
   warning are listed for review (they may be true, e.g. a weight whose norm is free).
2. **precision**: stock transformers architectures from tiny random configs (no hub),
   train mode, the model's own loss. For each: findings at warning or above other
   than DW101/DW102 (on a healthy stock model every one is a false alarm or a
   mislabelled severity), findings at info, and DW101 against the ground truth, the set
   of trainable parameters whose ``.grad`` is None after a plain ``loss.backward()`` on
   a deep copy with the same seed ("yes": equal sets). Then (2b) architectures whose
   first step is special, each checked over 10 random draws: LayerDrop on (wav2vec2,
   HuBERT, Whisper), gates that start at or near zero (ConvNeXt's LayerScale, DiT's
   adaLN-Zero, ReZero, tanh gates, PEFT LoRA), with 50 watched steps for the gated
   ones; and two seeded bugs inside such models that must still get a warning or
   error: a detached layer in a LayerDrop model, a scalar before ConvNeXt's final norm.
3. **seeds**: the two seed incidents from ``deadweight.demos``, with the codes they
   must get and the DW104/DW204 evidence for the layer scalar.

Every case runs inside try/except: a library or model failure is an "error" row, not
a crash. Nothing is downloaded; all models are random.

    python benchmarks/detection_quality.py [--quick] [--part recall|precision|seeds|all]
                                           [--json PATH]

``--quick`` runs a deterministic, stratified subset of the recall sweep (about 150
cases, balanced over every dimension); the full sweep is several thousand cases.
Parts 2 and 3 are the same in both modes.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import random
import re
import subprocess
import sys
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import deadweight

INVARIANCE_CODES = frozenset({"DW103", "DW104", "DW105"})
DRIFT_CODES = frozenset({"DW203", "DW204"})
GRAD_FLOW_CODES = frozenset({"DW101", "DW102"})
N_CLASSES = 10
LR = 1e-3
WEIGHT_DECAY = 0.01  # transformers' Trainer recipe
MAX_LISTED = 40  # missed / error ids printed per list; the JSON has them all

LossFn = Callable[[], torch.Tensor]


# ---------------------------------------------------------------------------------------
# optimizer groups, as transformers' Trainer builds them


def hf_param_groups(model: nn.Module, no_decay_extra: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Weight decay for everything except biases, normalization weights and `no_decay_extra`.

    A normalization is any module whose class name contains "Norm" (LayerNorm, RMSNorm,
    GroupNorm, BatchNorm*, InstanceNorm*, LlamaRMSNorm, T5LayerNorm, ...). The planted
    parameters go into the zero-decay group: that is the incident, a shape rule leaving a
    scalar undecayed.
    """
    extra = set(no_decay_extra)
    norm_ids = {
        id(p)
        for m in model.modules()
        if "Norm" in type(m).__name__
        for p in m.parameters(recurse=False)
    }
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.endswith("bias") or id(p) in norm_ids or name in extra:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def make_optimizer(model: nn.Module, no_decay_extra: Iterable[str] = ()) -> torch.optim.Optimizer:
    return torch.optim.AdamW(hf_param_groups(model, no_decay_extra), lr=LR)


# ---------------------------------------------------------------------------------------
# findings as plain data


def severity_name(finding: Any) -> str:
    sev = deadweight.Severity
    if finding.severity is sev.ERROR:
        return "error"
    if finding.severity is sev.WARNING:
        return "warning"
    if finding.severity is sev.INFO:
        return "info"
    return str(finding.severity)


def at_warning(finding: Any) -> bool:
    return severity_name(finding) in ("warning", "error")


def json_safe(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def finding_record(finding: Any) -> dict[str, Any]:
    location = getattr(finding, "location", None)
    return {
        "code": finding.code,
        "severity": severity_name(finding),
        "params": list(finding.params),
        "message": finding.message,
        "location": str(location) if location is not None else None,
        "evidence": json_safe(dict(finding.evidence)),
    }


# A finding names its mechanism when it points at the cancelling op or module, or at a
# source line. Evidence keys such as grad_norm / param_norm and the generic word
# "normalization" must not count, so bare "norm" is not a term.
MECHANISM_RE = re.compile(
    r"(?i)(layer|rms|group|batch|instance)[ _-]?norm|\brsqrt\b|\bnormalize\b|softmax"
    r"|cross[ _-]?entropy|[\w./-]+\.py:\d+"
)


def names_mechanism(records: Sequence[dict[str, Any]]) -> bool:
    for r in records:
        text = " ".join([r["message"], r["location"] or "", json.dumps(r["evidence"], default=str)])
        if MECHANISM_RE.search(text):
            return True
    return False


def short_error(exc: BaseException) -> str:
    """The exception and the innermost frame it came from (an AssertionError has no text)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:240]
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename.rsplit('/', 1)[-1]}:{last.lineno} in {last.name})"
    return text


# ---------------------------------------------------------------------------------------
# Part 1: recall on planted parameters

PLACEMENTS: dict[str, str] = {
    "a": "shape-[1] gain on a bias-free Linear's output, before a norm",
    "b": "per-channel gain before a per-channel normalization (2-D)",
    "c": "3 pre-norm residual blocks with branch scalars; a scalar on the stream before the final norm",
    "d": "conv2d bias before BatchNorm2d (train mode)",
    "e": "attention key bias before softmax over keys",
    "f": "shape-[1] gain before a hand-written RMSNorm",
    "g": "shape-[1] gain before F.normalize(dim=-1)",
    "h": "shape-[1] bias on every logit before cross-entropy",
}
NORMS_BY_PLACEMENT: dict[str, tuple[str, ...]] = {
    "a": ("layernorm", "rmsnorm", "groupnorm", "f_layer_norm", "llama_rmsnorm"),
    "b": ("batchnorm2d", "instancenorm2d", "groupnorm_per_channel"),
    "c": ("layernorm", "rmsnorm", "groupnorm", "f_layer_norm", "llama_rmsnorm"),
    "d": ("batchnorm2d",),
    "e": ("softmax",),
    "f": ("hand_rmsnorm",),
    "g": ("f_normalize",),
    "h": ("cross_entropy",),
}
EPS_VALUES: tuple[float, ...] = (1e-5, 1e-6, 1e-12)
NORMS_WITHOUT_EPS = frozenset({"softmax", "cross_entropy"})
WIDTHS: tuple[int, ...] = (8, 64, 512, 4096)
LOSS_FORMS: tuple[str, ...] = ("ce", "mse", "mse_zero", "sum", "ce_plus_const", "ce_zero_value")
CE_LOSS_FORMS: tuple[str, ...] = ("ce", "ce_plus_const", "ce_zero_value")
# How the model computes: fp32; fp32 parameters under bf16 autocast; the model and its
# input cast to bf16 or fp16 (`model.to(dtype)`); FSDP2 mixed precision (fp32 sharded
# parameters, bf16 compute: one process, gloo).
DTYPES: tuple[str, ...] = ("fp32", "bf16_autocast", "bf16", "fp16", "fsdp2_bf16")
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SEEDS: tuple[int, ...] = (0, 1, 2)
GROUPNORM_GROUPS = 2
STACK_BLOCKS = 3
STACK_MAX_HIDDEN = 512  # keeps the width-4096 stack at ~30M parameters
CONV_SPATIAL = 4
SEQ_LEN = 8


@dataclass(frozen=True)
class Case:
    placement: str
    norm: str
    eps: float | None
    width: int
    loss: str
    dtype: str
    seed: int

    @property
    def id(self) -> str:
        eps = "-" if self.eps is None else f"{self.eps:g}"
        return (
            f"{self.placement}/{self.norm}/eps={eps}/w={self.width}/{self.loss}/"
            f"{self.dtype}/s={self.seed}"
        )


def all_cases() -> list[Case]:
    cases = []
    for placement, norms in NORMS_BY_PLACEMENT.items():
        losses = CE_LOSS_FORMS if placement == "h" else LOSS_FORMS
        for norm in norms:
            eps_values: tuple[float | None, ...] = (
                (None,) if norm in NORMS_WITHOUT_EPS else EPS_VALUES
            )
            for eps, width, loss, dtype, seed in itertools.product(
                eps_values, WIDTHS, losses, DTYPES, SEEDS
            ):
                if norm == "groupnorm" and width % GROUPNORM_GROUPS:
                    continue
                cases.append(Case(placement, norm, eps, width, loss, dtype, seed))
    return cases


BALANCED_DIMS = ("norm", "eps", "width", "loss", "dtype", "seed")


def quick_cases(cases: Sequence[Case], total: int) -> list[Case]:
    """A deterministic subset: the same share of every placement, balanced over each dimension.

    Within a placement the cases are shuffled with a fixed string seed (stable across
    runs and machines), then picked greedily: each next case is the one whose values of
    norm, eps, width, loss, dtype and seed have been picked least so far.
    """
    by_placement: dict[str, list[Case]] = defaultdict(list)
    for case in cases:
        by_placement[case.placement].append(case)
    placements = [p for p in PLACEMENTS if by_placement[p]]
    share, extra = divmod(total, len(placements))
    chosen: set[str] = set()
    for i, placement in enumerate(placements):
        pool = sorted(by_placement[placement], key=lambda c: c.id)
        random.Random(f"deadweight-quick-{placement}").shuffle(pool)
        counts: dict[str, Counter[Any]] = {d: Counter() for d in BALANCED_DIMS}
        for _ in range(min(len(pool), share + (i < extra))):
            best = min(
                (c for c in pool if c.id not in chosen),
                key=lambda c: sum(counts[d][getattr(c, d)] for d in BALANCED_DIMS),
            )
            chosen.add(best.id)
            for d in BALANCED_DIMS:
                counts[d][getattr(best, d)] += 1
    return [c for c in cases if c.id in chosen]


def make_norm(kind: str, width: int, eps: float) -> nn.Module | None:
    if kind == "layernorm":
        return nn.LayerNorm(width, eps=eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(width, eps=eps)
    if kind == "groupnorm":  # on an (N, C) input
        return nn.GroupNorm(GROUPNORM_GROUPS, width, eps=eps)
    if kind == "f_layer_norm":
        return None  # applied as F.layer_norm in forward
    if kind == "llama_rmsnorm":
        # transformers' own: computes in fp32 and casts back (as Mistral, Qwen, Gemma do)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        return LlamaRMSNorm(width, eps=eps)
    raise ValueError(kind)


def apply_norm(norm: nn.Module | None, x: torch.Tensor, eps: float) -> torch.Tensor:
    if norm is None:
        return F.layer_norm(x, (x.shape[-1],), eps=eps)
    return norm(x)


class GainBeforeNorm(nn.Module):
    """(a) head(norm(proj(x) * gain)), gain of shape [1]."""

    def __init__(self, width: int, norm: str, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(width, width, bias=False)
        self.gain = nn.Parameter(torch.ones(1))
        self.out_norm = make_norm(norm, width, eps)
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(apply_norm(self.out_norm, self.proj(x) * self.gain, self.eps))


class ChannelGainBeforeNorm(nn.Module):
    """(b) a per-channel gain [1, C, 1, 1] between a bias-free conv and a per-channel norm."""

    def __init__(self, width: int, norm: str, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.gain = nn.Parameter(torch.ones(1, width, 1, 1))
        if norm == "batchnorm2d":
            self.out_norm: nn.Module = nn.BatchNorm2d(width, eps=eps)
        elif norm == "instancenorm2d":
            self.out_norm = nn.InstanceNorm2d(width, eps=eps, affine=True)
        elif norm == "groupnorm_per_channel":
            self.out_norm = nn.GroupNorm(width, width, eps=eps)
        else:
            raise ValueError(norm)
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.out_norm(self.conv(x) * self.gain))
        return self.head(h.mean((2, 3)))


class ScalarBlock(nn.Module):
    def __init__(self, width: int, norm: str, eps: float) -> None:
        super().__init__()
        hidden = min(2 * width, STACK_MAX_HIDDEN)
        self.eps = eps
        self.norm = make_norm(norm, width, eps)
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.branch_scalar = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        branch = self.fc2(F.gelu(self.fc1(apply_norm(self.norm, h, self.eps))))
        return h + self.branch_scalar * branch


class ScalarStack(nn.Module):
    """(c) pre-norm residual MLP; final_scalar multiplies the stream right before out_norm."""

    def __init__(self, width: int, norm: str, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList([ScalarBlock(width, norm, eps) for _ in range(STACK_BLOCKS)])
        self.final_scalar = nn.Parameter(torch.ones(1))
        self.out_norm = make_norm(norm, width, eps)
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(apply_norm(self.out_norm, self.final_scalar * h, self.eps))


class ConvBiasBatchNorm(nn.Module):
    """(d) Conv2d(bias=True) -> BatchNorm2d: the batch mean removes the bias."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1, bias=True)
        self.out_norm = nn.BatchNorm2d(width, eps=eps)
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.out_norm(self.conv(x))).mean((2, 3)))


class KeyBiasAttention(nn.Module):
    """(e) single-head attention; q . (k + b) = q . k + q . b is constant over keys."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=True)
        self.v = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        scores = q @ k.transpose(-1, -2) / math.sqrt(x.shape[-1])
        return torch.softmax(scores, dim=-1) @ v


class KeyBiasModel(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = KeyBiasAttention(width)
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x))


class GainBeforeHandRMSNorm(nn.Module):
    """(f) a scalar before x * rsqrt(mean(x^2) + eps), written out by hand."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(width, width, bias=False)
        self.gain = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) * self.gain
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.head(h)


class GainBeforeNormalize(nn.Module):
    """(g) a scalar before F.normalize(x, dim=-1)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(width, width, bias=False)
        self.gain = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(width, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.normalize(self.proj(x) * self.gain, dim=-1, eps=self.eps))


class LogitBias(nn.Module):
    """(h) one shape-[1] bias added to every class logit: softmax removes it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Linear(width, width)
        self.head = nn.Linear(width, N_CLASSES)
        self.logit_bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.body(x))) + self.logit_bias


@dataclass
class Built:
    model: nn.Module
    loss_fn: LossFn
    planted: tuple[str, ...]
    x: torch.Tensor
    healthy: tuple[str, ...] = ()  # must not be reported at warning
    truth_residual: float = math.nan  # cancellation_residual, before any cast


SHIFTED_PLACEMENTS = frozenset({"d", "e", "h"})  # biases; the others are gains


def cancellation_residual(
    model: nn.Module, x: torch.Tensor, planted: tuple[str, ...], placement: str
) -> float:
    """The ground truth, checked: how much the planted parameter moves what the loss sees.

    In float64 on a copy, under no_grad: scale the planted gain by 10, or add a random
    vector of size 10 to the planted bias, and return |out' - out| / |out| of the model's
    output (of its log-softmax for (h), where the logits themselves do shift). A true
    cancellation leaves only the normalization's eps residue (about eps / variance).
    """
    twin = copy.deepcopy(model).double()
    x = x.double()
    gen = torch.Generator().manual_seed(99)

    def seen(out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(out, dim=-1) if placement == "h" else out

    with torch.no_grad():
        base = seen(twin(x))
        params = dict(twin.named_parameters())
        for name in planted:
            p = params[name]
            if placement in SHIFTED_PLACEMENTS:
                p.add_(10 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            else:
                p.mul_(10)
        moved = seen(twin(x))
    return float((moved - base).norm() / base.norm())


def batch_size(case: Case) -> int:
    conv = case.placement in ("b", "d")
    if case.width >= 4096:
        return 4 if conv else 8
    return 8 if conv or case.placement == "e" else 32


def make_loss(
    model: nn.Module, x: torch.Tensor, form: str, dtype: str, gen: torch.Generator
) -> LossFn:
    with torch.no_grad():
        logits_shape = model(x).shape
    reshard = getattr(model, "reshard", None)
    if callable(reshard):  # FSDP2 keeps a root gathered after a no_grad forward
        reshard()
    targets = torch.randint(0, N_CLASSES, logits_shape[:-1], generator=gen)
    regression = torch.randn(logits_shape, generator=gen)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        flat = logits.reshape(-1, N_CLASSES)
        if form in ("ce", "ce_plus_const", "ce_zero_value"):
            ce = F.cross_entropy(flat, targets.reshape(-1))
            if form == "ce_plus_const":
                return ce + 1000.0
            if form == "ce_zero_value":
                return ce - ce.detach()  # value exactly 0, gradient that of ce
            return ce
        if form == "mse":
            return F.mse_loss(logits, regression.to(logits.dtype))
        if form == "mse_zero":
            return logits.pow(2).mean()
        if form == "sum":
            return logits.sum()
        raise ValueError(form)

    def loss_fn() -> torch.Tensor:
        if dtype == "bf16_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(model(x))
            return loss.float()
        return loss_of(model(x))

    return loss_fn


def build_case(case: Case) -> Built:
    torch.manual_seed(case.seed)
    gen = torch.Generator().manual_seed(10_000 + case.seed)
    n, w, eps = batch_size(case), case.width, case.eps
    model: nn.Module
    planted: tuple[str, ...]
    healthy: tuple[str, ...] = ()
    if case.placement in ("b", "d"):
        x = torch.randn(n, 3, CONV_SPATIAL, CONV_SPATIAL, generator=gen)
    elif case.placement == "e":
        x = torch.randn(n, SEQ_LEN, w, generator=gen)
    else:
        x = torch.randn(n, w, generator=gen)
    if case.placement == "a":
        assert eps is not None
        model, planted = GainBeforeNorm(w, case.norm, eps), ("gain",)
    elif case.placement == "b":
        assert eps is not None
        model, planted = ChannelGainBeforeNorm(w, case.norm, eps), ("gain",)
    elif case.placement == "c":
        assert eps is not None
        model, planted = ScalarStack(w, case.norm, eps), ("final_scalar",)
        healthy = tuple(f"blocks.{i}.branch_scalar" for i in range(STACK_BLOCKS))
    elif case.placement == "d":
        assert eps is not None
        model, planted = ConvBiasBatchNorm(w, eps), ("conv.bias",)
    elif case.placement == "e":
        model, planted = KeyBiasModel(w), ("attn.k.bias",)
    elif case.placement == "f":
        assert eps is not None
        model, planted = GainBeforeHandRMSNorm(w, eps), ("gain",)
    elif case.placement == "g":
        assert eps is not None
        model, planted = GainBeforeNormalize(w, eps), ("gain",)
    elif case.placement == "h":
        model, planted = LogitBias(w), ("logit_bias",)
    else:
        raise ValueError(case.placement)
    model.train()
    truth = cancellation_residual(model, x, planted, case.placement)
    model, x = in_dtype(model, x, case.dtype)
    loss_fn = make_loss(model, x, case.loss, case.dtype, gen)
    return Built(model, loss_fn, planted, x, healthy, truth)


def in_dtype(model: nn.Module, x: torch.Tensor, dtype: str) -> tuple[nn.Module, torch.Tensor]:
    """The model (and its input) as the case computes: cast, or sharded by FSDP2."""
    if dtype in PARAM_DTYPES:
        return model.to(PARAM_DTYPES[dtype]), x.to(PARAM_DTYPES[dtype])
    if dtype == "fsdp2_bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        single_process_group()
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model, mp_policy=policy)  # casts the forward's inputs to bf16 too
    return model, x


def single_process_group() -> None:
    """A one-process gloo group, once, for FSDP2."""
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)


def _runs_in_fp32(case: Case) -> bool:
    try:
        build_case(Case(**{**asdict(case), "dtype": "fp32"}))
    except Exception:
        return False
    return True


def run_recall_case(case: Case) -> dict[str, Any]:
    row: dict[str, Any] = {"id": case.id, **asdict(case), "status": "ok"}
    try:
        built = build_case(case)
        row["truth_residual_fp64"] = built.truth_residual
    except Exception as exc:
        row.update(status="error", error=short_error(exc), traceback=traceback.format_exc())
        if case.dtype != "fp32" and _runs_in_fp32(case):
            # the model itself cannot run in this dtype (BatchNorm's fp32 running
            # statistics against FSDP2's bf16 parameters): not deadweight's to judge
            row["status"] = "unsupported"
        return row
    try:
        optimizer = make_optimizer(built.model, built.planted)
        start = time.perf_counter()
        report = deadweight.check(built.model, built.loss_fn, optimizer)
        row["check_s"] = time.perf_counter() - start
        records = [finding_record(f) for f in report.findings]
    except Exception as exc:
        row.update(status="error", error=short_error(exc), traceback=traceback.format_exc())
        return row
    planted = set(built.planted)
    on_planted = [r for r in records if planted & set(r["params"])]
    invariance = [r for r in on_planted if r["code"] in INVARIANCE_CODES]
    found = bool(invariance)
    severities = {r["severity"] for r in invariance}
    best = next((s for s in ("error", "warning", "info") if s in severities), None)
    warn_other = sorted(
        {
            p
            for r in records
            if r["severity"] in ("warning", "error") and r["code"] not in GRAD_FLOW_CODES
            for p in r["params"]
            if p not in planted
        }
    )
    row.update(
        planted=list(built.planted),
        found=found,
        severity=best,
        codes_on_planted=sorted({r["code"] for r in on_planted}),
        invariance_codes=sorted({r["code"] for r in invariance}),
        drift_warning=any(
            r["code"] == "DW204" and r["severity"] in ("warning", "error") for r in on_planted
        ),
        decay_by_shape=any(r["code"] == "DW203" for r in on_planted),
        mechanism_named=names_mechanism(invariance) if found else None,
        healthy_at_warning=[p for p in built.healthy if p in warn_other],
        other_at_warning=[p for p in warn_other if p not in built.healthy],
        findings=records,
    )
    return row


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
    torch.manual_seed(1234)
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


def run_arch(arch: Arch, dtype: str = "fp32") -> dict[str, Any]:
    row: dict[str, Any] = {
        "arch": arch.name,
        "family": arch.family,
        "model": arch.model_cls,
        "note": arch.note,
        "dtype": dtype,
        "status": "ok",
    }
    try:
        model, layerdrop = build_arch(arch)
        gen = torch.Generator().manual_seed(0)
        inputs = hf_inputs(arch, model, gen)
        row["layerdrop"] = layerdrop
        row["n_params"] = sum(p.numel() for p in model.parameters())
    except Exception as exc:
        row.update(status="build error", error=short_error(exc), traceback=traceback.format_exc())
        return row
    try:
        truth = grads_none_after_backward(model, inputs)
    except Exception as exc:
        row.update(status="run error", error=short_error(exc), traceback=traceback.format_exc())
        return row
    try:
        model, inputs = arch_in_dtype(model, inputs, dtype)
        with torch.no_grad():
            torch.manual_seed(1234)
            model(**inputs)
        reshard = getattr(model, "reshard", None)
        if callable(reshard):  # FSDP2 keeps a root gathered after a no_grad forward
            reshard()
    except Exception as exc:  # the model itself cannot run in this dtype
        row.update(status="unsupported", error=short_error(exc))
        return row

    def loss_fn() -> torch.Tensor:
        if dtype == "bf16_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return model(**inputs).loss.float()
        return model(**inputs).loss

    try:
        optimizer = make_optimizer(model)
        torch.manual_seed(1234)
        start = time.perf_counter()
        report = deadweight.check(model, loss_fn, optimizer)
        row["check_s"] = time.perf_counter() - start
        records = [finding_record(f) for f in report.findings]
    except Exception as exc:
        row.update(status="check error", error=short_error(exc), traceback=traceback.format_exc())
        return row
    warnings = [
        r
        for r in records
        if r["severity"] in ("warning", "error") and r["code"] not in GRAD_FLOW_CODES
    ]
    infos = [r for r in records if r["severity"] == "info" and r["code"] not in GRAD_FLOW_CODES]
    dw101 = {p for r in records if r["code"] == "DW101" for p in r["params"]}
    row.update(
        warnings=len(warnings),
        warning_codes=sorted(Counter(r["code"] for r in warnings).items()),
        warning_params=sorted({p for r in warnings for p in r["params"]}),
        infos=len(infos),
        info_codes=sorted(Counter(r["code"] for r in infos).items()),
        dw101_params=sorted(dw101),
        grad_none_truth=sorted(truth),
        dw101_match=dw101 == truth,
        dw101_missing=sorted(truth - dw101),
        dw101_extra=sorted(dw101 - truth),
        findings=records,
    )
    return row


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
            torch.manual_seed(seed)
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
            torch.manual_seed(0)
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


# ---------------------------------------------------------------------------------------
# Part 3: the seed incidents


@dataclass
class Expectation:
    what: str
    met: bool


@dataclass
class SeedResult:
    name: str
    status: str = "ok"
    error: str | None = None
    codes: list[tuple[str, str, list[str]]] = field(default_factory=list)
    expectations: list[Expectation] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)


def _has(records: Sequence[dict[str, Any]], code: str, severity: str, param: str | None) -> bool:
    return any(
        r["code"] == code and r["severity"] == severity and (param is None or param in r["params"])
        for r in records
    )


def run_seeds() -> list[SeedResult]:
    results = []
    fused = SeedResult(
        "seed 1: fused RMSNorm without backward (demos.fused_rmsnorm.make(diff=False))"
    )
    try:
        from deadweight.demos import fused_rmsnorm

        setup = fused_rmsnorm.make(diff=False)
        report = deadweight.check(setup.model, setup.loss, setup.optimizer)
        records = [finding_record(f) for f in report.findings]
        fused.codes = [(r["code"], r["severity"], r["params"]) for r in records]
        dw101 = {p for r in records if r["code"] == "DW101" for p in r["params"]}
        fused.expectations = [
            Expectation("DW101 at error", _has(records, "DW101", "error", None)),
            Expectation("DW102 at error", _has(records, "DW102", "error", None)),
            Expectation(
                "DW101 names exactly l1.weight, norm.weight",
                dw101 == {"l1.weight", "norm.weight"},
            ),
        ]
    except Exception as exc:
        fused.status, fused.error = "error", short_error(exc)
    results.append(fused)

    drift = SeedResult(
        "seed 2: layer scalar before the final RMSNorm (demos.layer_scalar_drift.make())"
    )
    try:
        from deadweight.demos import layer_scalar_drift

        setup2 = layer_scalar_drift.make()
        scalar = f"blocks.{layer_scalar_drift.LAYERS - 1}.layer_scalar"
        branch = [f"blocks.{i}.layer_scalar" for i in range(layer_scalar_drift.LAYERS - 1)]
        report = deadweight.check(setup2.model, setup2.loss, setup2.optimizer)
        records = [finding_record(f) for f in report.findings]
        drift.codes = [(r["code"], r["severity"], r["params"]) for r in records]
        branch_warned = sorted(
            {
                p
                for r in records
                if r["severity"] in ("warning", "error")
                for p in r["params"]
                if p in branch
            }
        )
        drift.expectations = [
            Expectation(f"DW104 at warning on {scalar}", _has(records, "DW104", "warning", scalar)),
            Expectation(f"DW204 at warning on {scalar}", _has(records, "DW204", "warning", scalar)),
            Expectation(
                f"DW203 on {scalar} (the groups follow the shape rule)",
                any(r["code"] == "DW203" and scalar in r["params"] for r in records),
            ),
            Expectation(
                "no warning on the branch scalars"
                + (f" (got {branch_warned})" if branch_warned else ""),
                not branch_warned,
            ),
        ]
        dw104 = next((r for r in records if r["code"] == "DW104" and scalar in r["params"]), None)
        dw204 = next((r for r in records if r["code"] == "DW204" and scalar in r["params"]), None)
        per_param = dw104["evidence"].get("params", {}).get(scalar, {}) if dw104 else {}
        # The library has named the relative loss change both ways.
        loss_change = next(
            (per_param[k] for k in ("relative_loss_change", "loss_change") if k in per_param), None
        )
        drift.numbers = {
            "DW104 relative loss change": loss_change,
            "DW104 op_output_change": per_param.get("op_output_change"),
            "DW104 grad_norm": per_param.get("grad_norm"),
            "DW104 probe": per_param.get("probe"),
            "DW204 expected_step": dw204["evidence"].get("expected_step") if dw204 else None,
            "DW204 max_step": dw204["evidence"].get("max_step") if dw204 else None,
            "DW204 reset_amplification": (
                dw204["evidence"].get("reset_amplification") if dw204 else None
            ),
            "DW204 noise_rms": dw204["evidence"].get("noise_rms") if dw204 else None,
        }
    except Exception as exc:
        drift.status, drift.error = "error", short_error(exc)
    results.append(drift)
    return results


# ---------------------------------------------------------------------------------------
# tables


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        lines.append("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def pct(num: int, den: int) -> str:
    return f"{num}/{den} ({100 * num / den:.0f}%)" if den else "-"


def recall_row(label: str, rows: Sequence[dict[str, Any]]) -> list[Any]:
    ran = [r for r in rows if r["status"] == "ok"]
    found = [r for r in ran if r["found"]]
    warn = [r for r in found if r["severity"] in ("warning", "error")]
    info = [r for r in found if r["severity"] == "info"]
    mech = [r for r in found if r["mechanism_named"]]
    drift = [r for r in found if r["drift_warning"]]
    return [
        label,
        len(rows),
        sum(1 for r in rows if r["status"] == "error"),
        pct(len(found), len(ran)),
        pct(len(warn), len(ran)),
        pct(len(info), len(ran)),
        pct(len(mech), len(found)),
        pct(len(drift), len(found)),
    ]


RECALL_HEADERS = (
    "group",
    "cases",
    "errors",
    "found (recall)",
    "at warning",
    "at info",
    "mechanism named",
    "DW204",
)


def print_id_list(title: str, ids: Sequence[str]) -> None:
    print(f"{title}: {len(ids)}")
    for i in ids[:MAX_LISTED]:
        print(f"  {i}")
    if len(ids) > MAX_LISTED:
        print(f"  ... and {len(ids) - MAX_LISTED} more (all in --json)")


def print_recall(rows: Sequence[dict[str, Any]]) -> None:
    print("\n== Part 1: recall on planted parameters ==")
    print("placements:")
    for key, text in PLACEMENTS.items():
        print(f"  ({key}) {text}")
    print()
    print(table(RECALL_HEADERS, [recall_row("overall", rows)]))
    for dim, title in (
        ("placement", "by placement"),
        ("norm", "by norm kind"),
        ("loss", "by loss form"),
        ("width", "by width"),
        ("dtype", "by dtype"),
        ("eps", "by eps"),
        ("seed", "by seed"),
    ):
        groups: dict[Any, list[dict[str, Any]]] = defaultdict(list)
        for r in rows:
            groups[r[dim]].append(r)
        order = sorted(groups, key=lambda v: (v is None, str(v) if dim != "width" else v))
        if dim == "width":
            order = sorted(groups)
        print(f"\n{title}")
        print(table(RECALL_HEADERS, [recall_row(str(v), groups[v]) for v in order]))
    ran = [r for r in rows if r["status"] == "ok"]
    residual: dict[str, float] = defaultdict(float)
    for r in ran:
        residual[r["placement"]] = max(residual[r["placement"]], r["truth_residual_fp64"])
    print(
        "\nground truth, checked in fp64 (planted gain x10, planted bias + a random shift of "
        "size 10): largest relative change of what the loss sees, per placement: "
        + ", ".join(f"({p}) {v:.1e}" for p, v in sorted(residual.items()))
    )
    codes = Counter(c for r in ran if r["found"] for c in r["invariance_codes"])
    print(
        "\ninvariance codes on the planted parameter (found cases): "
        + (", ".join(f"{c} {n}" for c, n in sorted(codes.items())) or "none")
    )
    dw203 = sum(1 for r in ran if r["decay_by_shape"])
    print(f"DW203 (decay-by-shape) on the planted parameter: {pct(dw203, len(ran))}")
    print()
    print_id_list("missed cases", [r["id"] for r in ran if not r["found"]])
    stacks = [r for r in ran if r["placement"] == "c"]
    fp = [r for r in stacks if r["healthy_at_warning"]]
    print(
        "\nfalse positives, (c) branch scalars at warning: "
        f"{pct(len(fp), len(stacks))} of stack cases, "
        f"{sum(len(r['healthy_at_warning']) for r in fp)} scalar(s) in all"
    )
    for r in fp[:MAX_LISTED]:
        print(f"  {r['id']}: {', '.join(r['healthy_at_warning'])}")
    if len(fp) > MAX_LISTED:
        print(f"  ... and {len(fp) - MAX_LISTED} more")
    other = [r for r in ran if r["other_at_warning"]]
    print(
        f"other parameters at warning (not planted; review, may be true): {pct(len(other), len(ran))} "
        "of cases"
    )
    by_param = Counter((r["placement"], p) for r in other for p in r["other_at_warning"])
    for (placement, p), n in by_param.most_common(15):
        print(f"  ({placement}) {p}: {n} case(s)")
    unsupported = [r for r in rows if r["status"] == "unsupported"]
    if unsupported:
        print()
        print_id_list(
            "cases the model itself cannot run in their dtype (not counted)",
            [f"{r['id']}: {r['error']}" for r in unsupported],
        )
    errors = [r for r in rows if r["status"] == "error"]
    if errors:
        print()
        print_id_list("error cases", [f"{r['id']}: {r['error']}" for r in errors])


def print_precision(all_rows: Sequence[dict[str, Any]]) -> None:
    print("\n== Part 2: precision on stock transformers architectures (train mode, own loss) ==")
    rows = [r for r in all_rows if r.get("dtype", "fp32") == "fp32"] or list(all_rows)
    having = [r["arch"] for r in rows if r.get("layerdrop", {}).get("present")]
    nonzero = [
        f"{r['arch']} ({', '.join(r['layerdrop']['nonzero_default'])})"
        for r in rows
        if r.get("layerdrop", {}).get("nonzero_default")
    ]
    print(
        "layerdrop / encoder_layerdrop / decoder_layerdrop set to 0.0 (Part 2b checks "
        f"random layer skipping) in every config that has them: {', '.join(having) or 'none'}; "
        f"nonzero by default in: {', '.join(nonzero) or 'none'}"
    )
    out = []
    for r in rows:
        if r["status"] != "ok":
            out.append([r["arch"], r["family"], "-", "-", "-", "-", f"{r['status']}: {r['error']}"])
            continue
        codes = " ".join(f"{c}x{n}" for c, n in r["warning_codes"]) or "-"
        info = " ".join(f"{c}x{n}" for c, n in r["info_codes"]) or "-"
        match = "yes" if r["dw101_match"] else "NO"
        out.append([r["arch"], r["family"], r["warnings"], codes, r["infos"], info, match])
    print(f"\n{rows[0].get('dtype', 'fp32') if rows else 'fp32'}:")
    print(
        table(
            ("arch", "family", "warnings", "warning codes", "infos", "info codes", "DW101 = truth"),
            out,
        )
    )
    by_dtype: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in all_rows:
        by_dtype[r.get("dtype", "fp32")].append(r)
    summary = []
    for dtype in [d for d in DTYPES if d in by_dtype]:
        group = by_dtype[dtype]
        ok = [r for r in group if r["status"] == "ok"]
        summary.append(
            [
                dtype,
                len(ok),
                sum(1 for r in group if r["status"] == "unsupported"),
                sum(1 for r in group if r["status"] not in ("ok", "unsupported")),
                sum(1 for r in ok if r["warnings"]),
                sum(r["infos"] for r in ok),
                f"{sum(1 for r in ok if r['dw101_match'])}/{len(ok)}",
            ]
        )
    print("\nby dtype (the model itself failing in a dtype is 'unsupported', not counted):")
    print(
        table(
            (
                "dtype",
                "ran",
                "unsupported",
                "check errors",
                "with >= 1 warning",
                "infos",
                "DW101 = truth",
            ),
            summary,
        )
    )
    for dtype, group in by_dtype.items():
        ok = [r for r in group if r["status"] == "ok"]
        for r in [r for r in ok if r["warnings"]]:
            params = r["warning_params"]
            shown = ", ".join(params[:8]) + (
                f" and {len(params) - 8} more" if len(params) > 8 else ""
            )
            codes = " ".join(f"{c}x{n}" for c, n in r["warning_codes"])
            print(f"  {dtype} {r['arch']} ({codes}): {shown}")
        for r in [r for r in ok if not r["dw101_match"]]:
            print(
                f"  {dtype} {r['arch']}: DW101 missing {r['dw101_missing']} extra {r['dw101_extra']}"
            )
        for r in [r for r in ok if r["grad_none_truth"]]:
            print(f"  {dtype} (ground truth non-empty) {r['arch']}: {r['grad_none_truth']}")
        for r in group:
            if r["status"] != "ok":
                print(f"  {dtype} {r['arch']}: {r['status']}: {r['error']}")


def print_seeds(results: Sequence[SeedResult]) -> None:
    print("\n== Part 3: the seed incidents ==")
    for res in results:
        print(f"\n{res.name}")
        if res.status != "ok":
            print(f"  error: {res.error}")
            continue
        for code, sev, params in res.codes:
            print(f"  {code} {sev:<7} {', '.join(params)}")
        for e in res.expectations:
            print(f"  [{'ok' if e.met else 'FAIL'}] {e.what}")
        for key, value in res.numbers.items():
            shown = f"{value:.3g}" if isinstance(value, float) else str(value)
            print(f"  {key}: {shown}")


# ---------------------------------------------------------------------------------------


REPO_SRC = Path(__file__).resolve().parents[1] / "src"


def git_revision() -> str | None:
    try:
        repo = str(REPO_SRC.parent)
        out = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty src" if dirty else "")
    except Exception:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a stratified subset (~150 cases)")
    parser.add_argument(
        "--quick-cases", type=int, default=150, help="size of the --quick subset (default 150)"
    )
    parser.add_argument("--part", choices=("recall", "precision", "seeds", "all"), default="all")
    parser.add_argument("--json", metavar="PATH", help="write every raw per-case result here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtypes",
        default=",".join(DTYPES),
        help=f"recall cases in these dtypes only (comma-separated; default all: {','.join(DTYPES)})",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="recall cases whose FIELD (placement, norm, eps, width, loss, seed) is one of the "
        "values; repeatable, e.g. --only norm=layernorm,llama_rmsnorm --only width=8,64",
    )
    args = parser.parse_args(argv)
    only: dict[str, set[str]] = {}
    for item in args.only:
        field_name, _, values = item.partition("=")
        if field_name not in ("placement", "norm", "eps", "width", "loss", "seed") or not values:
            parser.error(f"--only {item!r}: expected FIELD=V1,V2 with FIELD one of placement, "
                         "norm, eps, width, loss, seed")  # fmt: skip
        only[field_name] = set(values.split(","))
    dtypes = set(args.dtypes.split(","))
    if not dtypes <= set(DTYPES):
        parser.error(f"--dtypes: unknown {', '.join(sorted(dtypes - set(DTYPES)))}")

    torch.set_num_threads(args.threads)
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # config chatter, not results
    except Exception:
        pass
    import warnings

    warnings.filterwarnings("ignore")

    started = time.perf_counter()
    library_path = str(getattr(deadweight, "__file__", None))
    meta: dict[str, Any] = {
        "deadweight": getattr(deadweight, "__version__", None),
        "git": git_revision() if library_path.startswith(str(REPO_SRC)) else "not this checkout",
        "library_path": library_path,
        "torch": torch.__version__,
        "threads": args.threads,
        "quick": args.quick,
        "part": args.part,
    }
    print(
        f"deadweight {meta['deadweight']} ({meta['git']}, imported from "
        f"{meta['library_path']}), torch {meta['torch']}, {args.threads} threads, "
        f"{'quick' if args.quick else 'full'} mode"
    )
    out: dict[str, Any] = {"meta": meta}

    if args.part in ("recall", "all"):
        t0 = time.perf_counter()
        cases = [
            c
            for c in all_cases()
            if c.dtype in dtypes
            and all(
                (f"{getattr(c, k):g}" if k == "eps" and getattr(c, k) is not None
                 else str(getattr(c, k))) in v
                for k, v in only.items()
            )
        ]  # fmt: skip
        chosen = quick_cases(cases, args.quick_cases) if args.quick else cases
        print(f"\nrecall: {len(chosen)} of {len(cases)} cases", file=sys.stderr)
        rows = []
        for k, case in enumerate(chosen, 1):
            rows.append(run_recall_case(case))
            if k % 25 == 0:
                print(f"  {k}/{len(chosen)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        out["recall"] = rows
        print_recall(rows)
        meta["recall_s"] = time.perf_counter() - t0
        print(f"\n(recall: {len(rows)} cases in {meta['recall_s']:.0f} s)")

    if args.part in ("precision", "all"):
        t0 = time.perf_counter()
        archs = ARCHS  # all of them in --quick too: at 2 layers even width 768 is quick
        rows = []
        for dtype in [d for d in DTYPES if d in dtypes]:
            for arch in archs:
                print(f"  precision: {arch.name} {dtype}", file=sys.stderr)
                rows.append(run_arch(arch, dtype))
        out["precision"] = rows
        print_precision(rows)
        first = []
        for case in FIRST_STEP:
            print(f"  first step: {case.name}", file=sys.stderr)
            first.append(run_first_step(case))
        out["first_step"] = first
        print_first_step(first)
        meta["precision_s"] = time.perf_counter() - t0
        print(
            f"\n(precision: {len(rows)} architectures and {len(first)} first-step cases in "
            f"{meta['precision_s']:.0f} s)"
        )

    if args.part in ("seeds", "all"):
        t0 = time.perf_counter()
        seeds = run_seeds()
        out["seeds"] = [asdict(s) for s in seeds]
        print_seeds(seeds)
        meta["seeds_s"] = time.perf_counter() - t0

    meta["total_s"] = time.perf_counter() - started
    print(f"\ntotal wall time {meta['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(json_safe(out), fh, indent=1)
        print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
