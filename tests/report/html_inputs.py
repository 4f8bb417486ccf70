"""Inputs of the HTML report tests: the seed incidents as a watch log and checkpoints."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import deadweight
from deadweight.demos import fused_rmsnorm, layer_scalar_drift
from tests.checkpoints.test_forensics_seeds import _incident_checkpoint

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


def loss_log(path: Path, *, diff: bool = False, steps: int = fused_rmsnorm.STEPS) -> Path:
    """Seed 1 watched with its loss logged: w1 and g never move, the loss plateaus
    (`diff`: the differentiable RMSNorm, where everything learns)."""
    setup = fused_rmsnorm.make(diff)
    with deadweight.watch(setup.model, setup.optimizer, every=20, log=path) as w:
        for _ in range(steps):
            setup.optimizer.zero_grad(set_to_none=True)
            loss = setup.loss()
            loss.backward()
            setup.optimizer.step()
            w.log_loss(loss)
    return path


def figure(text: str, div: str) -> dict[str, Any]:
    """The data and layout of one plotly figure of a page, arrays decoded."""
    match = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div) + r'",\s*', text)
    assert match is not None, f"no figure {div}"
    decoder = json.JSONDecoder()
    data, end = decoder.raw_decode(text, match.end())
    layout, _ = decoder.raw_decode(text, text.index("{", end))
    return {"data": _decoded(data), "layout": layout}


def _decoded(value: Any) -> Any:
    """plotly writes numeric arrays as {"dtype", "bdata"} (base64 of the raw array)."""
    if isinstance(value, dict) and "bdata" in value and "dtype" in value:
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"]).tolist()
    if isinstance(value, dict):
        return {k: _decoded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decoded(v) for v in value]
    return value


def incident_checkpoints(directory: Path) -> list[str]:
    """32 layers each; layers.31.layer_scalar climbs to 56.25 over the saves."""
    return [
        _incident_checkpoint(directory / f"step-{s}.safetensors", v)
        for s, v in zip(SAVES, VALUES, strict=True)
    ]


def checkpoint_reports(paths: list[str]) -> dict[str, Any]:
    """What inspect, diff and trend say of the incident's saves, to be saved as JSON."""
    return {
        "inspect": deadweight.inspect_checkpoints([paths[-1]], scheme="int4"),
        "diff": deadweight.diff_checkpoints(paths[0], paths[-1]),
        "trend": deadweight.trend_checkpoints(paths),
    }


def dw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )
