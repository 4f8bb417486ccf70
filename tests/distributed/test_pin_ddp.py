"""`deadweight.pin` under DDP: the parameter set DDP communicates stays the same."""

from __future__ import annotations

from tests.distributed import workers_watch as w
from tests.distributed.harness import run_ranks


def test_pinned_parameter_stays_fixed_on_every_rank_and_ddp_trains_on(tmp_path):
    results = run_ranks(w.pin_under_ddp, 2, tmp_path)
    assert set(results) == {0, 1}  # no reducer error on either rank
    for res in results.values():
        assert res["requires_grad"] is True
        assert res["bias_moved"] == 0.0  # bit-exact, under AdamW with weight decay
        assert res["pin_moved"] == 0.0
        assert res["body_moved"] > 0.0  # the rest trains
    assert results[0]["bias"] == results[1]["bias"]
    assert results[0]["body_sum"] == results[1]["body_sum"]
