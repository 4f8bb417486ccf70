"""DW4xx: what saved checkpoints show, from any framework that writes them."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterator

from deadweight.checkpoints.scan_stats import DiffStats, InspectStats, TrendStats
from deadweight.findings import Finding, Severity
from deadweight.homologous import homologous_groups, robust_outlier
from deadweight.registry import get_rule, rule
from deadweight.thresholds import current
from deadweight.wording import module_of, name_list

# A value that moved the same way at every save, over at least `trend-min-saves` saves,
# by at least `trend-min-relative` of its starting size, is drifting (defaults and their
# reasons in deadweight.thresholds).


@rule(
    code="DW401",
    name="never-learned",
    severity=Severity.WARNING,
    summary="A floating-point tensor is bitwise identical in two checkpoints of one run.",
    consumes=DiffStats,
)
def never_learned(stats: DiffStats) -> Iterator[Finding]:
    """
    ## What it does
    Compares every floating-point tensor present in both checkpoints (same name,
    shape and dtype) bit for bit, and lists those that did not change at all.

    ## Why is this bad
    Between two saves of a training run every trained tensor moves. One that is
    bitwise identical received no update: no gradient reached it (the first
    incident: a fused kernel without backward left the first layer and the norm
    weight at `max |change| = 0` after 1000 steps), it is missing from the
    optimizer, or its learning rate is 0. Intentionally frozen tensors (a frozen
    backbone under LoRA) show up here too; ignore them by name.

    ## Example
    ```text
    deadweight diff step-0.safetensors step-1000.safetensors
    ```

    ## Fix
    Run `deadweight check` on the model to find where gradients stop (DW101/DW102),
    or add the parameters to the optimizer. If the tensors are frozen on purpose,
    `--ignore DW401` or filter them out.

    ## Evidence
    - `a`, `b`: the two checkpoints.
    - `unchanged`: how many tensors are bitwise identical, of `compared`.
    """
    unchanged = [d.name for d in stats.tensors.values() if d.unchanged]
    if not unchanged:
        return
    everything = len(unchanged) == len(stats.tensors)
    yield get_rule("DW401").finding(
        f"{len(unchanged)} of {len(stats.tensors)} floating-point tensor(s) are bitwise "
        f"unchanged between {stats.a} and {stats.b}: {name_list(unchanged)}."
        + (" Every tensor is identical: the same checkpoint twice?" if everything else ""),
        params=unchanged,
        location=module_of(unchanged),
        evidence={
            "a": stats.a,
            "b": stats.b,
            "unchanged": len(unchanged),
            "compared": len(stats.tensors),
        },
    )


@rule(
    code="DW402",
    name="checkpoint-layer-outlier",
    severity=Severity.WARNING,
    summary="One layer's tensor stands far out from the same tensor in the other layers.",
    consumes=InspectStats,
)
def checkpoint_layer_outlier(stats: InspectStats) -> Iterator[Finding]:
    """
    ## What it does
    Groups tensors whose names are equal up to a layer index (`layers.{i}.X`, three
    layers or more of one shape) and compares one number per layer: the magnitude of
    the value for single-element tensors, the RMS otherwise. A layer is an outlier
    when its robust z-score (median and median absolute deviation, on a log scale
    unless a value is exactly 0) is at least 5 and it differs from the median by a
    factor of 2 or more.

    ## Why is this bad
    Layers of one model are built alike and train alike. The second incident was
    found exactly this way: a routine look at a checkpoint showed 31 layer scalars
    between 0.2 and 1.3 and the last one at 56.25, drifting because the final RMSNorm
    cancelled it.

    ## Example
    ```text
    layers.{0-30}.layer_scalar: 0.2 .. 1.3     layers.31.layer_scalar: 56.25
    ```

    ## Fix
    Find out why that layer differs: `deadweight check` on the model tells whether a
    normalization cancels it (DW104), `deadweight.watch` whether it drifts without a
    gradient (DW302). Pin it with `deadweight.pin` if it has no use.

    ## Evidence
    - `checkpoint`: the file.
    - `template`: the name shared by the layers (`layers.{}.attn.q_proj.weight`).
    - `statistic`: what is compared (RMS, absmax, value).
    - `value`, `siblings_median`, `siblings_range`, `robust_z`: the outlier against the rest.
    - `values`: the statistic of every layer of the group, by tensor name.
    """
    for scan in stats.scans:
        shapes = {n: t.shape for n, t in scan.tensors.items()}
        for template, members in homologous_groups(scan.tensors, shapes.__getitem__).items():
            tensors = [scan.tensors[n] for _, n in members]
            if not all(t.analysed and not t.nonfinite for t in tensors):
                continue
            values = [t.value if t.numel == 1 else t.rms for t in tensors]
            hit = robust_outlier([float(v) for v in values if v is not None])
            if hit is None or any(v is None for v in values):
                continue
            index, z = hit
            outlier = tensors[index]
            others = [v for k, v in enumerate(values) if k != index and v is not None]
            kind = "value" if outlier.numel == 1 else "RMS"
            yield get_rule("DW402").finding(
                f"{outlier.name} in {scan.path} has {kind} {values[index]:.4g} while its "
                f"{len(others)} siblings {template} have median {statistics.median(others):.4g} "
                f"(robust z = {z:.1f}).",
                params=[outlier.name],
                location=module_of(outlier.name),
                evidence={
                    "checkpoint": scan.path,
                    "template": template,
                    "statistic": kind,
                    "value": values[index],
                    "siblings_median": statistics.median(others),
                    "siblings_range": [min(others), max(others)],
                    "robust_z": z,
                    "values": {t.name: v for t, v in zip(tensors, values, strict=True)},
                },
            )


@rule(
    code="DW403",
    name="quantization-risk",
    severity=Severity.WARNING,
    summary="A tensor's range is set by a few outliers, leaving the bulk few bits when quantized.",
    consumes=InspectStats,
)
def quantization_risk(stats: InspectStats) -> Iterator[Finding]:
    """
    ## What it does
    For the chosen scheme (`--scheme`, default int4 per group of 128, symmetric) it
    computes, per block the quantizer scales together, the effective bits left for
    the bulk of the values: bits - log2(range with the outliers / range of the bulk),
    and the fraction of weights that round to zero, checked by fake-quantizing the
    tensor. Each layer scalar is also tried quantized together with the largest
    weight of its layer, as a per-tensor scheme over a fused layer would do.

    ## Why is this bad
    Quantization spends its levels on the whole range. One value far out (the
    incident's 56.25 next to weights in [-2, 2]) leaves 4 - log2(56.25 / 2) = -0.8
    bits for everything else under INT4: the weights collapse to zero, a failure no
    training metric shows.

    ## Example
    ```text
    deadweight inspect model.safetensors --scheme int4
    ```

    ## Fix
    Find out why the outlier exists (DW402, DW302) and fix it in training (pin a
    cancelled scalar). For deployment, keep such tensors out of quantization, use a
    finer granularity (per channel or per group), or fold scalars into the weights
    they multiply before quantizing.

    ## Evidence
    - `checkpoint`, `scheme`: the file and the quantization scheme judged.
    - `effective_bits`: the bits left to the bulk of the worst block.
    - `zero_fraction`: the share of elements that round to zero.
    - `range_ratio`: the block's range over its bulk (99.9th percentile).
    - `worst_block`, `outliers`: where the range is set, and by which elements.
    - `measured_error`: the relative error of quantizing and dequantizing the tensor.
    - `verdict`: `broken`, `degraded` or `ok`.
    - `quantized_with`: for a layer scalar, the weight it is quantized together with.
    """
    for scan in stats.scans:
        for name, risk in scan.quant.items():
            if risk.verdict == "ok":
                continue
            yield get_rule("DW403").finding(
                f"{name} in {scan.path} keeps {risk.effective_bits:.1f} effective bits for its bulk "
                f"under {risk.scheme} ({risk.outliers} outlier(s) stretch its range "
                f"{risk.range_ratio:.1f}x; {risk.zero_fraction:.0%} of its weights round to 0).",
                params=[name],
                location=module_of(name),
                evidence=_risk_evidence(scan.path, risk),
                severity=Severity.WARNING if risk.verdict == "broken" else Severity.INFO,
            )
        for name, (partner, risk) in scan.joint.items():
            if risk.verdict == "ok":
                continue
            value = scan.tensors[name].value
            yield get_rule("DW403").finding(
                f"Layer scalar {name} = {value:.4g} in {scan.path}, quantized together with "
                f"{partner} under {risk.scheme}, leaves its weights {risk.effective_bits:.1f} "
                f"effective bits ({risk.zero_fraction:.0%} round to 0).",
                params=[name],
                location=module_of(name),
                evidence={**_risk_evidence(scan.path, risk), "quantized_with": partner},
                severity=Severity.WARNING if risk.verdict == "broken" else Severity.INFO,
            )


def _risk_evidence(path: str, risk: object) -> dict[str, object]:
    fields = ("scheme", "effective_bits", "zero_fraction", "range_ratio", "worst_block",
              "outliers", "measured_error", "verdict")  # fmt: skip
    return {"checkpoint": path, **{f: getattr(risk, f) for f in fields}}


@rule(
    code="DW404",
    name="checkpoint-non-finite",
    severity=Severity.ERROR,
    summary="A saved tensor holds NaN or Inf values.",
    consumes=InspectStats,
)
def checkpoint_non_finite(stats: InspectStats) -> Iterator[Finding]:
    """
    ## What it does
    Counts NaN and Inf values in every floating-point tensor of the checkpoint.

    ## Why is this bad
    A non-finite weight makes every output it touches NaN. Saved, it survives into
    fine-tuning, evaluation and deployment, and resuming from it cannot recover.

    ## Example
    ```text
    layers.3.attn.q_proj.weight: 12 NaN
    ```

    ## Fix
    Resume from an earlier checkpoint, and find the first step where values became
    non-finite with `deadweight.watch` (DW305).

    ## Evidence
    - `checkpoint`: the file.
    - `nonfinite`: per tensor, the count of NaN and Inf values.
    """
    for scan in stats.scans:
        bad = {n: t.nonfinite for n, t in scan.tensors.items() if t.nonfinite}
        if bad:
            names = list(bad)
            yield get_rule("DW404").finding(
                f"{len(names)} tensor(s) in {scan.path} hold NaN/Inf values: {name_list(names)}.",
                params=names,
                location=module_of(names),
                evidence={"checkpoint": scan.path, "nonfinite": bad},
            )


@rule(
    code="DW405",
    name="monotone-drift",
    severity=Severity.WARNING,
    summary="A single-element parameter moved the same way at every save of a series.",
    consumes=TrendStats,
)
def monotone_drift(stats: TrendStats) -> Iterator[Finding]:
    """
    ## What it does
    Follows every single-element tensor (layer scalars, gates, temperatures) across a
    series of checkpoints ordered by step, and flags one that rose (or fell) at every
    save, over at least 4 saves, by at least 10% of its first value. The rate per
    step is given when the file names carry the steps.

    ## Why is this bad
    A learning scalar settles; one that moves the same way at every save is being
    pushed by something other than the loss. In the second incident the last layer's
    scalar rose steadily from 1.0 to 56.25 (0.00013 per step, then 0.0007 after an
    optimizer reset) while the loss did not change.

    ## Example
    ```text
    layers.31.layer_scalar: 1.0, 4.2, 9.8, 21.5, 56.25 at steps 0, 10k, 20k, 35k, 53k
    ```

    ## Fix
    Check whether the loss can see the parameter (`deadweight check`, DW104) and
    whether it drifts on noise (`deadweight.watch`, DW302); pin it or remove it.

    ## Evidence
    - `values`, `steps`: the value at each save and the save's step.
    - `first`, `last`, `rate_per_step`: the change over the series.
    """
    limits = current()
    for name, values in stats.values.items():
        points = [(k, v) for k, v in enumerate(values) if v is not None and math.isfinite(v)]
        if len(points) < limits.trend_min_saves:
            continue
        deltas = [b[1] - a[1] for a, b in itertools.pairwise(points)]
        if not (all(d > 0 for d in deltas) or all(d < 0 for d in deltas)):
            continue
        first, last = points[0][1], points[-1][1]
        if abs(last - first) < limits.trend_min_relative * max(abs(first), 1e-12):
            continue
        steps = [stats.steps[k] for k, _ in points]
        rate = None
        if all(s is not None for s in steps) and steps[-1] != steps[0]:
            rate = (last - first) / (steps[-1] - steps[0])  # type: ignore[operator]
        direction = "rose" if last > first else "fell"
        yield get_rule("DW405").finding(
            f"{name} {direction} at every one of {len(points)} saves, {first:.4g} -> {last:.4g}"
            + (f", {rate:+.3g} per step" if rate is not None else "")
            + ".",
            params=[name],
            location=module_of(name),
            evidence={
                "values": [v for _, v in points],
                "steps": steps,
                "rate_per_step": rate,
                "first": first,
                "last": last,
            },
        )


# Under half: most of the smaller file's tensors found no partner, so the diff's verdict
# (DW401 above all) covers a minority of the model; two saves of one run share every name.
_MIN_MATCHED_SHARE = 0.5
_EXAMPLES = 5  # unmatched names per side in the evidence


@rule(
    code="DW406",
    name="checkpoint-names-unmatched",
    severity=Severity.WARNING,
    summary="Two checkpoints compared by diff share under half of their tensor names.",
    consumes=DiffStats,
)
def checkpoint_names_unmatched(stats: DiffStats) -> Iterator[Finding]:
    """
    ## What it does
    Counts the tensors found in both checkpoints under one name, and reports the
    diff when they are under half of the tensors of the smaller checkpoint. Before
    counting, `diff` removes the prefixes wrappers add to every name where that
    matches more tensors: `_orig_mod.` (torch.compile), `module.`
    (DistributedDataParallel, DataParallel), `_fsdp_wrapped_module.` (FSDP),
    `_checkpoint_wrapped_module.` (activation checkpointing); the output says which it
    removed.

    ## Why is this bad
    `diff` judges only the tensors it can pair. Two saves of one run share every
    name; when most names differ, every unpaired tensor is listed as added or removed
    and DW401 says nothing about it, so "no findings" would mean nothing: the files
    are of different models, or a wrapper renamed the tensors in a way deadweight does
    not undo.

    ## Example
    ```text
    deadweight diff eager.pt compiled-with-a-custom-wrapper.pt
    DW406: Only 1 of the 17 tensors of eager.pt matches a tensor of renamed.pt by name, ...
    ```

    ## Fix
    Diff two checkpoints of the same model. If a wrapper renamed the tensors, save
    the unwrapped model's state dict (`model._orig_mod.state_dict()`,
    `ddp_model.module.state_dict()`), or rename the keys before saving.

    ## Evidence
    - `a`, `b`: the two checkpoints.
    - `tensors_a`, `tensors_b`: how many tensors each lists.
    - `matched`: how many names both share (after any prefix was removed).
    - `only_in_a`, `only_in_b`: a few of the names each file has alone.
    - `renamed`: the prefixes removed before matching, per side.
    """
    smaller = min(stats.names_a, stats.names_b)
    if smaller == 0 or stats.matched >= _MIN_MATCHED_SHARE * smaller:
        return
    side = stats.a if stats.names_a <= stats.names_b else stats.b
    other = stats.b if side == stats.a else stats.a
    examples = stats.removed[:1] + stats.added[:1]
    renamed = (
        "even after removing the prefix(es) "
        + ", ".join(f"`{r.prefix}` from {r.side}" for r in stats.renamed)
        if stats.renamed
        else "and no wrapper prefix deadweight knows (`_orig_mod.`, `module.`, "
        "`_fsdp_wrapped_module.`, `_checkpoint_wrapped_module.`) explains the difference"
    )
    yield get_rule("DW406").finding(
        (f"Only {stats.matched}" if stats.matched else "None")
        + f" of the {smaller} tensors of {side} "
        + ("match" if stats.matched > 1 else "matches")
        + f" a tensor of {other} by name, {renamed}: the diff says nothing about the other "
        f"{smaller - stats.matched} ({len(stats.removed)} only in {stats.a}, "
        f"{len(stats.added)} only in {stats.b}"
        + (f", e.g. {' and '.join(examples)}" if examples else "")
        + "). Are these checkpoints of the same model?",
        evidence={
            "a": stats.a,
            "b": stats.b,
            "tensors_a": stats.names_a,
            "tensors_b": stats.names_b,
            "matched": stats.matched,
            "only_in_a": stats.removed[:_EXAMPLES],
            "only_in_b": stats.added[:_EXAMPLES],
            "renamed": [f"{r.prefix} from {r.side}" for r in stats.renamed],
        },
    )
