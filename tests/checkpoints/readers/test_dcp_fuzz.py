"""The DCP reader sees an untrusted `.metadata` pickle and shard bytes: whatever they are,
it raises CheckpointError naming the directory or reads, in bounded work, without running
either pickle and without leaving the directory."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from deadweight.checkpoints.readers.torch_file import UnmeasuredEntry
from tests.checkpoints.readers.bounded import run_bounded
from tests.fuzzing import FUZZ, byte_edits, fuzz, mutate

pytestmark = fuzz

MARKER = Path(tempfile.gettempdir()) / "deadweight-dcp-fuzz-marker"
SECONDS = 10.0  # per example; a real read of these tiny directories takes milliseconds


class Payload:
    def __reduce__(self) -> tuple[object, tuple[Path, str]]:
        return (Path.write_text, (MARKER, "pwned"))  # would create the marker if run


def _base() -> tuple[bytes, dict[str, bytes]]:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4).bfloat16(), "n": 3}
        dcp.save(state, checkpoint_id=tmp, no_dist=True)
        shards = {p.name: p.read_bytes() for p in Path(tmp).glob("*.distcp")}
        return (Path(tmp) / ".metadata").read_bytes(), shards


METADATA, SHARDS = _base()
EVIL = pickle.dumps(Payload())


def _open_and_read(metadata: bytes, shards: dict[str, bytes]) -> None:
    MARKER.unlink(missing_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        path.mkdir()
        (path / ".metadata").write_bytes(metadata)
        for name, data in shards.items():
            (path / name).write_bytes(data)
        stored = sum(len(d) for d in shards.values())
        try:
            with open_checkpoint(str(path)) as ckpt:
                for entry in ckpt.entries():
                    if isinstance(entry, UnmeasuredEntry):
                        continue
                    assert entry.nbytes <= stored  # memory follows what the shards hold
                    try:
                        for _ in ckpt.chunks(entry, max_bytes=1 << 16):
                            pass
                    except CheckpointError as exc:
                        assert str(exc).startswith(f"{path}: ")
        except CheckpointError as exc:
            assert str(exc).startswith(f"{path}: ")
    assert not MARKER.exists(), "a pickle ran"
    assert time.monotonic() - start < SECONDS


@FUZZ
@given(st.sampled_from([METADATA, EVIL]), byte_edits, st.none() | st.integers(0, len(METADATA)))
def test_mutated_metadata(base: bytes, edits: list[tuple[int, int]], cut: int | None) -> None:
    _open_and_read(mutate(base, edits, cut), SHARDS)


@FUZZ
@given(byte_edits, st.none() | st.integers(0, max(len(d) for d in SHARDS.values())), st.booleans())
def test_mutated_shards(edits: list[tuple[int, int]], cut: int | None, evil: bool) -> None:
    base = {n: (torch_saved_evil() if evil else d) for n, d in SHARDS.items()}
    _open_and_read(METADATA, {n: mutate(d, edits, cut) for n, d in base.items()})


def torch_saved_evil() -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(Payload(), buffer)
    return buffer.getvalue()


class _ShowsOneNameOpensAnother:
    """A path object whose cached string is an in-folder shard name while its parts, which
    DCP would join and open, name `target` (issue 33, case 1)."""

    def __init__(self, shown: str, target: str) -> None:
        self.shown, self.target = shown, target

    def __reduce__(self) -> tuple[object, ...]:
        return (Path().__class__, (self.target,), (None, {"_str": self.shown}))


def _metadata_pointing_at(tmp: Path, target: str) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp / "evil"), no_dist=True)
    metadata = pickle.loads((tmp / "evil" / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = _ShowsOneNameOpensAnother(str(info.relative_path), target)
    (tmp / "evil" / ".metadata").write_bytes(pickle.dumps(metadata))
    return tmp / "evil"


def test_a_path_object_in_the_metadata_cannot_read_outside(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"w": torch.full((6,), 42.0)}, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    (shard,) = (tmp_path / "out").glob("*.distcp")
    evil = _metadata_pointing_at(tmp_path, str(shard))
    outcome = run_bounded(
        str(evil),
        "with open_checkpoint(PATH) as ckpt:\n"
        "    (entry,) = ckpt.entries()\n"
        "    outcome['values'] = ckpt.array(entry).tolist()",
        timeout=SECONDS * 3,
    )
    assert outcome.other is None
    # The str the pickle shows is what is read: the shard inside the directory, never 42s.
    assert outcome.error is None and outcome.extra["values"] == list(range(6))


def test_a_path_object_in_the_metadata_cannot_open_a_fifo_outside(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    evil = _metadata_pointing_at(tmp_path, str(fifo))
    outcome = run_bounded(str(evil), timeout=SECONDS * 3)  # a hang raises TimeoutExpired
    assert outcome.other is None and outcome.error is None
