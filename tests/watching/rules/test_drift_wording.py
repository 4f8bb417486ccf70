"""DW302's message reads as a sentence for every kind of reference set its gradient is
compared with: siblings in other layers, or the other small parameters of its optimizer."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from deadweight.watching.rules._drift import Drift, Reference
from deadweight.watching.rules.dynamics import drift_without_gradient
from deadweight.watching.watch_stats import ParamTrack, Series, SmallStats, WatchStats

STEPS = 200
LR = 1e-3
# Per-element gradients of 5.95e-6 against 4.08e-2: the ratio 1.5e-4 of the issue.
DRIFTER_GRAD, REFERENCE_GRAD = 5.95e-6, 4.08e-2

# One watched run per kind: the parameter that drifts, the others of its optimizer, and
# the reference set the message must name.
SCENARIOS: dict[Reference, tuple[str, list[str], str]] = {
    Reference.SIBLINGS: (
        "blocks.3.layer_scalar",
        [f"blocks.{i}.layer_scalar" for i in range(3)],
        "its siblings blocks.{}.layer_scalar",
    ),
    Reference.OPTIMIZER: (
        "final.scale",
        ["norm.weight", "proj.bias", "gate"],
        "the other small parameters of its optimizer",
    ),
}

# The whole sentence, numbers as the rule formats them.
SENTENCE = (
    "{name} moves 1.00 lr per step, 90% of its steps the same way, and has drifted 1 -> 1.19 "
    "in 200 steps, while its gradient is 1.5e-04 of the median of {phrase} (5.95e-06 vs "
    "4.08e-02): Adam is turning noise into steps."
)


def _track(name: str, grad: float, path: float, drift: float) -> ParamTrack:
    return ParamTrack(
        name=name,
        shape=(1,),
        dtype="float32",
        optimizer=0,
        group=0,
        pinned=False,
        small=True,
        numel=1,
        steps=STEPS,
        grad_present=STEPS,
        lr_sum=LR * STEPS,
        moved=True,
        series=Series(
            steps=[0, STEPS], param_norm=[1.0, 1.0 + drift], value=[[1.0], [1.0 + drift]]
        ),
        small_stats=SmallStats(
            steps=STEPS,
            path=path,
            radial_pos=0.9 * STEPS,
            radial_neg=0.1 * STEPS,
            grad_sum=grad * STEPS,
            drift=drift,
        ),
    )


def _stats(kind: Reference) -> WatchStats:
    drifter, others, _ = SCENARIOS[kind]
    # Steps of one lr each, 90% of them outward, and a net move of 0.19.
    tracks = [_track(drifter, DRIFTER_GRAD, LR * STEPS, 0.19)]
    tracks += [_track(n, REFERENCE_GRAD, LR * STEPS, 0.0) for n in others]
    return WatchStats(params={t.name: t for t in tracks})


def test_every_reference_kind_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(Reference)


@pytest.mark.parametrize("kind", list(Reference), ids=lambda k: k.value)
def test_drift_message_reads_well(kind: Reference) -> None:
    name, _, phrase = SCENARIOS[kind]
    (finding,) = drift_without_gradient(_stats(kind))
    assert finding.evidence["reference_kind"] == kind.value  # the scenario reaches this kind
    assert finding.evidence["reference"] == phrase
    message = finding.message
    assert f" of the median of {phrase} (" in message  # the set, named in full
    assert not re.search(r"\b(\w+) \1\b", message), message  # "of of", "the the"
    assert not re.search(r"\b(its|the|an?) (its|the|an?|of)\b", message), message  # "its the"
    assert "'" not in message and '"' not in message and "  " not in message, message
    assert message == SENTENCE.format(name=name, phrase=phrase)


def test_the_drift_adam_on_noise_predicts_is_in_the_evidence() -> None:
    """The report draws DW302's prediction from its evidence: steps of `mean_update_lr`
    lr, (2p - 1) of them net one way, in norm like `drift_per_step`."""
    (finding,) = drift_without_gradient(_stats(Reference.SIBLINGS))
    ev = finding.evidence
    assert ev["mean_update_lr"] == pytest.approx(1.0) and ev["same_sign_fraction"] == 0.9
    assert ev["predicted_drift_per_step"] == pytest.approx(LR * (2 * 0.9 - 1))
    assert ev["predicted_by"] == "Adam on noise, steps of 1 lr, 90% the same way"


def test_the_predicted_drift_is_a_norm_and_needs_its_numbers() -> None:
    drift = Drift(
        name="w", steps=100, grad_rms=1e-9, reference_grad_rms=1e-3,
        reference_kind=Reference.OPTIMIZER, reference_template=None, update_rms=1e-3,
        reference_update_rms=1e-3, mean_lr=1e-3, same_sign=0.75, total_drift=0.1,
        start_norm=1.0, net_share=0.5, numel=4,
    )  # fmt: skip
    assert drift.predicted_per_step == pytest.approx(1e-3 * 0.5 * 2)  # sqrt(4) in norm
    assert dataclasses.replace(drift, numel=1).predicted_per_step == pytest.approx(1e-3 * 0.5)
    assert dataclasses.replace(drift, update_rms=math.nan).predicted_per_step is None
