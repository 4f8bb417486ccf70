"""Inputs of the HTML report tests: the seed incidents as a watch log and checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import deadweight
from deadweight.demos import layer_scalar_drift
from tests.test_forensics_seeds import _incident_checkpoint

TIMEOUT = 300  # generous: shared CI machines
LAST = f"blocks.{layer_scalar_drift.LAYERS - 1}.layer_scalar"
DRIFT_STEPS = 1000  # the drifted scalar stands out among its siblings by ~step 900
AFTER_RESET = 300
# The incident's Stage 1 save points and the last scalar's value at each.
SAVES = [0, 10_000, 20_000, 35_000, 53_000]
VALUES = [1.0, 4.2, 9.8, 21.5, 56.25]


def drift_log(path: Path) -> Path:
    """Seed 2 watched: the last layer scalar drifts, then Adam's state is emptied."""
    setup = layer_scalar_drift.make_watchable()
    with deadweight.watch(setup.model, setup.optimizer, every=20, log=path):
        layer_scalar_drift.train(setup, DRIFT_STEPS, every=DRIFT_STEPS)
        setup.optimizer.state.clear()  # --no-load-optim: Adam's moments start from zero
        layer_scalar_drift.train(setup, AFTER_RESET, every=AFTER_RESET)
    return path


def incident_checkpoints(directory: Path) -> list[str]:
    """32 layers each; layers.31.layer_scalar climbs to 56.25 over the saves."""
    return [
        _incident_checkpoint(directory / f"step-{s}.safetensors", v)
        for s, v in zip(SAVES, VALUES, strict=True)
    ]


def dw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
