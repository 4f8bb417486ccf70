"""The DCP reader sees an untrusted `.metadata` pickle and shard bytes: whatever they are,
it raises CheckpointError naming the directory or reads, in bounded work, without running
either pickle and without leaving the directory."""

from __future__ import annotations

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
