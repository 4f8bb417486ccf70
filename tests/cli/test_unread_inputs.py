"""An input that could not be read is never summed up as "no findings": the text
report's last line says how many inputs were not read (exit code 2)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch
from safetensors.torch import save_file

from deadweight.findings import Finding, Severity
from deadweight.report import Report
from deadweight.report.text import render_plain
from tests.cli_runner import deadweight_cli

ENV = {**os.environ, "COLUMNS": "200"}


class Refused:  # not a tensor or a plain container: the safe loader refuses the pickle
    pass


def dw(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return deadweight_cli(*args, env=ENV)


def last_line(text: str) -> str:
    return text.rstrip().splitlines()[-1]


def test_inspect_of_a_refused_pickle(tmp_path: Path) -> None:
    path = tmp_path / "pet.pt"
    torch.save({"w": torch.ones(2), "config": Refused()}, path)
    result = dw("inspect", path)
    assert result.returncode == 2
    assert "--unsafe-pickle" in result.stderr
    assert "no findings" not in result.stdout
    assert last_line(result.stdout) == "1 input could not be read"


def test_inspect_counts_a_missing_path_with_a_refused_file(tmp_path: Path) -> None:
    good, refused = tmp_path / "good.safetensors", tmp_path / "pet.pt"
    save_file({"w": torch.ones(4)}, good)
    torch.save({"config": Refused()}, refused)
    result = dw("inspect", good, refused, tmp_path / "missing.pt")
    assert result.returncode == 2
    assert last_line(result.stdout) == "2 inputs could not be read"


def test_lint_of_a_missing_path(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("x = 1\n")
    result = dw("lint", tmp_path / "ok.py", tmp_path / "missing.py")
    assert result.returncode == 2
    assert "missing.py: error:" in result.stderr
    assert "no findings" not in result.stdout
    assert last_line(result.stdout) == "1 input could not be read"


def test_the_count_follows_the_findings_and_counts_each_file_once() -> None:
    finding = Finding(code="DW501", name="forward-gradient-cut", severity=Severity.ERROR,
                      message="cut")  # fmt: skip
    errors = [{"file": "a.py", "message": "x"}, {"file": "a.py", "message": "y"},
              {"file": "b.py", "message": "z"}]  # fmt: skip
    report = Report.of("lint", [finding], {"files": 3, "errors": errors})
    assert last_line(render_plain(report)) == "1 error; 2 inputs could not be read"
    clean = Report.of("lint", [], {"files": 1, "errors": []})
    assert last_line(render_plain(clean)) == "no findings"
