"""What watch adds to each training step, counted in aten calls (each one is Python and
dispatch time on the step's critical path, which on a GPU is what a step pays): a
constant number, whatever the number of parameter tensors."""

from __future__ import annotations

import pytest

from tests.watch_step_calls import added_per_step

pytest.importorskip("transformers")

STEPS = 40  # two cadences of the default every=20, with the baseline record


@pytest.mark.parametrize("layers, tensors", [(12, 148), (48, 580)])
def test_watch_adds_a_constant_number_of_aten_calls_per_step(layers: int, tensors: int) -> None:
    count, added = added_per_step(layers, STEPS)
    assert count == tensors
    per_step = sum(added.values()) / STEPS
    assert per_step <= 64, sorted(added.items(), key=lambda kv: -kv[1])[:10]
    # the per-tensor views and detaches of the old per-step path stay gone
    assert added.get("aten.view.default", 0) / STEPS < 5, added
    assert added.get("aten.detach.default", 0) / STEPS < 5, added
