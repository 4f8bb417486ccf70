"""`deadweight run` on a real training command, as its user would type it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def deadweight_run(
    python: str, command: list[str], *, cwd: Path, env: dict[str, str], log: Path, timeout: float
) -> tuple[dict, subprocess.CompletedProcess[str]]:
    """`python -m deadweight run --format=json -- COMMAND`: the watch report it printed
    (stdout holds only the report: the script's own output goes to stderr), and the
    finished process."""
    proc = subprocess.run(
        [
            python,
            "-m",
            "deadweight",
            "run",
            "--format=json",
            "--fail-on=never",
            "--isolated",
            "--log",
            str(log),
            "--",
            *command,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["kind"] == "watch", proc.stdout[-3000:]
    return report, proc
