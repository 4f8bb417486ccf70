"""Checkpoint forensics as a library: each function measures and returns a `Report`.

    report = deadweight.inspect_checkpoints(["model.safetensors"], scheme="int4")
    report = deadweight.diff_checkpoints("step-0.safetensors", "step-1000.safetensors")
    report = deadweight.trend_checkpoints(sorted(glob.glob("ckpt/step-*.safetensors")))

Files that cannot be read are listed in `report.subject["errors"]`; the others are
still analysed. `report.subject["warnings"]` says what the readers did that the user
should know: a pickle run under `unsafe_pickle`, a tensor listed but not measured.
Nothing is ever written next to the checkpoints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from deadweight.checkpoints import checkpoint_scan as scan
from deadweight.checkpoints.checkpoint_scan import Progress
from deadweight.checkpoints.name_matching import describe
from deadweight.checkpoints.readers.notes import collecting_notes
from deadweight.checkpoints.scan_stats import DiffStats, InspectStats, TrendStats
from deadweight.config import ConfigLike, applies_settings
from deadweight.registry import Selection, rules_consuming
from deadweight.report import Report
from deadweight.thresholds import Thresholds, current

Rules = Iterable[str] | str | None


def _judge(
    kind: str, stats: Any, stats_type: type, subject: dict[str, Any], select: Rules, ignore: Rules
) -> Report:
    selection = Selection.of(select, ignore)
    findings = [f for r in rules_consuming(stats_type) for f in r.judge(stats)]
    return Report.of(kind, selection.filter(findings), subject)


@applies_settings
def inspect_checkpoints(
    paths: Sequence[str],
    *,
    scheme: str | None = "default",
    unsafe_pickle: bool = False,
    select: Rules = None,
    ignore: Rules = None,
    progress: Progress | None = None,
    threads: int | None = None,
    config: ConfigLike = None,
    thresholds: Thresholds | Mapping[str, Any] | None = None,
) -> Report:
    """Per-tensor statistics, layer outliers (DW402), quantization risk under `scheme`
    (DW403; None or "none" skips it; "default" is the `quantization-scheme` threshold,
    int4-group128 unless configured) and non-finite values (DW404) of each checkpoint.

    Tensors are reduced on `threads` threads (default: every core the process may use).
    `config` and `thresholds` work as for `deadweight.check`."""
    if scheme == "default":
        scheme = current().quantization_scheme
    if scheme == "none":
        scheme = None
    with collecting_notes() as notes:  # what readers want said: pickles run, tensors skipped
        stats = scan.inspect_checkpoints(
            paths, scheme=scheme, unsafe_pickle=unsafe_pickle, progress=progress, threads=threads
        )
    subject = {
        "checkpoints": [s.path for s in stats.scans],
        "scheme": stats.scheme,
        "tensors": {s.path: [t.to_dict() for t in s.tensors.values()] for s in stats.scans},
        "optimizer": {s.path: s.optimizer for s in stats.scans if s.optimizer},
        # Per tensor under `scheme`, and per layer scalar quantized with its layer's largest
        # weight, for the HTML report's chart (DW403 lists only the risky ones).
        "quantization": {
            s.path: {
                name: {
                    "effective_bits": r.effective_bits,
                    "zero_fraction": r.zero_fraction,
                    "verdict": r.verdict,
                }
                for name, r in s.quant.items()
            }
            | {
                f"{name} with {partner}": {
                    "effective_bits": r.effective_bits,
                    "zero_fraction": r.zero_fraction,
                    "verdict": r.verdict,
                }
                for name, (partner, r) in s.joint.items()
            }
            for s in stats.scans
            if s.quant
        },
        "errors": stats.errors,
        "warnings": notes,
    }
    return _judge("inspect", stats, InspectStats, subject, select, ignore)


@applies_settings
def diff_checkpoints(
    a: str,
    b: str,
    *,
    unsafe_pickle: bool = False,
    select: Rules = None,
    ignore: Rules = None,
    top: int = 10,
    config: ConfigLike = None,
    thresholds: Thresholds | Mapping[str, Any] | None = None,
) -> Report:
    """Tensors bitwise unchanged between two checkpoints (DW401), the top movers, and
    tensors added, removed or reshaped; checkpoints that share under half their tensors
    (DW406).

    Names are matched across the prefixes wrappers add (torch.compile's `_orig_mod.`,
    DDP's `module.`, FSDP's `_fsdp_wrapped_module.`, activation checkpointing's
    `_checkpoint_wrapped_module.`) where removing them matches more tensors;
    `subject["renamed"]` and `subject["names_note"]` say which were removed."""
    with collecting_notes() as notes:
        stats = scan.diff_checkpoints(a, b, unsafe_pickle=unsafe_pickle)
    movers = sorted(
        (d for d in stats.tensors.values() if not d.unchanged), key=lambda d: -d.relative_change
    )
    subject = {
        "a": a,
        "b": b,
        "compared": len(stats.tensors),
        "top_movers": [
            {
                "name": d.name,
                "relative_change": d.relative_change,
                "max_abs_change": d.max_abs_change,
            }
            for d in movers[:top]
        ],
        "relative_change": {d.name: d.relative_change for d in stats.tensors.values()},
        "added": stats.added,
        "removed": stats.removed,
        "reshaped": [{"name": n, "a": sa, "b": sb} for n, sa, sb in stats.reshaped],
        "retyped": [{"name": n, "a": ta, "b": tb} for n, ta, tb in stats.retyped],
        "not_compared": stats.listed_only,
        # How names were matched: each file's count, those found in both, and the
        # wrapper prefixes (torch.compile's `_orig_mod.`, DDP's `module.`) taken off.
        "tensors_a": stats.names_a,
        "tensors_b": stats.names_b,
        "matched": stats.matched,
        "renamed": [dataclasses.asdict(r) for r in stats.renamed],
        "names_note": describe(stats.renamed) if stats.renamed else None,
        "errors": stats.errors,
        "warnings": notes,
    }
    return _judge("diff", stats, DiffStats, subject, select, ignore)


@applies_settings
def trend_checkpoints(
    paths: Sequence[str],
    *,
    unsafe_pickle: bool = False,
    select: Rules = None,
    ignore: Rules = None,
    config: ConfigLike = None,
    thresholds: Thresholds | Mapping[str, Any] | None = None,
) -> Report:
    """Single-element tensors across a series of checkpoints ordered by step (DW405)."""
    with collecting_notes() as notes:
        stats = scan.trend_checkpoints(paths, unsafe_pickle=unsafe_pickle)
    subject = {
        "checkpoints": stats.paths,
        "steps": stats.steps,
        "values": stats.values,
        "errors": stats.errors,
        "warnings": notes,
    }
    return _judge("trend", stats, TrendStats, subject, select, ignore)
