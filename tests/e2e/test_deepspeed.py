"""DeepSpeed on CPU, ZeRO stages 0-3, each in its own process (DeepSpeed sets up a
process group): `watch` takes the engine and optimizer as `initialize` returns them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.harness import free_port

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_loop.py"
NAMES = ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]


def _run(stage: int, cut: bool = False) -> dict:
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    root = Path(__file__).parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(stage), "cut" if cut else "healthy"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_healthy_deepspeed_run_is_watched_without_findings(stage: int) -> None:
    result = _run(stage)
    assert result["steps"] == 60
    assert result["findings"] == []
    assert "before deepspeed.initialize()" in result["check_refused"]
    if stage == 0:  # the model's own parameters are what the optimizer steps
        assert result["params"] == NAMES
    elif stage < 3:  # a flat partition is stepped; the parameters are seen to move
        assert set(NAMES) < set(result["params"])


def test_a_detached_layer_is_named_under_zero_stage_0() -> None:
    """DeepSpeed gives the cut-off layer zero gradients, not None: AdamW's weight decay
    moves it, so it is not unchanged (DW301), but its gradient is always 0 (DW310)."""
    result = _run(0, cut=True)
    assert [f["code"] for f in result["findings"]] == ["DW310"]
    assert sorted(result["findings"][0]["params"]) == ["0.bias", "0.weight"]
