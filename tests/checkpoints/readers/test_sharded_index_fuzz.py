"""The sharded-index reader sees untrusted JSON: whatever the index and the files it names
are, it raises CheckpointError naming the index or reads the shards it names."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from tests.fuzzing import FUZZ, fuzz

pytestmark = fuzz

_SHARD = "model-00001-of-00001.safetensors"
_json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=6),
)
_json = st.recursive(
    _json_leaves,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)
# Names the weight_map may point at: the real shard, itself, another index, a missing file,
# a FIFO, a directory, a path outside, odd strings.
_targets = st.sampled_from(
    [
        _SHARD,
        "fuzz.index.json",
        "other.index.json",
        "missing.safetensors",
        "fifo.safetensors",
        "sub",
        "../up.safetensors",
        "/etc/passwd",
        "",
        ".",
        "sub/../" + _SHARD,
    ]
) | st.text(max_size=6)
_weight_map = st.dictionaries(
    st.sampled_from(["w", "b", "x"]) | st.text(max_size=4), _targets, max_size=4
)


def _open_and_read(index: object, raw: bytes | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_file({"w": torch.ones(2, 2), "b": torch.zeros(3)}, folder / _SHARD)
        (folder / "other.index.json").write_text(json.dumps({"weight_map": {"w": _SHARD}}))
        os.mkfifo(folder / "fifo.safetensors")
        (folder / "sub").mkdir()
        path = folder / "fuzz.index.json"
        path.write_bytes(raw if raw is not None else json.dumps(index).encode())
        try:
            with open_checkpoint(str(path)) as ckpt:
                for entry in ckpt.entries():
                    for _ in ckpt.chunks(entry, max_bytes=1 << 16):
                        pass
        except CheckpointError as exc:
            message = str(exc)
            assert message.startswith(f"{path}: ")
            assert "\n" not in message and len(message) < 20_000


@FUZZ
@given(_weight_map, _json)
def test_random_weight_maps(weight_map: dict[str, str], metadata: object) -> None:
    _open_and_read({"metadata": metadata, "weight_map": weight_map})


@FUZZ
@given(_json)
def test_random_json(index: object) -> None:
    _open_and_read(index)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(raw: bytes) -> None:
    _open_and_read(None, raw)
