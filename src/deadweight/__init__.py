"""deadweight: catch silent PyTorch training bugs, parameters that never learn or only pretend to.

Public API::

    report = deadweight.check(model, lambda: loss_fn(model(x), y), optimizer)
    print(report)          # or report.ok, report.findings, report.to_json()

    groups = deadweight.param_groups(model, weight_decay=0.1)   # decay by meaning
    handle = deadweight.pin(model, "blocks.31.layer_scalar")   # keep one fixed

    with deadweight.watch(model, optimizer, log="run.jsonl") as w:  # during training
        train()
    print(w.report())

    report = deadweight.lint_paths(["src/"])   # source patterns behind silent gradient bugs
"""

from __future__ import annotations

from deadweight._version import __version__
from deadweight.check_model import check
from deadweight.errors import DeadweightError, InputError, LossFnError
from deadweight.findings import Finding, Location, Severity
from deadweight.fixes.param_groups import param_groups
from deadweight.fixes.pin import PinHandle, pin
from deadweight.forensics import diff_checkpoints, inspect_checkpoints, trend_checkpoints
from deadweight.lint import lint_paths
from deadweight.registry import Rule, all_rules, get_rule
from deadweight.report import SCHEMA_VERSION, Report
from deadweight.watcher import Watch, watch

__all__ = [
    "SCHEMA_VERSION",
    "DeadweightError",
    "Finding",
    "InputError",
    "Location",
    "LossFnError",
    "PinHandle",
    "Report",
    "Rule",
    "Severity",
    "Watch",
    "__version__",
    "all_rules",
    "check",
    "diff_checkpoints",
    "get_rule",
    "inspect_checkpoints",
    "lint_paths",
    "param_groups",
    "pin",
    "trend_checkpoints",
    "watch",
]
