"""The pickle guard end to end: no malicious pickle runs without --unsafe-pickle, whatever
the way in (a file, a directory scan, a glob, a sharded index, a DCP directory), and with it
a warning names each file whose pickle actually ran, and only those."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path

import pytest
import torch

from tests.cli_runner import deadweight_cli

ENV = {**os.environ, "COLUMNS": "200"}


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path, str]]:
        # Unpickling this creates the marker file: code runs at load time.
        return (Path.write_text, (Path(self.marker), "pwned"))


def dw(*args: str) -> subprocess.CompletedProcess[str]:
    return deadweight_cli(*args, env=ENV)


def _run_dir(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A run directory: a safe checkpoint and one whose pickle would create `marker`."""
    run, marker = tmp_path / "run", tmp_path / "marker"
    run.mkdir()
    torch.save({"w": torch.ones(3)}, run / "step-1.pt")
    evil = run / "step-2.pt"
    torch.save({"w": torch.ones(3), "x": Payload(str(marker))}, evil)
    return run, evil, marker


@pytest.mark.parametrize("how", ["file", "directory", "glob"])
def test_no_pickle_runs_without_the_flag(tmp_path: Path, how: str) -> None:
    run, evil, marker = _run_dir(tmp_path)
    target = {"file": evil, "directory": run, "glob": run / "*.pt"}[how]
    result = dw("inspect", target)
    assert result.returncode == 2
    assert f"deadweight: error: {evil}: " in result.stderr and "--unsafe-pickle" in result.stderr
    assert "deadweight: warning" not in result.stderr
    assert not marker.exists()


def test_no_pickle_runs_through_a_sharded_index_or_dcp(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    model = tmp_path / "model"
    model.mkdir()
    torch.save({"w": torch.ones(2), "x": Payload(str(marker))}, model / "pytorch_model.bin")
    (model / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"w": "pytorch_model.bin"}})
    )
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    for target in (model, model / "pytorch_model.bin.index.json", dcp):
        result = dw("inspect", target)
        assert result.returncode == 2, result.stderr
        assert "--unsafe-pickle" in result.stderr
    for command in (("diff", model / "pytorch_model.bin", dcp), ("trend", model, dcp)):
        assert dw(*command).returncode == 2
    assert not marker.exists()


def test_the_flag_warns_for_each_file_whose_pickle_ran(tmp_path: Path) -> None:
    run, evil, marker = _run_dir(tmp_path)
    safe = run / "step-1.pt"
    result = dw("inspect", run, "--unsafe-pickle")
    assert result.returncode == 0, result.stderr
    assert marker.exists()
    warnings = [
        line for line in result.stderr.splitlines() if line.startswith("deadweight: warning")
    ]
    assert warnings == [
        f"deadweight: warning: {evil}: --unsafe-pickle ran this file's pickle "
        "(any code in it has run)"
    ]
    assert str(safe) not in result.stderr  # loaded safely: nothing ran, nothing to say
    # Also in the JSON report, for tools, and for diff and trend.
    marker.unlink()
    report = json.loads(dw("inspect", run, "--unsafe-pickle", "--format", "json").stdout)
    assert report["subject"]["warnings"] == [
        f"{evil}: --unsafe-pickle ran this file's pickle (any code in it has run)"
    ]
    for command in (("diff", safe, evil), ("trend", run)):
        result = dw(*command, "--unsafe-pickle")
        assert f"deadweight: warning: {evil}: --unsafe-pickle ran" in result.stderr
        assert str(safe) + ":" not in result.stderr
