"""check and watch on FSDP2 (fully_shard, DTensor parameters), gloo on CPU: the same
findings as in one process, from statistics summed over the ranks' local shards."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.distributed import workers_fsdp_watch as w
from tests.distributed.harness import run_ranks

LAST = "blocks.3.layer_scalar"


def ref_numbers(result: dict) -> dict:
    assert set(result["reference"]) == set(result["measured"])
    return result["reference"]


def _findings(result: dict) -> list[tuple[str, list[str]]]:
    return [(code, params) for code, params, _ in result["findings"]]


@pytest.fixture(scope="module")
def fused_single() -> dict:
    return w.fused_check(0, 1)


# (4, True): HSDP, a (replicate 2, shard 2) mesh: each shard is held by two ranks,
# and `distributed.share_of_sum` must count it once.
MESHES = [(2, False), (3, False), (4, True)]


@pytest.mark.parametrize(("world", "hsdp"), MESHES)
def test_check_on_fsdp2_names_w1_and_g_as_in_one_process(tmp_path, fused_single, world, hsdp):
    results = run_ranks(w.fused_check, world, tmp_path, hsdp, deadline_s=120)
    assert set(results) == set(range(world))
    assert fused_single["findings"][0][:2] == ["DW101", ["l1.weight", "norm.weight"]]
    for res in results.values():
        assert res["dtensor"] is True
        # whole findings, messages included, as in one process and on every rank
        assert res["findings"] == fused_single["findings"]
        dist = res["subject"]["distributed"]
        assert dist["complete"] is True and dist["sharded"] is True
        # the ranks' losses over their slices average to the loss of the whole batch
        assert res["subject"]["loss"] == pytest.approx(fused_single["subject"]["loss"], rel=1e-6)
        assert res["untouched"] is True and res["grads_left"] == []
        # the combined gradient statistics are those of the whole tensors
        assert set(res["measured"]) == set(res["reference"]) == {"l2.weight"}
        for name, ref in res["reference"].items():
            assert res["measured"][name] == pytest.approx(ref, rel=1e-5, abs=1e-9), name


@pytest.fixture(scope="module")
def drift_single() -> dict:
    return w.drift_watch(0, 1)


@pytest.mark.parametrize(("world", "hsdp"), MESHES)
def test_watch_on_fsdp2_reports_the_drifting_scalar_as_in_one_process(
    tmp_path, drift_single, world, hsdp
):
    assert ("DW302", [LAST]) in _findings(drift_single)
    results = run_ranks(
        w.drift_watch, world, tmp_path, str(tmp_path / "run.jsonl"), hsdp, deadline_s=280
    )
    assert set(results) == set(range(world))
    ref = results[0]
    for res in results.values():
        assert res["findings"] == ref["findings"]  # one verdict, on every rank
        assert res["subject"]["distributed"]["complete"] is True
        assert res["subject"]["detector_errors"] == []
    assert _findings(ref) == _findings(drift_single)
    ev, single_ev = ref["evidence"]["DW302"], drift_single["evidence"]["DW302"]
    # rank 0 holds the shape-[1] scalar whole, the others an empty slice (under
    # HSDP rank 2 holds rank 0's replica)
    holders = [0, 2] if hsdp else [0]
    for r in range(world):
        assert len(results[r]["last_scalar_local"]) == (1 if r in holders else 0), r
    assert ev["last_value"] == pytest.approx(results[0]["last_scalar_local"][0])
    assert ev["steps"] == single_ev["steps"] == w.DRIFT_STEPS
    # rounding differs between the runs, and Adam turns the scalar's noise gradient
    # into full steps, so its path differs in detail but not in kind
    assert ev["same_sign_fraction"] >= 0.6 and ev["grad_ratio"] < 1e-3
    assert abs(ev["last_value"] - ev["first_value"]) > 0.1
    # whole-parameter numbers from the shards, against the whole tensors
    large = [n for n, m in results[0]["measured"].items() if m["drift"] is None]
    assert any(results[0]["measured"][n]["update_norm"] is not None for n in large)
    for name, ref in ref_numbers(results[0]).items():
        got = results[0]["measured"][name]
        assert got["param_norm"] == pytest.approx(ref["param_norm"], rel=1e-5), name
        assert got["grad_rms"] == pytest.approx(ref["grad_rms"], rel=1e-5), name
        if ref["value"] is not None:  # tiny parameters, put back together in rank order
            assert got["value"] == pytest.approx(ref["value"], rel=1e-6), name
        if got["update_norm"] is not None:  # the last step's update (copied or small)
            assert got["update_norm"] == pytest.approx(ref["update_norm"], rel=1e-4), name
        if got["drift"] is not None:  # one norm of the whole change: exact
            assert got["drift"] == pytest.approx(ref["drift"], rel=1e-5), name
    # the combining traffic: a few float64 per parameter tensor and rank per watched step
    watched = w.DRIFT_STEPS // 20 + 1
    per_step = results[0]["shard_bytes"][0] / watched
    assert per_step < world * 29 * 16 * 8  # 29 parameter tensors, well under 16 numbers each


def test_a_rank_that_never_watches_turns_into_an_error_not_a_hang(tmp_path):
    start = time.monotonic()
    results = run_ranks(
        w.watch_one_rank_missing,
        2,
        tmp_path,
        env={"DEADWEIGHT_COLLECTIVE_TIMEOUT": "5"},
        deadline_s=120,
    )
    assert set(results) == {0, 1}
    assert results[0]["trained"] == [25]  # training went on
    errors = results[0]["errors"]
    assert {e["detector"] for e in errors} == {"record", "ranks"}, errors
    assert all("failed within 5 s" in e["message"] for e in errors), errors
    assert time.monotonic() - start < 120


def test_a_rank_dying_under_fsdp2_leaves_the_survivors_reports_marked_incomplete(tmp_path):
    start = time.monotonic()
    results = run_ranks(
        w.rank_dies,
        3,
        tmp_path,
        str(tmp_path),
        env={"DEADWEIGHT_COLLECTIVE_TIMEOUT": "5", "DW_TEST_PG_TIMEOUT": "10"},
        deadline_s=90,
    )
    assert set(results) == {0, 1}  # rank 2 died
    for res in results.values():
        assert res["error"] is not None  # the survivors' training stopped with an error
        assert res["trained"] == 25
        rep = res["report"]
        # as of step 20, the last watched step the ranks combined; closing the
        # watch could not combine steps 21-25 with the dead rank's shards
        assert rep["subject"]["steps"] == 20
        assert rep["subject"]["end"] == "closed"
        assert rep["subject"]["distributed"]["complete"] is False
        errors = rep["subject"]["detector_errors"]
        assert errors and all("CollectiveError" in e["message"] for e in errors), errors
    # each survivor wrote its log, closed with the watch; the report rebuilt from it
    # is marked incomplete too
    assert results[0]["log"].endswith("run.jsonl") and (tmp_path / "run.jsonl").exists()
    for log in ("run.jsonl", "run.rank1.jsonl"):
        rebuilt = subprocess.run(
            [sys.executable, "-m", "deadweight", "report", str(tmp_path / log), "--format", "json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert rebuilt.returncode in (0, 1), rebuilt.stderr
        subject = json.loads(rebuilt.stdout)["subject"]
        assert subject["distributed"]["complete"] is False and subject["end"] == "closed"
    assert time.monotonic() - start < 60


def test_fsdp2_mixed_precision_check_finds_the_scalar_watch_stays_quiet(tmp_path):
    """bf16 compute over fp32 sharded parameters: check (after an evaluation forward
    under no_grad, which leaves the root gathered) proves the cancellation through the
    bf16 unsharded copies; watch stays quiet, since the fp32 copy only random-walks."""
    (tmp_path / "check").mkdir()
    (tmp_path / "watch").mkdir()
    checked = run_ranks(w.drift_check, 2, tmp_path / "check", None, True, deadline_s=120)
    for res in checked.values():
        codes = {code for code, params in _findings(res) if params == [LAST]}
        assert {"DW104", "DW203", "DW204"} <= codes, res["findings"]
        entry = res["evidence"]["DW104"]["params"][LAST]
        assert entry["confirmed"] is True and entry["mechanism"][0]["module"] == "final_norm"
        assert res["untouched"] is True
    assert checked[0]["findings"] == checked[1]["findings"]
    watched = run_ranks(w.drift_watch, 2, tmp_path / "watch", None, False, True, deadline_s=280)
    for res in watched.values():
        # bf16 compute turns the cancelled scalar's gradient into rounding noise of
        # random sign: Adam walks the fp32 copy at random rather than steadily, and
        # its updates are kept (fp32), so neither DW302 nor DW304 can honestly fire.
        flagged = {code for code, params in _findings(res) if LAST in params}
        assert not flagged & {"DW302", "DW304"}, res["findings"]
