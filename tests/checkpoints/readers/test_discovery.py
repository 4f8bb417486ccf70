from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from deadweight.checkpoints.readers import (
    CheckpointError,
    find_checkpoints,
    natural_key,
    open_checkpoint,
    step_of,
)


@pytest.mark.parametrize(
    ("path", "step"),
    [
        ("runs/checkpoint-1200/model.safetensors", 1200),
        ("step_1200.safetensors", 1200),
        ("ckpt/iter_0001200/model_optim_rng.pt", 1200),
        ("global_step1200/mp_rank_00_model_states.pt", 1200),
        ("epoch=3-step=1200.ckpt", 1200),
        ("outputs/step-1200", 1200),
        ("model-00001-of-00002.safetensors", None),
        ("model.safetensors", None),
        ("checkpoint-100/step_5.pt", 5),
    ],
)
def test_step_of(path: str, step: int | None) -> None:
    assert step_of(path) == step


def test_natural_sort() -> None:
    names = ["step-1000.pt", "step-100.pt", "step-20.pt", "step-2.pt", "a.pt"]
    assert sorted(names, key=natural_key) == [
        "a.pt",
        "step-2.pt",
        "step-20.pt",
        "step-100.pt",
        "step-1000.pt",
    ]


def _touch_safetensors(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"w": torch.zeros(1)}, str(path))


def test_directory_of_files_sorted_naturally(tmp_path: Path) -> None:
    for step in (1000, 100, 20):
        _touch_safetensors(tmp_path / f"step-{step}.safetensors")
    torch.save({"w": torch.zeros(1)}, tmp_path / "final.pt")
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "training_args.bin").write_bytes(b"x")
    found, errors = find_checkpoints([str(tmp_path)])
    assert errors == []
    assert [Path(p).name for p in found] == [
        "final.pt",
        "step-20.safetensors",
        "step-100.safetensors",
        "step-1000.safetensors",
    ]


def test_sharded_directory_is_one_checkpoint(tmp_path: Path) -> None:
    _touch_safetensors(tmp_path / "model-00001-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (tmp_path / "pytorch_model.bin.index.json").write_text('{"weight_map": {}}')
    found, errors = find_checkpoints([str(tmp_path)])
    assert (found, errors) == ([str(tmp_path / "model.safetensors.index.json")], [])


def test_dcp_directory_is_one_checkpoint_and_run_directories_expand(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"w": torch.ones(2)}, checkpoint_id=str(tmp_path / "run" / "step-200"), no_dist=True
        )
    _touch_safetensors(tmp_path / "run" / "step-1000" / "model.safetensors")
    found, errors = find_checkpoints([str(tmp_path / "run" / "step-200")])
    assert (found, errors) == ([str(tmp_path / "run" / "step-200")], [])
    found, errors = find_checkpoints([str(tmp_path / "run")])
    assert errors == []
    assert found == [
        str(tmp_path / "run" / "step-200"),
        str(tmp_path / "run" / "step-1000" / "model.safetensors"),
    ]
    assert [step_of(p) for p in found] == [200, 1000]


def test_globs_and_errors_do_not_stop_other_inputs(tmp_path: Path) -> None:
    _touch_safetensors(tmp_path / "a" / "step-10.safetensors")
    _touch_safetensors(tmp_path / "a" / "step-9.safetensors")
    (tmp_path / "empty").mkdir()
    found, errors = find_checkpoints(
        [
            str(tmp_path / "a" / "*.safetensors"),
            str(tmp_path / "empty"),
            str(tmp_path / "nope.pt"),
            str(tmp_path / "z*.pt"),
        ]
    )
    assert [Path(p).name for p in found] == ["step-9.safetensors", "step-10.safetensors"]
    assert all(isinstance(e, CheckpointError) for e in errors)
    messages = [str(e) for e in errors]
    assert messages[0].startswith(f"{tmp_path / 'empty'}: holds no checkpoint")
    assert messages[1] == f"{tmp_path / 'nope.pt'}: no such file or directory"
    assert messages[2] == f"{tmp_path / 'z*.pt'}: no file or directory matches this pattern"


def test_open_checkpoint_refuses_unknown_inputs(tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(CheckpointError, match=r"x\.txt: unknown checkpoint format"):
        open_checkpoint(tmp_path / "x.txt")
    with pytest.raises(CheckpointError, match="no such file"):
        open_checkpoint(tmp_path / "missing.safetensors")
    with pytest.raises(CheckpointError, match="is a directory without a DCP"):
        open_checkpoint(tmp_path)
    assert os.listdir(tmp_path) == ["x.txt"]
