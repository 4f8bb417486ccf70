"""`deadweight.check` inside DDP ranks (gloo, CPU): the same findings as one process, plus rank disagreements."""

from __future__ import annotations

import time

import torch.nn.functional as F

import deadweight
from deadweight.demos import fused_rmsnorm
from tests.distributed import workers_check as w
from tests.distributed.harness import run_ranks


def _codes(report: dict) -> dict[str, list[list[str]]]:
    out: dict[str, list[list[str]]] = {}
    for f in report["findings"]:
        out.setdefault(f["code"], []).append(sorted(f["params"]))
    return out


def test_fused_rmsnorm_under_ddp_names_w1_and_g_like_one_process(tmp_path):
    results = run_ranks(w.fused_under_ddp, 2, tmp_path)
    assert set(results) == {0, 1}
    setup = fused_rmsnorm.make(diff=False)
    single = deadweight.check(setup.model, setup.loss, setup.optimizer).to_dict()
    for rank, res in results.items():
        rep = res["report"]
        # DDP trained with find_unused_parameters=True and raised nothing, and w1 never moved
        assert res["w1_moved"] == 0.0
        assert _codes(rep) == _codes(single), rank
        no_grad = rep["findings"][[f["code"] for f in rep["findings"]].index("DW101")]
        assert sorted(no_grad["params"]) == ["l1.weight", "norm.weight"]
        assert "ranks" not in no_grad["evidence"]  # every rank found it
        assert rep["subject"]["distributed"] == {
            "rank": rank,
            "world_size": 2,
            "backend": "gloo",
            "timeout_s": 300.0,
            "complete": True,
        }
    # every rank reports the same thing
    assert results[0]["report"]["findings"] == results[1]["report"]["findings"]


def test_parameter_used_only_on_rank0_is_reported_with_its_ranks(tmp_path):
    results = run_ranks(w.rank0_branch, 2, tmp_path)
    rep = results[0]["report"]
    dw108 = [f for f in rep["findings"] if f["code"] == "DW108"]
    assert len(dw108) == 1
    assert sorted(dw108[0]["params"]) == ["side.bias", "side.weight"]
    assert dw108[0]["evidence"]["ranks_with_gradient"] == [0]
    assert dw108[0]["evidence"]["ranks_without_gradient"] == [1]
    # rank 1's own explanation comes along, marked with its rank
    dw101 = [f for f in rep["findings"] if f["code"] == "DW101"]
    assert [f["evidence"]["ranks"] for f in dw101] == [[1]]
    assert "on rank 1 of 2 only" in dw101[0]["message"]
    assert results[1]["report"]["findings"] == rep["findings"]


def test_healthy_ddp_model_on_three_ranks_has_no_findings(tmp_path):
    results = run_ranks(w.healthy, 3, tmp_path)
    assert set(results) == {0, 1, 2}
    for res in results.values():
        assert res["report"]["findings"] == []
        assert res["report"]["subject"]["distributed"]["world_size"] == 3


def test_a_training_group_with_a_backend_per_device_works_alike(tmp_path):
    # deadweight talks over a gloo group of its own, whatever the training group uses
    results = run_ranks(w.rank0_branch, 2, tmp_path, env={"DW_TEST_BACKEND": "cpu:gloo,cuda:gloo"})
    for res in results.values():
        rep = res["report"]
        assert rep["subject"]["distributed"]["backend"] == "cpu:gloo,cuda:gloo"
        assert [f["code"] for f in rep["findings"] if f["code"] == "DW108"] == ["DW108"]


def test_optimizer_covering_different_parameters_per_rank(tmp_path):
    results = run_ranks(w.optimizer_differs, 2, tmp_path)
    rep = results[0]["report"]
    dw207 = [f for f in rep["findings"] if f["code"] == "DW207"]
    assert len(dw207) == 1
    assert sorted(dw207[0]["params"]) == ["net.2.bias", "net.2.weight"]
    assert dw207[0]["evidence"]["ranks_not_in_optimizer"] == [1]


def test_a_dead_rank_leaves_the_others_reports_marked_incomplete(tmp_path):
    start = time.monotonic()
    results = run_ranks(
        w.rank_dies, 3, tmp_path, env={"DEADWEIGHT_COLLECTIVE_TIMEOUT": "5"}, deadline_s=60
    )
    assert set(results) == {0, 1}
    for res in results.values():
        dist_info = res["report"]["subject"]["distributed"]
        assert dist_info["complete"] is False
        assert "another rank has probably died" in dist_info["error"]
    assert time.monotonic() - start < 60


def test_a_ddp_model_without_a_process_group_is_a_clear_error(tmp_path):
    results = run_ranks(w.not_initialised, 2, tmp_path)
    for res in results.values():
        assert res["error"] == "InputError"
        assert "torch.distributed is not initialised" in res["message"]


def test_single_process_check_is_unchanged():
    setup = fused_rmsnorm.make(diff=False)
    rep = deadweight.check(setup.model, lambda: F.mse_loss(setup.model(setup.x), setup.y))
    assert "distributed" not in rep.subject
