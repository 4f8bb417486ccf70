from __future__ import annotations

import json

from deadweight import SCHEMA_VERSION, __version__
from deadweight.findings import Finding, Severity
from deadweight.report import Report
from deadweight.report.text import compress_names, render_plain


def _report(*severities: Severity) -> Report:
    findings = [
        Finding(f"DW10{i}", f"rule-{i}", s, f"message {i}") for i, s in enumerate(severities)
    ]
    return Report.of("check", findings, {"model": "Net", "parameters": 3, "trainable": 3})


def test_ok_and_fail_on():
    assert _report().ok
    assert _report(Severity.INFO).ok
    assert not _report(Severity.WARNING).ok
    r = _report(Severity.WARNING)
    assert r.failed("warning") and r.failed("info") and not r.failed("error")
    assert not r.failed(None)


def test_findings_are_sorted_by_severity():
    r = _report(Severity.INFO, Severity.ERROR, Severity.WARNING)
    assert [f.severity for f in r.findings] == [Severity.ERROR, Severity.WARNING, Severity.INFO]


def test_json_has_schema_version_and_tool():
    data = json.loads(_report(Severity.ERROR).to_json())
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert data["tool"] == {"name": "deadweight", "version": __version__}
    assert data["summary"] == {"info": 0, "warning": 0, "error": 1}
    assert data["ok"] is False
    assert data["findings"][0]["code"] == "DW100"


def test_plain_text_rendering():
    text = render_plain(_report(Severity.ERROR))
    assert "DW100" in text and "message 0" in text and "1 error" in text
    assert "no findings" in render_plain(_report())


def test_compress_names():
    names = [f"h.{i}.ln.weight" for i in range(12)] + ["wte.weight"]
    assert compress_names(names) == "h.{0-11}.ln.weight, wte.weight"
    assert (
        compress_names(["h.0.ln.weight", "h.2.ln.weight", "h.3.ln.weight"]) == "h.{0,2-3}.ln.weight"
    )
    many = [f"block{i}.weight" for i in range(20)]
    assert "and 12 more (20 in all)" in compress_names(many)
