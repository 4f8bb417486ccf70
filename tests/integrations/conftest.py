from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """wandb, offline and silent, writing under tmp_path; any run left open is finished."""
    wandb = pytest.importorskip("wandb")
    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DIR": str(tmp_path),
        "WANDB_PROJECT": "deadweight-test",
    }.items():
        monkeypatch.setenv(key, value)
    yield wandb
    if wandb.run is not None:
        wandb.finish()
