from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from deadweight.readers import CheckpointError, open_checkpoint


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


def test_malicious_metadata_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "evil"
    path.mkdir()

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[Path, str]]:
            return (Path.write_text, (marker, "pwned"))

    (path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"not a DCP metadata type.*--unsafe-pickle"):
        open_checkpoint(path)
    assert not marker.exists()


def test_torn_metadata(tmp_path: Path) -> None:
    path = _save({"w": torch.ones(3)}, tmp_path / "ckpt")
    meta = Path(path) / ".metadata"
    meta.write_bytes(meta.read_bytes()[:20])
    with pytest.raises(CheckpointError, match=r"ckpt: the DCP \.metadata file is unreadable"):
        open_checkpoint(path)
