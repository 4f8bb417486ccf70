"""Part 3 of the detection-quality benchmark: the two seed incidents from
`deadweight.demos`, with the codes they must get."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import deadweight
from detection_quality_parts.common import finding_record, short_error

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
