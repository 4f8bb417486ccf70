"""Whatever the code under check does, `deadweight check` ends with one line saying what
happened and where, and exit code 2: never a traceback, never 1 (CI reads 1 as findings),
never 0 without a report (issue 33, case 12)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deadweight import cli
from deadweight.cli import rules as rules_cmd
from tests.cli_runner import deadweight_cli

_MODEL = "import sys, torch\nm = torch.nn.Linear(2, 1)\n"
_LOSS = "lambda: m(torch.ones(1, 2)).sum()"

CASES = {
    # make() returning what is no model: a TypeError traceback from wrappers.py, rc 1
    "str-model": ("def make():\n    return 'model', lambda: 0\n", "torch.nn.Module, got str"),
    "dict-model": ("def make():\n    return {'a': 1}, lambda: 0\n", "torch.nn.Module, got dict"),
    "loss-not-callable": ("def make():\n    return m, 3\n", "zero-argument callable"),
    # sys.exit(0) inside the loss: rc 0 and no output at all
    "exit-0-in-loss": (
        "def make():\n    def loss():\n        sys.exit(0)\n    return m, loss\n",
        "called sys.exit(0) (at model.py:5 in loss)",
    ),
    "exit-at-import": ("sys.exit(3)\n", "called sys.exit(3) (at model.py:3 in <module>)"),
    # a BaseException of the user's: a traceback, rc 1
    "base-exception": (
        "class Boom(BaseException):\n    pass\n"
        "def make():\n    def loss():\n        raise Boom('boom')\n    return m, loss\n",
        "the code under check raised Boom: boom (at model.py:7 in loss)",
    ),
    # a loss that closes stdout: a ValueError traceback from rich, rc 1
    "closes-stdout": (
        f"def make():\n    def loss():\n        sys.stdout.close()\n        return ({_LOSS})()\n"
        "    return m, loss\n",
        "standard output was closed by the code under check",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_odd_code_under_check_is_one_line_and_exit_2(tmp_path: Path, case: str, fmt: str) -> None:
    source, expected = CASES[case]
    (tmp_path / "model.py").write_text(_MODEL + source)
    result = deadweight_cli("check", "model.py:make", "--format", fmt, cwd=tmp_path)
    if (case, fmt) == ("closes-stdout", "json"):
        # The code under check wrote to stderr all along (its own copy of it): closing
        # that closes nothing of the report's.
        assert result.returncode == 0 and json.loads(result.stdout)["kind"] == "check"
        return
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("deadweight: error: ") and expected in last, result.stderr


def test_an_internal_error_is_one_line_and_exit_2(monkeypatch, capsys) -> None:
    # A deadweight bug: the rule listing gets no rules to iterate over.
    monkeypatch.setattr(rules_cmd, "all_rules", lambda: None)
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    assert cli.main(["rules"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("deadweight: error: internal error, TypeError: ")
    assert "rules.py" in err and f"{cli.TRACEBACK_ENV}=1" in err
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    assert cli.main(["rules"]) == 2
    assert "Traceback" in capsys.readouterr().err  # for the bug report


def test_a_working_check_still_exits_by_its_findings(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(_MODEL + f"def make():\n    return m, {_LOSS}\n")
    result = deadweight_cli("check", "model.py:make", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sys.executable  # the same interpreter ran it
