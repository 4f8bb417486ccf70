"""`deadweight config`, and every subcommand reading the one configuration: fail-on,
select/ignore and thresholds from deadweight.toml or [tool.deadweight], under the
command line's own options."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deadweight.cli import main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

BROKEN = """
import torch
import torch.nn.functional as F
from torch import nn

def make():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    model = nn.ModuleDict({"a": a, "b": b})
    return model, lambda: F.mse_loss(b(a(x).detach()), y)
"""
CHECKPOINTED = (
    "import torch\n\ndef f(block, x):\n    return torch.utils.checkpoint.checkpoint(block, x)\n"
)


def pyproject(directory: Path, body: str) -> Path:
    path = directory / "pyproject.toml"
    path.write_text('[project]\nname = "x"\n\n[tool.deadweight]\n' + body)
    return path


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(BROKEN)
    return tmp_path


def test_config_prints_defaults_without_a_file(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["file"] is None
    assert shown["values"]["fail-on"] == {"value": "warning", "source": "default"}
    assert shown["values"]["thresholds.never-moved-steps"] == {"value": 50, "source": "default"}


def test_config_names_where_each_value_came_from(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = pyproject(project, 'fail-on = "error"\n[tool.deadweight.thresholds]\noutlier-z = 8\n')
    assert main(["config", "--format", "json"]) == 0
    values = json.loads(capsys.readouterr().out)["values"]
    origin = f"{path} [tool.deadweight]"
    assert values["fail-on"] == {"value": "error", "source": origin}
    assert values["thresholds.outlier-z"] == {"value": 8, "source": origin}
    assert values["thresholds.outlier-min-factor"]["source"] == "default"
    assert main(["config"]) == 0
    text = capsys.readouterr().out
    assert f"configuration: {path}" in text and "thresholds.outlier-z" in text
    assert main(["config", "--isolated", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["values"]["fail-on"]["value"] == "warning"


def test_config_toml_output_reads_back_as_the_same_configuration(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pyproject(project, """
ignore = ["DW504"]
fail-on = "info"
[tool.deadweight.per-file-ignores]
"tests/**" = ["DW501"]
[tool.deadweight.thresholds]
quantization-scheme = "int8-channel"
""")  # fmt: skip
    assert main(["config", "--format", "toml"]) == 0
    again = project / "again"
    again.mkdir()
    (again / "pyproject.toml").write_text(capsys.readouterr().out)
    assert tomllib.loads((again / "pyproject.toml").read_text())["tool"]["deadweight"]
    assert main(["config", "--format", "json"]) == 0
    first = json.loads(capsys.readouterr().out)["values"]
    assert main(["config", str(again), "--format", "json"]) == 0
    second = json.loads(capsys.readouterr().out)["values"]
    assert {k: v["value"] for k, v in first.items()} == {k: v["value"] for k, v in second.items()}


def test_config_of_a_path_finds_its_nearest_file(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pyproject(project, 'ignore = ["DW504"]\n')
    inner = project / "pkg"
    inner.mkdir()
    (inner / "deadweight.toml").write_text('ignore = ["DW502"]\n')
    assert main(["config", str(inner / "m.py"), "--format", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["file"] == str(inner / "deadweight.toml")
    assert shown["values"]["ignore"]["value"] == ["DW502"]


def test_a_bad_configuration_stops_every_subcommand_naming_the_key(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pyproject(project, "[tool.deadweight.thresholds]\nnever-moved-step = 10\n")
    for argv in (["config"], ["check", "train.py"], ["lint", "."], ["inspect", "x.safetensors"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "unknown key 'never-moved-step' (did you mean 'never-moved-steps'?)" in err, argv


def test_check_reads_fail_on_and_ignore_under_the_command_line(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "train.py"]) == 1  # no configuration: a.weight, a.bias get no gradient
    out = capsys.readouterr().out
    assert "DW101 no-gradient" in out and "DW102 graph-cut" in out  # code and name, per finding
    pyproject(project, 'fail-on = "never"\n')
    assert main(["check", "train.py"]) == 0
    assert main(["check", "train.py", "--fail-on", "error"]) == 1  # the command line wins
    assert main(["check", "train.py", "--isolated"]) == 1
    pyproject(project, 'ignore = ["DW1"]\n')
    capsys.readouterr()
    assert main(["check", "train.py", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []
    (project / "other.toml").write_text('ignore = ["DW107"]\n')  # --config FILE instead
    assert main(["check", "train.py", "--config", "other.toml"]) == 1


def test_inspect_judges_by_the_configured_quantization_scheme(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_file({"layer.weight": torch.randn(16, 16)}, str(project / "m.safetensors"))
    assert main(["inspect", "m.safetensors", "--format", "json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["subject"]["scheme"] == "int4-group128"
    pyproject(project, '[tool.deadweight.thresholds]\nquantization-scheme = "int8-channel"\n')
    assert main(["inspect", "m.safetensors", "--format", "json"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["subject"]["scheme"] == "int8-channel"
    assert main(["inspect", "m.safetensors", "--format", "json", "--scheme", "int4"]) in (0, 1)
    assert json.loads(capsys.readouterr().out)["subject"]["scheme"] == "int4"


def test_lint_reads_fail_on_and_keeps_its_per_file_rules(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "m.py").write_text(CHECKPOINTED)
    assert main(["lint", "m.py"]) == 1
    assert "DW504 reentrant-checkpoint" in capsys.readouterr().out
    pyproject(project, 'fail-on = "error"\n')
    assert main(["lint", "m.py"]) == 0  # DW504 is a warning
    pyproject(project, 'ignore = ["DW504"]\n')
    capsys.readouterr()
    assert main(["lint", "m.py", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["findings"] == []


def test_a_broken_pyproject_that_is_not_ours_does_not_stop_inspect(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "pyproject.toml").write_text("x = " + "[" * 200_000 + "]" * 200_000 + "\n")
    save_file({"layer.weight": torch.randn(16, 16)}, str(project / "m.safetensors"))
    assert main(["inspect", "m.safetensors"]) in (0, 1)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"deadweight: note: {project / 'pyproject.toml'}: not valid TOML: nested too deeply "
        "to read; it has no [tool.deadweight], so deadweight ignores it"
    ]


def test_a_broken_deadweight_toml_stops_every_subcommand_in_one_line(
    project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (project / "deadweight.toml").write_text("x = " + "{a = " * 100_000 + "\n")
    save_file({"layer.weight": torch.randn(16, 16)}, str(project / "m.safetensors"))
    for argv in (["inspect", "m.safetensors"], ["lint", "train.py"], ["config"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err == [
            f"deadweight: error: {project / 'deadweight.toml'}: not valid TOML: nested too "
            "deeply to read"
        ]


def test_a_fifo_named_deadweight_toml_is_an_error_not_a_hang(project: Path) -> None:
    import os
    import subprocess

    os.mkfifo(project / "deadweight.toml")
    for argv in (["lint", "train.py"], ["config"], ["config", "--config", "deadweight.toml"]):
        result = subprocess.run(  # the timeout turns a hang into a failure
            [sys.executable, "-m", "deadweight", *argv],
            capture_output=True, text=True, timeout=120, cwd=project,
        )  # fmt: skip
        named = "deadweight.toml" if "--config" in argv else project / "deadweight.toml"
        assert result.returncode == 2
        assert result.stderr.splitlines() == [f"deadweight: error: {named}: not a regular file"]
