"""`deadweight run`'s exit code, for every combination of the script's exit code, the
findings, the configured fail-on and --fail-on: the script's own non-zero code wins,
otherwise the findings decide, by --fail-on, else the configuration, else warning.

The matrix runs `deadweight.cli.main` in this process, and the command it runs is a
Python child that writes a recorded event log (a clean run, one warning, one error) to
the path deadweight gives it and exits with the code asked for: the exit code is
decided from the log and the child's code exactly as after a training run, at a
fraction of the cost. One real training run checks the default end to end.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import deadweight
from deadweight.cli import main
from deadweight.demos import fused_rmsnorm
from deadweight.findings import Severity
from deadweight.watching.run_in_script import ENV_LOG

TIMEOUT = 300  # generous: shared CI machines

# Writes the recorded log where `deadweight run` expects the script's, then exits.
REPLAY = (
    "import os, shutil, sys\n"
    f"shutil.copyfile(sys.argv[1], os.environ[{ENV_LOG!r}])\n"
    "sys.exit(int(sys.argv[2]))\n"
)
SCRIPT_EXITS = (0, 3)
FINDINGS = ("none", "warning", "error")
CONFIGS = (None, "error", "never")  # fail-on in deadweight.toml; None: no file
FLAGS = (None, "warning", "never")  # --fail-on; None: not given


def _record_clean(log: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadweight.watch(model, opt, log=log):
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def _record_warning(log: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadweight.watch(model, opt, log=log):  # backward, never a step: DW309 (warning)
        model(torch.randn(8, 4)).pow(2).mean().backward()


def _record_error(log: Path) -> None:
    setup = fused_rmsnorm.make(False)  # the seed incident: DW301 never-moved (error)
    with deadweight.watch(setup.model, setup.optimizer, log=log, every=10):
        fused_rmsnorm.train(setup, 60)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("recorded")
    logs = {}
    for kind, record in (("none", _record_clean), ("warning", _record_warning),
                         ("error", _record_error)):  # fmt: skip
        torch.manual_seed(0)
        logs[kind] = folder / f"{kind}.jsonl"
        record(logs[kind])
    return logs


def _worst(kind: str) -> Severity | None:
    return {"none": None, "warning": Severity.WARNING, "error": Severity.ERROR}[kind]


def expected(script: int, findings: str, config: str | None, flag: str | None) -> int:
    fail_on = flag or config or "warning"
    worst = _worst(findings)
    failed = fail_on != "never" and worst is not None and worst.rank >= Severity.parse(fail_on).rank
    return script if script != 0 else int(failed)


def test_the_recorded_logs_hold_what_their_names_say(recorded):
    from deadweight.cli.report import load_log

    for kind, log in recorded.items():
        ((report, _),) = load_log(str(log), None, None)
        assert {f.severity for f in report.findings} == ({_worst(kind)} - {None}), kind


@pytest.mark.parametrize(
    ("script", "findings", "config", "flag"),
    list(itertools.product(SCRIPT_EXITS, FINDINGS, CONFIGS, FLAGS)),
)
def test_exit_code(recorded, tmp_path, monkeypatch, capsys, script, findings, config, flag):
    if config is not None:
        (tmp_path / "deadweight.toml").write_text(f'fail-on = "{config}"\n')
    monkeypatch.chdir(tmp_path)
    options = ["--fail-on", flag] if flag else []
    command = [sys.executable, "-c", REPLAY, str(recorded[findings]), str(script)]
    code = main(["run", "--log", str(tmp_path / "run.jsonl"), *options, "--", *command])
    out = capsys.readouterr().out
    assert code == expected(script, findings, config, flag), out
    assert out.startswith("deadweight watch")  # reported in every case


def test_the_expected_codes_are_the_issue_s_cases():
    """The spec above, spelled out for the cases a CI job meets."""
    assert expected(0, "error", None, None) == 1  # an error finding fails CI by default
    assert expected(0, "warning", None, None) == 1  # as does a warning (the default)
    assert expected(0, "warning", "error", None) == 0  # fail-on = "error" lets it pass
    assert expected(0, "error", "error", None) == 1
    assert expected(0, "error", "never", "warning") == 1  # the flag beats the file
    assert expected(0, "error", None, "never") == 0
    assert expected(3, "none", None, None) == 3  # the script's own failure wins
    assert expected(3, "error", None, "never") == 3


STEPS_THEN_EXITS_0 = """
from deadweight.demos import fused_rmsnorm as f

s = f.make(False)
f.train(s, 12)
"""


def test_an_error_finding_fails_a_real_run_with_no_config_and_no_flag(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(STEPS_THEN_EXITS_0))
    result = subprocess.run(
        [sys.executable, "-m", "deadweight", "run", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert "error DW101" in result.stdout  # the step-0 check: the fused norm's cut
    assert result.returncode == 1, result.stderr


def test_run_help_says_how_the_exit_code_is_decided(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "default: fail-on of the configuration, else warning" in text
    assert "the script's own when it is not 0" in text
