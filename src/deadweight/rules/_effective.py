"""Which parameters have no effective gradient, and why (shared by DW103-105 and DW2xx)."""

from __future__ import annotations

from dataclasses import dataclass

from deadweight import param_roles
from deadweight.probes.grad_flow import GradFlowStats, ParamInfo
from deadweight.probes.invariance import SCREEN, ProbeResult

# A gradient is at the noise floor when moving the parameter by its own size (by 1
# for an all-zero one) would, to first order, change the loss by less than 16 ulps of
# the loss: |g| * max(|theta|, 1) <= 16 * eps * |loss|, eps of the loss's dtype.
# The incident's scalar (|g| = 2.8e-10, theta = 1) is 4 orders of magnitude below it.
NOISE_FLOOR_ULPS = 16


@dataclass(frozen=True)
class Ineffective:
    param: ParamInfo
    kind: str  # "zero", "noise", "scale" or "shift"
    cannot_learn: bool  # no direction of it changes the loss (vs. only its norm / mean)
    probe: ProbeResult | None = None

    @property
    def noise(self) -> float:
        """RMS of the gradient entries: the noise level the optimizer sees."""
        g = self.param.grad
        assert g is not None
        return g.grad_norm / max(self.param.numel, 1) ** 0.5


def no_effective_gradient(stats: GradFlowStats) -> dict[str, Ineffective]:
    loss = stats.loss.value
    if loss is None or not stats.loss.finite:
        return {}
    floor = NOISE_FLOOR_ULPS * stats.loss_eps * max(abs(loss), 1e-12)
    out = {}
    for p in stats.params:
        g = p.grad
        if not p.trainable or g is None:
            continue
        whole = g.whole_gradient_score(loss, p.numel)
        silent = whole < SCREEN  # no direction of the gradient matters at first order
        scale = stats.invariance.get((p.name, "scale"))
        shift = stats.invariance.get((p.name, "shift"))
        if (
            p.role == param_roles.BIAS
            and scale is not None
            and scale.invariant
            and shift is not None
            and shift.invariant
        ):
            scale = None  # a bias that both probes leave unchanged is a shift story
        if g.exact_zero:
            out[p.name] = Ineffective(p, "zero", cannot_learn=False)
        elif scale is not None and scale.invariant:
            out[p.name] = Ineffective(p, "scale", p.numel == 1 or silent, scale)
        elif shift is not None and shift.invariant:
            out[p.name] = Ineffective(p, "shift", p.numel == 1 or silent, shift)
        elif g.grad_norm * max(g.param_norm, 1.0) <= floor:
            out[p.name] = Ineffective(p, "noise", cannot_learn=True)
    return out


def at_risk(stats: GradFlowStats) -> dict[str, Ineffective]:
    """Parameters the loss cannot move, whose gradient is nonzero noise: the drift cases."""
    return {
        n: i
        for n, i in no_effective_gradient(stats).items()
        if i.cannot_learn and i.kind != "zero" and not i.param.pinned
    }
