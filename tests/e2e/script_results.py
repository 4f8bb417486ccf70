"""Run a loop script of tests/e2e/scripts over several specs in one process and read
back the one `RESULT {json}` line each spec printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.distributed.harness import free_port

ROOT = Path(__file__).parents[2]


def process_env() -> dict[str, str]:
    """The environment of a one-process run with its own gloo group: a free port, one
    thread, and this repository's deadweight first on the path."""
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def script_results(
    script: Path, specs: list[str], *, env: dict[str, str], timeout: float
) -> dict[str, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, str(script), *specs],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            results[result["spec"]] = result
    assert proc.returncode == 0 and set(results) == set(specs), (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )
    return results
