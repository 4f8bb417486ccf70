"""Which parameters have no effective gradient, and why (shared by DW103-105 and DW2xx)."""

from __future__ import annotations

from dataclasses import dataclass

from deadweight import param_roles
from deadweight.probes.grad_flow import GradFlowStats, ParamInfo
from deadweight.probes.invariance import ProbeResult

__all__ = ["Ineffective", "at_risk", "no_effective_gradient"]


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
    out = {}
    for p in stats.params:
        g = p.grad
        if not p.trainable or g is None:
            continue
        noise = g.at_noise_floor(loss, stats.loss_eps)
        scale = stats.invariance.get((p.name, "scale"))
        shift = stats.invariance.get((p.name, "shift"))
        if p.role == param_roles.BIAS and _holds(scale) and _holds(shift):
            scale = None  # a bias that both probes leave unchanged is a shift story
        # Cannot learn at all: nothing left to learn once the invariant direction is
        # gone: a single number, or a gradient that is noise everywhere.
        nothing_left = p.numel == 1 or noise

        if g.exact_zero:
            out[p.name] = Ineffective(p, "zero", cannot_learn=False)
        elif scale is not None and scale.invariant:
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
