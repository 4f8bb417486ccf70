from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from tests.checkpoints.readers.bounded import run_bounded


def _sharded(tmp_path: Path, fmt: str = "safetensors") -> tuple[str, dict[str, torch.Tensor]]:
    shards = {
        f"model-00001-of-00002.{fmt}": {
            "embed.weight": torch.randn(10, 4),
            "layers.0.weight": torch.randn(4, 4),
        },
        f"model-00002-of-00002.{fmt}": {
            "layers.1.weight": torch.randn(4, 4).bfloat16(),
            "head.bias": torch.zeros(3),
        },
    }
    weight_map = {}
    for shard, tensors in shards.items():
        if fmt == "safetensors":
            save_file(tensors, str(tmp_path / shard))
        else:
            torch.save(tensors, tmp_path / shard)
        weight_map.update(dict.fromkeys(tensors, shard))
    index = tmp_path / f"model.{fmt}.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return str(index), {k: v for t in shards.values() for k, v in t.items()}


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_sharded_round_trip(tmp_path: Path, fmt: str) -> None:
    index, tensors = _sharded(tmp_path, fmt)
    with open_checkpoint(index) as ckpt:
        assert ckpt.path == index
        entries = ckpt.entries()
        assert {e.name for e in entries} == set(tensors)
        # shard by shard
        assert [Path(e.file).name[:11] for e in entries] == ["model-00001"] * 2 + [
            "model-00002"
        ] * 2
        for entry in entries:
            if fmt == "safetensors":
                want = load_file(entry.file)[entry.name]
            else:
                want = torch.load(entry.file, weights_only=True)[entry.name]
            np.testing.assert_array_equal(ckpt.array(entry), want.float().numpy())
            assert (
                np.concatenate([c.copy() for c in ckpt.chunks(entry, max_bytes=16)]).size
                == want.numel()
            )


def test_missing_shard_and_wrong_mapping_are_named(tmp_path: Path) -> None:
    index, _ = _sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    data = json.loads(Path(index).read_text())
    data["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    Path(index).write_text(json.dumps(data))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(index)
    message = str(info.value)
    assert message.startswith(f"{index}: ")
    assert "shard model-00002-of-00002.safetensors is missing" in message
    assert "shard model-00001-of-00002.safetensors does not hold ghost.weight" in message


def test_broken_shard_and_bad_index(tmp_path: Path) -> None:
    index, _ = _sharded(tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(
        CheckpointError,
        match=r"shard model-00001-of-00002\.safetensors is unreadable: the file is 3 bytes",
    ):
        open_checkpoint(index)
    bad = tmp_path / "other.index.json"
    bad.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match=r'other\.index\.json: the index has no "weight_map"'):
        open_checkpoint(str(bad))
    bad.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        open_checkpoint(str(bad))
    bad.write_text(json.dumps({"weight_map": {"a": "../../etc/passwd"}}))
    with pytest.raises(CheckpointError, match="outside the index's directory"):
        open_checkpoint(str(bad))


@pytest.mark.parametrize("target", ["self", "other"])
def test_an_index_naming_an_index_is_one_short_error(tmp_path: Path, target: str) -> None:
    # It recursed, each level quoting the one below: a 12 KB error repeating itself.
    index = tmp_path / "a.index.json"
    other = tmp_path / "b.index.json"
    shard = index.name if target == "self" else other.name
    index.write_text(json.dumps({"weight_map": {"w": shard}}))
    other.write_text(json.dumps({"weight_map": {"w": index.name}}))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(index))
    message = str(info.value)
    assert message == (
        f"{index}: shard {shard} is itself an index (.json), not a weight file "
        "(1 tensor(s) mapped to it, e.g. w)"
    )


def test_an_index_of_a_million_empty_objects_is_refused_before_decoding(
    tmp_path: Path,
) -> None:
    index = tmp_path / "big.index.json"
    index.write_bytes(b'{"metadata": [' + b"{}," * 20_000_000 + b'{}], "weight_map": {}}')
    outcome = run_bounded(str(index), timeout=120, memory=1 << 30)  # json.loads: 1.5 GB
    assert outcome.other is None, outcome.other
    assert outcome.error is not None and "JSON objects and lists" in outcome.error
    assert outcome.maxrss_mb < 500


def test_an_index_with_an_absurd_integer_is_refused(tmp_path: Path) -> None:
    index = tmp_path / "n.index.json"
    index.write_text('{"metadata": {"total_size": ' + "9" * 4000 + '}, "weight_map": {}}')
    with pytest.raises(CheckpointError, match="4000 digits"):
        open_checkpoint(str(index))
