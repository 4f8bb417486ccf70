"""Seed incident 2 at reduced size: the check at step 0, the reset, forced decay, pin."""

from __future__ import annotations

import statistics

import pytest

from deadweight import Severity
from deadweight.demos import layer_scalar_drift as d

LAST = f"blocks.{d.LAYERS - 1}.layer_scalar"
SCALARS = {f"blocks.{i}.layer_scalar" for i in range(d.LAYERS)}


@pytest.fixture(scope="module")
def story() -> d.Story:
    return d.run_story(steps=1500, resets=3)


def test_1_check_flags_exactly_the_last_scalar(story):
    report = story.report
    at_warning = {
        f.code: set(f.params) for f in report.findings if f.severity.rank >= Severity.WARNING.rank
    }
    assert at_warning == {"DW104": {LAST}, "DW203": {LAST}, "DW204": {LAST}}
    flagged_scalars = {p for f in report.findings for p in f.params} & SCALARS
    assert flagged_scalars == {LAST}  # none of the other scalars, at any severity
    (dw104,) = report.by_code("DW104")
    change = dw104.evidence["params"][LAST]["relative_loss_change"]
    assert change < 1e-5  # the measured effect of doubling it: rounding noise


def test_3_reset_accelerates_the_drift(story):
    assert story.predicted_reset == pytest.approx(4.4721, rel=1e-4)  # sqrt(1/(1-0.95))
    # Measured: the first update after a reset is several times the usual one.
    assert statistics.median(story.reset_ratios) > 1.5
    assert statistics.median(story.reset_ratios_20) > 1.0


def test_4_forced_decay_settles_away_from_the_initial_value(story):
    values = story.decayed.values
    assert values[-1] < 0.5  # not held at 1.0: pulled towards an equilibrium
    assert values[-1] <= story.predicted_equilibrium_max
    # settled: the last samples move far less than the first ones did
    assert abs(values[-1] - values[-2]) < abs(values[0] - 1.0) / 5


def test_5_pin_keeps_it_bit_exact_while_the_others_learn(story):
    assert story.pinned_moved == 0.0
    assert story.pinned.values[-1] == 1.0
    assert story.pinned_others_moved > 1e-2


def test_2_prediction_sizes_the_updates(story):
    n = len(story.drift.updates)
    mean_abs = sum(abs(u) for u in story.drift.updates) / n
    # the step-0 prediction is the right size (within 3x) and the bound holds
    assert story.predicted_step / 3 < mean_abs < story.predicted_step * 3
    assert max(abs(u) for u in story.drift.updates[:100]) <= story.predicted_max_step * 1.01
