"""`deadweight.watch` inside DDP ranks: replica divergence, optimizer coverage, a dead rank."""

from __future__ import annotations

import time

import pytest

from tests.distributed import workers_watch as w
from tests.distributed.harness import run_ranks


def _codes(report: dict) -> list[str]:
    return [f["code"] for f in report["findings"]]


def test_healthy_ddp_run_has_identical_replicas_and_one_log_per_rank(tmp_path):
    results = run_ranks(w.ddp_watch, 2, tmp_path, str(tmp_path), None)
    assert set(results) == {0, 1}
    rep = results[0]["report"]
    assert "DW308" not in _codes(rep)
    assert rep["subject"]["distributed"]["complete"] is True
    assert rep["subject"]["distributed"]["world_size"] == 2
    assert results[0]["log"].endswith("run.jsonl")
    assert results[1]["log"].endswith("run.rank1.jsonl")
    assert (tmp_path / "run.jsonl").exists() and (tmp_path / "run.rank1.jsonl").exists()
    # steps 1, 20, 40, 60 were compared; the names once, then 4 float64 per tensor
    assert results[0]["replica_checks"] == [4]
    names_bytes = sum(len(n) + 2 for n in ("body.weight", "body.bias", "head.weight", "head.bias"))
    # 4 checks x 4 tensors x 4 float64, whatever the tensors' sizes
    assert results[0]["replica_bytes"] == [[names_bytes, 4 * 4 * 4 * 8]]


def test_a_replica_changed_on_rank0_is_reported_with_the_ranks(tmp_path):
    results = run_ranks(w.ddp_watch, 2, tmp_path, str(tmp_path), 30)
    rep = results[0]["report"]
    found = [f for f in rep["findings"] if f["code"] == "DW308"]
    assert [f["params"] for f in found] == [["head.weight"]]
    ev = found[0]["evidence"]
    assert ev["first_step"] == 40  # the first watched step after the change at step 31
    assert ev["groups"] == [[0], [1]]
    assert ev["norm_min"] < ev["norm_max"]
    # every rank saw the same divergence
    assert results[1]["report"]["findings"] == rep["findings"]


def test_optimizer_covering_different_parameters_per_rank_in_watch(tmp_path):
    results = run_ranks(w.ddp_watch_optimizer_differs, 2, tmp_path, str(tmp_path))
    rep = results[0]["report"]
    found = [f for f in rep["findings"] if f["code"] == "DW207"]
    assert len(found) == 1
    assert sorted(found[0]["params"]) == ["head.bias", "head.weight"]
    assert found[0]["evidence"]["ranks_not_in_optimizer"] == [1]
    # and so the replicas of head drift apart from the first step
    diverged = sorted(f["params"][0] for f in rep["findings"] if f["code"] == "DW308")
    assert diverged == ["head.bias", "head.weight"]


def test_a_rank_dying_mid_run_leaves_the_others_reports_marked_incomplete(tmp_path):
    start = time.monotonic()
    results = run_ranks(
        w.watch_rank_dies,
        3,
        tmp_path,
        str(tmp_path),
        env={"DEADWEIGHT_COLLECTIVE_TIMEOUT": "5"},
        deadline_s=60,
    )
    assert set(results) == {0, 1}
    for res in results.values():
        rep = res["report"]
        assert rep["subject"]["distributed"]["complete"] is False
        assert rep["subject"]["steps"] == 50  # training went on
        errors = [e for e in rep["subject"]["detector_errors"] if e["detector"] == "ranks"]
        assert len(errors) == 1 and errors[0]["step"] == 40
    assert (tmp_path / "run.jsonl").exists()
    assert time.monotonic() - start < 60


def test_ranks_holding_different_models_are_not_replicas(tmp_path):
    # pipeline stages: different parameters per rank is the design, not DW207 or DW308
    results = run_ranks(w.pipeline_stages, 2, tmp_path, str(tmp_path))
    for res in results.values():
        codes = _codes(res["report"])
        assert "DW207" not in codes and "DW308" not in codes
        assert res["report"]["subject"]["distributed"]["complete"] is True


@pytest.fixture(scope="module")
def replica_groups(tmp_path_factory) -> dict:
    return run_ranks(w.replica_groups, 4, tmp_path_factory.mktemp("groups"), deadline_s=120)


def _divergences(report: dict) -> list[tuple[list[str], list[list[int]], int]]:
    return [
        (f["params"], f["evidence"]["groups"], f["evidence"]["first_step"])
        for f in report["findings"]
        if f["code"] == "DW308"
    ]


def test_ddp_in_two_groups_compares_each_group_within_itself(replica_groups):
    assert set(replica_groups) == {0, 1, 2, 3}
    for rank, res in replica_groups.items():
        # the groups train different replicas: only rank 0's change inside its group
        assert _divergences(res["ddp"]) == [(["head.weight"], [[0], [2]], 20)]
        assert res["ddp"]["subject"]["distributed"]["complete"] is True
        # two groups of 4 tensors, 4 float64 each, at steps 1 and 20; then the
        # diverged copy's checksum from the ranks that hold one
        assert res["ddp_bytes"] == [2 * 2 * 4 * 4 * 8 + (8 if rank in (0, 2) else 0)]


def test_hsdp_compares_each_shard_between_the_ranks_that_hold_it(replica_groups):
    for rank, res in replica_groups.items():
        # rank 0's shard of body.weight against rank 2's; ranks 1 and 3 agree
        assert _divergences(res["hsdp"]) == [(["body.weight"], [[0], [2]], 20)]
        assert res["hsdp"]["subject"]["distributed"]["complete"] is True
        # one group per shard: ranks {0, 2} and {1, 3}
        assert res["hsdp_bytes"] == [2 * 2 * 4 * 4 * 8 + (8 if rank in (0, 2) else 0)]
