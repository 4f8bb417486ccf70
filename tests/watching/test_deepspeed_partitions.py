"""The parts of DeepSpeed's view that need no DeepSpeed process: finding its optimizer
in a chain of wrappers, slicing a flat gradient buffer per parameter, and the one-shot
step patch zero-code mode installs. DeepSpeed itself runs in tests/e2e/test_deepspeed.py.
"""

from __future__ import annotations

from typing import Any

import torch

from deadweight.watching import deepspeed_partitions


class DeepSpeedZeroOptimizer:
    """Named as DeepSpeed's ZeRO-1/2 optimizer (the name is what is matched) and
    holding a torch optimizer, but none of DeepSpeed's partitions."""

    def __init__(self) -> None:
        self.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        self.calls: list[str] = []

    def step(self, closure: Any = None) -> str:
        self.calls.append("step")
        return "stepped"


class Wrapper:
    def __init__(self, inner: Any) -> None:
        self.optimizer = inner


def test_the_deepspeed_optimizer_is_found_through_wrappers_and_not_in_a_plain_one() -> None:
    zero = DeepSpeedZeroOptimizer()
    assert deepspeed_partitions.find_zero(Wrapper(Wrapper(zero))) is zero
    assert deepspeed_partitions.find_zero(zero.optimizer) is None  # the torch optimizer inside
    looped = Wrapper(None)
    looped.optimizer = looped
    assert deepspeed_partitions.find_zero(looped) is None  # a cycle ends the walk


def test_each_parameter_gets_its_slice_of_a_flat_gradient() -> None:
    params = [torch.zeros(2, 3), torch.zeros(4), torch.zeros(1)]
    flat = torch.arange(11.0)
    offsets = [0, 6, 10]
    grads = deepspeed_partitions._slices(flat, params, offsets)
    reference = [flat[0:6].view(2, 3), flat[6:10], flat[10:11]]
    for got, want in zip(grads, reference, strict=True):
        assert got is not None and torch.equal(got, want)
        assert got.data_ptr() == want.data_ptr()  # a view: nothing is copied
    # An offset past the buffer, or no buffer at all, gives no gradient, not an error.
    assert deepspeed_partitions._slices(flat, params, [0, 6, 11])[2] is None
    assert deepspeed_partitions._slices(None, params, offsets) == [None, None, None]


def test_the_next_step_builds_once_then_steps_through_what_was_built() -> None:
    zero = DeepSpeedZeroOptimizer()
    built: list[Any] = []

    def build(z: Any) -> None:
        built.append(z)
        return None  # nothing to step through: DeepSpeed's own step runs

    deepspeed_partitions.on_next_step(zero, build)
    assert zero.step() == "stepped" and built == [zero]
    assert "step" not in vars(zero)  # the patch removed itself
    assert zero.step() == "stepped" and built == [zero]


def test_the_one_shot_patch_can_be_undone_before_any_step() -> None:
    zero = DeepSpeedZeroOptimizer()
    undo = deepspeed_partitions.on_next_step(zero, lambda z: None)
    undo()
    assert "step" not in vars(zero)
    zero.step()
    assert zero.calls == ["step"]


def test_a_failing_build_never_stops_the_step() -> None:
    zero = DeepSpeedZeroOptimizer()

    def build(z: Any) -> None:
        raise RuntimeError("a deadweight bug")

    deepspeed_partitions.on_next_step(zero, build)
    assert zero.step() == "stepped"


def test_an_unmapped_optimizer_is_watched_for_steps_only_and_gets_its_step_back() -> None:
    """A class whose layout is not known: the view holds no tensors, says why, still
    counts one step per DeepSpeed step, and `release` restores DeepSpeed's own step."""
    zero = DeepSpeedZeroOptimizer()
    view = deepspeed_partitions.view_of(Wrapper(zero))
    assert view is not None and deepspeed_partitions.view_of(zero) is view  # one per optimizer
    assert view.limit is not None  # this stand-in has none of DeepSpeed's partitions
    assert [p for g in view.param_groups for p in g["params"]] == []
    seen: list[str] = []
    view.register_step_pre_hook(lambda *_: seen.append("pre"))
    view.register_step_post_hook(lambda *_: seen.append("post"))
    assert zero.step() == "stepped"
    assert seen == ["pre", "post"] and zero.calls == ["step"]
    view.release()
    assert "step" not in vars(zero)
    assert vars(zero).get(deepspeed_partitions._ATTR) is None  # a later watch builds its own
