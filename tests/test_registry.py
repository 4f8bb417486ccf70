from __future__ import annotations

import pytest

from deadweight import registry
from deadweight.checking.check_stats import GradFlowStats
from deadweight.findings import Finding, Severity
from deadweight.registry import DOC_SECTIONS, Selection, all_rules, get_rule, rule

DOC = """
## What it does
x
## Why is this bad
y
## Example
z
## Fix
w
"""


def test_every_rule_is_documented_and_well_formed():
    rules = all_rules()
    assert [r.code for r in rules] == sorted(r.code for r in rules)
    for r in rules:
        sections = r.sections()
        for heading in DOC_SECTIONS:
            assert sections.get(heading), (r.code, heading)
        assert r.summary.endswith(".")
        assert r.code[2] in registry.FAMILIES


def test_check_rules_are_registered():
    codes = {r.code: r.name for r in all_rules()}
    assert codes["DW101"] == "no-gradient"
    assert codes["DW102"] == "graph-cut"


def test_lookup_by_code_or_name():
    assert get_rule("dw101") is get_rule("no-gradient")
    with pytest.raises(KeyError, match="deadweight rules"):
        get_rule("DW999")


@pytest.mark.parametrize(
    "kwargs,problem",
    [
        ({"code": "DW101", "name": "brand-new"}, "already taken"),
        ({"code": "DW199", "name": "no-gradient"}, "already taken"),
        ({"code": "XX100", "name": "brand-new"}, "not of the form"),
        ({"code": "DW199", "name": "Not_Kebab"}, "kebab-case"),
    ],
)
def test_registration_rejects_bad_declarations(kwargs, problem):
    all_rules()  # make sure the real rules are loaded first
    with pytest.raises(ValueError, match=problem):
        rule(severity=Severity.INFO, summary="s.", consumes=GradFlowStats, **kwargs)(
            _judge_with_doc
        )


def test_registration_rejects_missing_doc_sections():
    def judge(stats):
        """## What it does\nonly this"""
        return []

    with pytest.raises(ValueError, match="Why is this bad"):
        rule(
            code="DW198",
            name="undocumented",
            severity=Severity.INFO,
            summary="s.",
            consumes=GradFlowStats,
        )(judge)


def test_retired_codes_cannot_be_reused(monkeypatch):
    monkeypatch.setattr(registry, "RETIRED_CODES", frozenset({"DW197"}))
    with pytest.raises(ValueError, match="retired"):
        rule(
            code="DW197",
            name="zombie",
            severity=Severity.INFO,
            summary="s.",
            consumes=GradFlowStats,
        )(_judge_with_doc)


def test_a_new_rule_needs_no_edit_elsewhere(monkeypatch):
    monkeypatch.setattr(registry, "_RULES", dict(registry._RULES))
    rule(
        code="DW196", name="test-only", severity=Severity.INFO, summary="s.", consumes=GradFlowStats
    )(_judge_with_doc)
    assert get_rule("DW196").name == "test-only"
    assert get_rule("DW196") in registry.rules_consuming(GradFlowStats)


def _judge_with_doc(stats):
    return []


_judge_with_doc.__doc__ = DOC


def _finding(code: str, name: str) -> Finding:
    return Finding(code, name, Severity.ERROR, "m")


def test_selection_by_code_prefix_and_name():
    a, b = _finding("DW101", "no-gradient"), _finding("DW102", "graph-cut")
    assert list(Selection.of(["DW1"]).filter([a, b])) == [a, b]
    assert list(Selection.of(["graph-cut"]).filter([a, b])) == [b]
    assert list(Selection.of(None, ["dw101"]).filter([a, b])) == [b]
    assert list(Selection.of(["DW101,DW102"], ["DW102"]).filter([a, b])) == [a]


def test_selection_rejects_unknown_entries():
    with pytest.raises(ValueError, match="DW9"):
        Selection.of(["DW9"])
    with pytest.raises(ValueError, match="no-such-rule"):
        Selection.of(None, ["no-such-rule"])
