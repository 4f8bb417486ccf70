"""The boundary around every reader: whatever a reader raises, at open or while reading,
becomes a CheckpointError naming the file; only regular files (and DCP directories) are
opened, so a FIFO or a device never hangs a scan or fills memory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from deadweight.checkpoints.readers import safetensors_file as safetensors_module
from tests.checkpoints.readers.bounded import run_bounded


class _TornDown(BaseException):
    """Like torch.distributed.checkpoint's CheckpointException: a BaseException subclass."""


RAISED = [
    ValueError("negative dimensions are not allowed"),
    RecursionError("maximum recursion depth exceeded"),
    MemoryError(),
    OverflowError("Python int too large to convert to C long"),
    _TornDown("rank 0 failed\n  Traceback (most recent call last):\n  ..."),
]


@pytest.fixture
def good(tmp_path: Path) -> str:
    path = str(tmp_path / "good.safetensors")
    save_file({"w": torch.arange(6, dtype=torch.float32)}, path)
    return path


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
def test_an_exception_at_open_names_the_file(
    good: str, exc: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(safetensors_module, "parse_header", explode)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(good)
    message = str(info.value)
    assert message.startswith(f"{good}: ")
    assert "\n" not in message  # one line, whatever the exception's text was
    assert info.value.__cause__ is None  # the CLI would print a cause's traceback


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("method", ["entries", "chunks", "raw_chunks", "array"])
def test_an_exception_while_reading_names_the_file(
    good: str, exc: BaseException, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(self: object, *args: object, **kwargs: object) -> Iterator[np.ndarray]:
        raise exc
        yield np.empty(0)  # a generator, as the readers' chunks() are

    def explode_now(self: object, *args: object, **kwargs: object) -> object:
        raise exc

    cls = safetensors_module.SafetensorsFile
    with open_checkpoint(good) as ckpt:
        entry = ckpt.entries()[0]
        replacement = explode if method in ("chunks", "raw_chunks") else explode_now
        monkeypatch.setattr(cls, method, replacement)
        with pytest.raises(CheckpointError) as info:
            if method == "entries":
                ckpt.entries()
            elif method == "array":
                ckpt.array(entry)
            elif method == "chunks":
                list(ckpt.chunks(entry))
            else:
                list(ckpt.raw_chunks(entry, 4))
    assert str(info.value).startswith(f"{good}: ")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), SystemExit(3)], ids=repr)
def test_an_interrupt_is_not_swallowed(
    good: str, exc: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    def explode(*args: object, **kwargs: object) -> None:
        raise exc

    monkeypatch.setattr(safetensors_module, "parse_header", explode)
    with pytest.raises(type(exc)):
        open_checkpoint(good)


def test_a_generator_closed_early_still_closes(good: str) -> None:
    with open_checkpoint(good) as ckpt:
        entry = ckpt.entries()[0]
        chunks = ckpt.chunks(entry, max_bytes=4)
        next(chunks)
        chunks.close()  # GeneratorExit passes through the boundary untouched
        assert ckpt.array(entry).tolist() == [0, 1, 2, 3, 4, 5]


SUFFIXES = [".safetensors", ".npz", ".index.json", ".pt", ".bin", ".ckpt"]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, suffix: str) -> None:
    fifo = tmp_path / f"f{suffix}"
    os.mkfifo(fifo)
    outcome = run_bounded(str(fifo), timeout=30)  # the bug: blocked in open() forever
    assert outcome.other is None
    assert outcome.error is not None and outcome.error.startswith(f"{fifo}: ")
    assert "not a regular file" in outcome.error


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_link_to_dev_zero_is_refused(tmp_path: Path, suffix: str) -> None:
    link = tmp_path / f"zero{suffix}"
    link.symlink_to("/dev/zero")
    outcome = run_bounded(str(link), timeout=60, memory=1 << 30)  # the bug: read until OOM
    assert outcome.other is None
    assert outcome.error is not None and "not a regular file" in outcome.error


def test_a_link_to_a_regular_file_still_reads(good: str, tmp_path: Path) -> None:
    link = tmp_path / "link.safetensors"
    link.symlink_to(good)
    with open_checkpoint(str(link)) as ckpt:
        assert [e.name for e in ckpt.entries()] == ["w"]
