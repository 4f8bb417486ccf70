"""`deadweight run -- torchrun --nproc_per_node=N train.py`: one report, from rank 0's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.distributed.harness import free_port

SCRIPT = Path(__file__).with_name("scripts") / "ddp_train.py"


def _run(tmp_path: Path, *script_args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    log = tmp_path / "run.jsonl"
    command = [
        sys.executable, "-m", "deadweight", "run", "--log", str(log), "--format", "json", "--",
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(SCRIPT), *script_args,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DEADWEIGHT_COLLECTIVE_TIMEOUT": "30"}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env
    ), log


def test_torchrun_under_deadweight_run_gives_one_report_naming_the_diverged_replica(tmp_path):
    result, log = _run(tmp_path, "tamper")
    assert result.returncode == 1, result.stderr  # the script exits 0; DW308 is an error
    report = json.loads(result.stdout)  # one report on stdout
    assert report["subject"]["distributed"] == {
        "rank": 0,
        "world_size": 2,
        "backend": "gloo",
        "timeout_s": 30.0,
        "complete": True,
    }
    found = [f for f in report["findings"] if f["code"] == "DW308"]
    assert [f["params"] for f in found] == [["2.weight"]]
    assert log.exists() and (tmp_path / "run.rank1.jsonl").exists()
    assert "1 other process(es) of the run wrote their own logs" in result.stderr


def test_torchrun_healthy_ddp_run_reports_no_divergence(tmp_path):
    result, _ = _run(tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["subject"]["steps"] == 45
    assert "DW308" not in [f["code"] for f in report["findings"]]
