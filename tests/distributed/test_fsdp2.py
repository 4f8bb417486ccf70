"""FSDP2 (fully_shard, DTensor parameters) on gloo/CPU: checkpoints and the entry points."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from tests.distributed import workers_fsdp as w
from tests.distributed.harness import run_ranks


def _inspect(path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", "inspect", path, "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dcp_checkpoint_written_by_fsdp2_is_read_back_whole_by_inspect(tmp_path):
    results = run_ranks(w.fsdp2_checkpoint, 2, tmp_path, str(tmp_path))
    assert set(results) == {0, 1}
    assert results[0]["sharded"] is True
    assert results[0]["local_rows"]["layers.0.weight"] == 8  # half of 16 rows each
    ckpt = tmp_path / "ckpt"
    shards = sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))
    assert len(shards) == 2  # one file per rank
    result = _inspect(str(ckpt))
    assert result.returncode in (0, 1), result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)["subject"]["tensors"][str(ckpt)]}
    full = results[0]["full"]
    assert set(rows) == {f"model.{k}" for k in full}
    for name, ref in full.items():
        row = rows[f"model.{name}"]
        assert row["shape"] == ref["shape"]
        assert math.isclose(row["mean"], ref["mean"], rel_tol=1e-5, abs_tol=1e-7)
        assert row["absmax"] == ref["absmax"]

    os.remove(ckpt / shards[1])
    broken = _inspect(str(ckpt))
    assert broken.returncode == 2
    assert f"shard file(s) missing from the DCP directory: {shards[1]}" in broken.stderr


def test_watch_check_and_zero_code_watching_run_on_fsdp2_and_agree_across_ranks(tmp_path):
    results = run_ranks(w.fsdp2_entry_points, 2, tmp_path, str(tmp_path), deadline_s=120)
    assert set(results) == {0, 1}
    for key in ("watch", "check", "watch_all"):
        assert results[0][key]["findings"] == results[1][key]["findings"], key
    for res in results.values():
        assert res["watch"]["subject"]["steps"] == 5
        assert res["watch"]["subject"]["detector_errors"] == []
        assert res["watch_all"]["subject"]["steps"] == 3
        assert res["watch_all"]["subject"]["detector_errors"] == []
        assert res["check"]["subject"]["distributed"]["sharded"] is True
        # a healthy model: every parameter gets a gradient
        assert not [f for f in res["check"]["findings"] if f["code"].startswith("DW10")]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", *args, "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_diff_and_trend_read_a_pair_of_fsdp2_dcp_checkpoints(tmp_path):
    run_ranks(w.fsdp2_pair, 2, tmp_path, str(tmp_path), deadline_s=120)
    a, b = str(tmp_path / "step0"), str(tmp_path / "step1")
    diff = _cli("diff", a, b)
    assert diff.returncode in (0, 1), diff.stderr
    subject = json.loads(diff.stdout)["subject"]
    text = json.dumps(subject)
    # whole tensors (16 rows), not one rank's shard of 8
    assert "model.layers.0.weight" in text and "model.out.bias" in text
    trend = _cli("trend", a, b)
    assert trend.returncode in (0, 1), trend.stderr
    assert "model.out.bias" in trend.stdout  # the one single-element tensor, in both
