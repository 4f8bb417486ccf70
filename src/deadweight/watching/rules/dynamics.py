"""DW3xx: what only time shows, judged from `deadweight.watch` statistics."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from typing import Any

from deadweight.findings import Finding, Severity
from deadweight.homologous import homologous_groups, robust_outlier
from deadweight.registry import get_rule, rule
from deadweight.thresholds import current
from deadweight.watching.rules._drift import noise_driven
from deadweight.watching.watch_stats import OptimizerTrack, ParamTrack, WatchStats
from deadweight.wording import module_of, name_list

# The step counts and shares these rules judge by (`never-moved-steps`,
# `skipped-steps-share`, `skipped-steps-min`, `intermittent-warn-below`) are
# configurable; deadweight.thresholds holds their defaults and where they come from.


@rule(
    code="DW301",
    name="never-moved",
    severity=Severity.ERROR,
    summary="A trainable parameter is bitwise unchanged after many optimizer steps.",
    consumes=WatchStats,
    plots=("loss-plateau",),  # the report marks where the loss stopped falling
)
def never_moved(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Compares every trainable parameter with its value when watching began, bit for
    bit, at each watched step (exactly for small parameters, through its norm and a
    checksum of its raw bits for large ones), and flags those still unchanged after
    50 optimizer steps. Parameters held by `deadweight.pin` are skipped.

    ## Why is this bad
    A parameter that never changes is not being trained, and nothing fails: the
    loss still falls thanks to the others, then plateaus. In the first incident a
    fused RMSNorm recorded no backward, so the layer before it and the norm's own
    weight never received a gradient and stayed at their initial values for the
    whole run.

    ## Example
    ```python
    h = fused_rms_norm(self.l1(x), self.norm.weight)  # no backward: l1, norm get no grad
    ```

    ## Fix
    Run `deadweight check` on the model to find where the graph is cut (DW101/DW102),
    or put the parameter into the optimizer, or give its group a non-zero learning
    rate. If it is meant to stay fixed, freeze it or `deadweight.pin` it.

    ## Evidence
    - `steps`: optimizer steps watched.
    - `cause`: why it did not move (no gradient, zero learning rate, skipped steps, ...).
    - `per_param`: per parameter `steps_with_grad`, `last_grad_rms` and `mean_lr`.
    """
    causes: dict[str, list[ParamTrack]] = {}
    for track in stats.params.values():
        if track.pinned or track.moved is not False or track.steps < current().never_moved_steps:
            continue
        if track.group is None:
            cause = "they are in no watched optimizer"
        elif track.grad_present == 0:
            cause = "they never received a gradient"
        elif track.lr0_steps >= track.grad_present:
            cause = "their learning rate was 0 whenever they had a gradient"
        else:
            cause = "they had gradients but the optimizer never changed them"
        causes.setdefault(cause, []).append(track)
    for cause, tracks in causes.items():
        names = [t.name for t in tracks]
        steps = max(t.steps for t in tracks)
        yield get_rule("DW301").finding(
            f"{len(names)} trainable parameter(s) are bitwise unchanged after {steps} optimizer "
            f"steps ({name_list(names)}): {cause}.",
            params=names,
            location=module_of(names),
            evidence={
                "steps": steps,
                "cause": cause,
                "per_param": {
                    t.name: {
                        "steps_with_grad": t.grad_present,
                        "last_grad_rms": _last(t.series.grad_rms),
                        "mean_lr": t.mean_lr,
                    }
                    for t in tracks
                },
            },
        )


@rule(
    code="DW310",
    name="gradient-always-zero",
    severity=Severity.ERROR,
    summary="A trainable parameter's gradient was exactly zero on every optimizer step.",
    consumes=WatchStats,
)
def gradient_always_zero(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Sums the squared norm of every parameter's gradient at every step, and flags
    those whose gradient was present on some steps and exactly zero (or None) on
    every one of at least 10 optimizer steps (`no-gradient-steps`). Parameters held
    by `deadweight.pin` (which zeroes their gradient on purpose) are skipped, as are
    those whose learning rate was 0 whenever they had a gradient, and those DW301
    reports (bitwise unchanged after its 50 steps).

    ## Why is this bad
    It is the first incident seen through a framework that fills in missing
    gradients: DeepSpeed, and data parallelism in some configurations, give a
    parameter the loss never reaches a gradient of zeros instead of None. The
    optimizer then steps it, so it is not bitwise unchanged: weight decay shrinks it
    towards 0 and Adam's moments stay empty, while it learns nothing.

    ## Example
    ```python
    h = self.block(x).detach()      # under DeepSpeed, block's grads are zeros, not None
    ```

    ## Fix
    Run `deadweight check` on the model (before `deepspeed.initialize`) to find
    where the graph is cut (DW101/DW102). If the parameter is meant to stay fixed,
    freeze it or `deadweight.pin` it.

    ## Evidence
    - `steps`: optimizer steps watched.
    - `per_param`: per parameter `steps_with_grad` and `mean_lr`.
    """
    minimum = current().no_gradient_steps
    tracks = [
        t
        for t in stats.params.values()
        if not t.pinned
        and not _never_moved(t)  # DW301 says more: nothing changed it at all
        and t.steps >= minimum
        and t.grad_present > 0
        and t.lr0_steps < t.grad_present  # lr 0 whenever it had one: DW301/DW304's story
        and t.series.grad_rms
        and all(v == 0.0 for v in t.series.grad_rms if v is not None)
        and any(v is not None for v in t.series.grad_rms)
    ]
    if not tracks:
        return
    names = [t.name for t in tracks]
    steps = max(t.steps for t in tracks)
    yield get_rule("DW310").finding(
        f"{len(names)} trainable parameter(s) had a gradient of exactly zero on every one of "
        f"{steps} optimizer steps ({name_list(names)}): they learn nothing, and only weight "
        "decay moves them.",
        params=names,
        location=module_of(names),
        evidence={
            "steps": steps,
            "per_param": {
                t.name: {"steps_with_grad": t.grad_present, "mean_lr": t.mean_lr} for t in tracks
            },
        },
    )


def _never_moved(track: ParamTrack) -> bool:
    """DW301 reports it (bitwise unchanged after its steps), with its cause."""
    return track.moved is False and track.steps >= current().never_moved_steps


@rule(
    code="DW313",
    name="never-got-gradient",
    severity=Severity.ERROR,
    summary="A parameter of a stepping optimizer got no gradient on any of the first steps.",
    consumes=WatchStats,
)
def never_got_gradient(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Counts, at every optimizer step, which parameters of the optimizer have a
    gradient, and flags a trainable parameter whose gradient was None on every one of
    at least 10 steps (`no-gradient-steps`), its optimizer stepping all along.
    Parameters held by `deadweight.pin` are skipped. Once the parameter is also
    bitwise unchanged after DW301's 50 steps, DW301 reports it instead, with its
    cause; DW301's bitwise test stays for parameters that get gradients yet do not
    move, and DW310 covers gradients that are present but exactly zero.

    ## Why is this bad
    A gradient that is None on every step is certain long before a parameter can be
    seen not to move: nothing the loss depends on reaches it. A module registered but
    never called in `forward`, a branch cut by `.detach()`, a layer whose output is
    thrown away: the optimizer holds it, weight decay skips it, and a 40-step smoke
    test, exactly when users look, passes in silence.

    ## Example
    ```python
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder, self.proj, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.head(self.encoder(x))  # self.proj is never used
    ```

    ## Fix
    Call the module in `forward`, or remove it (and from the optimizer). Run
    `deadweight check` on the model to find where the graph is cut (DW101/DW102).
    If it is meant to stay fixed, freeze it (`requires_grad_(False)`) or
    `deadweight.pin` it.

    ## Evidence
    - `steps`: optimizer steps watched.
    - `per_param`: per parameter `steps` (of its optimizer) and `optimizer`.
    """
    minimum = current().no_gradient_steps
    tracks = [
        t
        for t in stats.params.values()
        if not t.pinned
        and t.group is not None  # in no watched optimizer: DW301 says so
        and t.steps >= minimum
        and t.grad_present == 0
        and not _never_moved(t)
    ]
    if not tracks:
        return
    names = [t.name for t in tracks]
    steps = min(t.steps for t in tracks)
    yield get_rule("DW313").finding(
        f"{len(names)} trainable parameter(s) got no gradient on any of {steps} optimizer "
        f"steps ({name_list(names)}): nothing the loss depends on reaches them, so they "
        "do not learn.",
        params=names,
        location=module_of(names),
        evidence={
            "steps": steps,
            "per_param": {t.name: {"steps": t.steps, "optimizer": t.optimizer} for t in tracks},
        },
    )


def _last(values: list[float | None]) -> float | None:
    return next((v for v in reversed(values) if v is not None), None)


@rule(
    code="DW302",
    name="drift-without-gradient",
    severity=Severity.WARNING,
    summary="A parameter keeps moving in one direction while its gradient is numerical noise.",
    consumes=WatchStats,
)
def drift_without_gradient(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    For every small parameter (layer scalars, norm gains, biases) it follows each
    update exactly and compares the parameter's gradient with that of its homologous
    siblings (the same name in other layers) or, without siblings, with the other
    small parameters. It flags a parameter whose gradient is at most 1/1000 of theirs
    while it still moves by a sizeable fraction of the learning rate per step, mostly
    in one direction: at least 60% of its steps the same way, or a net move of 10% of
    the distance travelled, and in either case 3 standard deviations beyond what a
    random walk of as many steps gives by chance (a share of 0.5 +- 0.5/sqrt(n), a
    net share of 1/sqrt(n)). A weak-but-real gradient of random sign (a fresh layer
    on random data) makes Adam random-walk, 52-53% of steps one way: not a drift.

    ## Why is this bad
    Adam-family optimizers normalise each update by the gradient's own running size,
    so a gradient that is pure rounding noise still produces steps of about the
    learning rate. If the noise has a bias, the parameter drifts without bound while
    the loss cannot see it. In the second incident a layer scalar that the final
    RMSNorm cancels drifted from 1.0 to 56.25 over 53k steps with 82% of its updates
    positive, invisible in the loss, and would have wrecked INT4 quantization.

    ## Example
    ```python
    return self.final_norm(self.layer_scalar * h)  # RMSNorm divides the scalar out
    ```

    ## Fix
    If the parameter has no use, remove it. Otherwise keep it fixed with
    `deadweight.pin(model, name)` (the gradient is zeroed after every backward, so
    Adam's update is exactly 0, and it stays out of weight decay). Forcing weight
    decay on it only moves the drift's equilibrium, to drift / (lr * wd).

    ## Evidence
    - `steps`: steps with exact statistics.
    - `drift_per_step`, `drift_per_step_lr` (in learning rates), `total_drift`, `start_norm`,
      `first_value`, `last_value`: how far and how steadily it moved.
    - `mean_update_lr`: its mean per-element update, in learning rates.
    - `same_sign_fraction`: the share of steps that moved it the same way.
    - `grad_rms`, `reference_grad_rms`, `grad_ratio`: its gradient against the median of its
      reference set.
    - `reference_kind`, `reference`: that set, by kind and in words: `siblings` ("its siblings
      blocks.{}.scale", the same name in other layers) or, with fewer than two unpinned
      siblings, `optimizer` ("the other small parameters of its optimizer").
    - `mean_lr`: the mean learning rate.
    - `update_vs_signal`: how much more it moves per unit of gradient than its reference set.
    - `predicted_at_step_0`: under `deadweight run`, the step-0 check's rule (DW104/DW105)
      that found the loss cannot see it, before it had moved at all.
    - `predicted_drift_per_step`, `predicted_by`: the drift per step (a norm, like
      `drift_per_step`) that Adam on pure noise gives: steps of `mean_update_lr` lr, a share
      `same_sign_fraction` of them the same way, so (2p - 1) of a step net per step; and that
      assumption in words. A measured drift near it is the noise-driven walk this rule names.
    """
    # What `deadweight run`'s step-0 check said the loss cannot see (DW104/DW105).
    predicted = {
        name: f.code for f in stats.step0 if f.code in ("DW104", "DW105") for name in f.params
    }
    for d in noise_driven(stats):
        moved = (
            f"{d.values[0]:.4g} -> {d.values[1]:.4g}" if d.values else f"{d.total_drift:.4g} (norm)"
        )
        # (with several models the watch names by class, `Model:name`; the check does not)
        at_step_0 = predicted.get(d.name) or predicted.get(d.name.partition(":")[2])
        yield get_rule("DW302").finding(
            f"{d.name} moves {d.update_rms / d.mean_lr:.2f} lr per step, {d.same_sign:.0%} of its "
            f"steps the same way, and has drifted {moved} in {d.steps} steps, while "
            f"its gradient is {d.grad_ratio:.1e} of the median of {d.reference} "
            f"({d.grad_rms:.2e} vs {d.reference_grad_rms:.2e}): Adam is turning noise into steps."
            + (f" Predicted at step 0 ({at_step_0}: the loss cannot see it)." if at_step_0 else ""),
            params=[d.name],
            location=module_of(d.name),
            evidence={
                "steps": d.steps,
                "drift_per_step": d.total_drift / d.steps,
                "drift_per_step_lr": d.total_drift / d.steps / d.mean_lr,
                "mean_update_lr": d.mean_update_lr,
                "same_sign_fraction": d.same_sign,
                "total_drift": d.total_drift,
                "start_norm": d.start_norm,
                "first_value": d.values[0] if d.values else None,
                "last_value": d.values[1] if d.values else None,
                "grad_rms": d.grad_rms,
                "reference_grad_rms": d.reference_grad_rms,
                "grad_ratio": d.grad_ratio,
                "update_vs_signal": d.update_vs_signal,
                "reference": d.reference,
                "reference_kind": d.reference_kind.value,
                "mean_lr": d.mean_lr,
                "predicted_at_step_0": at_step_0,
                "predicted_drift_per_step": d.predicted_per_step,
                "predicted_by": d.predicted_by,
            },
        )


@rule(
    code="DW303",
    name="optimizer-state-reset",
    severity=Severity.WARNING,
    summary="Adam-family moments went back to zero mid-run, amplifying noise-driven updates.",
    consumes=WatchStats,
)
def optimizer_state_reset(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Notices when an optimizer's per-parameter state (Adam's moments and step
    counter) is empty again for parameters that had it: `optimizer.state` cleared, a
    new optimizer built over the same parameters, or a checkpoint loaded without
    optimizer state. It measures the update sizes of the small parameters in the
    steps right after the reset against those right before, next to the predicted
    amplification sqrt(1 / (1 - beta2)). It is a warning when parameters whose
    gradient is at the noise floor (DW302) are among those reset, information
    otherwise.

    ## Why is this bad
    Right after a reset Adam's second moment is tiny, so updates driven by noise are
    sqrt(1 / (1 - beta2)) times larger (4.47 for beta2 = 0.95) until it builds up
    again. In the second incident a stage change loaded weights with
    `--no-load-optim` and the drifting scalar moved 5.4 times faster from then on.

    ## Example
    ```python
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # stage 2: fresh state
    ```

    ## Fix
    Load the optimizer state with the weights when resuming; when that is not
    possible (new parameters), remap the old state onto the new optimizer. Pin or
    remove the noise-driven parameters (DW302) so a reset has nothing to amplify.

    ## Evidence
    - `step`, `optimizer`, `cause`: when and how the state was reset.
    - `parameters`: how many parameters lost their moments.
    - `predicted_amplification`: √(1/(1−β2)), the predicted growth of noise-driven steps.
    - `measured_first_update_ratio`, `measured_first_N_updates_ratio`, `measured_on`,
      `per_param`: the update sizes after the reset relative to those before it.
    """
    drifting = {d.name for d in noise_driven(stats)}
    for reset in stats.resets:
        noisy = [n for n in reset.params if n in drifting]
        evidence: dict[str, object] = {
            "step": reset.step,
            "optimizer": _optimizer(stats, reset.optimizer),
            "cause": reset.cause,
            "parameters": len(reset.params),
            "predicted_amplification": reset.predicted,
        }
        measured = ""
        if reset.effect:
            ratios = _ratios(reset.effect, noisy or list(reset.effect))
            if ratios:
                first = statistics.median(r[0] for r in ratios)
                mean = statistics.median(r[1] for r in ratios)
                evidence |= {
                    "measured_first_update_ratio": first,
                    f"measured_first_{reset.after_steps}_updates_ratio": mean,
                    "measured_on": "noise-driven parameters" if noisy else "small parameters",
                    "per_param": {
                        n: {"first": r[0], f"first_{reset.after_steps}": r[1]}
                        for n, r in zip(noisy or list(reset.effect), ratios, strict=False)
                    }
                    if noisy
                    else {},
                }
                measured = (
                    f" Updates of {'the noise-driven' if noisy else 'the small'} parameters right "
                    f"after it: first {first:.2f}x, first {reset.after_steps} steps {mean:.2f}x "
                    f"the {reset.before_steps} steps before"
                    + (f" (predicted {reset.predicted:.2f}x)." if reset.predicted else ".")
                )
        elif reset.predicted:
            measured = f" Predicted amplification of noise-driven updates: {reset.predicted:.2f}x."
        who = (
            f"including {name_list(noisy)} whose gradient is noise"
            if noisy
            else "none of them noise-driven"
        )
        yield get_rule("DW303").finding(
            f"Optimizer state of {len(reset.params)} parameter(s) went back to zero at step "
            f"{reset.step} of {_optimizer(stats, reset.optimizer)}"
            + (f": {reset.cause}" if reset.cause else "")
            + f" ({who}).{measured}",
            params=noisy or reset.params,
            evidence=evidence,
            severity=Severity.WARNING if noisy else Severity.INFO,
        )


def _optimizer(stats: WatchStats, index: int) -> str:
    opt = stats.optimizers.get(index)
    return f"{opt.cls}#{index}" if opt else f"optimizer #{index}"


def _ratios(
    effect: dict[str, tuple[float, float, float]], names: list[str]
) -> list[tuple[float, float]]:
    out = []
    for name in names:
        if name not in effect:
            continue
        before, first, after = effect[name]
        if before and before > 0 and math.isfinite(before):
            out.append((first / before, after / before))
    return out


@rule(
    code="DW304",
    name="skipped-steps",
    severity=Severity.WARNING,
    summary="Optimizer steps left parameters with non-zero gradients unchanged.",
    consumes=WatchStats,
)
def skipped_steps(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Counts steps that did not update parameters which had a gradient: steps a
    GradScaler (or DeepSpeed, which checks its own) skipped because it found inf/NaN
    gradients, with the parameters whose gradient held them, steps with a learning
    rate of 0, and, for small parameters, steps whose update was lost entirely (for
    example below the precision of a bf16 parameter). A few skips are normal (a
    GradScaler calibrating its scale, lr 0 on the first warm-up step) and reported
    as information; more than 5% of the steps is a warning.

    ## Why is this bad
    Each skipped step is a batch the model did not learn from, and the loss curve
    only shows it as slower progress. A GradScaler that keeps skipping means the
    gradients keep overflowing; updates lost to rounding mean the parameter's dtype
    cannot represent the step.

    ## Example
    ```python
    scaler.step(optimizer)  # silently skipped whenever a gradient is inf/NaN
    ```

    ## Fix
    Each finding gives the fix for its cause. GradScaler skips: find the overflow
    (deadweight's DW305, a lower learning rate, bf16 instead of fp16). A learning
    rate of 0: check the schedule. Updates lost by a bf16 or fp16 parameter: keep an
    fp32 master copy of it (the optimizer steps the copy), unless the parameter cannot
    learn at all (DW104/DW204: a normalization cancels it), whose noise-driven updates
    would then land and drift: pin it instead. Updates lost by a
    parameter that is already fp32: a master copy in fp32 changes nothing; the step
    is below fp32's resolution at the parameter's size (about 6e-8 of its value), so
    check the learning rate and why the parameter is so large.

    ## Evidence
    - `optimizer`: the optimizer whose steps were skipped.
    - `skipped`: how many steps (per cause), and `steps` watched.
    - `share`: the skipped share of the steps.
    - `cause`, `first_after_step`: why (a GradScaler, a zero learning rate, ...) and when first.
    - `dtypes`: for lost updates, each parameter's dtype (what the fix depends on).
    """
    for opt in stats.optimizers.values():
        skips = opt.scaler_skips
        if skips:
            total = _steps_tried(opt)
            share = len(skips) / max(1, total)
            culprits = _skip_culprits(stats, opt, minimum=1)
            yield get_rule("DW304").finding(
                f"{opt.skipper[0].upper()}{opt.skipper[1:]} skipped {len(skips)} of {total} steps of "
                f"{opt.cls}#{opt.index} ({share:.1%}), the first after step {skips[0]}"
                + (f"; inf/NaN gradients in {name_list(list(culprits))}." if culprits else "."),
                params=list(culprits),
                location=module_of(culprits) if culprits else None,
                evidence={
                    "optimizer": f"{opt.cls}#{opt.index}",
                    "skipped": len(skips),
                    "first_after_step": skips[0],
                    "share": share,
                    "nonfinite_on_skips": culprits,
                },
                fix="Find the overflow: DW305 names the parameters whose gradient held "
                "inf/NaN; lower the learning rate, or train in bf16 instead of fp16.",
                severity=_skip_severity(len(skips), share),
            )
    lost: dict[str, list[ParamTrack]] = {}
    for track in stats.params.values():
        if track.pinned or track.steps == 0:
            continue
        if track.lr0_steps:
            lost.setdefault("learning rate 0", []).append(track)
        if track.small_stats and track.small_stats.zero_updates > track.lr0_steps:
            lost.setdefault("update lost (non-zero lr and gradient, no change)", []).append(track)
    for cause, tracks in lost.items():
        counts = {
            t.name: int(
                t.lr0_steps
                if cause.startswith("learning")
                else (t.small_stats.zero_updates - t.lr0_steps if t.small_stats else 0)
            )
            for t in tracks
        }
        worst = max(counts.values())
        steps = max(t.steps for t in tracks)
        share = worst / max(1, steps)
        names = list(counts)
        evidence: dict[str, Any] = {"cause": cause, "steps": steps, "skipped": counts,
                                    "share": share}  # fmt: skip
        if cause.startswith("learning"):
            fix = ("Check the learning-rate schedule: a group at lr 0 (a warm-up that starts "
                   "at 0, a frozen group left in the optimizer) does not train.")  # fmt: skip
        else:
            evidence["dtypes"] = {t.name: t.dtype for t in tracks}
            fix = _lost_update_fix(tracks)
        yield get_rule("DW304").finding(
            f"{len(names)} parameter(s) had a gradient but were not updated on up to {worst} of "
            f"{steps} steps ({cause}): {name_list(names)}.",
            params=names,
            location=module_of(names),
            evidence=evidence,
            fix=fix,
            severity=_skip_severity(worst, share),
        )


# Dtypes whose few mantissa bits lose small updates, which an fp32 master copy keeps.
_LOW_PRECISION = ("bfloat16", "float16")


def _lost_update_fix(tracks: list[ParamTrack]) -> str:
    """An fp32 master copy for a bf16/fp16 parameter; for one that is already fp32 (or
    wider) that copy would be the parameter itself, so the fix is elsewhere."""
    low = [t.name for t in tracks if t.dtype in _LOW_PRECISION]
    wide = [t.name for t in tracks if t.dtype not in _LOW_PRECISION]
    parts = []
    if low:
        dtypes = "/".join(sorted({t.dtype for t in tracks if t.dtype in _LOW_PRECISION}))
        parts.append(
            f"Keep an fp32 master copy of {name_list(low)}: the optimizer steps the fp32 "
            f"copy and the model reads it in {dtypes}, which cannot hold steps this small "
            "at the parameter's size. Unless it cannot learn at all (a scalar a "
            "normalization cancels, DW104/DW204 at step 0): in fp32 its noise-driven "
            "updates would land and it would drift, so pin it (deadweight.pin) instead."
        )
    if wide:
        which = "/".join(sorted({t.dtype for t in tracks if t.dtype not in _LOW_PRECISION}))
        parts.append(
            f"{name_list(wide)} {'is' if len(wide) == 1 else 'are'} already {which}, so a "
            "master copy would change nothing: each step is below the resolution of the "
            "value (about 6e-8 of it in fp32) and rounds away. Check the learning rate (a "
            "schedule decayed to almost 0) and why the values are so large."
        )
    return " ".join(parts)


# Backward passes without a step that a watch still open takes for a finding: far
# past any gradient accumulation (a closed watch needs only one).
LIVE_BACKWARDS_WITHOUT_STEP = 256


@rule(
    code="DW309",
    name="no-steps",
    severity=Severity.WARNING,
    summary="Backward ran, but no watched optimizer ever stepped.",
    consumes=WatchStats,
)
def no_steps(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Counts backward passes (at the first and last parameter of each watched
    optimizer, or every scalar `.backward()` under `deadweight run`) and reports a
    watch in which backward ran but no watched optimizer's `step()` ever ran or was
    skipped by a GradScaler. Reported once the watch has closed, or while it runs
    after 256 backward passes without a step.

    ## Why is this bad
    Every other watch rule judges optimizer steps; with none, the report would be
    empty and read as healthy. Either the model does not train at all (the step is
    never called, or called on another optimizer than the one watched), or the
    steps happen somewhere deadweight cannot see.

    ## Example
    ```python
    opt = torch.optim.AdamW(model.parameters())
    with deadweight.watch(model, torch.optim.AdamW(model.parameters())):  # not `opt`
        ...  # loss.backward(); opt.step()
    ```

    ## Fix
    Watch the optimizer that steps (a framework's wrapper is fine: deadweight looks
    through accelerate, Lightning, Fabric and DeepSpeed). Check that `step()` is
    called, and for a custom optimizer that it subclasses `torch.optim.Optimizer`
    and calls its `__init__`.

    ## Evidence
    - `backwards`: backward passes counted.
    - `optimizers`: the optimizers watched (none: none was found).
    - `complete`: whether the watch had closed.
    """
    backwards = stats.backwards or 0
    if backwards == 0:
        return
    if not stats.complete and backwards < LIVE_BACKWARDS_WITHOUT_STEP:
        return
    if any(o.steps > o.start_step or o.scaler_skips for o in stats.optimizers.values()):
        return
    names = [f"{o.cls}#{o.index}" for o in stats.optimizers.values()]
    watched = f"the watched optimizer(s) {', '.join(names)}" if names else "no optimizer"
    yield get_rule("DW309").finding(
        f"Backward ran {backwards} time(s) but {watched} never stepped: nothing was "
        "trained or judged.",
        evidence={"backwards": backwards, "optimizers": names, "complete": stats.complete},
    )


def _steps_tried(opt: OptimizerTrack) -> int:
    """The optimizer's steps while watched, the skipped ones included."""
    return opt.steps - opt.start_step + len(opt.scaler_skips) - opt.skips_among_steps


def _skip_culprits(stats: WatchStats, opt: OptimizerTrack, minimum: int) -> dict[str, int]:
    """Parameters of `opt` whose gradient held inf/NaN on at least `minimum` of the steps
    a GradScaler skipped: name -> how many, most first."""
    found = {
        t.name: t.skipped_nonfinite
        for n in opt.params
        if (t := stats.params.get(n)) is not None
        and t.optimizer == opt.index
        and t.skipped_nonfinite >= minimum
    }
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def _skip_severity(count: int, share: float) -> Severity:
    limits = current()
    if count >= limits.skipped_steps_min and share >= limits.skipped_steps_share:
        return Severity.WARNING
    return Severity.INFO


def _persistent_overflow(stats: WatchStats) -> Iterator[Finding]:
    """A GradScaler that skipped most steps, because of the same parameters' gradients."""
    for opt in stats.optimizers.values():
        skips = len(opt.scaler_skips)
        total = _steps_tried(opt)
        if skips < current().skipped_steps_min or skips < total / 2:
            continue
        culprits = _skip_culprits(stats, opt, minimum=max(1, math.ceil(skips / 2)))
        if not culprits:
            continue
        names = list(culprits)
        yield get_rule("DW305").finding(
            f"The gradient of {name_list(names)} was NaN/Inf on up to {max(culprits.values())} "
            f"of the {skips} steps {opt.skipper} skipped ({skips} of {total} steps of "
            f"{opt.cls}#{opt.index}): "
            + (
                "a lower scale does not make it finite"
                if opt.skipper == "a GradScaler"
                else f"{opt.skipper} skips every step it is not finite on"
            )
            + ", so the model no longer trains.",
            params=names,
            location=module_of(names),
            evidence={
                "optimizer": f"{opt.cls}#{opt.index}",
                "steps": total,
                "skipped": skips,
                "nonfinite_on_skips": culprits,
            },
        )


@rule(
    code="DW305",
    name="non-finite",
    severity=Severity.ERROR,
    summary="A gradient or parameter value became NaN or Inf.",
    consumes=WatchStats,
)
def non_finite(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Checks every gradient for NaN/Inf at every step (one fused norm on the device,
    read back at the next watched step) and every parameter at each watched step,
    and reports the first step and parameter where it happened. Gradients on a step
    a GradScaler (or DeepSpeed) skipped are the scaler's to handle (it lowers its
    scale and tries again), unless it keeps skipping: when at least half of an optimizer's steps
    were skipped, the parameters whose gradient was inf/NaN on at least half of
    those skips are reported, since no lower scale makes them finite and the run no
    longer trains.

    ## Why is this bad
    One non-finite gradient that reaches the optimizer turns the parameter, and
    Adam's moments, into NaN for good; the loss follows some steps later, far from
    the cause.

    ## Example
    ```python
    loss = (logits.exp() / logits.exp().sum()).log()  # overflows for large logits
    ```

    ## Fix
    Look at the first parameter and step reported: the layer that produced it is
    where the overflow starts. Use numerically stable ops (log_softmax), a lower
    learning rate, gradient clipping, or a GradScaler under fp16.

    ## Evidence
    - `first_step`, `first_param`, `first_kind`: where the first NaN or Inf appeared (in a
      gradient or a value).
    - `per_param`: per parameter, the first step of each kind.
    - For a GradScaler that keeps skipping: `optimizer`, `steps`, `skipped`, and
      `nonfinite_on_skips` (per parameter, on how many skipped steps).
    """
    yield from _persistent_overflow(stats)
    events = [
        (step, what, t.name) for t in stats.params.values() for what, step in t.nonfinite.items()
    ]
    if not events:
        return
    events.sort()
    step, what, name = events[0]
    names = sorted({n for _, _, n in events}, key=lambda n: min(s for s, _, m in events if m == n))
    yield get_rule("DW305").finding(
        f"The {what} of {name} became NaN/Inf at step {step}"
        + (f"; {len(names) - 1} more parameter(s) followed" if len(names) > 1 else "")
        + ".",
        params=names,
        location=module_of(name),
        evidence={
            "first_step": step,
            "first_param": name,
            "first_kind": what,
            "per_param": {n: {w: s for s, w, m in events if m == n} for n in names},
        },
    )


@rule(
    code="DW306",
    name="intermittent-gradient",
    severity=Severity.INFO,
    summary="A parameter gets a gradient on some steps and none on others.",
    consumes=WatchStats,
)
def intermittent_gradient(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Counts, per parameter, the optimizer steps on which its gradient was present
    (not None). Parameters with a gradient on some steps but not all are reported
    with the fraction; below half of the steps it is a warning.

    ## Why is this bad
    A parameter without a gradient is skipped by the optimizer on that step. That is
    by design for mixture-of-experts experts or conditional branches, but an expert
    routed on 2% of the steps is barely trained, and a branch that only some batches
    reach may be a data or routing bug.

    ## Example
    ```python
    out = self.experts[router(x).argmax()](x)  # most experts get no gradient this step
    ```

    ## Fix
    For mixture-of-experts, check the router's load balance (an auxiliary balancing
    loss, capacity factors). For conditional code, make sure every branch is taken
    often enough, or give the rarely used parameters their own learning rate.

    ## Evidence
    - `fraction_with_grad`: per parameter, the share of the steps with a gradient.
    """
    by_severity: dict[Severity, list[ParamTrack]] = {}
    for track in stats.params.values():
        if track.group is None or track.steps == 0 or track.pinned:
            continue
        if 0 < track.grad_present < track.steps:
            fraction = track.grad_present / track.steps
            sev = (
                Severity.WARNING if fraction < current().intermittent_warn_below else Severity.INFO
            )
            by_severity.setdefault(sev, []).append(track)
    for severity, tracks in by_severity.items():
        fractions = {t.name: t.grad_present / t.steps for t in tracks}
        names = sorted(fractions, key=fractions.__getitem__)
        low = fractions[names[0]]
        yield get_rule("DW306").finding(
            f"{len(names)} parameter(s) got a gradient on only part of the steps "
            f"({name_list(names)}; the rarest on {low:.1%} of {max(t.steps for t in tracks)} steps).",
            params=names,
            location=module_of(names),
            evidence={"fraction_with_grad": fractions},
            severity=severity,
        )


@rule(
    code="DW307",
    name="layer-outlier",
    severity=Severity.WARNING,
    summary="One layer's parameter stands far out from the same parameter in other layers.",
    consumes=WatchStats,
)
def layer_outlier(stats: WatchStats) -> Iterator[Finding]:
    """
    ## What it does
    Groups parameters whose names are equal up to a layer index (`layers.{i}.X`,
    three layers or more of one shape) and compares one number per layer: the value for
    single-element parameters, the RMS otherwise, by magnitude (a sign alone sets
    no layer apart). A layer is an outlier when its robust z-score (from the median
    and the median absolute deviation, on a log scale unless a value is exactly 0)
    is at least 5 and it differs from the median by a factor of 2 or more (by one
    median's size when a value is 0). The finding gives the first watched step at
    which it stood out.

    ## Why is this bad
    Layers of one model are built alike and usually train alike. One that stands
    out is often a parameter the loss does not constrain (second incident: 56.25
    among values of 0.2 to 1.3), a layer that diverged, or one that never trained.
    Even when the loss is fine, such a value ruins quantization ranges.

    ## Example
    ```text
    blocks.{0-30}.layer_scalar: 0.2 .. 1.3     blocks.31.layer_scalar: 56.25
    ```

    ## Fix
    Find out why that layer differs: DW302 says whether it drifts without a
    gradient (then `deadweight.pin` it), DW301 whether it never moved.

    ## Evidence
    - `template`: the name shared by the layers (`blocks.{}.layer_scalar`).
    - `statistic`: what is compared (value, norm, update size, ...).
    - `value`, `median`, `robust_z`: the outlier's value, its siblings' median, its robust z.
    - `since_step`: the first watched step it stood out at.
    - `values`: every layer's value.
    """
    groups = homologous_groups(stats.params, lambda n: stats.params[n].shape)
    for template, members in groups.items():
        tracks = [stats.params[n] for _, n in members]
        if any(t.pinned for t in tracks) or len({t.optimizer for t in tracks}) > 1:
            continue
        length = min(len(t.series.steps) for t in tracks)
        if length == 0:
            continue
        found = None
        for k in range(length):
            values = [_layer_value(t, k) for t in tracks]
            if any(v is None for v in values):
                continue
            hit = robust_outlier([float(v) for v in values if v is not None])
            if hit is not None and found is None:
                found = (k, hit)
            elif hit is None:
                found = None  # it must still stand out at the end
        if found is None:
            continue
        k0, _ = found
        last_values = [
            float(v) if v is not None else math.nan
            for v in (_layer_value(t, length - 1) for t in tracks)
        ]
        index, z = robust_outlier(last_values) or found[1]
        outlier = tracks[index]
        median = statistics.median(v for k, v in enumerate(last_values) if k != index)
        kind = "value" if outlier.numel == 1 else "RMS"
        yield get_rule("DW307").finding(
            f"{outlier.name} has {kind} {last_values[index]:.4g} while its {len(tracks) - 1} "
            f"siblings {template} have median {median:.4g} (robust z = {z:.1f}); it has stood "
            f"out since step {outlier.series.steps[k0]}.",
            params=[outlier.name],
            location=module_of(outlier.name),
            evidence={
                "template": template,
                "statistic": kind,
                "value": last_values[index],
                "median": median,
                "robust_z": z,
                "since_step": outlier.series.steps[k0],
                "values": {t.name: v for t, v in zip(tracks, last_values, strict=True)},
            },
        )


def _layer_value(track: ParamTrack, k: int) -> float | None:
    if track.numel == 1 and len(track.series.value) > k and track.series.value[k]:
        return track.series.value[k][0]
    norm = track.series.param_norm[k] if k < len(track.series.param_norm) else None
    return norm / math.sqrt(track.numel) if norm is not None and track.numel else None
