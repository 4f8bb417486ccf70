"""The report's JSON is strict: no NaN or Infinity tokens."""

from __future__ import annotations

import json
import math

from deadweight.findings import Finding, Severity
from deadweight.report import Report


def test_non_finite_numbers_become_null() -> None:
    finding = Finding("DW401", "never-learned", Severity.WARNING, "m",
                      evidence={"change": math.inf, "nested": [math.nan, 1.0]})  # fmt: skip
    report = Report.of("diff", [finding], {"relative_change": {"a": math.inf}})
    text = report.to_json()
    assert "Infinity" not in text and "NaN" not in text
    data = json.loads(text)
    assert data["findings"][0]["evidence"] == {"change": None, "nested": [None, 1.0]}
    assert data["subject"]["relative_change"] == {"a": None}
