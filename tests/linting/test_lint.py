"""`deadweight.lint_paths`: bad inputs become per-file diagnostics while the rest is linted,
suppression comments, selection, and the report's shape."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import deadweight
from deadweight.linting import source_files
from tests.linting.helpers import CUT, lines_of, lint_source, write

GOOD = (
    "import torch\n\n\ndef f(block, x):\n    return torch.utils.checkpoint.checkpoint(block, x)\n"
)


def lint(*paths: Path, **kwargs) -> deadweight.Report:
    kwargs.setdefault("config", None)
    return deadweight.lint_paths(list(paths), **kwargs)


def errors(report: deadweight.Report) -> dict[str, dict]:
    return {Path(e["file"]).name: e for e in report.subject["errors"]}


def test_bad_files_are_diagnosed_and_the_rest_linted(tmp_path: Path) -> None:
    write(tmp_path, GOOD, "good.py")
    write(tmp_path, "def broken(:\n    pass\n", "syntax.py")
    (tmp_path / "latin.py").write_bytes(b"s = '\xe9t\xe9'\n")
    (tmp_path / "nul.py").write_bytes(b"x = 1\x00\n")
    (tmp_path / "empty.py").write_bytes(b"")
    (tmp_path / "big.py").write_text("x = 1\n" * 50_000)
    os.symlink(tmp_path / "loop.py", tmp_path / "loop.py")
    report = lint(tmp_path, max_file_size=100_000)
    found = errors(report)
    assert set(found) == {"syntax.py", "latin.py", "nul.py", "big.py", "loop.py"}
    assert found["syntax.py"]["line"] == 1 and "syntax error" in found["syntax.py"]["message"]
    assert "not valid UTF-8" in found["latin.py"]["message"] and found["latin.py"]["line"] == 1
    assert "null bytes" in found["nul.py"]["message"]
    assert "limit" in found["big.py"]["message"]
    assert "link loop" in found["loop.py"]["message"]
    # good.py and the empty file (valid Python, nothing to find) were linted
    assert report.subject["files"] == 2
    assert [Path(f.location.file).name for f in report.findings] == ["good.py"]


def test_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, GOOD, "good.py")
    secret = write(tmp_path, GOOD, "secret.py")
    real_open = open

    def guarded_open(path, *args, **kwargs):
        if Path(path) == secret:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    report = lint(tmp_path)
    assert "permission denied" in errors(report)["secret.py"]["message"]
    assert report.subject["files"] == 1 and len(report.findings) == 1


def test_encoding_declaration_and_bom(tmp_path: Path) -> None:
    (tmp_path / "decl.py").write_bytes(
        b"# -*- coding: latin-1 -*-\nimport torch\ns = '\xe9'\n"
        b"y = torch.utils.checkpoint.checkpoint(f, x)\n"
    )
    (tmp_path / "bom.py").write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    report = lint(tmp_path)
    assert report.subject["errors"] == []
    assert sorted((Path(f.location.file).name, f.location.line) for f in report.findings) == [
        ("bom.py", 5),
        ("decl.py", 4),
    ]


def test_nothing_readable(tmp_path: Path) -> None:
    report = lint(tmp_path / "missing.py")
    assert report.subject["files"] == 0 and report.subject["errors"]


def test_each_file_once_however_named(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD, "m.py")
    report = lint(path, tmp_path, tmp_path / "." / "m.py")
    assert len(report.findings) == 1


SUPPRESSED = """
import torch
from torch.utils.checkpoint import checkpoint


def f(block, x):
    a = checkpoint(block, x)  # deadweight: ignore[DW504]
    b = checkpoint(block, x)  # deadweight: ignore[reentrant-checkpoint]
    c = checkpoint(block, x)  # deadweight: ignore
    d = checkpoint(block, x)  # deadweight: ignore[DW501]
    e = checkpoint(block, x)  # noqa
    s = "checkpoint(block, x)  # deadweight: ignore"
    g = checkpoint(  # the whole call spans lines: its last line works too
        block, x
    )  # deadweight: ignore[DW5]
    return a, b, c, d, e, s, g
"""


def test_suppression_comments(tmp_path: Path) -> None:
    report = lint_source(tmp_path, SUPPRESSED)
    assert lines_of(report, "DW504") == [9, 10]
    assert report.subject["suppressed"] == 4


def test_select_ignore_and_unknown_rules(tmp_path: Path) -> None:
    path = write(tmp_path, CUT + GOOD.replace("import torch\n", ""), "m.py")
    assert [f.code for f in lint(path).findings] == ["DW501", "DW504"]
    assert [f.code for f in lint(path, select="DW501").findings] == ["DW501"]
    assert [f.code for f in lint(path, ignore=["forward-gradient-cut"]).findings] == ["DW504"]
    with pytest.raises(ValueError, match="unknown rule"):
        lint(path, select=["DW599"])


def test_report_json_has_regions_and_stays_compatible(tmp_path: Path) -> None:
    report = lint_source(tmp_path, CUT)
    data = json.loads(report.to_json())
    assert data["kind"] == "lint" and data["schema_version"] == deadweight.SCHEMA_VERSION
    (finding,) = data["findings"]
    assert finding["location"] == {
        "file": str(tmp_path / "model.py"),
        "line": 11,
        "function": "M.forward",
        "module": None,
        "column": 14,
        "end_line": 11,
        "end_column": 29,
    }
    assert data["subject"]["files"] == 1 and data["subject"]["languages"]["python"] == 1


def test_text_prints_compiler_style_diagnostics(tmp_path: Path) -> None:
    report = lint_source(tmp_path, CUT)
    text = str(report)
    assert f"{tmp_path / 'model.py'}:11:14: DW501 forward-gradient-cut: `self.enc`" in text


def test_reading_goes_through_read_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are read once each, by the module that applies the size limit."""
    calls: list[str] = []
    real = source_files.read_bytes

    def counting(path: str, max_bytes: int = source_files.DEFAULT_MAX_BYTES):
        calls.append(path)
        return real(path, max_bytes)

    monkeypatch.setattr(source_files, "read_bytes", counting)
    write(tmp_path, GOOD, "a.py")
    write(tmp_path, GOOD, "b.py")
    lint(tmp_path)
    assert sorted(Path(c).name for c in calls) == ["a.py", "b.py"]


DECAY_RULE = """
def groups(model, wd):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
"""

LAYER_SCALAR = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
"""


def test_dw502_sees_the_scalar_of_a_model_the_script_imports(tmp_path: Path) -> None:
    train = write(tmp_path, "from model import M\n" + DECAY_RULE.lstrip("\n"), "train.py")
    model = write(tmp_path, LAYER_SCALAR, "model.py")
    write(tmp_path / "tests", LAYER_SCALAR, "test_other.py")  # imported by nothing here
    (alone,) = lint(train).findings
    assert alone.code == "DW502" and alone.severity is deadweight.Severity.INFO
    assert alone.evidence["scalar_parameters"] == []
    (both,) = lint(train, model, tmp_path / "tests").findings
    assert both.severity is deadweight.Severity.WARNING
    assert both.location.file == str(train) and both.location.line == 3
    assert both.evidence["scalar_parameters"] == [
        {"file": str(model), "line": 8, "parameter": "self.scale",
         "construct": "nn.Parameter(torch.ones(1))"}
    ]  # fmt: skip
    assert "`self.scale` (`nn.Parameter(torch.ones(1))` in model.py)" in both.message


def test_dw502_in_a_helper_sees_the_models_of_the_scripts_that_use_it(tmp_path: Path) -> None:
    """utils/optim.py holds the rule; train.py imports it and the model package."""
    write(tmp_path / "utils", "", "__init__.py")
    helper = write(tmp_path / "utils", DECAY_RULE, "optim.py")
    write(tmp_path / "models", "from .gpt import M\n", "__init__.py")
    gpt = write(tmp_path / "models", LAYER_SCALAR, "gpt.py")
    write(tmp_path, "from utils.optim import groups\nfrom models import M\n", "train.py")
    (finding,) = lint(tmp_path).findings
    assert finding.location.file == str(helper)
    assert finding.severity is deadweight.Severity.WARNING
    assert [p["file"] for p in finding.evidence["scalar_parameters"]] == [str(gpt)]


def test_dw502_across_files_keeps_each_files_settings(tmp_path: Path) -> None:
    """The rule reads the files together; suppressions and per-file-ignores still apply
    to the file each finding is in."""
    write(tmp_path, LAYER_SCALAR, "model.py")
    importing = "from model import M\n" + DECAY_RULE.lstrip("\n")
    write(tmp_path, importing.replace(">= 2]", ">= 2]  # deadweight: ignore[DW502]"), "a.py")
    write(tmp_path, importing, "scripts/b.py")
    write(tmp_path, importing, "c.py")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.deadweight.per-file-ignores]\n"scripts/**" = ["shape-based-decay"]\n'
    )
    report = deadweight.lint_paths([tmp_path], config=tmp_path / "pyproject.toml")
    assert [(Path(f.location.file).name, f.severity.value) for f in report.findings] == [
        ("c.py", "warning")
    ]
    assert report.subject["suppressed"] == 1
