"""Part 1 of the detection-quality benchmark: recall on planted parameters (small
models from random initialisation, each with a parameter an op after it provably
cancels), and its tables."""

from __future__ import annotations

import copy
import itertools
import math
import random
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from detection_quality_parts.common import (
    DTYPES,
    GRAD_FLOW_CODES,
    INVARIANCE_CODES,
    MAX_LISTED,
    N_CLASSES,
    LossFn,
    finding_record,
    in_dtype,
    make_optimizer,
    names_mechanism,
    pct,
    print_id_list,
    short_error,
    table,
)

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
