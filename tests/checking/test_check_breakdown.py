"""benchmarks/check_breakdown.py reads check's phases by wrapping the steps of
`checking.flow_measurement`: it must keep finding them, account for the check's time
without counting a step twice, and leave every step as it found it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from deadweight.checking import api, flow_measurement

pytest.importorskip("transformers")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _breakdown() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "check_breakdown", BENCHMARKS / "check_breakdown.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)  # the script puts its folder on the path to import check_overhead
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def test_the_breakdown_finds_every_step_and_puts_them_back() -> None:
    breakdown = _breakdown()
    originals = {name: getattr(flow_measurement, name) for name in breakdown.PHASES}
    originals["preserved"] = flow_measurement.preserved
    measure, restore = api.measure_grad_flow, flow_measurement.ParamGuard.restore

    model, ids = breakdown.build(2, 8, width=16, layers=2, heads=2)

    def loss_fn():  # type: ignore[no-untyped-def]
        return model(input_ids=ids, labels=ids).loss

    # two rounds: each median is then a mean, so sums of medians keep the order of the
    # sums they are medians of
    whole = breakdown.part2(model, loss_fn, rounds=2)

    # every step timed, none counted twice: the named phases fit inside the check
    for key in ("_trace", "_backward_step", "_gradient_statistics", "restore", "writes"):
        assert whole[key] > 0, key
    named = sum(whole[k] for k in breakdown.LABELS)
    assert named <= whole["measure_grad_flow"] <= whole["check"]
    for name, original in originals.items():
        assert getattr(flow_measurement, name) is original, name
    assert api.measure_grad_flow is measure
    assert flow_measurement.ParamGuard.restore is restore


def test_the_forward_ladder_counts_what_each_step_sees() -> None:
    breakdown = _breakdown()
    model, ids = breakdown.build(2, 8, width=16, layers=2, heads=2)

    def loss_fn():  # type: ignore[no-untyped-def]
        return model(input_ids=ids, labels=ids).loss

    n = breakdown.counts(model, loss_fn)
    # the structure pass sees a subset of the torch calls
    assert 0 < n["carrying calls"] < n["torch calls"]
    # module calls, against a hook of our own on every module
    called = []
    handles = [m.register_forward_pre_hook(lambda m, a: called.append(m)) for m in model.modules()]
    try:
        loss_fn()
    finally:
        for h in handles:
            h.remove()
    assert n["module calls"] == len(called) > 0
    added = breakdown.part1(model, loss_fn, rounds=2)
    assert set(added) == set(breakdown.ladder(model, loss_fn))
