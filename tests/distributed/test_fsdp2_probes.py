"""The confirming re-runs under FSDP2: the structure pass follows each parameter through
the unsharded copies FSDP2 computes with, every rank re-runs its batch with the sharded
parameters changed in place, and all ranks judge by the largest change any of them saw,
so `check` confirms a parameter the loss ignores as it does in one process."""

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
        # the same re-runs on every rank: the checked run and the x16 point, settled on
        # the cancelling op's own output as in one process
        assert res["calls"] == 2 and single["calls"] == 2
        ev, ref = (
            res["evidence"]["DW104"]["params"][LAST],
            single["evidence"]["DW104"]["params"][LAST],
        )
        assert ev["by_construction"] is True and ev["confirmed"] is True
        assert ev["mechanism"][0]["op"] == ref["mechanism"][0]["op"]
        assert ev["probe"] == ref["probe"] == "x16"
        # the largest change of the op's output over the ranks' batches
        assert ev["op_output_change"] < 1e-4
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
    # The structure pass proves, through FSDP2's unsharded copies and the identity
    # Function it wraps module inputs in, that the weak branch reaches the loss: no
    # rank re-runs anything.
    for res in [single, *results.values()]:
        assert res["calls"] == 1
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
        # rank 0's own rerun succeeded, yet it does not confirm the scalar either: the
        # cancellation stays what the structure shows, unconfirmed (info)
        found = [f for f in res["findings"] if f[0] == "DW104"]
        assert found and all("did not confirm" in message for _, _, message in found)
        assert res["evidence"]["DW104"]["params"][LAST]["confirmed"] is None
        # the same two calls on both ranks, in step
        assert res["calls"] == 2
        assert res["subject"]["distributed"]["complete"] is True
        assert res["untouched"] is True
    assert results[0]["findings"] == results[1]["findings"]
    assert time.monotonic() - start < 20  # no collective waited out its timeout
