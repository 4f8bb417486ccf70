from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deadweight.findings import Finding, Location, Severity


def test_severity_order_and_parse():
    assert Severity.INFO.rank < Severity.WARNING.rank < Severity.ERROR.rank
    assert Severity.parse("WARNING") is Severity.WARNING
    with pytest.raises(ValueError, match="info, warning, error"):
        Severity.parse("fatal")


def test_finding_is_frozen_and_serialisable():
    f = Finding(
        "DW101",
        "no-gradient",
        Severity.ERROR,
        "msg",
        params=("a",),
        location=Location("m.py", 3, "F.forward", "norm"),
        evidence={"n": 1},
        fix="do",
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.code = "DW102"  # type: ignore[misc]
    d = f.to_dict()
    assert d["severity"] == "error"
    assert d["location"] == {"file": "m.py", "line": 3, "function": "F.forward", "module": "norm"}
    assert d["params"] == ["a"] and d["evidence"] == {"n": 1}


def test_location_text():
    assert str(Location("m.py", 3, "F.forward", "norm")) == "m.py:3 in F.forward (module norm)"
    assert str(Location(module="")) == "(module <root>)"


def test_findings_module_does_not_import_renderers():
    import sys

    import deadweight.findings as findings_module

    source = Path(findings_module.__file__).read_text()
    assert "rich" not in source and "html" not in source.lower()
    assert "deadweight.findings" in sys.modules
