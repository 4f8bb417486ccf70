"""What every part of the detection-quality benchmark shares: the codes it counts,
Trainer-style optimizer groups, findings as plain data, plain-text tables."""

from __future__ import annotations

import json
import random
import re
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import deadweight

# The repository's src/ (the deadweight this benchmark reports on, when imported from here).
REPO_SRC = Path(__file__).resolve().parents[2] / "src"
INVARIANCE_CODES = frozenset({"DW103", "DW104", "DW105"})
DRIFT_CODES = frozenset({"DW203", "DW204"})
GRAD_FLOW_CODES = frozenset({"DW101", "DW102"})
N_CLASSES = 10
LR = 1e-3
WEIGHT_DECAY = 0.01  # transformers' Trainer recipe
MAX_LISTED = 40  # missed / error ids printed per list; the JSON has them all

# How the model computes: fp32; fp32 parameters under bf16 autocast; the model and its
# input cast to bf16 or fp16 (`model.to(dtype)`); FSDP2 mixed precision (fp32 sharded
# parameters, bf16 compute: one process, gloo).
DTYPES: tuple[str, ...] = ("fp32", "bf16_autocast", "bf16", "fp16", "fsdp2_bf16")
PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

LossFn = Callable[[], torch.Tensor]


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators: models draw from all three
    (wav2vec2, HuBERT and Whisper take their SpecAugment masks from numpy's), and a
    figure that moves between two runs of one tree is no measurement."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


def print_id_list(title: str, ids: Sequence[str]) -> None:
    print(f"{title}: {len(ids)}")
    for i in ids[:MAX_LISTED]:
        print(f"  {i}")
    if len(ids) > MAX_LISTED:
        print(f"  ... and {len(ids) - MAX_LISTED} more (all in --json)")


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
