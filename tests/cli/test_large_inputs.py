"""Inputs that are large rather than malformed (issue 33, minor items): a report of 10,000
findings, a log of a million loss events, a trend over 10,000 saves, a script that
replaces itself with os.execv, a schema_version that is no number."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from deadweight.findings import Finding, Severity
from deadweight.report import Report
from deadweight.report.text import MAX_PANELS, render_plain
from deadweight.watching.event_log import read_log
from tests.cli_runner import deadweight_cli, measured_cli


def _findings(n: int) -> list[Finding]:
    return [
        Finding(
            code="DW404",
            name="nonfinite-values",
            severity=Severity.ERROR,
            message=f"layers.{i}.w holds NaN",
            params=(f"layers.{i}.w",),
            evidence={"count": i},
            fix="fix it",
        )
        for i in range(n)
    ]


def test_a_saved_report_of_10000_findings_prints_in_bounded_time(tmp_path: Path) -> None:
    """25 s as text (every finding drawn as a panel, twice: once to check it renders)."""
    saved = tmp_path / "big.json"
    saved.write_text(Report.of("inspect", _findings(10_000), {}).to_json())
    run = measured_cli("report", saved)
    assert run.result.returncode == 1, run.result.stderr
    assert f"… and {10_000 - MAX_PANELS} more finding(s) not drawn here (DW404 x9800)" in (
        run.result.stdout.replace("\n", " ")
    )
    assert run.within_bounds, (run.seconds, run.peak_mb)


def test_a_long_evidence_list_is_cut_in_the_terminal() -> None:
    """A trend over 10,000 saves printed a finding of 1,800 lines (its values and steps)."""
    finding = Finding(
        code="DW405",
        name="checkpoint-scalar-trend",
        severity=Severity.WARNING,
        message="layers.0.scale rose at every one of 10000 saves",
        evidence={"values": [1.0 + i / 1e4 for i in range(10_000)], "steps": list(range(10_000))},
    )
    text = render_plain(Report.of("trend", [finding], {}))
    assert text.count("\n") < 30 and "(10000 in all)" in text


def test_consecutive_loss_events_are_held_as_one(tmp_path: Path) -> None:
    """A 49 MB log of a million loss events peaked at 766 MB: one dict per event."""
    log = tmp_path / "run.jsonl"
    lines = [json.dumps({"event": "loss", "steps": [i], "values": [0.5 + i]}) for i in range(1000)]
    lines.insert(500, json.dumps({"event": "error", "detector": "x", "message": "m"}))
    log.write_text("\n".join(lines) + "\n")
    events = read_log(log).events
    assert [e["event"] for e in events] == ["loss", "error", "loss"]
    assert events[0]["steps"] == list(range(500)) and events[2]["values"][-1] == 999.5


def test_a_schema_version_that_is_no_number_is_named_as_such(tmp_path: Path) -> None:
    saved = tmp_path / "r.json"
    data = json.loads(Report.of("inspect", _findings(1), {}).to_json())
    data["schema_version"] = "1"
    saved.write_text(json.dumps(data))
    result = deadweight_cli("report", saved, "-o", tmp_path / "r.html")
    assert "version None" not in result.stderr and "newer" not in result.stderr
    assert "its schema_version is '1', not a number" in result.stderr


def test_a_script_that_execs_itself_keeps_its_first_steps(tmp_path: Path) -> None:
    """os.execv replaced the process, and its new image emptied the log the first one had
    written: its 30 steps were lost."""
    (tmp_path / "train.py").write_text(
        "import os, sys, torch\n"
        "m = torch.nn.Linear(2, 1)\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    o.zero_grad(); m(torch.ones(1, 2)).sum().backward(); o.step()\n"
        "if len(sys.argv) == 1:\n"
        "    sys.stdout.flush()\n"
        "    os.execv(sys.executable, [sys.executable, __file__, 'again'])\n"
    )
    result = deadweight_cli("run", "--every", "1", "--", sys.executable, "train.py", cwd=tmp_path)
    assert result.returncode in (0, 1), result.stderr
    events = [json.loads(line) for line in (tmp_path / "deadweight-run.jsonl").open()]
    assert [e["event"] for e in events].count("start") == 2
    assert [e["event"] for e in events].count("step") == 6  # both images' 3 steps
    assert "holds 2 runs" in result.stderr
