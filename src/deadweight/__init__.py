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

    deadweight.testing.assert_all_learn(model, loss_fn)   # in a model's unit tests

Names are imported on first use, so `import deadweight` (and the pytest plugin, which
every pytest run in an environment with deadweight loads) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deadweight._version import __version__

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "SCHEMA_VERSION": "deadweight.report",
    "Config": "deadweight.config",
    "ConfigError": "deadweight.errors",
    "DeadweightError": "deadweight.errors",
    "Finding": "deadweight.findings",
    "InputError": "deadweight.errors",
    "Location": "deadweight.findings",
    "LossFnError": "deadweight.errors",
    "PinHandle": "deadweight.fixes.pin",
    "Report": "deadweight.report",
    "Rule": "deadweight.registry",
    "Severity": "deadweight.findings",
    "Thresholds": "deadweight.thresholds",
    "Watch": "deadweight.watching.watcher",
    "all_rules": "deadweight.registry",
    "check": "deadweight.checking.api",
    "diff_checkpoints": "deadweight.checkpoints.api",
    "get_rule": "deadweight.registry",
    "inspect_checkpoints": "deadweight.checkpoints.api",
    "lint_paths": "deadweight.linting.api",
    "load_config": "deadweight.config",
    "param_groups": "deadweight.fixes.param_groups",
    "pin": "deadweight.fixes.pin",
    "trend_checkpoints": "deadweight.checkpoints.api",
    "watch": "deadweight.watching.watcher",
}

if TYPE_CHECKING:
    from deadweight.checking.api import check
    from deadweight.checkpoints.api import diff_checkpoints, inspect_checkpoints, trend_checkpoints
    from deadweight.config import Config, load_config
    from deadweight.errors import ConfigError, DeadweightError, InputError, LossFnError
    from deadweight.findings import Finding, Location, Severity
    from deadweight.fixes.param_groups import param_groups
    from deadweight.fixes.pin import PinHandle, pin
    from deadweight.linting.api import lint_paths
    from deadweight.registry import Rule, all_rules, get_rule
    from deadweight.report import SCHEMA_VERSION, Report
    from deadweight.thresholds import Thresholds
    from deadweight.watching.watcher import Watch, watch

__all__ = [  # the same names as _EXPORTS, and the version
    "SCHEMA_VERSION",
    "Config",
    "ConfigError",
    "DeadweightError",
    "Finding",
    "InputError",
    "Location",
    "LossFnError",
    "PinHandle",
    "Report",
    "Rule",
    "Severity",
    "Thresholds",
    "Watch",
    "__version__",
    "all_rules",
    "check",
    "diff_checkpoints",
    "get_rule",
    "inspect_checkpoints",
    "lint_paths",
    "load_config",
    "param_groups",
    "pin",
    "trend_checkpoints",
    "watch",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deadweight' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
