from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint


def _save(state: dict[str, object], path: Path) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


def test_round_trip_with_optimizer(tmp_path: Path) -> None:
    model = nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    opt.step()
    bf, x = torch.randn(50).bfloat16(), torch.randn(2, 3)
    extra = {"bf": bf, "ids": torch.arange(7), "nested": {"x": x}}
    path = _save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), **extra, "epoch": 3},
        tmp_path / "step-20",
    )
    before = sorted(os.listdir(path))
    with open_checkpoint(path) as ckpt:
        assert ckpt.path == path
        entries = {e.name: e for e in ckpt.entries()}
        assert list(entries) == ["model.weight", "model.bias", "bf", "ids", "nested.x"]
        assert (
            entries["bf"].dtype == "bfloat16"
            and entries["bf"].nbytes == 100
            and entries["bf"].file == path
        )
        np.testing.assert_array_equal(
            ckpt.array(entries["model.weight"]), model.weight.detach().numpy()
        )
        np.testing.assert_array_equal(ckpt.array(entries["bf"]), bf.float().numpy())
        np.testing.assert_array_equal(ckpt.array(entries["ids"]), np.arange(7))
        np.testing.assert_array_equal(ckpt.array(entries["nested.x"]), x.numpy())
        chunks = [c.copy() for c in ckpt.chunks(entries["bf"], max_bytes=64)]
        assert len(chunks) == 4
        assert ckpt.optimizer == {
            "key": "optimizer",
            "params_with_state": 2,
            "step": 2.0,
            "moments": ["exp_avg", "exp_avg_sq"],
            "param_groups": [],
        }
    assert sorted(os.listdir(path)) == before  # nothing written into the user's directory


def test_missing_shard_file_is_named(tmp_path: Path) -> None:
    path = _save({"w": torch.ones(3)}, tmp_path / "ckpt")
    (shard,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    os.remove(os.path.join(path, shard))
    with pytest.raises(
        CheckpointError, match=f"ckpt: shard file\\(s\\) missing from the DCP directory: {shard}"
    ):
        open_checkpoint(path)


def _evil_dcp_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A DCP directory whose .metadata pickle writes `marker` when unpickled."""
    marker = tmp_path / "marker"
    path = tmp_path / "evil"
    path.mkdir()

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[Path, str]]:
            return (Path.write_text, (marker, "pwned"))

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    return path, marker


def test_malicious_metadata_is_refused_without_running(tmp_path: Path) -> None:
    path, marker = _evil_dcp_dir(tmp_path)
    with pytest.raises(CheckpointError, match=r"not a DCP metadata type.*--unsafe-pickle"):
        open_checkpoint(path)
    assert not marker.exists()


def test_torn_metadata(tmp_path: Path) -> None:
    path = _save({"w": torch.ones(3)}, tmp_path / "ckpt")
    meta = Path(path) / ".metadata"
    meta.write_bytes(meta.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"ckpt: the DCP \.metadata file is unreadable"):
        open_checkpoint(path)


# --- hostile and damaged directories (issue 20) -------------------------------------------


def _metadata(path: str) -> Any:
    with open(os.path.join(path, ".metadata"), "rb") as fh:
        return pickle.load(fh)  # our own test file: trusted


def _rewrite(path: str, metadata: Any) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as fh:
        pickle.dump(metadata, fh)


def _relocate(path: str, relative: str) -> None:
    metadata = _metadata(path)
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = dataclasses.replace(info, relative_path=relative)
    _rewrite(path, metadata)


def test_truncated_shard_is_a_clear_error(tmp_path: Path) -> None:
    path = _save({"w": torch.ones(300)}, tmp_path / "ckpt")
    (shard,) = Path(path).glob("*.distcp")
    # Still more bytes than the 1200 of w's values, so the read is tried: torch.load fails.
    shard.write_bytes(shard.read_bytes()[:2000])
    with open_checkpoint(path) as ckpt:
        (entry,) = ckpt.entries()
        with pytest.raises(CheckpointError) as info:
            ckpt.array(entry)
    message = str(info.value)
    assert message.startswith(f"{path}: reading w failed (") and "Traceback" not in message
    assert "\n" not in message


@pytest.mark.parametrize("unsafe", [False, True])
def test_malicious_pickle_in_a_shard_is_refused_without_running(
    tmp_path: Path, unsafe: bool
) -> None:
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[Path, str]]:
            return (Path.write_text, (marker, "pwned"))

    path = _save({"w": torch.ones(3)}, tmp_path / "ckpt")
    (shard,) = Path(path).glob("*.distcp")
    evil = tmp_path / "evil.pt"
    torch.save(Payload(), evil)
    shard.write_bytes(evil.read_bytes())
    metadata = _metadata(path)
    for index, info in list(metadata.storage_data.items()):
        metadata.storage_data[index] = dataclasses.replace(
            info, offset=0, length=evil.stat().st_size
        )
    _rewrite(path, metadata)
    with open_checkpoint(path, unsafe_pickle=unsafe) as ckpt:
        (entry,) = ckpt.entries()
        with pytest.raises(CheckpointError, match=r"reading w failed \(a shard holds a pickle"):
            ckpt.array(entry)
    assert not marker.exists()


@pytest.mark.parametrize("where", ["dotdot", "absolute", "symlink"])
def test_shard_paths_stay_inside_the_directory(tmp_path: Path, where: str) -> None:
    path = _save({"w": torch.ones(3)}, tmp_path / "ckpt")
    (shard,) = Path(path).glob("*.distcp")
    outside = tmp_path / "outside.distcp"
    shard.rename(outside)  # the data exists, readable, only outside the directory
    if where == "dotdot":
        _relocate(path, "../outside.distcp")
    elif where == "absolute":
        _relocate(path, str(outside))
    else:
        shard.symlink_to(outside)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    assert str(info.value).startswith(
        f"{path}: the .metadata names shard files outside the DCP directory: "
    )
    # A symlink that stays inside is fine.
    if where == "symlink":
        shard.unlink()
        inner = Path(path) / "data"
        inner.mkdir()
        outside.rename(inner / "real.distcp")
        shard.symlink_to(inner / "real.distcp")
        with open_checkpoint(path) as ckpt:
            np.testing.assert_array_equal(ckpt.array(ckpt.entries()[0]), np.ones(3))


def test_claims_beyond_what_the_shards_store_are_not_read(tmp_path: Path) -> None:
    path = _save({"w": torch.ones(3), "v": torch.arange(4.0)}, tmp_path / "ckpt")
    metadata = _metadata(path)
    w = metadata.state_dict_metadata["w"]
    huge = torch.Size([2**40])  # 4 TiB of float32 claimed by a few kilobytes
    w.size = huge
    w.chunks = [dataclasses.replace(w.chunks[0], sizes=huge)]
    v = metadata.state_dict_metadata["v"]
    v.size = torch.Size([8])  # chunks still cover 4: the other 4 would be made up
    _rewrite(path, metadata)
    with open_checkpoint(path) as ckpt:
        entries = {e.name: e for e in ckpt.entries()}
        assert entries["w"].shape == (2**40,) and not entries["w"].is_float
        assert not entries["v"].is_float
        with pytest.raises(CheckpointError, match=r"w: the \.metadata claims 4398046511104 bytes"):
            ckpt.array(entries["w"])
        assert ckpt.notes == [  # type: ignore[attr-defined]
            f"{path}: w: the .metadata claims 4398046511104 bytes but its shards store "
            f"{metadata.storage_data[next(iter(metadata.storage_data))].length}: not read",
            f"{path}: v: the .metadata's chunks cover 4 of its 8 elements: not read",
        ]


@pytest.mark.parametrize(
    "damage",
    [
        lambda m: setattr(m, "state_dict_metadata", [1, 2]),
        lambda m: setattr(m, "storage_data", "x"),
        lambda m: setattr(m.state_dict_metadata["w"], "size", "abc"),
        lambda m: setattr(m.state_dict_metadata["w"].properties, "dtype", None),
        lambda m: setattr(m.state_dict_metadata["w"], "chunks", 5),
    ],
)
def test_malformed_metadata_fields_are_a_clear_error(tmp_path: Path, damage: Any) -> None:
    path = _save({"w": torch.ones(3)}, tmp_path / "ckpt")
    metadata = _metadata(path)
    damage(metadata)
    _rewrite(path, metadata)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    assert str(info.value).startswith(f"{path}: ")


def test_unsafe_pickle_metadata_is_noted(tmp_path: Path) -> None:
    from deadweight.checkpoints.readers.notes import collecting_notes

    path, marker = _evil_dcp_dir(tmp_path)
    good = _save({"w": torch.ones(3)}, tmp_path / "good")
    with collecting_notes() as notes:
        with open_checkpoint(good, unsafe_pickle=True) as ckpt:
            assert ckpt.notes == []  # type: ignore[attr-defined]
        with pytest.raises(CheckpointError, match="not DCP Metadata"):
            open_checkpoint(path, unsafe_pickle=True)
    assert marker.exists()
    assert notes == [
        f"{path / '.metadata'}: --unsafe-pickle ran this file's pickle (any code in it has run)"
    ]
