"""DW103-DW105: parameters that get a gradient, but not one that carries information."""

from __future__ import annotations

from collections.abc import Iterator

from deadweight.findings import Finding, Location, Severity
from deadweight.probes.grad_flow import GradFlowStats
from deadweight.probes.invariance import SCALE_FACTOR
from deadweight.registry import get_rule, rule
from deadweight.rules._effective import Ineffective, no_effective_gradient
from deadweight.thresholds import current

_MAX_EVIDENCE = 20


def _evidence(items: list[Ineffective], loss: float | None) -> dict[str, object]:
    per_param = {}
    for i in items[:_MAX_EVIDENCE]:
        g = i.param.grad
        assert g is not None
        entry: dict[str, object] = {
            "grad_norm": g.grad_norm,
            "grad_dot_param": g.grad_dot_param,
            "grad_sum": g.grad_sum,
            "param_norm": g.param_norm,
        }
        if i.probe is not None:
            entry["probe"] = f"x{SCALE_FACTOR:g}" if i.probe.kind == "scale" else "+shift"
            entry["relative_loss_change"] = i.probe.relative_change
            entry["screen_score"] = i.probe.screen_score
        if i.param.pinned:
            entry["pinned"] = True
            entry["moved_since_pin"] = i.param.moved_since_pin
        per_param[i.param.name] = entry
    evidence: dict[str, object] = {"loss": loss, "params": per_param}
    if len(items) > _MAX_EVIDENCE:
        evidence["omitted"] = len(items) - _MAX_EVIDENCE
    return evidence


def _location(items: list[Ineffective]) -> Location:
    return Location(module=items[0].param.module)


def _split(
    stats: GradFlowStats, kinds: tuple[str, ...]
) -> tuple[list[Ineffective], list[Ineffective]]:
    """(cannot learn at all and not pinned, the rest) among the given kinds."""
    found = [i for i in no_effective_gradient(stats).values() if i.kind in kinds]
    hard = [i for i in found if i.cannot_learn and not i.param.pinned]
    soft = [i for i in found if not (i.cannot_learn and not i.param.pinned)]
    return hard, soft


def _names(items: list[Ineffective]) -> str:
    shown = ", ".join(i.param.name for i in items[:3])
    return shown + (f" and {len(items) - 3} more" if len(items) > 3 else "")


@rule(
    code="DW103",
    name="zero-gradient",
    severity=Severity.WARNING,
    summary="A parameter's gradient is exactly zero, or numerical noise below the loss's rounding floor.",
    consumes=GradFlowStats,
)
def zero_gradient(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Finds parameters whose gradient is present but carries no signal:

    - exactly zero in every entry (info: at step 0 this is what zero-initialised
      designs give the layers next to them, such as LoRA's A matrix while B = 0);
    - nonzero but below the noise floor (warning), unless the functional probe shows
      the loss does depend on it (then it merely sits at an optimum). The floor is where moving the
      parameter by its own size (by 1 for an all-zero parameter) would, to first
      order, change the loss by less than 16 rounding errors of the loss:
      `|g| * max(|theta|, 1) <= 16 * eps * |loss|`, eps the machine epsilon of the
      loss's dtype (1.19e-7 for float32).

    Parameters whose invariance the functional probe confirms are reported by
    DW104/DW105 instead.

    ## Why is this bad
    Such a parameter does not learn, yet still "has a gradient", so checks for None
    gradients pass. An adaptive optimizer divides the noise by its own running RMS
    and takes steps of up to the learning rate in a direction nothing controls.

    ## Example
    A scalar multiplying the hidden state right before the final RMSNorm had
    |g| = 2.8e-10 in the incident (an eps residue of RMSNorm), far below the floor.

    ## Fix
    Find what cancels the parameter (a normalization after it, a zero factor) and
    remove the parameter, or pin it with `deadweight.pin(model, name)`.

    ## Evidence
    - `loss`: the loss value the gradients are compared with.
    - `params`: per parameter `grad_norm`, `grad_dot_param` (⟨g, θ⟩), `grad_sum` (Σg),
      `param_norm`, and `pinned` / `moved_since_pin` for a pinned one.
    - `omitted`: parameters left out of `params` (it holds at most 20).
    """
    hard, soft = _split(stats, ("noise", "zero"))
    loss = stats.loss.value
    if hard:
        yield get_rule("DW103").finding(
            f"{len(hard)} parameter(s) get only numerical noise as gradient ({_names(hard)}): "
            f"below the floor of {current().noise_floor_ulps:g} ulps of the loss.",
            params=[i.param.name for i in hard],
            location=_location(hard),
            evidence=_evidence(hard, loss),
        )
    zeros = [i for i in soft if i.kind == "zero"]
    if zeros:
        yield get_rule("DW103").finding(
            f"{len(zeros)} parameter(s) get an exactly zero gradient at this step "
            f"({_names(zeros)}); expected next to zero-initialised layers, a bug otherwise.",
            params=[i.param.name for i in zeros],
            location=_location(zeros),
            evidence=_evidence(zeros, loss),
            severity=Severity.INFO,
            fix="If nothing next to them is zero-initialised, find the zero factor; "
            "`deadweight watch` shows whether they ever move.",
        )


def _invariance_findings(stats: GradFlowStats, code: str, kind: str) -> Iterator[Finding]:
    hard, soft = _split(stats, (kind,))
    loss = stats.loss.value
    verb = f"scaling it by {SCALE_FACTOR:g}" if kind == "scale" else "shifting it far"
    for i in hard:
        assert i.probe is not None and i.param.grad is not None
        yield get_rule(code).finding(
            f"The loss does not depend on {i.param.name}: {verb} changed the loss by "
            f"{i.probe.relative_change:.1e} (relative) and its gradient "
            f"(|g| = {i.param.grad.grad_norm:.1e}) carries nothing to learn; the optimizer "
            "moves it on noise alone.",
            params=[i.param.name],
            location=Location(module=i.param.module),
            evidence=_evidence([i], loss),
        )
    if soft:
        pinned = [i for i in soft if i.param.pinned and i.cannot_learn]
        free = [i for i in soft if i not in pinned]
        if free:
            what = "norm" if kind == "scale" else "mean"
            yield get_rule(code).finding(
                f"{len(free)} parameter(s) are {kind}-invariant ({_names(free)}): their {what} "
                "is free while the rest still learns, as for a projection right before a "
                "normalization; expected in such designs.",
                params=[i.param.name for i in free],
                location=_location(free),
                evidence=_evidence(free, loss),
                severity=Severity.INFO,
                fix=f"Nothing to do if the design intends it; weight decay keeps the free {what} bounded.",
            )
        held = [i for i in pinned if not i.param.moved_since_pin]
        slipped = [i for i in pinned if i.param.moved_since_pin]
        if held:
            yield get_rule(code).finding(
                f"{len(held)} pinned parameter(s) cannot change the loss ({_names(held)}); "
                "the pin holds them: unchanged since pinned.",
                params=[i.param.name for i in held],
                location=_location(held),
                evidence=_evidence(held, loss),
                severity=Severity.INFO,
                fix="Nothing to do: pinned with deadweight.pin.",
            )
        if slipped:
            yield get_rule(code).finding(
                f"{len(slipped)} pinned parameter(s) moved since they were pinned "
                f"({_names(slipped)}): something other than the gradient changes them.",
                params=[i.param.name for i in slipped],
                location=_location(slipped),
                evidence=_evidence(slipped, loss),
                fix="Keep pinned parameters out of weight decay (deadweight.param_groups after "
                "pinning, see DW206) and clear their optimizer state (pin(..., optimizer=opt)).",
            )


@rule(
    code="DW104",
    name="scale-invariant",
    severity=Severity.WARNING,
    summary="The loss does not change when a parameter is scaled: a normalization cancels it.",
    consumes=GradFlowStats,
)
def scale_invariant(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Screens every parameter with the first-order loss change of scaling it by 100,
    `9 <g, theta> / |loss|`, and confirms candidates below 5e-4 by re-running the
    loss function under no_grad with the parameter scaled by 100, on the same batch
    and RNG state. Invariant means the loss moved by at most 0.1%: a normalization
    cancels a factor at any size up to its eps residue (about 1e-5 relative for
    eps = 1e-5), while a weak but real influence (a fresh GPT-2 projection moves
    the loss by 7.6e-6 when merely doubled) shows far more at x100. Candidates are
    probed in groups, each member by a different factor, so joint-only cancellations
    do not pass. Would-be warnings come first; info candidates get one probe, and
    only when there is no would-be warning to confirm.

    A scalar or a parameter whose whole gradient is noise cannot learn at all
    (warning): the incident's layer scalar feeding straight into the final RMSNorm.
    A weight matrix whose norm is free while its direction learns, such as a
    projection right before QK-norm, is how such models are meant to work (info).

    ## Why is this bad
    The parameter only pretends to learn: it has a gradient and changes every step,
    so "did it get a grad" and "did it move" both pass. Adam turns the noise into
    lr-sized steps and, without weight decay, it drifts: 1.0 to 56.25 in the
    incident, with the loss unchanged, until INT4 quantization broke.

    ## Example
    ```python
    h = self.layer_scalar * h          # shape [1]
    return self.head(self.final_norm(h))  # RMSNorm(s * h) == RMSNorm(h)
    ```

    ## Fix
    Remove the parameter, or keep it fixed with `deadweight.pin(model, name)`
    (a zeroed gradient, no weight decay, still trainable for DDP).

    ## Evidence
    - `loss`: the loss value the gradients are compared with.
    - `params`: per parameter `grad_norm`, `grad_dot_param` (⟨g, θ⟩), `grad_sum`, `param_norm`,
      the `probe` that confirmed it (`x10`: scaled tenfold), the `relative_loss_change` it
      caused, the gradient screen's `screen_score`, and `pinned` / `moved_since_pin`.
    - `omitted`: parameters left out of `params` (it holds at most 20).
    """
    yield from _invariance_findings(stats, "DW104", "scale")


@rule(
    code="DW105",
    name="shift-invariant",
    severity=Severity.WARNING,
    summary="The loss does not change when a constant is added to a parameter: a normalization cancels it.",
    consumes=GradFlowStats,
)
def shift_invariant(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Screens every parameter with the first-order loss change of adding `c` to every
    entry (100 times its RMS, or 10 for an all-zero parameter), `c * sum(g) / |loss|`,
    and confirms candidates below 5e-4 by re-running the loss function under no_grad
    with the parameter shifted, on the same batch and RNG state (invariant: the loss
    moved by at most 0.1%).

    Probed are the parameters that could not learn at all if invariant: a single
    number, or one whose whole gradient is at the noise floor, such as a bias right
    before BatchNorm, which subtracts it again (warning). A bias whose mean alone is
    free while the rest learns (feeding a LayerNorm) is how such models work and is
    not probed, so as not to spend forwards on it.

    ## Why is this bad
    The free part of the parameter moves on noise under adaptive optimizers; when
    the whole parameter is free it only pretends to learn and drifts.

    ## Example
    ```python
    nn.Sequential(nn.Conv2d(3, 8, 3, bias=True), nn.BatchNorm2d(8))  # conv bias is cancelled
    ```

    ## Fix
    Drop the parameter (`bias=False` before BatchNorm), or pin it with
    `deadweight.pin(model, name)`.

    ## Evidence
    - `loss`: the loss value the gradients are compared with.
    - `params`: per parameter `grad_norm`, `grad_dot_param`, `grad_sum` (Σg), `param_norm`,
      the `probe` that confirmed it (`+shift`), the `relative_loss_change` it caused, the
      gradient screen's `screen_score`, and `pinned` / `moved_since_pin`.
    - `omitted`: parameters left out of `params` (it holds at most 20).
    """
    yield from _invariance_findings(stats, "DW105", "shift")
