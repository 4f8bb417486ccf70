"""Part 2 of the detection-quality benchmark: precision on stock transformers
architectures (tiny random configs, the model's own loss), and its table."""

from __future__ import annotations

import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

import torch

import deadweight
from detection_quality_parts.common import (
    DTYPES,
    GRAD_FLOW_CODES,
    finding_record,
    make_optimizer,
    seed_everything,
    short_error,
    table,
)
from detection_quality_parts.models import (
    Arch,
    arch_in_dtype,
    build_arch,
    grads_none_after_backward,
    hf_inputs,
)


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
            seed_everything(1234)
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
        seed_everything(1234)
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
