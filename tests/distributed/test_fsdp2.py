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


def test_watch_and_check_refuse_fsdp2_models_clearly_without_hanging(tmp_path):
    results = run_ranks(w.fsdp2_refused, 2, tmp_path, str(tmp_path), deadline_s=60)
    assert set(results) == {0, 1}
    for res in results.values():
        assert "watch does not support sharded (FSDP2 / DTensor) parameters" in res["watch"]
        assert "check() on an FSDP2 (fully_shard) model is not supported" in res["check"]
        assert len(res["watch_all"]) == 1
        assert "left unwatched" in res["watch_all"][0]
