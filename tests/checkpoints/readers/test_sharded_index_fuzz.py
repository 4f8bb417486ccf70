"""The sharded-index reader sees untrusted JSON: whatever the index and the files it names
are, it raises CheckpointError naming the index or reads the shards it names."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from tests.checkpoints.readers.bounded import BOUND_MB, BOUND_SECONDS, READ_ALL, run_bounded
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
        "./" + _SHARD,
        "link-out.safetensors",
        "linked-dir/secret.safetensors",
        "link-passwd.safetensors",
    ]
) | st.text(max_size=6)
_weight_map = st.dictionaries(
    st.sampled_from(["w", "b", "x"]) | st.text(max_size=4), _targets, max_size=4
)


def _open_and_read(index: object, raw: bytes | None = None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outside = Path(tmp) / "outside"
        outside.mkdir()
        save_file({"secret": torch.full((2,), 42.0)}, outside / "secret.safetensors")
        folder = Path(tmp) / "model"
        folder.mkdir()
        # Links out of the folder: to a file, to a directory, to a file that is no checkpoint.
        os.symlink(outside / "secret.safetensors", folder / "link-out.safetensors")
        os.symlink(outside, folder / "linked-dir")
        os.symlink("/etc/passwd", folder / "link-passwd.safetensors")
        save_file({"w": torch.ones(2, 2), "b": torch.zeros(3)}, folder / _SHARD)
        (folder / "other.index.json").write_text(json.dumps({"weight_map": {"w": _SHARD}}))
        os.mkfifo(folder / "fifo.safetensors")
        (folder / "sub").mkdir()
        path = folder / "fuzz.index.json"
        path.write_bytes(raw if raw is not None else json.dumps(index).encode())
        try:
            with open_checkpoint(str(path)) as ckpt:
                for entry in ckpt.entries():
                    assert entry.name != "secret", "a tensor outside the folder was listed"
                    for _ in ckpt.chunks(entry, max_bytes=1 << 16):
                        pass
        except CheckpointError as exc:
            message = str(exc)
            assert message.startswith(f"{path}: ")
            assert "\n" not in message and len(message) < 20_000
            assert "header length" not in message, "bytes of a file outside were shown"


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


def _index(folder: Path, weight_map: dict[str, str]) -> str:
    path = folder / "model.safetensors.index.json"
    path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(path)


@pytest.mark.parametrize("how", ["file", "directory", "passwd"])
def test_a_link_out_of_the_folder_is_refused(tmp_path: Path, how: str) -> None:
    """Issue 33, case 2: a shard linked out of the folder is refused, never listed, and
    no byte of what it leads to reaches the message."""
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({"secret": torch.full((3,), 7.0)}, outside / "secret.safetensors")
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"a": torch.ones(2)}, folder / "model-00001.safetensors")
    if how == "file":
        os.symlink("../outside/secret.safetensors", folder / "model-00002.safetensors")
        shard = "model-00002.safetensors"
    elif how == "directory":
        os.symlink(outside, folder / "sub")
        shard = "sub/secret.safetensors"
    else:
        os.symlink("/etc/passwd", folder / "model-00002.safetensors")
        shard = "model-00002.safetensors"
    index = _index(folder, {"a": "model-00001.safetensors", "secret": shard})
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(index)
    message = str(caught.value)
    assert "outside the index's directory" in message and shard in message
    assert "header length" not in message


@pytest.mark.parametrize("alias", ["links", "dot-prefixes"])
def test_one_file_named_many_ways_is_read_once(tmp_path: Path, alias: str) -> None:
    """Issue 33, case 7: 2000 names of one 2000-tensor shard (in-folder links, or `./`
    prefixes) took 38-52 s and 1.43 GB; the file is now opened and listed once."""
    n = 2000
    save_file({f"t{i}": torch.full((1,), float(i)) for i in range(n)}, tmp_path / "one.safetensors")
    weight_map = {}
    for i in range(n):
        if alias == "links":
            os.symlink("one.safetensors", tmp_path / f"s{i}.safetensors")
            weight_map[f"t{i}"] = f"s{i}.safetensors"
        else:
            weight_map[f"t{i}"] = "./" * i + "one.safetensors"
    outcome = run_bounded(
        _index(tmp_path, weight_map),
        READ_ALL + "\n    outcome['count'] = len(ckpt.entries())",
        timeout=BOUND_SECONDS * 6,
    )
    assert outcome.other is None and outcome.error is None
    assert outcome.extra["count"] == n
    assert outcome.seconds < BOUND_SECONDS and outcome.maxrss_mb < BOUND_MB


def test_an_unterminated_string_of_escaped_quotes_is_read_in_one_pass(tmp_path: Path) -> None:
    """The container count skipped strings with a regex that restarted at every quote of
    an unterminated one (issue 33, case 8, in the index reader)."""
    path = tmp_path / "model.safetensors.index.json"
    path.write_text('{"weight_map": {"w": "' + '\\"' * 150_000 + "[" * 40)
    outcome = run_bounded(str(path), timeout=BOUND_SECONDS * 6)
    assert outcome.other is None and outcome.error is not None
    assert "not valid JSON" in outcome.error
    assert outcome.seconds < BOUND_SECONDS and outcome.maxrss_mb < BOUND_MB
