"""The torch.save reader sees untrusted bytes: whatever they are, it raises CheckpointError
naming the file or reads, in bounded work, and never runs the file's pickle."""

from __future__ import annotations

import io
import pickle
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from deadweight.checkpoints.readers.torch_file import REPEAT_READ_BYTES, UnmeasuredEntry
from tests.fuzzing import FUZZ, byte_edits, fuzz, mutate

pytestmark = fuzz

MARKER = Path(tempfile.gettempdir()) / "deadweight-torch-fuzz-marker"
# Per example: a real read of these tiny files takes milliseconds.
SECONDS = 10.0


class Payload:
    def __reduce__(self) -> tuple[object, tuple[Path, str]]:
        return (Path.write_text, (MARKER, "pwned"))  # would create the marker if run


def _saved(obj: object, **kwargs: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **kwargs)  # type: ignore[arg-type]
    return buffer.getvalue()


SAFE = _saved({"w": torch.arange(6.0).reshape(2, 3), "n": torch.ones(2, dtype=torch.int64)})
EVIL = _saved({"w": torch.ones(2), "x": Payload()})
LEGACY = _saved({"w": torch.arange(4.0)}, _use_new_zipfile_serialization=False)
PICKLES = [pickle.dumps(Payload(), protocol=p) for p in (2, 4)]
with zipfile.ZipFile(io.BytesIO(SAFE)) as _zip:
    MEMBERS = {name: _zip.read(name) for name in _zip.namelist()}


def _open_and_read(data: bytes) -> None:
    MARKER.unlink(missing_ok=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.pt"
        path.write_bytes(data)
        try:
            with open_checkpoint(str(path)) as ckpt:
                for entry in ckpt.entries():
                    if isinstance(entry, UnmeasuredEntry):
                        continue
                    # What is read is bounded by the bytes there are, never by a claim.
                    assert entry.nbytes <= max(len(data), REPEAT_READ_BYTES)
                    for _ in ckpt.chunks(entry, max_bytes=1 << 16):
                        pass
        except CheckpointError as exc:
            assert str(exc).startswith(f"{path}: ")
    assert not MARKER.exists(), "the file's pickle ran"
    assert time.monotonic() - start < SECONDS


@FUZZ
@given(st.sampled_from([SAFE, EVIL, LEGACY]), byte_edits, st.none() | st.integers(0, len(SAFE)))
def test_mutated_torch_save_files(
    base: bytes, edits: list[tuple[int, int]], cut: int | None
) -> None:
    _open_and_read(mutate(base, edits, cut))


_member_data = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([*MEMBERS.values(), *PICKLES]),
    st.builds(mutate, st.sampled_from([*MEMBERS.values(), *PICKLES]), byte_edits, st.none()),
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from([*MEMBERS, "archive/data.pkl", "archive/data/1", "x/data.pkl", "data.pkl"]),
        _member_data,
        max_size=6,
    )
)
def test_random_zip_members(members: dict[str, bytes]) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    _open_and_read(buffer.getvalue())
