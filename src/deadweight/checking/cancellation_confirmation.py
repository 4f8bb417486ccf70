"""Confirm the structure pass's candidates: re-run the forward with each perturbed and
read the outputs of the ops that cancel it.

A normalization keeps its output at a scale of its own, so comparing that output
(not the loss) makes the verdict independent of the loss's value, form or scale.
Scale candidates are multiplied by powers of two, shift candidates get a shift of
ten times their RMS; a candidate holds when every op that cancels it gave the same
output within rounding (the tolerances below). Perturbing, restoring, the budget,
the halving of groups and the check that the loss uses one fixed batch are shared
with the numerical screens (`perturbation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from deadweight.checking.carrier_algebra import FLOAT32_ROUNDOFF, unit_roundoff
from deadweight.checking.check_stats import Cancellation, Mechanism
from deadweight.checking.op_table import COUNTED
from deadweight.checking.perturbation import (
    FIXED_BATCH_HINT,
    Budget,
    halves,
    reproduces,
    restored,
    settle,
    spread,
)
from deadweight.distributed.ranks import local_tensor

Tensor = torch.Tensor


class OutputCapture(TorchFunctionMode):
    """Counts calls as `StructureTracker` does and keeps the outputs of the given calls."""

    def __init__(self, targets: set[tuple[str, int]], name_of: Callable[[Any], str]) -> None:
        super().__init__()
        self._targets = targets
        self._name_of = name_of
        self.ordinals: dict[str, int] = {}
        self.outputs: dict[tuple[str, int], Tensor] = {}

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = self._name_of(func)
        if name in COUNTED:
            n = self.ordinals.get(name, 0)
            self.ordinals[name] = n + 1
            if (name, n) in self._targets and isinstance(out, Tensor):
                self.outputs[(name, n)] = out.detach()
        return out


def relative_change(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b||, in float64; inf when shapes differ or values are not finite."""
    if a.shape != b.shape:
        return math.inf
    a64, b64 = a.detach().double(), b.detach().double()
    denom = float(b64.norm())
    diff = float((a64 - b64).norm())
    if not (math.isfinite(diff) and math.isfinite(denom)):
        return math.inf
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)


# A cancelled shift is exact: what is left is rounding, of the order of the unit
# roundoff of the coarsest dtype on the way (2^-24 for float32) times the size of the
# shift against the values; 2e-4 leaves room for shifts 1000x the values and still sits
# 50x under the 1e-2 that a real but weak shift influence of a freshly initialised
# layer showed. A path through half precision gets 16 of its unit roundoffs (bfloat16:
# 0.0625, float16: 0.0078): x + c rounded to bf16 loses x's low bits, and the op
# amplifies that by |x + c| / std(x).
SHIFT_TOLERANCE = 2e-4
HALF_ROUNDOFFS = 16
# Scale candidates are multiplied by powers of two. Binary floating point rounds
# 2^k * x exactly as it rounds x, so through every op that carries a scale (products,
# sums, means, matmuls, convolutions, casts) the cancelling op sees its input scaled
# exactly, in any dtype: what is left of the change in its output is its own eps
# residue (about eps / 2 var(x)) and the rounding of its own output, never rounding
# noise of a bfloat16 path. x16 first (2^4), then x256 (the exponents doubled).
SCALE_EXPONENT = 4
# A cancelled scale leaves the op's eps residue, which the growth x16 -> x256 shrinks
# ~256x (the residue goes as 1 / lambda^2); a weak real influence grows 10-170x. So:
# invariant when x16 changed the op's output by at most SCALE_OP_OUTPUT_RESIDUE and
# x256 added at most RESIDUE_GROWTH of that, or nothing beyond rounding.
SCALE_OP_OUTPUT_RESIDUE = 0.05
RESIDUE_GROWTH = 0.25


def tolerance(t: Tensor, rounding: float = FLOAT32_ROUNDOFF) -> float:
    """How much `t`, an op's output, may change in a re-run and count as unchanged:
    the rounding of its own dtype, or of a coarser one on the way (`rounding`)."""
    u = max(unit_roundoff(t.dtype), rounding)
    return max(SHIFT_TOLERANCE, HALF_ROUNDOFFS * u) if u > FLOAT32_ROUNDOFF else SHIFT_TOLERANCE


def _mechanism_tolerance(m: Mechanism, kind: str, base: Tensor) -> float:
    # A scale reaches the op exactly (powers of two): only the op's own output rounds.
    return tolerance(base, m.rounding if kind == "shift" else FLOAT32_ROUNDOFF)


@dataclass
class _Probe:
    name: str
    param: Tensor
    cancellation: Cancellation

    def op_keys(self) -> list[tuple[str, int]]:
        return [(m.call, m.ordinal) for m in self.cancellation.mechanisms]


Outputs = dict[tuple[str, int], Tensor]
Rerun = Callable[[set[tuple[str, int]]], tuple[float | None, Outputs] | None]
# Under FSDP2 every rank re-runs its own batch: each measured change is agreed on (the
# largest over the ranks), so all ranks take the same decisions and re-runs.
Agree = Callable[[list[float]], list[float]]
# Groups of would-be warnings (every direction cancelled) confirmed by one re-run.
GROUP = 16
NOT_SEEN = "the cancelling op was not seen again in the re-run"
NOT_REPRODUCIBLE = (
    f"not reproducible: re-running loss_fn unchanged gave other outputs; {FIXED_BATCH_HINT}"
)


def confirm_by_op_outputs(
    cancellations: dict[str, Cancellation],
    params: dict[str, Tensor],
    baseline: Outputs,
    rerun: Rerun,
    loss: float | None,
    seed: int = 0,
    agree: Agree | None = None,
) -> dict[str, Cancellation]:
    """Re-run the forward with the candidates perturbed; keep what the cancelling ops say.

    Every candidate is changed at once, each by a different amount (joint-only
    cancellations then do not pass): scale candidates by x16 (their full facet by a
    random x16 or x32 per entry; candidates that one op cancels together get x2 and x4
    in turn, so that the op does not see 16^n), shift candidates by c = 10 x their RMS
    (10 for an all-zero one; full facet: c times a random sign per entry). A candidate
    holds when every op that cancels it gave the same output within rounding; a scale
    whose op output moved by an eps-sized amount gets a second point (x256, every
    exponent doubled) and holds when the change shrank (see the tolerances above). A
    group in which something failed is split in halves until each candidate stands
    alone, within a bounded number of re-runs. `rerun(targets)` re-runs the loss under
    no_grad on the checked run's RNG state and returns (loss, captured outputs), or
    None when it cannot. `agree` combines each rank's measured changes (FSDP2).
    """
    probes = [_Probe(n, params[n], c) for n, c in cancellations.items() if n in params]
    if not probes:
        return dict(cancellations)
    return _Confirmation(probes, baseline, rerun, loss, seed, agree).settle_all(cancellations)


Verdicts = dict[str, tuple[bool, dict[str, Any]]]


class _Confirmation:
    """The re-runs of one `confirm_by_op_outputs`: perturb, re-run, measure, judge."""

    def __init__(
        self,
        probes: list[_Probe],
        baseline: Outputs,
        rerun: Rerun,
        loss: float | None,
        seed: int,
        agree: Agree | None,
    ) -> None:
        self.probes = probes
        self.baseline = baseline
        self.rerun = rerun
        self.loss = loss
        self.agree: Agree = agree or (lambda values: values)
        generator = torch.Generator().manual_seed(seed)
        self.exponents = _scale_exponents(probes, generator)
        self.shifts = {
            p.name: _shift(p, generator) for p in probes if p.cancellation.kind == "shift"
        }
        self.budget = Budget(2 * 4 + 2 * len(probes))  # 9 + 2 per candidate in all
        self.out: dict[str, Cancellation] = {}

    def settle_all(self, cancellations: dict[str, Cancellation]) -> dict[str, Cancellation]:
        self.out = dict(cancellations)
        # Would-be warnings (every direction cancelled) in groups of 16; free norms, which
        # can only ever be info, all in one group.
        full = [p for p in self.probes if p.cancellation.full]
        for start in range(0, len(full), GROUP):
            self.settle(full[start : start + GROUP])
        free = [p for p in self.probes if not p.cancellation.full]
        if free:
            self.settle(free)
        self.unless_reproducible([p for p in self.probes if self.out[p.name].confirmed is False])
        return self.out

    def settle(self, group: list[_Probe]) -> None:
        settle(group, self.verdicts, _all_hold, self.record, halves)

    def record(self, group: list[_Probe], found: Verdicts | None) -> None:
        for p in group:
            if found is None:
                self.out[p.name] = replace(
                    p.cancellation, confirmed=None, evidence={"probe": "not run"}
                )
            else:
                ok, evidence = found[p.name]
                self.out[p.name] = replace(p.cancellation, confirmed=ok, evidence=evidence)

    def verdicts(self, group: list[_Probe]) -> Verdicts | None:
        first = self.run(group, 0)
        if first is None:
            return None
        change1 = self.changes(group, first[1], self.baseline)
        # Unchanged within rounding at x16 settles a scale; only an eps-sized change
        # needs the second point, to see it shrink rather than grow.
        change2 = None
        if any(self.needs_second(p, change1[p.name]) for p in group):
            second = self.run(group, 1)
            if second is not None:
                change2 = self.changes(group, second[1], first[1])
        return {
            p.name: _judge(
                p,
                self.baseline,
                change1[p.name],
                None if change2 is None else change2[p.name],
                _relative(first[0], self.loss),
            )
            for p in group
        }

    def needs_second(self, p: _Probe, change1: list[float]) -> bool:
        """A scale candidate whose ops' outputs moved beyond rounding at x16."""
        return p.cancellation.kind == "scale" and any(
            c > _mechanism_tolerance(m, "scale", self.baseline[k])
            for m, k, c in zip(p.cancellation.mechanisms, p.op_keys(), change1, strict=True)
            if k in self.baseline
        )

    def changes(
        self, group: list[_Probe], outputs: Outputs, reference: Outputs
    ) -> dict[str, list[float]]:
        """Per candidate, the relative change of each cancelling op's output (inf where
        the op was not seen), agreed on by the ranks."""
        flat = [
            relative_change(outputs[k], reference[k])
            if k in outputs and k in reference
            else math.inf
            for p in group
            for k in p.op_keys()
        ]
        agreed = iter(self.agree(flat))
        return {p.name: [next(agreed) for _ in p.op_keys()] for p in group}

    def run(self, group: list[_Probe], step: int) -> tuple[float | None, Outputs] | None:
        """The forward re-run with `group` perturbed (the first point, or the second at
        `step` 1), its parameters put back bitwise afterwards."""
        if not self.budget.take():
            return None
        with restored([p.param for p in group]):
            with torch.no_grad():
                for k, p in enumerate(group):
                    local = local_tensor(p.param)  # a shard of an FSDP2 parameter
                    if p.cancellation.kind == "scale":
                        local.mul_(_power_of_two(self.exponents[p.name] * (step + 1), local))
                    else:
                        local.add_(self.shifts[p.name] * spread(k))
            targets = {k for p in group for k in p.op_keys()}
            return self.rerun(targets or set(self.baseline))

    def unless_reproducible(self, refuted: list[_Probe]) -> None:
        """Before trusting a refutation, make sure an unchanged re-run reproduces the
        checked forward: a loss_fn that draws a new batch (or a model with randomness
        outside torch's RNG) cannot confirm anything either way."""
        if not refuted:
            return
        self.budget.grant()
        again = self.run([], 0)
        keys = [k for p in refuted for k in p.op_keys() if k in self.baseline]
        moved = self.agree(
            [
                relative_change(again[1][k], self.baseline[k]) if k in again[1] else math.inf
                for k in keys
            ]
            if again is not None
            else [math.inf] * len(keys)
        )
        if reproduces(
            None if again is None else moved, [tolerance(self.baseline[k]) for k in keys]
        ):
            return
        for p in refuted:
            self.out[p.name] = replace(
                self.out[p.name], confirmed=None, evidence={"probe": NOT_REPRODUCIBLE}
            )


def not_reproducible(c: Cancellation) -> bool:
    """Whether `c` was left unconfirmed because an unchanged re-run did not reproduce."""
    return c.evidence.get("probe") == NOT_REPRODUCIBLE


def _all_hold(_: list[_Probe], found: Verdicts | None) -> bool:
    """A group is settled when it could not be run, or when every member held."""
    return found is None or all(ok for ok, _ in found.values())


def _relative(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None:
        return None
    return abs(value - reference) / max(abs(reference), 1e-12)


def _scale_exponents(probes: list[_Probe], generator: torch.Generator) -> dict[str, Any]:
    """The power of two each scale candidate is multiplied by at the first point (an
    int, or an int tensor for a full facet: each entry its own, 2^4 or 2^5).

    Candidates that one op cancels together (a chain of scalars before one norm) would
    multiply the op's input by 16^n; they get 2^1 and 2^2 in turn instead, each a
    different amount from its neighbour, by their place among the widest such set."""
    sharing: dict[tuple[str, int], list[str]] = {}
    scale = [p for p in probes if p.cancellation.kind == "scale"]
    for p in scale:
        for m in p.cancellation.mechanisms:
            sharing.setdefault((m.call, m.ordinal), []).append(p.name)
    exponents: dict[str, Any] = {}
    for p in scale:
        widest = max((sharing[(m.call, m.ordinal)] for m in p.cancellation.mechanisms), key=len)
        base = SCALE_EXPONENT if len(widest) == 1 else 1 + widest.index(p.name) % 2
        t = local_tensor(p.param.detach())
        if p.cancellation.full and t.numel() > 1:
            jitter = torch.randint(0, 2, t.shape, generator=generator)
            exponents[p.name] = (jitter + base).to(t.device)
        else:
            exponents[p.name] = base
    return exponents


def _power_of_two(exponent: Any, like: Tensor) -> Tensor | float:
    if isinstance(exponent, Tensor):
        ones = torch.ones(exponent.shape, dtype=torch.float32, device=like.device)
        return torch.ldexp(ones, exponent).to(like.dtype)
    return 2.0**exponent


def _shift(p: _Probe, generator: torch.Generator) -> Tensor | float:
    t = local_tensor(p.param.detach())
    rms = float(t.double().pow(2).mean().sqrt()) if t.numel() else 0.0
    step = 10.0 * rms if rms > 0 else 10.0
    if p.cancellation.full and t.numel() > 1:
        signs = torch.randint(0, 2, t.shape, generator=generator).to(torch.float64) * 2 - 1
        return (signs * step).to(t.dtype).to(t.device)
    return step


def _judge(
    p: _Probe,
    baseline: Outputs,
    change1: list[float],
    change2: list[float] | None,
    loss_change: float | None,
) -> tuple[bool, dict[str, Any]]:
    """Whether the changes of the ops that cancel `p` (first point; second point
    against the first) say it holds, with the evidence."""
    if not all(math.isfinite(c) for c in change1) or (
        change2 is not None and not all(math.isfinite(c) for c in change2)
    ):
        return False, {"probe": NOT_SEEN}
    tol = max(
        _mechanism_tolerance(m, p.cancellation.kind, baseline[k])
        for m, k in zip(p.cancellation.mechanisms, p.op_keys(), strict=True)
    )
    worst1 = max(change1)
    evidence: dict[str, Any]
    if p.cancellation.kind == "shift":
        evidence = {"probe": "+shift", "op_output_change": worst1, "tolerance": tol}
        ok = worst1 <= tol
    else:
        per_entry = p.cancellation.full and p.param.numel() > 1
        evidence = {
            "probe": ("x16 or x32 per entry" if per_entry else "x16")
            + (", squared" if per_entry and change2 is not None else "")
            + (", x256" if not per_entry and change2 is not None else ""),
            "op_output_change": worst1,
        }
        if change2 is None:
            ok = worst1 <= tol
        else:
            worst2 = max(change2)
            evidence["op_output_growth"] = worst2
            ok = worst2 <= tol or (
                worst1 <= SCALE_OP_OUTPUT_RESIDUE and worst2 <= RESIDUE_GROWTH * worst1
            )
    if loss_change is not None:
        # Shown, never judged by: its scale is the loss's (a sum near 0 in bf16 moves by
        # half its value on a rounding-level change of the op's output).
        evidence["relative_loss_change"] = loss_change
    return ok, evidence


__all__ = [
    "OutputCapture",
    "confirm_by_op_outputs",
    "not_reproducible",
    "relative_change",
]
