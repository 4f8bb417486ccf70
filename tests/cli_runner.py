"""The command line as a user runs it: `python -m deadweight ...` in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

TIMEOUT = 300  # generous: shared CI machines


def deadweight_cli(
    *args: str | Path, env: Mapping[str, str] | None = None, timeout: float = TIMEOUT
) -> subprocess.CompletedProcess[str]:
    """Its output captured. `env` is the whole environment (default: this one, 200 columns)."""
    return subprocess.run(
        [sys.executable, "-m", "deadweight", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env) if env is not None else {**os.environ, "COLUMNS": "200"},
    )
