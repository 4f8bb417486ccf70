from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import deadweight
from deadweight.checkpoints.readers import CheckpointError, open_checkpoint


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


# --- hostile and unusual files: bounded work, clear errors (issue 20) ---------------------

TIMEOUT = 300  # generous: shared CI machines; the fixed code takes seconds


def _child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter, so that a regression (a hang, gigabytes) cannot take
    the test run down with it."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_broadcast_tensor_is_listed_not_materialised(tmp_path: Path) -> None:
    # 1.4 KB on disk claiming 2^31 float32 (8 GiB): a stride-0 view of one stored element.
    path = tmp_path / "e.pt"
    torch.save({"w": torch.zeros(1).expand(2**16, 2**15), "b": torch.ones(3)}, path)
    assert path.stat().st_size < 4096
    result = _child(
        """
        import json, resource, sys
        import deadweight
        # Address space: what the imports took plus 4 GiB, half of what materialising needs.
        with open("/proc/self/status") as fh:
            vm = next(int(l.split()[1]) * 1024 for l in fh if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 30), resource.RLIM_INFINITY))
        report = deadweight.inspect_checkpoints([sys.argv[1]], threads=1)
        rows = {r["name"]: r for r in report.subject["tensors"][sys.argv[1]]}
        print(json.dumps({"rows": rows, "warnings": report.subject["warnings"],
                          "errors": report.subject["errors"]}))
        """,
        str(path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert out["errors"] == []
    w, b = out["rows"]["w"], out["rows"]["b"]
    assert (w["shape"], w["dtype"], w["analysed"]) == ([2**16, 2**15], "float32", False)
    assert b["analysed"] and b["min"] == b["max"] == 1.0  # the rest of the file is measured
    (warning,) = out["warnings"]
    assert warning.startswith(f"{path}: w: a broadcast (expanded, stride-0) view")
    assert "not measured" in warning


def test_small_broadcast_is_measured_exactly(tmp_path: Path) -> None:
    # Within one read chunk the repeats are read: the statistics of the tensor as it is.
    base = torch.tensor([1.0, -2.0, 0.0, 3.5])
    path = str(tmp_path / "small.pt")
    torch.save({"w": base.expand(5, 4), "v": base[:3].unsqueeze(1).expand(3, 6)}, path)
    report = deadweight.inspect_checkpoints([path], scheme=None)
    assert report.subject["warnings"] == []
    rows = {r["name"]: r for r in report.subject["tensors"][path]}
    for name, want in (("w", base.expand(5, 4)), ("v", base[:3].unsqueeze(1).expand(3, 6))):
        values = want.contiguous().double().numpy()
        row = rows[name]
        assert row["analysed"] and row["numel"] == values.size
        assert (row["min"], row["max"], row["zeros"]) == (
            values.min(),
            values.max(),
            int((values == 0).sum()),
        )
        assert math.isclose(row["mean"], values.mean(), rel_tol=1e-6)
        assert math.isclose(row["std"], values.std(), rel_tol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(50, 40).t(),  # rows longer than a chunk
        lambda: torch.randn(3, 4, 5).permute(2, 0, 1),  # a row of 12 > 7: per sub-row
        lambda: torch.randn(6, 9)[::2, 1::3],  # strided slices
    ],
)
def test_non_contiguous_view_in_exact_chunks(tmp_path: Path, make: Any) -> None:
    tensor = make()
    assert not tensor.is_contiguous()
    path = str(tmp_path / "view.pt")
    torch.save({"t": tensor}, path)
    with open_checkpoint(path) as ckpt:
        (entry,) = ckpt.entries()
        chunks = [c.copy() for c in ckpt.chunks(entry, max_bytes=7 * 4)]
    sizes = [c.size for c in chunks]
    assert sizes[:-1] == [7] * (len(sizes) - 1) and 0 < sizes[-1] <= 7
    np.testing.assert_array_equal(np.concatenate(chunks), tensor.contiguous().numpy().ravel())


def _deep(depth: int) -> object:
    value: object = torch.ones(2)
    for _ in range(depth):
        value = {"a": [value]}
    return value


def test_deep_nesting_is_a_clear_error(tmp_path: Path) -> None:
    path = str(tmp_path / "deep.pt")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(50_000)  # only to write the file: torch.save recurses
    try:
        torch.save(_deep(3000), path)
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    assert (
        str(info.value) == f"{path}: nests containers more than 1000 levels deep: not a state dict"
    )
    shallow = str(tmp_path / "shallow.pt")
    torch.save(_deep(200), shallow)  # deeper than any real state dict, still read
    with open_checkpoint(shallow) as ckpt:
        (entry,) = ckpt.entries()
        assert entry.name == ".".join(["a.0"] * 200)


def test_shared_and_cyclic_containers_cost_what_they_store(tmp_path: Path) -> None:
    # A few hundred bytes of pickle memo: 2^64 paths to one tensor if walked as a tree.
    shared = str(tmp_path / "shared.pt")
    value: object = [torch.ones(2)]
    for _ in range(64):
        value = [value, value]
    torch.save(value, shared)
    cyclic = str(tmp_path / "cyclic.pt")
    loop: list[object] = [torch.zeros(3)]
    loop.append(loop)
    torch.save({"loop": loop}, cyclic)
    result = _child(
        """
        import sys
        from deadweight.checkpoints.readers import open_checkpoint
        for path in sys.argv[1:]:
            with open_checkpoint(path) as ckpt:
                print(*[e.name for e in ckpt.entries()])
        """,
        shared,
        cyclic,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [".".join(["0"] * 65), "loop.0"]


def test_tied_weights_keep_both_names(tmp_path: Path) -> None:
    weight = torch.randn(4, 3)
    path = str(tmp_path / "tied.pt")
    torch.save({"embed.weight": weight, "lm_head.weight": weight}, path)
    with open_checkpoint(path) as ckpt:
        assert [e.name for e in ckpt.entries()] == ["embed.weight", "lm_head.weight"]


def test_odd_keys_and_numbers_do_not_break_listing(tmp_path: Path) -> None:
    path = str(tmp_path / "odd.pt")
    # float() overflows on it (weights_only reads ints of up to 2040 bits: LONG1, not LONG4)
    big = 2**2000
    torch.save(
        {
            big: torch.ones(1),
            "opt": {"state": {0: {"step": big, big: torch.ones(1)}}, "param_groups": [{"lr": big}]},
        },
        path,
    )
    with open_checkpoint(path) as ckpt:
        assert [e.name for e in ckpt.entries()] == ["<2001-bit int>"]
        assert ckpt.optimizer is not None
        assert ckpt.optimizer["step"] is None and ckpt.optimizer["param_groups"][0]["lr"] is None


def test_unsafe_pickle_runs_only_what_needs_it_and_says_so(tmp_path: Path) -> None:
    from deadweight.checkpoints.readers.notes import collecting_notes

    safe = str(tmp_path / "safe.pt")
    torch.save({"w": torch.ones(2)}, safe)
    marker = tmp_path / "marker"
    evil = str(tmp_path / "evil.pt")
    torch.save({"w": torch.ones(2), "x": Payload(str(marker))}, evil)
    with collecting_notes() as notes:
        with open_checkpoint(safe, unsafe_pickle=True) as ckpt:
            assert ckpt.notes == [] and not ckpt.ran_pickle  # type: ignore[attr-defined]
        assert notes == []
        with open_checkpoint(evil, unsafe_pickle=True) as ckpt:
            assert ckpt.ran_pickle  # type: ignore[attr-defined]
            assert ckpt.notes == [  # type: ignore[attr-defined]
                f"{evil}: --unsafe-pickle ran this file's pickle (any code in it has run)"
            ]
    assert notes == [f"{evil}: --unsafe-pickle ran this file's pickle (any code in it has run)"]
    assert marker.exists()


# --- files that are not torch.save files: what they are, in words (issue 35) --------------


def test_a_raw_pickle_says_what_it_is_and_the_two_ways_forward(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "model.bin"
    state = {"w": torch.arange(4.0), "x": Payload(str(marker))}
    path.write_bytes(pickle.dumps(state, protocol=4))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(path))
    message = str(info.value)
    assert "a raw Python pickle (protocol 4, written by pickle.dump" in message
    assert "torch._utils._rebuild_tensor_v2" in message and "pathlib" in message
    assert "no code from it ran" in message
    assert "--unsafe-pickle" in message and "safetensors.torch.save_file" in message
    assert "Unsupported operand" not in message
    assert not marker.exists()
    # the explicit opt-in loads a trusted raw pickle, and says it ran
    path.write_bytes(pickle.dumps({"w": torch.arange(4.0)}, protocol=2))
    with open_checkpoint(str(path), unsafe_pickle=True) as ckpt:
        (entry,) = ckpt.entries()
        np.testing.assert_array_equal(ckpt.array(entry), np.arange(4.0, dtype=np.float32))
        assert ckpt.ran_pickle  # type: ignore[attr-defined]


def test_a_legacy_file_of_any_protocol_is_told_from_a_raw_pickle(tmp_path: Path) -> None:
    from deadweight.checkpoints.readers.file_kind import sniff

    for protocol in (2, 4):
        path = tmp_path / f"legacy{protocol}.pt"
        torch.save(
            {"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False,
            pickle_protocol=protocol,
        )  # fmt: skip
        assert sniff(str(path)).kind == "torch-legacy"
    raw = tmp_path / "raw.pt"
    raw.write_bytes(pickle.dumps({"w": 1}, protocol=4))
    assert sniff(str(raw)).kind == "pickle"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 12\n", "git lfs pull"),
        (b"<!DOCTYPE html><html><body>404</body></html>", "an HTML page"),
        (b"GGUF\x03\x00\x00\x00" + bytes(64), "a GGUF file"),
        (b"\x93NUMPY\x01\x00" + bytes(64), "a NumPy .npy array"),
        (b"\x1f\x8b\x08\x00" + bytes(64), "gzip-compressed"),
        (len(b'{"a":1}').to_bytes(8, "little") + b'{"a":1}', "rename it to .safetensors"),
    ],
)
def test_other_files_say_what_they_are(tmp_path: Path, content: bytes, said: str) -> None:
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(path))
    assert said in str(info.value) and "Nothing in it was run" in str(info.value)
