"""Does the loss depend on a parameter at all? Gradient screens, then a functional probe.

At init, a parameter the loss cannot see still gets a gradient: numerical noise.
Two first-order screens find candidates cheaply from the gradient already computed:

- scale (theta -> 10 theta): the first-order loss change is 9 <g, theta>;
- shift (theta -> theta + c, c = 10 x the parameter's RMS, or 10 for an all-zero
  one): the first-order change is c * sum(g).

Both are taken relative to |loss|. Candidates are then confirmed by re-running the
loss function under no_grad on the same RNG state with the parameter changed:

- shift: invariant when the loss stays within 32 rounding errors (ulps of the
  loss's dtype). Mean subtraction (LayerNorm, BatchNorm, softmax over a shifted
  logit) cancels a shift exactly.
- scale: a normalization cancels a factor only up to its eps, whose residue is
  about eps / mean(x^2) relative (1e-5 for eps = 1e-5) and dies off as the factor
  grows. So the loss is taken at 10 theta and at 100 theta: invariant when those
  two agree within 32 ulps and 10 theta moved the loss by at most 0.1%. A weak but
  real influence (a layer of a freshly initialised model whose predictions are
  still uniform, where even x100 moves the loss by only 0.1%) keeps changing
  between x10 and x100.

Candidates are probed in groups, each member changed by a different amount (the
factor or shift times 1, 1.25, 1.5, ...): parameters that cancel only jointly (a
Linear's weight and bias before a LayerNorm, scaled together) then no longer
cancel, so a group that leaves the loss unchanged shows every member invariant on
its own. A typical model costs a few extra forwards; a group that moves the loss
is split at its widest gap in screen score.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deadweight.checking.check_stats import (
    SCALE_FACTOR,
    GradStats,
    ProbeResult,
    loss_scale,
)
from deadweight.checking.perturbation import (
    FIXED_BATCH_HINT,
    Budget,
    reproduces,
    restored,
    settle,
    spread,
)

# A first-order relative loss change below this makes a parameter a candidate. In a
# small reproduction of the layer-scalar incident the cancelled scalar scored 7e-7
# per unit of <g, theta> and its healthy siblings 4e-3 to 2.5e-2; x9 for the probe's
# x10, that is 6e-6 against 0.04 and more. A norm eps of 1e-5 raises the cancelled
# scalar to 2e-4, hence 5e-4. (Weak layers of a freshly initialised GPT-2 score
# 5e-5 to 2e-3: the few below the bar cost a probe each.)
SCREEN = 5e-4
# "Unchanged": within this many ulps (machine epsilons of the loss's dtype) of the loss.
CONFIRM_ULPS = 32
# The x10 point of the scale probe may move the loss by at most this fraction (the
# eps residue of a normalization); more means the parameter has a real influence.
SCALE_LOSS_RESIDUE = 1e-3
# At most this many extra forwards per check for the functional probes, half per kind.
MAX_PROBE_FORWARDS = 24
# An unchanged re-run reproduces the checked loss when it stays within this fraction
# of it: loosely, as no_grad may pick other kernels than the checked run did.
RERUN_LOSS_TOLERANCE = 1e-4
# A gradient is at the noise floor when moving the parameter by its own size (by 1
# for an all-zero one) would, to first order, change the loss by less than
# `noise-floor-ulps` ulps of the loss (deadweight.thresholds, 16 by default).


def grad_stats(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    norms: Sequence[GradNorms],
    wanted: Sequence[bool],
) -> list[GradStats]:
    """Per-parameter gradient statistics from their `gradient_norms`, with <g, theta>
    and sum(g) taken (`gradient_sums`, one transfer) where `wanted` says: only the
    screens and the findings' evidence read them. The others' are None."""
    picked = [k for k, w in enumerate(wanted) if w]
    sums = iter(gradient_sums([grads[k] for k in picked], [params[k] for k in picked]))
    stats = []
    for p, n, w in zip(params, norms, wanted, strict=True):
        dot, total = next(sums) if w else (None, None)
        stats.append(
            GradStats(
                grad_norm=n.grad_norm,
                grad_dot_param=dot,
                grad_sum=total,
                param_norm=n.param_norm,
                param_rms=n.param_norm / math.sqrt(max(p.numel(), 1)),
                exact_zero=n.exact_zero,
            )
        )
    return stats


@dataclass(frozen=True)
class GradNorms:
    """What a check reads of every gradient; `GradStats` adds the rest where needed."""

    grad_norm: float
    param_norm: float
    exact_zero: bool  # every gradient entry is exactly 0


def gradient_norms(
    grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> list[GradNorms]:
    """|g| and |theta| per parameter (given with its gradient), in one transfer.

    A gradient whose norm is 0 may still hold entries too small to square in float32:
    for those alone the largest magnitude decides, in a second transfer. (It was taken
    for every gradient, a sixth of the gradient statistics on a dispatch-bound model,
    to tell apart what the norm nearly always tells apart: a norm above 0, or NaN, has
    an entry that is not 0.)"""
    if not params:
        return []
    same_device = len({p.device for p in params}) == 1
    with torch.no_grad():
        grads = [_entries(g) for g in grads]
        thetas = [_entries(p) for p in params]
        columns: list[Sequence[torch.Tensor]]
        if same_device:  # torch._foreach_*: one kernel per tensor on CPU, a few on a GPU
            columns = [torch._foreach_norm(grads), torch._foreach_norm(thetas)]
        else:
            columns = [[g.norm() for g in grads], [t.norm() for t in thetas]]
        values = _rows(columns, same_device)
        zero_norm = [k for k, v in enumerate(values) if v[0] == 0.0]
        largest = (
            _rows([_largest_magnitudes([grads[k] for k in zero_norm])], same_device)
            if zero_norm
            else []
        )
    entries = {k for k, (m,) in zip(zero_norm, largest, strict=True) if m != 0.0}
    return [GradNorms(v[0], v[1], v[0] == 0.0 and k not in entries) for k, v in enumerate(values)]


def gradient_sums(
    grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> list[tuple[float, float]]:
    """(<g, theta>, sum g) per parameter (given with its gradient), in one transfer."""
    if not params:
        return []
    same_device = len({p.device for p in params}) == 1
    dense = [k for k, g in enumerate(grads) if g.layout == torch.strided]
    with torch.no_grad():
        dots: list[torch.Tensor | None] = [None] * len(grads)
        sums: list[torch.Tensor | None] = [None] * len(grads)
        gs = [_entries(grads[k]) for k in dense]
        thetas = [_entries(params[k]) for k in dense]
        products: Sequence[torch.Tensor]
        if same_device and gs:
            products = torch._foreach_mul(gs, thetas)
        else:
            products = [g * t for g, t in zip(gs, thetas, strict=True)]
        for k, x, g in zip(dense, products, gs, strict=True):
            dots[k], sums[k] = x.sum(), g.sum()
        for k, g in enumerate(grads):
            if g.layout != torch.strided:
                dots[k], sums[k] = _sparse_dot_and_sum(g, params[k])
        values = _rows([_filled(dots), _filled(sums)], same_device)
    return [(v[0], v[1]) for v in values]


def _sparse_dot_and_sum(
    grad: torch.Tensor, param: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """<g, theta> and sum g for a sparse gradient (nn.Embedding(sparse=True)), over its
    stored entries: densified, an embedding's gradient would be the size of its table.
    A complex one as its real and imaginary parts, like `_entries`."""
    g = grad.coalesce() if grad.layout == torch.sparse_coo else grad.to_sparse_coo().coalesce()
    theta = param.detach()
    if not g.is_complex() and g.dtype != torch.float64:
        g, theta = g.float(), theta.float()
    dot = torch.sparse.sum(g * (theta.conj() if g.is_complex() else theta))
    total = torch.sparse.sum(g)
    if g.is_complex():  # Re <g, theta> over the parts; the parts' sum
        return dot.real, total.real + total.imag
    return dot, total


def _filled(column: list[torch.Tensor | None]) -> list[torch.Tensor]:
    out = [t for t in column if t is not None]
    assert len(out) == len(column)
    return out


def _rows(columns: Sequence[Sequence[torch.Tensor]], same_device: bool) -> list[list[float]]:
    """0-d tensors, one column per statistic, as rows of Python floats: one transfer
    when they share a device, one per row otherwise."""
    if not columns[0]:
        return []
    if same_device:
        return torch.stack([torch.stack(list(c)) for c in columns], dim=1).cpu().tolist()
    return [torch.stack(list(row)).cpu().tolist() for row in zip(*columns, strict=True)]


def _largest_magnitudes(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """max |x| per tensor (0 for an empty one): 0 exactly when every entry is, where the
    2-norm underflows for tiny entries. The max of the absolute values runs at the speed
    of a sum; counting nonzero entries (norm of order 0) took four times as long."""
    foreach_max = getattr(torch, "_foreach_max", None)
    full = [t for t in tensors if t.numel()]
    if foreach_max is None or len(full) < len(tensors) or len({t.device for t in tensors}) > 1:
        return [t.abs().max() if t.numel() else t.new_zeros(()) for t in tensors]
    return list(foreach_max(torch._foreach_abs(full)))


def _entries(t: torch.Tensor) -> torch.Tensor:
    """`t`'s entries as a dense real tensor the statistics reduce over: a sparse
    gradient's stored values (the others are 0), a complex tensor's real and imaginary
    parts, half precision in float32. float64 stays: in float32 its tiniest entries
    would round to 0 and pass for an exact zero. (Under no_grad a float32 tensor is
    used as it is: a detach and a cast per tensor were a third of the calls, each a
    dispatch that costs what a tiny kernel does.)"""
    if t.layout == torch.sparse_coo:
        t = t.coalesce().values()
    elif t.layout != torch.strided:  # compressed layouts keep their values likewise
        t = t.values()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def grad_stats_from_sums(sums: Sequence[Sequence[float]], numels: Sequence[int]) -> list[GradStats]:
    """`GradStats` from per-parameter sums [sum g^2, sum g*theta, sum g, sum theta^2,
    nonzero gradient entries], which add up over the shards of a sharded parameter."""
    return [
        GradStats(
            grad_norm=math.sqrt(max(v[0], 0.0)),
            grad_dot_param=v[1],
            grad_sum=v[2],
            param_norm=math.sqrt(max(v[3], 0.0)),
            param_rms=math.sqrt(max(v[3], 0.0)) / math.sqrt(max(n, 1)),
            exact_zero=v[4] == 0.0,
        )
        for v, n in zip(sums, numels, strict=True)
    ]


@dataclass
class _Candidate:
    name: str
    param: torch.Tensor
    kind: str
    score: float
    step: float  # the shift amount; unused for scale


def confirm_by_loss(
    candidates: Sequence[tuple[str, torch.Tensor, str, float, float]],
    rerun: Callable[[], float | None],
    base: float,
    loss_eps: float,
    *,
    split: bool = True,
    max_group: int = 8,
    budget: Budget | None = None,
) -> dict[tuple[str, str], ProbeResult]:
    """Probe (name, param, kind, screen score, shift step) candidates; see the module doc.

    `rerun()` re-runs the loss function under no_grad on the same RNG state and
    returns its value (None when that is impossible). With `split=False` a group
    that moves the loss is not searched further (its members stay unconfirmed).
    `budget` counts the forwards left (shared between calls).
    """
    results: dict[tuple[str, str], ProbeResult] = {}
    probing = _LossProbe(rerun, base, CONFIRM_ULPS * loss_eps, budget or Budget(MAX_PROBE_FORWARDS))
    by_kind: dict[str, list[_Candidate]] = {}
    for name, param, kind, score, step in sorted(candidates, key=lambda c: c[3]):
        by_kind.setdefault(kind, []).append(_Candidate(name, param, kind, score, step))

    def record(group: list[_Candidate], outcome: tuple[float | None, bool]) -> None:
        change, invariant = outcome
        for c in group:
            shown = change if (invariant or len(group) == 1) else None
            results[(c.name, c.kind)] = ProbeResult(c.kind, c.score, shown, invariant, len(group))

    def settled(_: list[_Candidate], outcome: tuple[float | None, bool]) -> bool:
        change, invariant = outcome
        return invariant or change is None or not split

    for members in by_kind.values():
        # Bounded groups: many large changes at once add up rounding error (and a
        # chain of scalars multiplies its factors).
        for start in range(0, len(members), max_group):
            settle(members[start : start + max_group], probing.probe, settled, record, _widest_gap)
    return results


class _LossProbe:
    """One group of candidates changed at once, judged on the re-run loss."""

    def __init__(
        self, rerun: Callable[[], float | None], base: float, unchanged: float, budget: Budget
    ) -> None:
        self.rerun = rerun
        self.base = base
        self.unchanged = unchanged  # how far the loss may move and count as unchanged
        self.budget = budget

    def run(
        self, group: list[_Candidate], change: Callable[[torch.Tensor, _Candidate], object]
    ) -> float | None:
        if not self.budget.take():
            return None
        with torch.no_grad():
            for c in group:
                change(c.param, c)
        value = self.rerun()
        return value if value is not None and math.isfinite(value) else None

    def probe(self, group: list[_Candidate]) -> tuple[float | None, bool]:
        """(relative change at the first point, invariant) for the group, restored after."""
        with restored([c.param for c in group]):
            multiple = {id(c): spread(i) for i, c in enumerate(group)}
            base, scale = self.base, loss_scale(self.base)
            if group[0].kind == "shift":
                value = self.run(group, lambda p, c: p.add_(c.step * multiple[id(c)]))
                if value is None:
                    return None, False
                change = abs(value - base) / scale
                return change, change <= self.unchanged
            at10 = self.run(group, lambda p, c: p.mul_(SCALE_FACTOR * multiple[id(c)]))
            if at10 is None:
                return None, False
            change = abs(at10 - base) / scale
            if change > SCALE_LOSS_RESIDUE:
                return change, False
            at100 = self.run(group, lambda p, c: p.mul_(SCALE_FACTOR))
            if at100 is None:
                return change, False
            return change, abs(at100 - at10) / scale <= self.unchanged


def screen_and_confirm(
    with_grad: Sequence[tuple[str, torch.Tensor]],
    stats: dict[str, GradStats],
    loss_value: float,
    loss_eps: float,
    rerun: Callable[[], float | None],
    runnable: bool,
) -> tuple[dict[tuple[str, str], ProbeResult], str | None]:
    """Screen every parameter with a nonzero gradient; confirm candidates functionally.

    An exactly-zero gradient is left out: it is what zero-initialised designs (a LoRA
    B matrix, a zero-init output projection) give the layers around them at step 0,
    and Adam does not move a parameter on exact zeros.

    `rerun()` re-runs the loss with the parameters as they are now (`rerun_of` in one
    process). Which probes run depends only on the statistics, `loss_value` and what
    `rerun()` returns, so ranks that share those (FSDP2, where every probe's forward
    all-gathers) run the same probes in the same order.
    """
    # Would-be warnings (a single number, or a gradient that is noise everywhere: it
    # could not learn at all) are what the probes are for: small groups, bisected,
    # within the budget. Candidates that could only ever be info are probed only when
    # there are no would-be warnings, and only for scale (a free norm, as in QK-norm):
    # one group, one look. Every probe is a forward, so this keeps a typical check
    # to two extra forwards.
    careful: list[tuple[str, torch.Tensor, str, float, float]] = []
    cheap: list[tuple[str, torch.Tensor, str, float, float]] = []
    for name, p in with_grad:
        s = stats[name]
        if s.exact_zero:
            continue
        would_warn = p.numel() == 1 or s.at_noise_floor(loss_value, loss_eps)
        if s.param_norm > 0 and s.scale_score(loss_value) < SCREEN:
            (careful if would_warn else cheap).append(
                (name, p, "scale", s.scale_score(loss_value), 0.0)
            )
        # A single number is covered by the scale probe unless it is 0.
        shift_ok = p.numel() > 1 or s.param_norm == 0
        if would_warn and shift_ok and s.shift_score(loss_value) < SCREEN:
            careful.append((name, p, "shift", s.shift_score(loss_value), s.shift_step()))
    if not careful and not cheap:
        return {}, None
    if not runnable:
        return {}, "functional probes skipped: the loss is not finite or backward failed"

    results: dict[tuple[str, str], ProbeResult] = {}
    if careful:
        for kind in ("scale", "shift"):  # each kind its own half of the budget
            mine = [c for c in careful if c[2] == kind]
            if mine:
                budget = Budget(MAX_PROBE_FORWARDS // 2)
                results.update(confirm_by_loss(mine, rerun, loss_value, loss_eps, budget=budget))
        if not all(r.invariant for r in results.values()):
            # Something moved the loss: make sure it was the parameter, not a loss_fn
            # that draws a new batch on every call.
            fresh = rerun()
            moved = None if fresh is None else [abs(fresh - loss_value)]
            if not reproduces(moved, [RERUN_LOSS_TOLERANCE * max(abs(loss_value), 1e-12)]):
                return {}, (
                    "functional probes skipped: re-running loss_fn gave a different loss "
                    f"({fresh} vs {loss_value}); {FIXED_BATCH_HINT}"
                )
    elif cheap:
        share = Budget(2)  # one scale probe: at 10x and at 100x
        results.update(
            confirm_by_loss(cheap, rerun, loss_value, loss_eps, max_group=len(cheap), budget=share)
        )
    return results, None


def rerun_of(loss_fn: Callable[[], Any], guard: Any) -> Callable[[], float | None]:
    """`loss_fn` re-run under no_grad on the checked run's RNG state (`guard.reset_rng`).

    The rerun returns the loss as a float, or None when `loss_fn` raises or returns
    something other than a one-element tensor: that probe is then impossible.
    """

    def rerun() -> float | None:
        guard.reset_rng()
        try:
            with torch.no_grad():
                out = loss_fn()
        except Exception:
            return None
        if not isinstance(out, torch.Tensor) or out.numel() != 1:
            return None
        return float(out.detach().float().item())

    return rerun


def _widest_gap(group: list[_Candidate]) -> int:
    """Where to split a group (sorted by screen score) that moved the loss.

    True invariants score at rounding level and weak real influences orders of
    magnitude higher, so the widest gap in log-score usually separates them in one
    split; with no clear gap (less than a factor 10) it is halved.
    """
    logs = [math.log10(max(c.score, 1e-30)) for c in group]
    gaps = [(logs[i + 1] - logs[i], i + 1) for i in range(len(logs) - 1)]
    widest, at = max(gaps)
    return at if widest >= 1.0 else len(group) // 2
