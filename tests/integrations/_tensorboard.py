"""Read back what was written to TensorBoard event files, the way TensorBoard reads them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def read_events(root: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    """Scalars (tag -> [(step, value)]) and texts (tag -> the last text) of every event
    file under `root`. torch's `add_text(tag, ...)` stores the tag as `tag/text_summary`."""
    accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    ).EventAccumulator
    scalars: dict[str, list[tuple[int, float]]] = {}
    texts: dict[str, str] = {}
    dirs = {os.path.dirname(p) for p in map(str, root.rglob("events.out.tfevents.*"))}
    assert dirs, f"no TensorBoard event files under {root}"
    for directory in sorted(dirs):
        ea = accumulator(directory, size_guidance={"scalars": 0, "tensors": 0})
        ea.Reload()
        tags = ea.Tags()
        for tag in tags["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in ea.Scalars(tag))
        for tag in tags.get("tensors", []):
            for e in ea.Tensors(tag):
                texts[tag] = b"".join(e.tensor_proto.string_val).decode()
    return scalars, texts
