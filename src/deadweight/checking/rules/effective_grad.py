"""DW103-DW105: parameters that get a gradient, but not one that carries information."""

from __future__ import annotations

from collections.abc import Iterator

from deadweight.checking.check_stats import SCALE_FACTOR, GradFlowStats
from deadweight.checking.rules._effective import (
    Ineffective,
    gradient_kind,
    movement,
    no_effective_gradient,
    severity_of,
)
from deadweight.findings import Finding, Location, Severity
from deadweight.registry import get_rule, rule
from deadweight.thresholds import current
from deadweight.wording import module_of

_MAX_EVIDENCE = 20


def _evidence(
    items: list[Ineffective], loss: float | None, stats: GradFlowStats | None = None
) -> dict[str, object]:
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
        c = i.cancellation
        if c is not None:
            entry["mechanism"] = [
                {
                    "op": m.op,
                    "site": str(m.site) if m.site is not None else None,
                    "module": m.module,
                    "dims": list(m.dims),
                    "directions": "every" if m.facet == "full" else "uniform",
                    "up_to_eps": m.approx,
                }
                for m in c.mechanisms[:4]
            ]
            entry["by_construction"] = True
            entry["confirmed"] = c.confirmed
            entry.update({k: v for k, v in c.evidence.items()})
        elif i.probe is not None:
            entry["probe"] = f"x{SCALE_FACTOR:g}" if i.probe.kind == "scale" else "+shift"
            entry["relative_loss_change"] = i.probe.relative_change
            entry["screen_score"] = i.probe.screen_score
        if stats is not None and stats.optimizer_facts is not None and i.cannot_learn:
            moved = movement(i, stats.optimizer_facts)
            if moved is not None and "drift_over_horizon" in moved:
                entry["horizon_steps"] = moved["horizon_steps"]
                entry["predicted_move"] = max(
                    float(moved["drift_over_horizon"]),  # type: ignore[arg-type]
                    float(moved["decay_over_horizon"]),  # type: ignore[arg-type]
                )
                entry["material"] = moved["material"]
        if i.param.pinned:
            entry["pinned"] = True
            entry["moved_since_pin"] = i.param.moved_since_pin
        per_param[i.param.name] = entry
    evidence: dict[str, object] = {"loss": loss, "params": per_param}
    if len(items) > _MAX_EVIDENCE:
        evidence["omitted"] = len(items) - _MAX_EVIDENCE
    return evidence


def _location(items: list[Ineffective]) -> Location:
    return module_of([i.param.name for i in items])


def _names(items: list[Ineffective]) -> str:
    shown = ", ".join(i.param.name for i in items[:3])
    return shown + (f" and {len(items) - 3} more" if len(items) > 3 else "")


def _found(stats: GradFlowStats, kinds: tuple[str, ...]) -> list[Ineffective]:
    return [i for i in no_effective_gradient(stats).values() if i.kind in kinds]


def _mechanism(items: list[Ineffective]) -> str:
    """What cancels them, as one phrase: "the LayerNorm at model.py:88 (ln_f)"."""
    described = []
    for i in items:
        if i.cancellation is not None:
            text = "the " + i.cancellation.mechanism
            if text not in described:
                described.append(text)
    if not described:
        return ""
    return described[0] + (f" and {len(described) - 1} other op(s)" if len(described) > 1 else "")


def _confirmation(i: Ineffective) -> str:
    c = i.cancellation
    if c is None:
        return ""
    if c.confirmed is None:
        return " (by construction; a re-run to confirm it was not possible)"
    change = c.evidence.get("op_output_change")
    if c.kind == "shift" and change is not None:
        return f" (shifting it changed that op's output by {change:.1e}, relative)"
    growth = c.evidence.get("op_output_growth")
    if change is not None and growth is not None:
        return (
            f" (scaling it x16 changed that op's output by {change:.1e}, relative, and "
            f"scaling it 16x further by {growth:.1e})"
        )
    return ""


def _gradient(i: Ineffective) -> str:
    """What the gradient of a cancelled parameter is, from the confirming re-run
    (`gradient_kind`), with how much the re-run moved that op's output and the loss."""
    g = i.param.grad
    assert g is not None
    size = f"Its gradient (|g| = {g.grad_norm:.1e})"
    kind = gradient_kind(i)
    c = i.cancellation
    if kind is None or c is None:
        return f"{size} is rounding noise with nothing to learn"
    change = float(c.evidence["op_output_change"])
    loss = c.evidence.get("relative_loss_change")
    and_loss = f" and the loss by {loss:.1e}" if isinstance(loss, float) else ""
    probe = "shifting" if c.kind == "shift" else "scaling it x16"
    if kind == "eps residue":
        growth = c.evidence.get("op_output_growth")
        shrank = f", x256 by only {growth:.1e} more," if isinstance(growth, float) else ""
        op = next(m.op for m in c.mechanisms if m.approx)
        return (
            f"{size} is the residue of the {op}'s eps, deterministic but nothing to "
            f"learn from ({probe} changed that op's output by {change:.1e}{shrank}"
            f"{and_loss}, relative)"
        )
    return (
        f"{size} is {kind} with nothing to learn ({probe} left that op's output "
        f"unchanged within rounding ({change:.1e}){and_loss.replace(' and', ' and moved')}, "
        "relative)"
    )


def _fate(i: Ineffective, stats: GradFlowStats) -> str:
    """What the optimizer will do with it, in words."""
    facts = stats.optimizer_facts
    if facts is None:
        return "whatever optimizer trains it moves it on noise alone"
    moved = movement(i, facts)
    if moved is None:
        return "it is in no param group"
    if "drift_over_horizon" not in moved:
        return f"{facts.name}'s update rule is unknown to deadweight, so it may drift"
    move = max(float(moved["drift_over_horizon"]), float(moved["decay_over_horizon"]))  # type: ignore[arg-type]
    size = float(moved["param_rms"])  # type: ignore[arg-type]
    share = f" ({move / size:.0%} of its size)" if size > 0 else ""
    within = f"by about {move:.2g}{share} within {moved['horizon_steps']} steps"
    if moved.get("updates_lost") == "all":
        return (
            f"{facts.name}'s updates to it are lost to {moved['param_dtype']} rounding, so it "
            f"stays put while stored in {moved['param_dtype']}; with float32 master weights it "
            f"would move {within}"
        )
    return f"{facts.name} will move it {within}"


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
      designs give the layers next to them, such as LoRA's A matrix while B = 0;
      the finding names the gate when the graph shows a zero parameter multiplying
      the branch, as ReZero's alpha, adaLN-Zero's modulation or LoRA's B);
    - nonzero but below the noise floor (warning), for parameters whose path to the
      loss goes through a call deadweight cannot see into (a custom op, an
      `autograd.Function`). The floor is where moving the parameter by its own size
      (by 1 for an all-zero parameter) would, to first order, change the loss by less
      than 16 rounding errors of the loss: `|g| * max(|theta|, 1) <= 16 * eps * |loss|`,
      eps the machine epsilon of the loss's dtype (1.19e-7 for float32), and never
      coarser than float32's: a bf16 loss's own (2^-7) would call small real gradients
      noise.

    How a verdict is reached: every other parameter is judged from the structure of
    the forward (see DW104). A parameter the structure shows reaching the loss
    through ops deadweight knows has a real gradient however small: a freshly
    initialised layer whose influence is still weak (at width 32 with init std 0.02
    a whole BART encoder moves the loss by 5e-5) is no finding. One that a
    normalization cancels is DW104's or DW105's. The floor in ulps of the loss is
    only the fallback where the structure is unknown.

    ## Why is this bad
    Such a parameter does not learn, yet still "has a gradient", so checks for None
    gradients pass. An adaptive optimizer divides the noise by its own running RMS
    and takes steps of up to the learning rate in a direction nothing controls.

    ## Example
    A scalar multiplying the hidden state right before a fused RMSNorm kernel that
    deadweight cannot see into: its gradient is the kernel's eps residue.

    ## Fix
    Find what cancels the parameter (a normalization after it, a zero factor) and
    remove the parameter, or pin it with `deadweight.pin(model, name)`.

    ## Evidence
    - `loss`: the loss value the gradients are compared with.
    - `params`: per parameter `grad_norm`, `grad_dot_param` (⟨g, θ⟩), `grad_sum` (Σg),
      `param_norm`, and `pinned` / `moved_since_pin` for a pinned one.
    - `omitted`: parameters left out of `params` (it holds at most 20).
    - `gated_by`: for exactly zero gradients, the zero-initialised parameters that
      multiply the branch they feed (the one nearest the loss first), when the
      graph shows them.
    """
    found = _found(stats, ("noise", "zero"))
    loss = stats.loss.value
    hard = [i for i in found if i.kind == "noise" and not i.param.pinned]
    if hard:
        yield get_rule("DW103").finding(
            f"{len(hard)} parameter(s) get only numerical noise as gradient ({_names(hard)}): "
            f"below the floor of {current().noise_floor_ulps:g} ulps of the loss, on a path "
            "through an op deadweight cannot see into.",
            params=[i.param.name for i in hard],
            location=_location(hard),
            evidence=_evidence(hard, loss, stats),
        )
    zeros = [i for i in found if i.kind == "zero"]
    behind: dict[tuple[str, ...], list[Ineffective]] = {}
    for i in zeros:
        behind.setdefault(stats.gated_by.get(i.param.name, ()), []).append(i)
    for gates, members in sorted(behind.items(), key=lambda kv: not kv[0]):
        evidence = _evidence(members, loss)
        if gates:
            evidence["gated_by"] = list(gates)
            more = f" (and {len(gates) - 1} more such gates)" if len(gates) > 1 else ""
            message = (
                f"{len(members)} parameter(s) get an exactly zero gradient at this step "
                f"({_names(members)}): they feed a branch multiplied by {gates[0]}{more}, "
                "a zero-initialised gate (ReZero, adaLN-Zero, LoRA's B = 0) that gets a "
                "gradient of its own, so they start learning once it moves."
            )
            fix = (
                "Nothing to do if the zero init is the design; `deadweight watch` shows them move."
            )
        else:
            message = (
                f"{len(members)} parameter(s) get an exactly zero gradient at this step "
                f"({_names(members)}); expected next to zero-initialised layers, a bug otherwise."
            )
            fix = (
                "If nothing next to them is zero-initialised, find the zero factor; "
                "`deadweight watch` shows whether they ever move."
            )
        yield get_rule("DW103").finding(
            message,
            params=[i.param.name for i in members],
            location=_location(members),
            evidence=evidence,
            severity=Severity.INFO,
            fix=fix,
        )


def _invariance_findings(stats: GradFlowStats, code: str, kind: str) -> Iterator[Finding]:
    found = _found(stats, (kind,))
    loss = stats.loss.value
    what = "divides out" if kind == "scale" else "removes any constant added to"
    by_severity: dict[Severity, list[Ineffective]] = {}
    for i in found:
        by_severity.setdefault(severity_of(i, stats), []).append(i)
    for i in by_severity.get(Severity.WARNING, []):
        g = i.param.grad
        assert g is not None
        mechanism = _mechanism([i])
        if mechanism:
            # a confirmed one's re-run is told with what its gradient is, below
            told = i.cancellation is not None and i.cancellation.confirmed is True
            how = (
                f"{mechanism} {what} {i.param.name} on every path to the loss"
                f"{'' if told else _confirmation(i)}"
            )
        else:
            verb = f"scaling it by {SCALE_FACTOR:g}" if kind == "scale" else "shifting it far"
            change = i.probe.relative_change if i.probe is not None else None
            how = f"{verb} changed the loss by {change:.1e} (relative)"
        yield get_rule(code).finding(
            f"The loss does not depend on {i.param.name}: {how}. {_gradient(i)}, and "
            f"{_fate(i, stats)}.",
            params=[i.param.name],
            location=Location(module=i.param.module),
            evidence=_evidence([i], loss, stats),
        )
    infos = by_severity.get(Severity.INFO, [])
    pinned = [i for i in infos if i.param.pinned and i.cannot_learn]
    held = [i for i in pinned if not i.param.moved_since_pin]
    slipped = [i for i in pinned if i.param.moved_since_pin]
    rest = [i for i in infos if i not in pinned]
    free = [i for i in rest if not i.cannot_learn]
    exact = [i for i in rest if i.cannot_learn and i.kind == "shift" and i.confirmed]
    still = [i for i in rest if i.cannot_learn and i not in exact and i.confirmed]
    unconfirmed = [i for i in rest if i.cannot_learn and not i.confirmed]
    norm = "norm" if kind == "scale" else "mean"
    grouped: list[tuple[list[Ineffective], str, str, Severity]] = [
        (
            free,
            f"have a free {norm} ({_names(free)}): {_mechanism(free) or 'a normalization'} "
            f"{what} it while the rest still learns, as for a projection right before a "
            "normalization; expected in such designs.",
            f"Nothing to do if the design intends it; weight decay keeps the free {norm} bounded.",
            Severity.INFO,
        ),
        (
            exact,
            f"are exact redundancies ({_names(exact)}): {_mechanism(exact)} {what} them"
            f"{_confirmation(exact[0]) if exact else ''}. They get only rounding noise as "
            "gradient, and nothing downstream of that op sees where they drift: harmless, "
            "but they learn nothing.",
            "Drop them (bias=False on the layer that feeds the cancelling op), or keep "
            "them fixed with `deadweight.pin(model, name)`.",
            Severity.INFO,
        ),
        (
            still,
            f"cannot learn ({_names(still)}): {_mechanism(still)} {what} them"
            f"{_confirmation(still[0]) if still else ''}; "
            f"{_fate(still[0], stats) if still else ''}, which is not enough to matter.",
            "Remove them, or keep them fixed with `deadweight.pin(model, name)`.",
            Severity.INFO,
        ),
        (
            unconfirmed,
            f"look cancelled by construction ({_names(unconfirmed)}): "
            f"{_mechanism(unconfirmed)} {what} them, but re-running the forward did not "
            "confirm it.",
            "Make loss_fn re-runnable on one fixed batch so that check can confirm it.",
            Severity.INFO,
        ),
        (
            held,
            f"are pinned and cannot change the loss ({_names(held)}); the pin holds them: "
            "unchanged since pinned.",
            "Nothing to do: pinned with deadweight.pin.",
            Severity.INFO,
        ),
        (
            slipped,
            f"are pinned but moved since ({_names(slipped)}): something other than the "
            "gradient changes them.",
            "Keep pinned parameters out of weight decay (deadweight.param_groups after "
            "pinning, see DW206) and clear their optimizer state (pin(..., optimizer=opt)).",
            Severity.WARNING,
        ),
    ]
    for items, message, fix, severity in grouped:
        if items:
            yield get_rule(code).finding(
                f"{len(items)} parameter(s) {message}",
                params=[i.param.name for i in items],
                location=_location(items),
                evidence=_evidence(items, loss, stats),
                severity=severity,
                fix=fix,
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
    Finds parameters that a normalization divides out: scaling them leaves the loss
    unchanged.

    How a verdict is reached, without reference to the loss's value, form or scale:

    1. **Structure.** While the forward runs, every torch call is followed for each
       parameter's *scale* (theta -> lambda theta multiplies a tensor by
       lambda^k) through the ops that carry it: elementwise mul/div, linear/matmul/
       conv without bias, reshapes and permutes (dims mapped), mean/sum over dims it
       does not vary along, pow/sqrt/rsqrt, dropout, and additions of terms with the
       same factor. LayerNorm, RMSNorm, GroupNorm, BatchNorm (training),
       InstanceNorm and F.normalize cancel a factor that is constant over the dims
       they normalize, and so does a written-out `x * rsqrt(mean(x^2) + eps)` or
       `x / x.norm()` (the degrees add up to 0). A parameter whose scale is cancelled
       on every path to the loss, and that reaches the loss in no other way, is a
       candidate; the message names the op, its line and its module.
    2. **Confirmation.** The forward is re-run under no_grad on the same batch and RNG
       state with the candidates scaled (x16, then x256; a gain's every entry by x16 or
       x32 at random, then squared), and the output of the cancelling op itself is
       compared: invariant when x16 changed it by at most 5% (the eps residue,
       ~eps / 2 var(x)) and x256 added at most a quarter of that, or nothing beyond
       rounding. A weak but real influence grows 10-170x from the first point to the
       second instead. A re-run that is not reproducible (a new batch each call)
       leaves the candidate unconfirmed (info).

    **Half precision** (bf16 or fp16 parameters, bf16 autocast, FSDP2 mixed
    precision) is judged as float32 is. The structure pass follows a parameter
    through casts (`.to(dtype)`, `.float()`, `type_as`, autocast's), so the
    upcasting RMSNorm of Llama, Mistral, Qwen and Gemma (compute in float32, cast
    back) is named as in float32. The probe's factors are powers of two: binary
    floating point rounds 2^k x exactly as it rounds x, so the cancelling op sees its
    input scaled exactly through a bf16 path, and what it shows is its eps residue,
    not bf16 rounding noise of the way there; a change counts as rounding at 16 unit
    roundoffs of the op's output dtype. The message says what the gradient is: the
    residue of the op's eps when the probe moved the op's output well above rounding
    (then float32 and float64 give the same gradient), else rounding noise of the
    coarsest dtype on the way, with how much the probe moved the loss. Under FSDP2
    the pass follows the unsharded copies the forward computes with, every rank
    re-runs its own batch with the sharded parameters scaled, and the largest change
    any rank saw decides.

    The numerical screen (the first-order loss change 9 <g, theta> / |loss|, confirmed
    on the loss) is used only for parameters whose path goes through a call the
    structure pass cannot see into. With a bf16/fp16 loss it judges at float32's
    resolution (the loss's own, 2^-8 of it, would call small real gradients noise) and
    the report notes what that may leave unseen.

    Severity says what will happen to the run:

    - **warning**: cancelled in every direction (a scalar, or a gain whose every
      entry is divided out), confirmed, and the optimizer will move it materially
      within `drift-horizon-steps` (10k): Adam's noise-driven steps or weight decay
      move it by at least `material-drift` (10%) of its size; or no optimizer was
      given to tell. The incident's scalar: 0.18 lr per step, 1.5x its size in 10k
      steps at lr 8.5e-4.
    - **info**: a free norm while the direction still learns (a projection right
      before QK-norm, a conv weight before BatchNorm), a cancelled parameter the
      optimizer will not move materially (plain SGD moves it by lr x noise), or one a
      re-run could not confirm.

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
    - `loss`: the loss value of the checked run.
    - `params`: per parameter `grad_norm`, `grad_dot_param` (⟨g, θ⟩), `grad_sum`, `param_norm`;
      `mechanism` (per cancelling op: `op`, `site`, `module`, `dims`, `directions` every /
      uniform, `up_to_eps`), `by_construction`, `confirmed`; the re-run's `probe`,
      `op_output_change` (x16 against x1), `op_output_growth` (x256 against x16) and
      `relative_loss_change`; with an optimizer, `horizon_steps`, `predicted_move`
      and `material`; `pinned` / `moved_since_pin`. Parameters judged by the fallback
      screen carry `probe`, `relative_loss_change` and `screen_score` instead.
    - `omitted`: parameters left out of `params` (it holds at most 20).
    """
    yield from _invariance_findings(stats, "DW104", "scale")


@rule(
    code="DW105",
    name="shift-invariant",
    severity=Severity.INFO,
    summary="The loss does not change when a constant is added to a parameter: a normalization cancels it.",
    consumes=GradFlowStats,
)
def shift_invariant(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Finds parameters to which adding a constant leaves the loss unchanged: a
    softmax, a cross-entropy or a mean subtraction removes the constant again.

    How a verdict is reached (see DW104 for the structure pass): each parameter's
    *shift* (theta -> theta + delta adds a term to a tensor) is followed through the
    ops that carry it, including additions of unrelated terms, linear and matmul
    (q @ k^T turns a constant added to every key into a term constant over the keys),
    reshapes, permutes and means. Softmax and log_softmax over a dim, cross_entropy
    over the classes, the softmax over keys in `scaled_dot_product_attention`,
    LayerNorm, GroupNorm, BatchNorm (training), InstanceNorm and a written-out
    `x - x.mean()` cancel a term that is constant over the dims they work on. A
    parameter cancelled in every direction is confirmed by re-running the forward
    with it shifted by 10x its RMS (10 for an all-zero one, a random sign per entry)
    and comparing the cancelling op's output: unchanged within 2e-4 relative; where
    the shift passed through bf16 or fp16 on its way to the op, within 16 unit
    roundoffs of that dtype (0.0625 for bf16, 0.0078 for fp16), since adding the shift
    rounds away low bits of the values; a real but weak shift influence changes it by
    1e-2 and more.

    Severity: **info**. A cancelled shift is exact and harmless: the parameter
    learns nothing, and nothing downstream of the cancelling op sees where it goes.
    In float32 an attention key bias gets gradients of 1e-15 to 1e-10, 100-10^4x
    under Adam's eps, and barely moves; under bf16 it random-walks (52% of its
    steps one way) as far as real parameters move, still unseen. A bias whose mean
    alone is free (a bias feeding a LayerNorm) is how such designs work and is not
    reported.

    ## Why is this bad
    The parameter spends memory, optimizer state and, under bf16, a random walk on
    nothing; a reader of the model assumes it does something.

    ## Example
    ```python
    nn.Sequential(nn.Conv2d(3, 8, 3, bias=True), nn.BatchNorm2d(8))  # conv bias is cancelled
    k = self.key(x)                    # key bias: softmax over keys removes it
    ```

    ## Fix
    Drop the parameter (`bias=False` before BatchNorm, on the key projection), or
    keep it fixed with `deadweight.pin(model, name)`.

    ## Evidence
    - `loss`: the loss value of the checked run.
    - `params`: per parameter `grad_norm`, `grad_dot_param`, `grad_sum` (Σg), `param_norm`;
      `mechanism`, `by_construction`, `confirmed`, the re-run's `probe` (`+shift`),
      `op_output_change`, `tolerance` and `relative_loss_change`; `pinned` /
      `moved_since_pin`. Parameters judged by the fallback screen carry `probe`,
      `relative_loss_change` and `screen_score` instead.
    - `omitted`: parameters left out of `params` (it holds at most 20).
    """
    yield from _invariance_findings(stats, "DW105", "shift")
