"""The command line, end to end in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BROKEN = """
import torch
import torch.nn.functional as F
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.a(x).detach())

def make():
    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    return model, lambda: F.mse_loss(model(x), y), torch.optim.SGD(model.parameters(), lr=0.1)

def healthy():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    return model, lambda: F.mse_loss(model(x), y)

def in_eval():
    model, loss_fn = healthy()
    model.eval()
    return model, loss_fn

def raising_loss():
    model, _ = healthy()
    def loss_fn():
        raise ValueError("bad batch 42")
    return model, loss_fn

def raising_factory():
    raise KeyError("no such dataset")

def wrong_shape():
    return 1, 2, 3, 4
"""


def dw(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,  # generous: the demo trains models, and CI machines are shared
    )


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(BROKEN))
    return path


def test_check_finds_the_cut_and_exits_1(script):
    result = dw("check", f"{script}:make")
    assert result.returncode == 1, result.stderr
    assert "DW101" in result.stdout and "DW102" in result.stdout
    assert "train.py:13" in result.stdout  # the .detach() line
    assert "a.weight" in result.stdout


def test_default_function_is_make(script):
    assert dw("check", str(script)).returncode == 1


def test_json_output(script):
    result = dw("check", f"{script}:make", "--format", "json")
    data = json.loads(result.stdout)
    assert data["schema_version"] == 1 and data["kind"] == "check"
    codes = {f["code"] for f in data["findings"]}
    assert codes == {"DW101", "DW102"}
    cut = next(f for f in data["findings"] if f["code"] == "DW102")
    assert cut["location"]["line"] == 13 and cut["evidence"]["kind"] == "detach"


PRINTS = """
import os
import subprocess
import sys

import torch
from torch import nn

print("printed at import")


def make():
    print("printed by the factory")
    os.write(1, b"written to descriptor 1\\n")
    subprocess.run([sys.executable, "-c", "print('printed by a child process')"], check=True)
    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)

    def loss_fn():
        print("printed by the loss")
        return model(x).pow(2).mean()

    return model, loss_fn
"""
PRINTED = ("printed at import", "printed by the factory", "written to descriptor 1",
           "printed by a child process", "printed by the loss")  # fmt: skip


def test_json_output_holds_only_the_report_when_the_file_prints(tmp_path):
    path = tmp_path / "prints.py"
    path.write_text(PRINTS)
    result = dw("check", str(path), "--format", "json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "check"  # nothing else on stdout
    for line in PRINTED:
        assert line in result.stderr
    text = dw("check", str(path))  # a terminal report: the prints stay where they were
    for line in PRINTED:
        assert line in text.stdout


def test_healthy_model_exits_0(script):
    result = dw("check", f"{script}:healthy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no findings" in result.stdout


def test_fail_on(script):
    assert dw("check", f"{script}:make", "--fail-on", "never").returncode == 0
    # eval mode is only info: it fails only with --fail-on info
    assert dw("check", f"{script}:in_eval").returncode == 0
    assert dw("check", f"{script}:in_eval", "--fail-on", "info").returncode == 1


def test_select_and_ignore(script):
    out = json.loads(dw("check", f"{script}:make", "--format", "json", "--select", "DW102").stdout)
    assert {f["code"] for f in out["findings"]} == {"DW102"}
    out = json.loads(
        dw(
            "check", f"{script}:make", "--format", "json", "--ignore", "no-gradient,graph-cut"
        ).stdout
    )
    assert out["findings"] == []
    bad = dw("check", f"{script}:make", "--select", "DW999")
    assert bad.returncode == 2 and "unknown rule" in bad.stderr


def test_loss_fn_raising_shows_its_traceback_and_exits_2(script):
    result = dw("check", f"{script}:raising_loss")
    assert result.returncode == 2
    assert "ValueError: bad batch 42" in result.stderr
    assert "train.py" in result.stderr  # the user's own frame is in the traceback
    assert "deadweight: error: loss_fn raised ValueError" in result.stderr


@pytest.mark.parametrize(
    "target,message",
    [
        (":raising_factory", "raising_factory() raised KeyError"),
        (":wrong_shape", "must return (model, loss_fn)"),
        (":missing", "has no function 'missing'"),
    ],
)
def test_bad_targets_exit_2(script, target, message):
    result = dw("check", f"{script}{target}")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr or "raising_factory" in target


def test_missing_file_exits_2(tmp_path):
    result = dw("check", str(tmp_path / "nope.py"))
    assert result.returncode == 2 and "no such file" in result.stderr


def test_usage_error_exits_2():
    assert dw("check").returncode == 2
    assert dw().returncode == 2


def test_rules_list_and_explain():
    listing = dw("rules")
    assert listing.returncode == 0 and "DW101" in listing.stdout and "no-gradient" in listing.stdout
    one = dw("rules", "DW101")
    assert one.returncode == 0
    for heading in ("What it does", "Why is this bad", "Example", "Fix"):
        assert heading in one.stdout
    by_name = dw("rules", "graph-cut", "--format", "json")
    assert json.loads(by_name.stdout)["code"] == "DW102"
    assert dw("rules", "DW999").returncode == 2


def test_demo_runs_the_seed_and_shows_the_report():
    result = dw("demo", "--steps", "300", "--drift-steps", "300")
    assert result.returncode == 0, result.stderr
    assert "grads present: w1 false g false w2 true" in result.stdout
    assert "grads present: w1 true g true w2 true" in result.stdout
    assert "DW101" in result.stdout and "DW102" in result.stdout


def test_console_script_is_installed():
    result = subprocess.run(["deadweight", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("deadweight ")


def test_a_command_runs_with_what_the_imports_made_frozen(monkeypatch):
    """The objects made by importing torch and deadweight live until exit: the command
    line freezes them, so the cyclic collector never walks them during a command."""
    import gc

    from deadweight.cli import main

    frozen = []
    monkeypatch.setattr(gc, "freeze", lambda: frozen.append(True))
    assert main(["rules"]) == 0
    assert frozen == [True]
    assert main([]) == 2  # no command, nothing run: nothing frozen either
    assert frozen == [True]
