from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from deadweight.readers import CheckpointError, open_checkpoint


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6
    )
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
    return model, opt


def test_nested_model_and_optimizer(tmp_path: Path) -> None:
    model, opt = _trained()
    path = str(tmp_path / "ckpt.pt")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": 3,
            "config": {"name": "tiny", "ema": {"decay": torch.tensor(0.999)}},
            "extra": [torch.zeros(2, dtype=torch.int32)],
        },
        path,
    )
    reference = torch.load(path, weights_only=True)
    with open_checkpoint(path) as ckpt:
        names = [e.name for e in ckpt.entries()]
        assert names == [
            "model.0.weight",
            "model.0.bias",
            "model.2.weight",
            "model.2.bias",
            "config.ema.decay",
            "extra.0",
        ]
        for entry in ckpt.entries()[:4]:
            want = reference["model"][entry.name.removeprefix("model.")].numpy()
            np.testing.assert_array_equal(ckpt.array(entry), want)
        extra = ckpt.entries()[-1]
        assert (extra.dtype, extra.is_float, extra.nbytes) == ("int32", False, 8)
        assert ckpt.array(extra).dtype == np.int32
        assert ckpt.optimizer == {
            "key": "optimizer",
            "params_with_state": 4,
            "step": 3.0,
            "moments": ["exp_avg", "exp_avg_sq"],
            "param_groups": [{"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-6}],
        }


def test_plain_state_dict_bf16_and_chunks(tmp_path: Path) -> None:
    weights = {
        "w": torch.randn(100, 30).bfloat16(),
        "d": torch.randn(7, dtype=torch.float64),
        "h": torch.randn(9).half(),
    }
    path = str(tmp_path / "pytorch_model.bin")
    torch.save(weights, path)
    with open_checkpoint(path) as ckpt:
        assert ckpt.optimizer is None
        by_name = {e.name: e for e in ckpt.entries()}
        assert by_name["w"].dtype == "bfloat16" and by_name["w"].nbytes == 6000
        chunks = [c.copy() for c in ckpt.chunks(by_name["w"], max_bytes=1000)]
        assert len(chunks) == 12 and all(c.dtype == np.float32 and c.nbytes <= 1000 for c in chunks)
        np.testing.assert_array_equal(
            np.concatenate(chunks), weights["w"].float().numpy().reshape(-1)
        )
        assert ckpt.array(by_name["d"]).dtype == np.float64
        np.testing.assert_array_equal(ckpt.array(by_name["h"]), weights["h"].float().numpy())


def test_non_contiguous_saved_view_comes_out_in_c_order(tmp_path: Path) -> None:
    t = torch.randn(3, 5)
    path = str(tmp_path / "view.pth")
    torch.save({"t": t.t()}, path)
    with open_checkpoint(path) as ckpt:
        (entry,) = ckpt.entries()
        assert entry.shape == (5, 3)
        np.testing.assert_array_equal(ckpt.array(entry), t.t().numpy())


def test_legacy_non_zip_format(tmp_path: Path) -> None:
    path = str(tmp_path / "legacy.pt")
    torch.save({"w": torch.arange(6.0)}, path, _use_new_zipfile_serialization=False)
    with open_checkpoint(path) as ckpt:
        (entry,) = ckpt.entries()
        np.testing.assert_array_equal(ckpt.array(entry), np.arange(6.0, dtype=np.float32))


class Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        # Unpickling this creates the marker file: code runs at load time.
        return (Path.write_text, (Path(self.marker), "pwned"))  # type: ignore[return-value]


@pytest.mark.parametrize("zip_format", [True, False])
def test_malicious_pickle_is_refused_without_running(tmp_path: Path, zip_format: bool) -> None:
    marker = tmp_path / "marker"
    path = str(tmp_path / "evil.pt")
    torch.save(
        {"w": torch.ones(2), "x": Payload(str(marker))},
        path,
        _use_new_zipfile_serialization=zip_format,
    )
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert "arbitrary code" in message and "safetensors" in message and "--unsafe-pickle" in message
    assert not marker.exists()
    # The explicit opt-in loads it (and, as documented, runs the payload).
    with open_checkpoint(path, unsafe_pickle=True) as ckpt:
        assert [e.name for e in ckpt.entries()] == ["w"]
    assert marker.exists()


def test_raw_pickle_file_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "raw.bin"
    path.write_bytes(pickle.dumps(Payload(str(marker))))
    with pytest.raises(CheckpointError):
        open_checkpoint(str(path))
    assert not marker.exists()


def test_bad_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"empty\.pt: the file is empty"):
        open_checkpoint(str(empty))
    junk = tmp_path / "junk.pth"
    junk.write_bytes(os.urandom(64))
    with pytest.raises(CheckpointError, match=r"junk\.pth: not a readable torch.save file"):
        open_checkpoint(str(junk))
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(1000)}, good)
    torn = tmp_path / "torn.pt"
    torn.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(CheckpointError, match=r"torn\.pt: not a readable torch.save file"):
        open_checkpoint(str(torn))
