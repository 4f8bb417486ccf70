"""Does the loss depend on a parameter at all? Gradient screens, then a functional probe.

At init, a parameter the loss cannot see still gets a gradient: numerical noise.
Two first-order screens find candidates cheaply from the gradient already computed:

- scale (theta -> 10 theta): the first-order loss change is 9 <g, theta>;
- shift (theta -> theta + c, c = 10 x the parameter's RMS, or 1 for an all-zero one):
  the first-order change is c * sum(g).

The perturbations are large on purpose: a parameter the loss truly cannot see
stays invisible at any size, while one with a small but real influence (a layer of
a freshly initialised model whose logits are still near uniform) shows it clearly.

Both are taken relative to |loss|. A candidate is then confirmed by re-running the
loss function under no_grad with the parameter actually scaled or shifted, on the
same RNG state, and measuring the relative loss change. Candidates are probed in
groups: if perturbing all of them at once leaves the loss unchanged, every one is
invariant (the invariances found here are structural: a normalisation divides the
factor out whatever the other parameters are), so a typical model costs one extra
forward per kind; a group that moves the loss is split in halves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# A first-order relative loss change below this makes a parameter a candidate. In a
# small reproduction of the layer-scalar incident the cancelled scalar scored 7e-7
# and its healthy siblings 4e-3 to 2.5e-2: 1e-4 sits well between, and a healthy
# parameter that scores below it only costs a probe.
SCREEN = 1e-4
SCALE_FACTOR = 10.0
SHIFT_RMS = 10.0
# A measured relative loss change at or below this many machine epsilons of the
# loss's dtype counts as "unchanged". Scaling a scalar that RMSNorm cancels moved the
# loss by 0 to ~12 float32 ulps (RMSNorm's eps leaves a residue); doubling a real
# but weak projection of a fresh GPT-2 moved it by 64 ulps, and by far more at x10.
CONFIRM_EPS = 32
# At most this many extra forwards per check for the functional probes.
MAX_PROBE_FORWARDS = 24


@dataclass(frozen=True)
class GradStats:
    """The numbers the gradient screens need, for one parameter."""

    grad_norm: float
    grad_dot_param: float  # <g, theta>
    grad_sum: float  # sum(g)
    param_norm: float
    param_rms: float
    exact_zero: bool  # every gradient entry is exactly 0

    def scale_score(self, loss: float) -> float:
        return (SCALE_FACTOR - 1) * abs(self.grad_dot_param) / _safe(loss)

    def shift_step(self) -> float:
        return SHIFT_RMS * self.param_rms if self.param_rms > 0 else 1.0

    def shift_score(self, loss: float) -> float:
        return self.shift_step() * abs(self.grad_sum) / _safe(loss)

    def whole_gradient_score(self, loss: float, numel: int) -> float:
        """First-order loss change for a perturbation of the parameter's own size in
        the worst direction: |g| * |theta| (or |g| * sqrt(n) for an all-zero one)."""
        ref = self.param_norm if self.param_norm > 0 else math.sqrt(numel)
        return self.grad_norm * ref / _safe(loss)


def grad_stats(params: Sequence[torch.Tensor]) -> list[GradStats]:
    """Per-parameter gradient statistics in one device-to-host transfer."""
    rows = []
    for p in params:
        g = p.grad
        assert g is not None
        gf, pf = g.detach().float(), p.detach().float()
        rows.append(
            torch.stack(
                [
                    gf.norm(),
                    (gf * pf).sum(),
                    gf.sum(),
                    pf.norm(),
                    (gf != 0).any().float(),
                ]
            ).cpu()
        )
    if not rows:
        return []
    values = torch.stack(rows).tolist()  # the one host sync
    return [
        GradStats(
            grad_norm=v[0],
            grad_dot_param=v[1],
            grad_sum=v[2],
            param_norm=v[3],
            param_rms=v[3] / math.sqrt(max(p.numel(), 1)),
            exact_zero=v[4] == 0.0,
        )
        for v, p in zip(values, params, strict=True)
    ]


@dataclass(frozen=True)
class ProbeResult:
    """The measured effect of scaling or shifting a parameter (or a group holding it)."""

    kind: str  # "scale" or "shift"
    screen_score: float
    relative_change: float | None  # None: not probed (budget spent or probe impossible)
    invariant: bool
    group_size: int  # how many candidates were perturbed together in the deciding probe


@dataclass
class _Candidate:
    name: str
    param: torch.Tensor
    kind: str
    score: float
    step: float  # the shift amount; unused for scale


def confirm(
    candidates: Sequence[tuple[str, torch.Tensor, str, float, float]],
    rerun: Callable[[], float | None],
    tolerance: float,
    base: float,
) -> dict[tuple[str, str], ProbeResult]:
    """Probe (name, param, kind, screen score, shift step) candidates; see the module doc.

    `rerun()` re-runs the loss function under no_grad on the same RNG state and
    returns its value (None when that is impossible).
    """
    results: dict[tuple[str, str], ProbeResult] = {}
    budget = [MAX_PROBE_FORWARDS]
    by_kind: dict[str, list[_Candidate]] = {}
    for name, param, kind, score, step in sorted(candidates, key=lambda c: c[3]):
        by_kind.setdefault(kind, []).append(_Candidate(name, param, kind, score, step))

    def measure(group: list[_Candidate]) -> float | None:
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        saved = [c.param.detach().clone() for c in group]
        try:
            with torch.no_grad():
                for c in group:
                    if c.kind == "scale":
                        c.param.mul_(SCALE_FACTOR)
                    else:
                        c.param.add_(c.step)
            value = rerun()
        finally:
            with torch.no_grad():
                for c, s in zip(group, saved, strict=True):
                    c.param.copy_(s)
        if value is None:
            return None
        return abs(value - base) / _safe(base)

    def settle(group: list[_Candidate]) -> None:
        change = measure(group)
        if change is not None and change <= tolerance:
            for c in group:
                results[(c.name, c.kind)] = ProbeResult(c.kind, c.score, change, True, len(group))
            return
        if change is None or len(group) == 1:
            for c in group:
                results[(c.name, c.kind)] = ProbeResult(
                    c.kind, c.score, change if len(group) == 1 else None, False, len(group)
                )
            return
        half = len(group) // 2
        settle(group[:half])
        settle(group[half:])

    for group in by_kind.values():
        settle(group)
    return results


def _safe(loss: float) -> float:
    # A loss of exactly 0 would make every relative change infinite; 1e-12 keeps the
    # ratio finite and still flags any real change.
    return max(abs(loss), 1e-12)
