"""The command line as a user runs it: `python -m deadweight ...` in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TIMEOUT = 300  # generous: shared CI machines


def deadweight_cli(
    *args: str | Path,
    env: Mapping[str, str] | None = None,
    timeout: float = TIMEOUT,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Its output captured. `env` is the whole environment (default: this one, 200 columns)."""
    return subprocess.run(
        [sys.executable, "-m", "deadweight", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env) if env is not None else {**os.environ, "COLUMNS": "200"},
        cwd=cwd,
    )


# Issue 33's bound on a hostile input: no command over 5 s or 300 MB (peak resident memory
# of the whole process, imports included). The time is the child's own, from its first
# line to its exit, so that a loaded machine's process start-up does not count.
BOUND_SECONDS = 5.0
BOUND_MB = 300.0

_MEASURED = """
import atexit, os, sys, time
_started = time.monotonic()

def _measure():
    with open("/proc/self/status") as fh:
        peak = next(int(l.split()[1]) for l in fh if l.startswith("VmHWM:"))
    with open(os.environ["DEADWEIGHT_TEST_MEASURE"], "w") as out:
        out.write(f"{time.monotonic() - _started} {peak / 1024}")

atexit.register(_measure)
sys.argv = ["deadweight", *sys.argv[1:]]
from deadweight.cli import main
sys.exit(main())
"""


@dataclass(frozen=True)
class Measured:
    result: subprocess.CompletedProcess[str]
    seconds: float  # in the child
    peak_mb: float  # its peak resident memory (VmHWM)

    @property
    def within_bounds(self) -> bool:
        return self.seconds < BOUND_SECONDS and self.peak_mb < BOUND_MB


def measured_cli(*args: str | Path, cwd: str | Path | None = None, timeout: float = 60) -> Measured:
    """`deadweight ARGS` with its own time and peak memory; a hang fails with a timeout
    (TimeoutExpired), never hangs the suite."""
    with tempfile.TemporaryDirectory() as tmp:
        figures = Path(tmp) / "measured"
        env = {**os.environ, "COLUMNS": "200", "DEADWEIGHT_TEST_MEASURE": str(figures)}
        result = subprocess.run(
            [sys.executable, "-c", _MEASURED, *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
        )
        seconds, peak = map(float, figures.read_text().split())
    return Measured(result, seconds, peak)
