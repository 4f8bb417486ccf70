"""`deadweight inspect`, `diff` and `trend`, end to end in subprocesses: text and JSON
output, exit codes 0/1/2, unreadable files among good ones, nothing written beside them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deadweight.report import SCHEMA_VERSION

TIMEOUT = 300  # generous: shared CI machines
ENV = {**os.environ, "COLUMNS": "200"}  # rich wraps at 80 columns without a terminal

PET = """
import torch


class RunConfig:  # saved beside the weights: loading it runs this module's code
    def __init__(self, lr):
        self.lr = lr
"""


def dw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env or ENV,
    )


def listing(directory: Path) -> list[tuple[str, int, int]]:
    return sorted(
        (str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
    )


def weights(seed: int, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"layers.{i}.mlp.weight": torch.randn(16, 16, generator=gen) for i in range(3)}
    return {**tensors, **extra}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """Four saves of a run whose layers.0.gate rises at every save."""
    directory = tmp_path / "run"
    directory.mkdir()
    for k, step in enumerate([0, 100, 200, 300]):
        gate = torch.tensor([1.0 + 0.5 * k])
        save_file(weights(k, **{"layers.0.gate": gate}), directory / f"step-{step}.safetensors")
    return directory


def test_inspect_healthy_text_and_json(run_dir: Path) -> None:
    before = listing(run_dir)
    text = dw("inspect", run_dir / "step-0.safetensors")
    assert text.returncode == 0, text.stderr
    assert "layers.2.mlp.weight" in text.stdout and "no findings" in text.stdout
    assert "16×16" in text.stdout
    result = dw("inspect", run_dir, "--format", "json", "--scheme", "none")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kind"] == "inspect" and data["schema_version"] == SCHEMA_VERSION
    assert data["subject"]["scheme"] == "none"
    assert len(data["subject"]["checkpoints"]) == 4
    rows = data["subject"]["tensors"][str(run_dir / "step-300.safetensors")]
    assert {r["name"] for r in rows} == {*weights(0), "layers.0.gate"}
    assert listing(run_dir) == before  # nothing written beside the checkpoints


def test_inspect_findings_exit_1(tmp_path: Path) -> None:
    bad = torch.ones(8)
    bad[3] = math.nan
    path = tmp_path / "model.safetensors"
    save_file({"w": bad}, path)
    result = dw("inspect", path)
    assert result.returncode == 1, result.stderr
    assert "DW404" in result.stdout and "checkpoint-non-finite" in result.stdout


def test_unreadable_file_among_good_ones(run_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    good = run_dir / "step-0.safetensors"
    result = dw("inspect", good, broken, "--format", "json")
    assert result.returncode == 2
    data = json.loads(result.stdout)
    assert data["subject"]["checkpoints"] == [str(good)]  # the good one is still reported
    errors = [line for line in result.stderr.splitlines() if line.startswith("deadweight: error:")]
    assert len(errors) == 1 and f"deadweight: error: {broken}: " in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def test_directory_without_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("nothing here")
    result = dw("trend", tmp_path)
    assert result.returncode == 2
    assert f"deadweight: error: {tmp_path}: holds no checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


def test_threads_change_nothing_but_speed(run_dir: Path) -> None:
    path = run_dir / "step-300.safetensors"
    outputs = []
    for threads in ("1", "3"):
        result = dw("inspect", path, "--format", "json", "--threads", threads)
        assert result.returncode == 0, result.stderr
        outputs.append(json.loads(result.stdout)["subject"]["tensors"])
    assert outputs[0] == outputs[1]
    bad = dw("inspect", path, "--threads", "0")
    assert bad.returncode == 2 and "threads must be at least 1" in bad.stderr


def test_bogus_scheme_lists_the_accepted_forms(run_dir: Path) -> None:
    result = dw("inspect", run_dir / "step-0.safetensors", "--scheme", "bogus")
    assert result.returncode == 2
    assert "unknown quantization scheme 'bogus'" in result.stderr
    assert "accepted:" in result.stderr and "int4-group128" in result.stderr


def test_diff_different_names(tmp_path: Path) -> None:
    a, b = tmp_path / "step-0.safetensors", tmp_path / "step-1.safetensors"
    shared = torch.randn(4, 4)
    save_file({"kept": shared, "moved": torch.ones(3), "old.weight": torch.ones(2)}, a)
    save_file({"kept": shared, "moved": torch.ones(3) * 2, "new.weight": torch.ones(2)}, b)
    text = dw("diff", a, b)
    assert text.returncode == 1, text.stderr  # DW401: `kept` did not change
    assert "DW401" in text.stdout
    assert "added: new.weight" in text.stdout and "removed: old.weight" in text.stdout
    result = dw("diff", a, b, "--format", "json", "--top", "1")
    data = json.loads(result.stdout)
    assert data["kind"] == "diff" and data["schema_version"] == SCHEMA_VERSION
    s = data["subject"]
    assert s["added"] == ["new.weight"] and s["removed"] == ["old.weight"]
    assert [m["name"] for m in s["top_movers"]] == ["moved"]


def test_diff_eager_against_compiled_says_how_names_matched(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    a, b = tmp_path / "eager.safetensors", tmp_path / "compiled.safetensors"
    save_file({n: t.clone() for n, t in model.state_dict().items()}, a)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the rest never learned: DW401 names them unwrapped
    save_file({n: t.clone() for n, t in torch.compile(model).state_dict().items()}, b)
    text = dw("diff", a, b)
    assert text.returncode == 1, text.stderr
    assert (
        "matched names after removing the prefix `_orig_mod.` (torch.compile) from b's 6 names"
        in text.stdout
    )
    assert "5 of 5 floating-point" not in text.stdout and "5 of 6 floating-point" in text.stdout
    assert "added:" not in text.stdout and "DW406" not in text.stdout
    data = json.loads(dw("diff", a, b, "--format", "json").stdout)
    assert data["subject"]["compared"] == 6 and data["subject"]["matched"] == 6
    assert data["subject"]["renamed"][0]["prefix"] == "_orig_mod."
    [dw401] = data["findings"]
    assert "2.weight" in dw401["params"] and not any("_orig_mod" in p for p in dw401["params"])


def test_diff_of_unrelated_checkpoints_is_not_silent(tmp_path: Path) -> None:
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"shared": torch.ones(2), **{f"enc.{i}.weight": torch.ones(3) for i in range(4)}}, a)
    save_file(
        {"shared": torch.ones(2) * 2, **{f"dec.{i}.weight": torch.ones(3) for i in range(4)}}, b
    )
    result = dw("diff", a, b)
    assert result.returncode == 1, result.stderr
    assert "DW406" in result.stdout and "no findings" not in result.stdout


def test_diff_unreadable_side(tmp_path: Path) -> None:
    good = tmp_path / "step-0.safetensors"
    save_file({"w": torch.ones(2)}, good)
    result = dw("diff", good, tmp_path / "missing.safetensors")
    assert result.returncode == 2
    assert f"deadweight: error: {tmp_path / 'missing.safetensors'}" in result.stderr


def test_trend_text_and_json(run_dir: Path) -> None:
    before = listing(run_dir)
    text = dw("trend", run_dir)
    assert text.returncode == 1, text.stderr
    assert "DW405" in text.stdout and "layers.0.gate rose" in text.stdout
    assert "steps 0..300" in text.stdout
    glob = dw("trend", str(run_dir / "step-*.safetensors"), "--format", "json")
    assert glob.returncode == 1, glob.stderr
    data = json.loads(glob.stdout)
    assert data["kind"] == "trend" and data["schema_version"] == SCHEMA_VERSION
    assert data["subject"]["steps"] == [0, 100, 200, 300]
    (finding,) = data["findings"]
    assert finding["evidence"]["rate_per_step"] == pytest.approx(1.5 / 300)
    assert listing(run_dir) == before


def test_optimizer_summary_in_text(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt-1.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    result = dw("inspect", path)
    assert result.returncode == 0, result.stderr
    assert "optimizer state" in result.stdout and "exp_avg_sq" in result.stdout
    assert "0.0003" in result.stdout
    assert "{'key'" not in result.stdout  # not a raw dict in the header
    assert "model.weight" in result.stdout and "optimizer.state" not in result.stdout


def test_unsafe_pickle_is_opt_in(tmp_path: Path) -> None:
    (tmp_path / "pets.py").write_text(PET)
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV.get("PYTHONPATH", "")])}
    path = tmp_path / "pet.pt"
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"import torch, pets; torch.save({{'model': {{'w': torch.ones(3)}}, "
            f"'config': pets.RunConfig(0.1)}}, {str(path)!r})",
        ],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=TIMEOUT,
    )
    refused = dw("inspect", path, env=env)
    assert refused.returncode == 2
    assert f"deadweight: error: {path}: " in refused.stderr
    assert "--unsafe-pickle" in refused.stderr
    allowed = dw("inspect", path, "--unsafe-pickle", "--format", "json", env=env)
    assert allowed.returncode == 0, allowed.stderr
    rows = json.loads(allowed.stdout)["subject"]["tensors"][str(path)]
    assert [r["name"] for r in rows] == ["model.w"]


def _npz_claiming(path: Path, shape: str) -> Path:
    """An .npz whose one member's .npy header claims `shape` over 16 bytes of data."""
    import struct
    import zipfile

    text = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}".encode()
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            "w.npy", b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + bytes(16)
        )
    return path


def _bad_inputs(tmp_path: Path) -> list[Path]:
    """One of every kind of bad input issue 20 reported, each a separate file."""
    import struct

    bad: list[Path] = []
    for suffix in (".safetensors", ".npz", ".index.json", ".pt"):
        fifo = tmp_path / f"fifo{suffix}"
        os.mkfifo(fifo)  # hung forever, waiting for a writer
        bad.append(fifo)
    for suffix in (".npz", ".index.json"):
        zero = tmp_path / f"zero{suffix}"
        zero.symlink_to("/dev/zero")  # grew without bound
        bad.append(zero)
    for name, shape in (
        ("neg", "(-5, 3)"),
        ("huge", f"({2**40}, {2**40})"),
        ("over", f"({10**30},)"),
    ):
        bad.append(_npz_claiming(tmp_path / f"{name}.npz", shape))  # tracebacks, or exit 2 unnamed
    digits = tmp_path / "digits.safetensors"
    header = (
        b'{"x":{"dtype":"F32","shape":['
        + b",".join([b"9" * 4000] * 1000)
        + b'],"data_offsets":[0,4]}}'
    )
    digits.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))  # minutes of CPU
    bad.append(digits)
    nested = tmp_path / "nested.safetensors"
    header = b'{"x":{"dtype":"F32","shape":[' + b"{}," * 1_000_000 + b'{}],"data_offsets":[0,4]}}'
    nested.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))  # 30x its size
    bad.append(nested)
    index = tmp_path / "self.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "self.index.json"}}))  # a 12 KB error
    bad.append(index)
    return bad


def test_inspect_names_every_bad_file_once_and_reports_the_good_one(tmp_path: Path) -> None:
    good = tmp_path / "good" / "model.safetensors"
    good.parent.mkdir()
    save_file({"layers.0.mlp.weight": torch.randn(8, 8)}, good)
    bad = _bad_inputs(tmp_path)
    result = dw("inspect", good, *bad, "--scheme", "none")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "layers.0.mlp.weight" in result.stdout  # the good file's table
    errors = [line for line in result.stderr.splitlines() if line.startswith("deadweight: error: ")]
    for path in bad:
        named = [line for line in errors if line.startswith(f"deadweight: error: {path}: ")]
        assert len(named) == 1, (path, errors)
        assert len(named[0]) < 500, named[0]
    assert len(errors) == len(bad)


def test_a_glob_and_a_directory_holding_fifos_do_not_hang(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    save_file({"w": torch.randn(4, 4)}, run / "step-1.safetensors")
    os.mkfifo(run / "step-2.safetensors")
    os.mkfifo(run / "step-3.npz")
    for inputs in ([run], [str(run / "step-*")]):
        result = dw("trend", *inputs)  # TIMEOUT guards a hang
        assert "Traceback" not in result.stderr
        assert result.returncode in (0, 2), result.stderr
        assert "step-1.safetensors" not in result.stderr
