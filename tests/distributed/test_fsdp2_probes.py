"""The functional probes under FSDP2: every rank re-runs the loss with the sharded
parameters changed in place, and all ranks judge by the mean of their losses, so
`check` confirms a parameter the loss ignores as it does in one process."""

from __future__ import annotations

import time

import pytest

from tests.distributed import workers_fsdp_watch as w
from tests.distributed.harness import run_ranks

LAST = "blocks.3.layer_scalar"


def _codes_and_params(result: dict) -> list[tuple[str, list[str]]]:
    return [(code, params) for code, params, _ in result["findings"]]


def test_check_on_fsdp2_confirms_the_cancelled_scalar_as_in_one_process(tmp_path):
    single = w.drift_check(0, 1)
    assert ("DW104", [LAST]) in _codes_and_params(single)
    results = run_ranks(w.drift_check, 2, tmp_path, deadline_s=120)
    assert set(results) == {0, 1}
    for res in results.values():
        assert _codes_and_params(res) == _codes_and_params(single)
        assert res["subject"]["distributed"]["complete"] is True
        assert res["subject"]["distributed"]["note"] is None  # the probes ran
        # the same probes on every rank: the checked run and the x10 and x100 points;
        # one process settles it on the op's output at x10
        assert res["calls"] == 3 and single["calls"] == 2
        ev, ref = (
            res["evidence"]["DW104"]["params"][LAST],
            single["evidence"]["DW104"]["params"][LAST],
        )
        # FSDP2 confirms on the loss (the structure pass is off there); one process
        # on the cancelling op's own output
        assert ev["probe"] == "x10"
        assert ref["probe"] in ("x10", "x10, x100") and ref["confirmed"] is True
        # scaling the scalar moved the whole batch's loss by rounding noise only
        assert ev["relative_loss_change"] < 1e-5
        assert ref["relative_loss_change"] < 1e-5
        assert res["untouched"] is True
    assert results[0]["findings"] == results[1]["findings"]
    # no probe's gathered copy outlives the check: the next forward sees the shards
    # as they were (the mean of the ranks' losses is the whole batch's)
    after = (results[0]["next_loss"] + results[1]["next_loss"]) / 2
    assert after == pytest.approx(single["next_loss"], rel=1e-6)
    assert single["next_loss"] == single["subject"]["loss"]


def test_healthy_fsdp2_model_is_probed_and_nothing_is_confirmed_invariant(tmp_path):
    single = w.healthy_check(0, 1)
    results = run_ranks(w.healthy_check, 2, tmp_path, deadline_s=120)
    assert set(results) == {0, 1}
    for res in [single, *results.values()]:
        codes = {code for code, _ in _codes_and_params(res)}
        assert not codes & {"DW101", "DW103", "DW104", "DW105"}, res["findings"]
    # Under FSDP2 the weak branch is a candidate of the loss-relative screen: probed at
    # x10 and x100 on every rank, found to matter. One process proves from the graph's
    # structure that it reaches the loss, and re-runs nothing.
    assert single["calls"] == 1
    for res in results.values():
        assert res["calls"] == 3
    assert results[0]["findings"] == results[1]["findings"] == single["findings"]


def test_a_rank_whose_loss_fn_raises_in_a_probe_makes_it_impossible_on_every_rank(tmp_path):
    start = time.monotonic()
    results = run_ranks(
        w.drift_check,
        2,
        tmp_path,
        2,  # rank 1's second call, the first probe, raises
        env={"DEADWEIGHT_COLLECTIVE_TIMEOUT": "20"},
        deadline_s=90,
    )
    assert set(results) == {0, 1}
    for res in results.values():
        # rank 0's own rerun succeeded, yet it does not confirm the scalar either
        assert "DW104" not in {code for code, _ in _codes_and_params(res)}
        # then the fresh rerun: the same three calls on both ranks, in step
        assert res["calls"] == 3
        assert res["subject"]["distributed"]["complete"] is True
        assert res["untouched"] is True
    assert results[0]["findings"] == results[1]["findings"]
    assert time.monotonic() - start < 20  # no collective waited out its timeout
