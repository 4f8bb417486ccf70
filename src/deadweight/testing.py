"""Assertions for a model's unit tests: the check as the first test a new model gets.

    from deadweight.testing import assert_all_learn, loss_from_batch

    def test_every_parameter_learns():
        model = GPT(tiny_config)
        batch = (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16)))
        assert_all_learn(model, loss_from_batch(model, batch))

On failure the AssertionError lists every finding at or above `fail_on` (warning by
default) in the text `deadweight check` prints: rule code and name, the parameters,
where the graph was cut, and the fix. With pytest, the `deadweight` fixture does the
same with options from `@pytest.mark.deadweight(...)` (deadweight.pytest_plugin).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from deadweight.checking.api import check
from deadweight.config import ConfigLike, resolve
from deadweight.findings import Finding, Severity
from deadweight.registry import Selection, all_rules
from deadweight.report import Report
from deadweight.report.text import render_plain
from deadweight.thresholds import Thresholds

__all__ = ["assert_all_learn", "assert_no_findings", "failing_findings", "loss_from_batch"]

Rules = Iterable[str] | str | None


def assert_all_learn(
    model: nn.Module,
    loss_fn: Callable[[], Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    allow: Iterable[str] = (),
    select: Rules = None,
    ignore: Rules = None,
    fail_on: Severity | str = Severity.WARNING,
    config: ConfigLike = None,
    thresholds: Thresholds | Mapping[str, Any] | None = None,
) -> Report:
    """Assert that every trainable parameter of `model` learns: `deadweight.check` finds
    nothing at or above `fail_on`. Returns the report for further assertions.

    allow: what is accepted: rule codes, code prefixes or names (`"DW104"`,
        `"scale-invariant"`), and parameter names or glob patterns (`"head.*"`); a
        finding is accepted when its rule is allowed, or when every parameter it names is.
    select, ignore, config, thresholds: as for `deadweight.check`.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not ours
    select, ignore, limits = resolve(config, select, ignore, thresholds)
    rules, params = _split_allow(allow)
    selection = Selection.of(select, (*ignore, *rules))
    if not any(r.code[2] in "12" and _kept(selection, r.code, r.name) for r in all_rules()):
        raise ValueError(
            f"the selection (select={list(selection.select)}, ignore={list(selection.ignore)}) "
            "keeps no rule that check() reports (DW1xx, DW2xx): the assertion could never fail"
        )
    report = check(
        model, loss_fn, optimizer, select=selection.select, ignore=selection.ignore,
        thresholds=limits,
    )  # fmt: skip
    _raise_if_failing(
        report, failing_findings(report, fail_on=fail_on, allow_params=params), fail_on
    )
    return report


def assert_no_findings(
    report: Report,
    *,
    select: Rules = None,
    ignore: Rules = None,
    fail_on: Severity | str = Severity.WARNING,
) -> None:
    """Assert that `report` (of check, watch, inspect, lint, ...) holds no finding at or
    above `fail_on` among the rules `select` keeps and `ignore` does not skip."""
    __tracebackhide__ = True  # pytest shows the caller's line, not ours
    failing = failing_findings(report, select=select, ignore=ignore, fail_on=fail_on)
    _raise_if_failing(report, failing, fail_on)


def failing_findings(
    report: Report,
    *,
    select: Rules = None,
    ignore: Rules = None,
    fail_on: Severity | str = Severity.WARNING,
    allow_params: Iterable[str] = (),
) -> list[Finding]:
    """The findings of `report` an assertion would fail on."""
    selection = Selection.of(select, ignore)
    least = Severity.parse(fail_on)
    patterns = tuple(allow_params)
    return [
        f
        for f in report.findings
        if selection.keeps(f)
        and f.severity.rank >= least.rank
        and not (patterns and f.params and all(_matches(p, patterns) for p in f.params))
    ]


def loss_from_batch(
    model: nn.Module,
    batch: Any,
    criterion: Callable[..., Any] | None = None,
    *,
    target_key: str = "labels",
) -> Callable[[], torch.Tensor]:
    """A zero-argument loss function for `check` / `assert_all_learn` from one batch.

    batch: `(inputs, targets)` (or `(x1, x2, ..., targets)`), a dict of keyword inputs
        (its `target_key` entry is the targets when there is a criterion), or a tensor.
    criterion: called as `criterion(model(inputs), targets)` (`F.cross_entropy`,
        `nn.MSELoss()`); without one the model computes its own loss, returned as a
        scalar tensor, as `.loss` / `["loss"]` (Hugging Face), or as the one scalar
        tensor of a returned tuple (nanoGPT's `logits, loss`).
    """

    def loss_fn() -> torch.Tensor:
        if criterion is None:
            if isinstance(batch, Mapping):
                return _loss_of(model(**batch))
            if isinstance(batch, (tuple, list)):
                return _loss_of(model(*batch))
            return _loss_of(model(batch))
        if isinstance(batch, Mapping):
            if target_key not in batch:
                raise KeyError(f"the batch has no {target_key!r} entry to compare with")
            kwargs = {k: v for k, v in batch.items() if k != target_key}
            return criterion(model(**kwargs), batch[target_key])
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise TypeError("with a criterion, the batch must be (inputs, targets) or a dict")
        *inputs, targets = batch
        return criterion(model(*inputs), targets)

    return loss_fn


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        scalars = [o for o in output if isinstance(o, torch.Tensor) and o.numel() == 1]
        if len(scalars) == 1:
            return scalars[0]
    raise TypeError(
        f"the model returned {type(output).__name__}, not a loss: pass a criterion, "
        "or have the model return its loss"
    )


def _split_allow(allow: Iterable[str] | str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    entries = [allow] if isinstance(allow, str) else list(allow)
    rules = tuple(e for e in entries if _names_a_rule(e))
    return rules, tuple(e for e in entries if e not in rules)


def _names_a_rule(entry: str) -> bool:
    key = entry.strip()
    if key.upper().startswith("DW") and key[2:3].isdigit():
        return True  # a code or prefix; Selection.of names an unknown one
    return any(r.name == key for r in all_rules())


def _kept(selection: Selection, code: str, name: str) -> bool:
    probe = Finding(code=code, name=name, severity=Severity.ERROR, message="")
    return selection.keeps(probe)


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def _raise_if_failing(report: Report, failing: list[Finding], fail_on: Severity | str) -> None:
    __tracebackhide__ = True  # pytest shows the caller's line, not ours
    if not failing:
        return
    shown = Report.of(report.kind, failing, report.subject)
    n = len(failing)
    header = (
        f"deadweight {report.kind}: {n} finding{'s' if n > 1 else ''} at or above "
        f"{Severity.parse(fail_on).value}:"
    )
    footer = (
        "`deadweight rules CODE` explains a rule; allow=[CODE or parameter name] accepts a finding."
    )
    raise AssertionError(f"{header}\n{render_plain(shown)}{footer}")
