"""checkpoint_scan's entry points around the readers and kernels."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from deadweight.checkpoints import checkpoint_scan
from deadweight.checkpoints.readers.base import GuardedCheckpoint


@pytest.fixture
def pair(tmp_path: Path) -> tuple[str, str]:
    paths = []
    for step in (0, 1):
        path = str(tmp_path / f"step-{step}.safetensors")
        save_file({"w": torch.randn(64, 64), "layers.0.s": torch.tensor([1.0 + step])}, path)
        paths.append(path)
    return paths[0], paths[1]


@pytest.fixture
def eager_collector() -> Iterator[list[int]]:
    """The cycle collector due after every allocation, and a count of its runs."""
    runs = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        runs[0] += phase == "start"

    threshold = gc.get_threshold()
    gc.set_threshold(1)
    gc.callbacks.append(count)
    try:
        yield runs
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)


def test_scans_pause_the_cycle_collector_and_restore_it(
    pair: tuple[str, str], eager_collector: list[int]
) -> None:
    # A full collection walks every object of the process (torch's included): in a fresh
    # CLI process the first one took a fifth of a 2 GB scan.
    a, b = pair
    for run in (
        lambda: checkpoint_scan.inspect_checkpoints([a, b]),
        lambda: checkpoint_scan.diff_checkpoints(a, b),
        lambda: checkpoint_scan.trend_checkpoints([a, b]),
    ):
        eager_collector[0] = 0
        run()
        assert eager_collector[0] == 0
        assert gc.isenabled()
    # the collector works again right after
    [object() for _ in range(10)]
    assert eager_collector[0] > 0


def test_a_collector_turned_off_by_the_caller_stays_off(pair: tuple[str, str]) -> None:
    gc.disable()
    try:
        checkpoint_scan.inspect_checkpoints([pair[0]])
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_an_error_inside_still_restores_the_collector(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="threads"):
        checkpoint_scan.inspect_checkpoints([str(tmp_path / "x.safetensors")], threads=0)
    assert gc.isenabled()


class _TornDown(BaseException):
    """Like torch.distributed.checkpoint's CheckpointException: not an Exception."""


@pytest.mark.parametrize(
    "exc", [ValueError("negative dimensions are not allowed"), RecursionError(), _TornDown("x")]
)
def test_what_a_scan_raises_is_that_files_error(
    pair: tuple[str, str], exc: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad, good = pair
    real = checkpoint_scan.scan_checkpoint

    def scan(ckpt: Any, *args: Any) -> Any:
        if ckpt.path == bad:
            raise exc
        return real(ckpt, *args)

    monkeypatch.setattr(checkpoint_scan, "scan_checkpoint", scan)
    stats = checkpoint_scan.inspect_checkpoints([bad, good], scheme=None)
    assert [s.path for s in stats.scans] == [good]
    assert len(stats.errors) == 1 and stats.errors[0].startswith(f"{bad}: ")


def test_what_a_comparison_raises_is_an_error_of_the_diff(
    pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def compare(*args: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(checkpoint_scan, "_compare", compare)
    stats = checkpoint_scan.diff_checkpoints(*pair)
    assert len(stats.errors) == 1 and pair[0] in stats.errors[0] and pair[1] in stats.errors[0]


def test_what_reading_a_trend_raises_is_that_files_error(
    pair: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bad, good = pair
    real = GuardedCheckpoint.entries

    def entries(self: GuardedCheckpoint) -> Any:
        if self.path == bad:
            raise _TornDown("rank 1 failed")
        return real(self)

    monkeypatch.setattr(GuardedCheckpoint, "entries", entries)
    stats = checkpoint_scan.trend_checkpoints([bad, good])
    assert stats.values["layers.0.s"] == [None, 2.0]
    assert len(stats.errors) == 1 and stats.errors[0].startswith(f"{bad}: ")
