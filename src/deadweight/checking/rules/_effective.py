"""Which parameters have no effective gradient, why, and what the optimizer will do with
them (shared by DW103-105 and DW2xx).

The verdict rests on evidence that does not depend on the loss's scale:

1. **structure** (checking/cancellation.py): a cancelling op removes the parameter's
   scale or shift on every path to the loss, confirmed by re-running the forward
   with it perturbed and comparing that op's own output;
2. only for parameters the structure pass could not follow (a custom op or an
   autograd.Function on their way): the numerical screens and loss probes of
   checking/invariance.py, and the noise floor in ulps of the loss.

A parameter the structure pass proved to reach the loss through ops it knows has a
real gradient however small it is (a fresh layer's weak coupling at init): no finding.

Severity says what will happen to the run:

- **warning**: cancelled in every direction (it cannot learn), confirmed, a scale
  (a scalar or gain that a normalization divides out, as in the incident), and the
  optimizer will move it materially within the horizon (`drift-horizon-steps`,
  10k by default): by at least `material-drift` (10%) of its own size through
  noise-driven steps or weight decay; or no optimizer was given to tell;
- **info**: an exact but harmless redundancy (a shift that softmax or a mean
  subtraction removes: a key bias, a bias before BatchNorm, one bias over all the
  choices of a softmax), a free norm while the direction learns (a projection
  before QK-norm), a cancellation the optimizer will not move materially, or one
  that could not be confirmed by a re-run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deadweight import param_roles
from deadweight.checking.check_stats import (
    Cancellation,
    GradFlowStats,
    GroupInfo,
    OptimizerFacts,
    ParamInfo,
    ProbeResult,
)
from deadweight.findings import Severity
from deadweight.thresholds import current

__all__ = [
    "Ineffective",
    "at_risk",
    "drift_prediction",
    "gradient_kind",
    "movement",
    "no_effective_gradient",
    "severity_of",
]


@dataclass(frozen=True)
class Ineffective:
    param: ParamInfo
    kind: str  # "zero", "noise", "scale" or "shift"
    cannot_learn: bool  # no direction of it changes the loss (vs. only its norm / mean)
    probe: ProbeResult | None = None  # the numerical probe, for unstructured parameters
    cancellation: Cancellation | None = None  # the structural verdict

    @property
    def noise(self) -> float:
        """RMS of the gradient entries: the noise level the optimizer sees."""
        g = self.param.grad
        assert g is not None
        return g.grad_norm / max(self.param.numel, 1) ** 0.5

    @property
    def structural(self) -> bool:
        return self.cancellation is not None

    @property
    def confirmed(self) -> bool:
        """Confirmed by a re-run: the cancelling op's output, or the loss probe."""
        if self.cancellation is not None:
            return self.cancellation.confirmed is True
        return self.probe is not None and self.probe.invariant


# The unit roundoffs of the float dtypes, by name (check_stats imports no torch).
_DTYPE_OF_ROUNDING = {
    2.0**-24: "float32",
    2.0**-8: "bfloat16",
    2.0**-11: "float16",
    2.0**-53: "float64",
}


def gradient_kind(item: Ineffective) -> str | None:
    """What a confirmed cancellation's gradient is, from its re-run: "eps residue" when
    the probe moved the cancelling op's output well above rounding (the op divides by
    sqrt(var + eps), not sqrt(var): deterministic, the same in float32 and float64,
    and of a consistent sign from batch to batch), else "<dtype> rounding noise" of
    the coarsest dtype on its way (of random sign). None when there was no re-run."""
    c = item.cancellation
    if c is None or c.confirmed is not True:
        return None
    change = c.evidence.get("op_output_change")
    if not isinstance(change, float):
        return None
    rounding = max(m.rounding for m in c.mechanisms)
    if any(m.approx for m in c.mechanisms) and change > 16 * rounding:
        return "eps residue"
    return f"{_DTYPE_OF_ROUNDING.get(rounding, 'its dtype')} rounding noise"


def no_effective_gradient(stats: GradFlowStats) -> dict[str, Ineffective]:
    loss = stats.loss.value
    if loss is None or not stats.loss.finite:
        return {}
    out = {}
    for p in stats.params:
        g = p.grad
        if not p.trainable or g is None:
            continue
        found = stats.cancellations.get(p.name)
        if g.exact_zero and found is None:
            out[p.name] = Ineffective(p, "zero", cannot_learn=False)
            continue
        if found is not None:
            # (an exactly-zero gradient here is the same cancellation, rounded to 0)
            if found.confirmed is False:
                continue  # the re-run showed the cancelling op does see it
            if found.kind == "shift" and not found.full:
                # A free mean (a bias or embedding feeding a LayerNorm or softmax): how
                # mean-subtracting designs work, and nothing an optimizer drifts far.
                continue
            nothing_left = found.full or p.numel == 1
            out[p.name] = Ineffective(p, found.kind, nothing_left, cancellation=found)
            continue
        if p.name not in stats.unstructured:
            continue  # the structure pass proved it reaches the loss, or never saw it cancelled
        noise = g.at_noise_floor(loss, stats.loss_eps)
        scale = stats.invariance.get((p.name, "scale"))
        shift = stats.invariance.get((p.name, "shift"))
        if p.role == param_roles.BIAS and _holds(scale) and _holds(shift):
            scale = None  # a bias that both probes leave unchanged is a shift story
        # Cannot learn at all: nothing left to learn once the invariant direction is
        # gone: a single number, or a gradient that is noise everywhere.
        nothing_left = p.numel == 1 or noise
        if scale is not None and scale.invariant:
            out[p.name] = Ineffective(p, "scale", nothing_left, scale)
        elif shift is not None and shift.invariant:
            out[p.name] = Ineffective(p, "shift", nothing_left, shift)
        elif noise and not _contradicted(scale) and not _contradicted(shift):
            # (a probe that moved the loss means it sits at an optimum, not that it
            # cannot learn)
            out[p.name] = Ineffective(p, "noise", cannot_learn=True)
    return out


def _holds(probe: ProbeResult | None) -> bool:
    return probe is not None and probe.invariant


def _contradicted(probe: ProbeResult | None) -> bool:
    return probe is not None and probe.relative_change is not None and not probe.invariant


def at_risk(stats: GradFlowStats) -> dict[str, Ineffective]:
    """Parameters the loss cannot move, whose gradient is nonzero noise: the drift cases."""
    return {
        n: i
        for n, i in no_effective_gradient(stats).items()
        if i.cannot_learn and i.kind != "zero" and not i.param.pinned
    }


def severity_of(item: Ineffective, stats: GradFlowStats) -> Severity:
    """What the finding on `item` says will happen to the run (see the module doc)."""
    if not item.cannot_learn or item.param.pinned or item.kind == "zero":
        return Severity.INFO
    if item.kind == "shift":
        return Severity.INFO  # exact and harmless: nothing downstream sees the shift
    if item.structural and not item.confirmed:
        return Severity.INFO
    if item.kind == "noise" or stats.optimizer_facts is None:
        return Severity.WARNING
    moved = movement(item, stats.optimizer_facts)
    if moved is None or moved.get("material") is not False:
        return Severity.WARNING  # unknown update rule: cannot rule it out
    return Severity.INFO


def drift_prediction(i: Ineffective, group: GroupInfo, facts: OptimizerFacts) -> dict[str, object]:
    """The step an update rule takes on noise of the measured RMS, per update."""
    lr = group.lr or 0.0
    sigma = i.noise
    evidence: dict[str, object] = {
        "optimizer": facts.name,
        "rule": group.rule,
        "lr": lr,
        "noise_rms": sigma,
    }
    decays = [g.weight_decay for g in facts.groups if g.weight_decay > 0]
    wd_ref = max(decays) if decays else 0.1
    if group.rule == "adam" and group.betas and group.eps is not None:
        b1, b2 = group.betas
        damp = sigma / (sigma + group.eps)  # noise comparable to eps damps the steps
        # Adam's step is lr * m / (sqrt(v) + eps). For noise of random sign, |m| is the
        # RMS of an EMA of it, sqrt((1 - b1) / (1 + b1)) * sigma, while sqrt(v) ~ sigma;
        # for noise of a consistent sign m ~ sqrt(v) and the step is the full lr.
        expected = lr * math.sqrt((1 - b1) / (1 + b1)) * damp
        worst = lr * damp
        kind = gradient_kind(i)
        if kind is not None and kind != "eps residue":
            # Noise of random sign: Adam's steps random-walk. The variance of their sum
            # over T steps is lr^2 * T (the EMA's autocorrelation undoes its shrinking:
            # (1-b1)/(1+b1) * (1+b1)/(1-b1)), so it wanders lr * sqrt(T) (measured: 0.106
            # for lr 1e-3 over 10k steps of Gaussian noise, b2 0.999 or 0.95).
            evidence.update(gradient=kind, random_walk_step=lr * damp)
        evidence.update(
            betas=[b1, b2],
            eps=group.eps,
            expected_step=expected,
            max_step=worst,
            reset_amplification=math.sqrt(1 / (1 - b2)),
            weight_decay_for_equilibrium=wd_ref,
            equilibrium_if_decayed_max=worst / (wd_ref * lr) if lr else None,
            equilibrium_if_decayed_expected=expected / (wd_ref * lr) if lr else None,
        )
    elif group.rule in ("rmsprop", "adagrad") and group.eps is not None:
        worst = lr * sigma / (sigma + group.eps)
        evidence.update(
            eps=group.eps,
            max_step=worst,
            expected_step=worst,
            equilibrium_if_decayed_max=worst / (wd_ref * lr) if lr else None,
        )
    elif group.rule == "sgd":
        # Plain SGD moves it by lr * g: the noise itself, orders below anything.
        evidence.update(expected_step=lr * sigma, max_step=lr * sigma)
    else:
        evidence["prediction"] = (
            f"unavailable: the update rule of {facts.name} is not known to deadweight"
        )
    return evidence


# Bits of precision (the implicit leading bit included) of the dtypes a parameter is
# stored in; a step smaller than half the gap below its value rounds away.
_PRECISION_BITS = {"float64": 53, "float32": 24, "bfloat16": 8, "float16": 11}


def smallest_step(value: float, dtype: str) -> float | None:
    """The smallest change to a number of size `value` stored in `dtype` that rounding
    to nearest keeps, in the direction where it is smallest: half the gap to the next
    number below `value` (at 1.0 in bfloat16: 2^-9). None for an unknown dtype or 0."""
    bits = _PRECISION_BITS.get(dtype)
    if bits is None or value <= 0 or not math.isfinite(value):
        return None
    exponent = math.floor(math.log2(value))
    gap_below = 2.0 ** (exponent - (bits - 1))
    if value == 2.0**exponent:  # at a power of two the gap below is half the one above
        gap_below /= 2
    return gap_below / 2


def lost_updates(expected: float, worst: float, value: float, dtype: str) -> str | None:
    """Whether an optimizer's steps on a parameter stored in `dtype` survive rounding:
    "all" lost (every step, up to `worst`, below the smallest step at its value),
    "some" (the typical step is below it, the largest ones land as whole steps of the
    dtype), "none"; None when it cannot tell."""
    floor = smallest_step(value, dtype)
    if floor is None:
        return None
    if worst < floor:
        return "all"
    return "some" if expected < floor else "none"


def movement(item: Ineffective, facts: OptimizerFacts) -> dict[str, object] | None:
    """How far the optimizer moves `item` within the horizon, against its own size.

    Noise-driven steps are taken as keeping their sign (the incident's scalar: 66%
    of its steps positive over 20k steps, 93% in the first 500), so the drift is
    `expected_step * horizon`; weight decay shrinks it by `1 - (1 - lr*wd)^horizon`.
    Material when either reaches `material-drift` of its RMS. None when the
    parameter is in no group; no `material` key when the update rule is unknown.
    """
    index = facts.group_of.get(item.param.name)
    if index is None:
        return None
    group = facts.groups[index]
    evidence = drift_prediction(item, group, facts)
    t = current()
    horizon = t.drift_horizon_steps
    g = item.param.grad
    size = g.param_norm / math.sqrt(max(item.param.numel, 1)) if g is not None else 0.0
    evidence.update(horizon_steps=horizon, param_rms=size)
    if "expected_step" not in evidence:
        return evidence
    drift = float(evidence["expected_step"]) * horizon  # type: ignore[arg-type]
    if "random_walk_step" in evidence:
        walk = float(evidence["random_walk_step"]) * math.sqrt(horizon)  # type: ignore[arg-type]
        evidence["random_walk_over_horizon"] = walk
    lr = group.lr or 0.0
    decayed = (
        size * (1 - (1 - lr * group.weight_decay) ** horizon) if group.weight_decay > 0 else 0.0
    )
    evidence.update(drift_over_horizon=drift, decay_over_horizon=decayed)
    # Judged as for a float32 parameter, whatever it is stored in: the verdict is about
    # the parameter, and a run moves to float32 master weights with no change to it.
    evidence["material"] = max(drift, decayed) >= t.material_drift * max(size, 1e-12)
    dtype = item.param.dtype
    if dtype in ("bfloat16", "float16"):
        lost = lost_updates(
            float(evidence["expected_step"]),  # type: ignore[arg-type]
            float(evidence["max_step"]),  # type: ignore[arg-type]
            size,
            dtype,
        )
        if lost is not None:
            evidence.update(
                param_dtype=dtype, smallest_step=smallest_step(size, dtype), updates_lost=lost
            )
    return evidence
