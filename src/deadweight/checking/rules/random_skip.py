"""DW110: modules skipped at random in the checked forward (LayerDrop, stochastic depth)."""

from __future__ import annotations

from collections.abc import Iterator

from deadweight.checking.check_stats import GradFlowStats
from deadweight.findings import Finding, Location, Severity
from deadweight.registry import get_rule, rule


@rule(
    code="DW110",
    name="skipped-at-random",
    severity=Severity.INFO,
    summary="A module sat out the checked forward by chance (LayerDrop); it runs on other steps.",
    consumes=GradFlowStats,
)
def skipped_at_random(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    When a module never ran in the checked forward, `check` re-runs the forward
    under no_grad with up to three other random states and notes which modules
    take part. A module that runs in some of those draws was skipped at random, as
    LayerDrop (wav2vec2, HuBERT, BART-family `encoder_layerdrop`) and stochastic
    depth do in train mode. If a redraw ran more of the model, the check measures
    that draw instead, so a real cut inside a skipped layer is still reported.
    This finding names the modules, how many of the forwards they ran in, and the
    setting that skips them when the model keeps one by a known name.

    A module that runs in none of the draws is skipped by the data or the code (an
    expert no token is routed to, a head the loss does not use) and stays DW101.

    ## Why is this bad
    It is not: a layer skipped with probability p gets gradients on a fraction
    1 - p of the steps. The finding says why those parameters had no gradient in
    one forward, so that it is not mistaken for a cut. `watch` shows the same layers
    as intermittent (DW306), with the measured fraction.

    ## Example
    ```python
    model = Wav2Vec2ForSequenceClassification(Wav2Vec2Config(layerdrop=0.1))
    model.train()
    deadweight.check(model, loss_fn)
    # DW110 info: module wav2vec2.encoder.layers.1 was skipped at random in the
    #   checked forward (layerdrop=0.1); it ran in 3 of 4 forwards
    ```

    ## Fix
    Nothing to fix. To check one fixed forward, set the skip probability to 0 for
    the check (`config.layerdrop = 0.0`) or check the model in a state where it
    does not skip.

    ## Evidence
    - `modules`: per module, `ran` (forwards it ran in), `draws` (forwards looked
      at: the checked one and the redraws), `in_report` (whether it sat out the
      forward this report is about), `params` (trainable parameters under it).
    - `option`: the setting that skips them ("layerdrop=0.1"), when known.
    """
    skips = list(stats.random_skips.values())
    if not skips:
        return
    options = sorted({s.option for s in skips if s.option})
    why = f" ({', '.join(options)})" if options else " (LayerDrop or stochastic depth)"
    low, high = min(s.ran for s in skips), max(s.ran for s in skips)
    counts = f"{low}" if low == high else f"{low} to {high}"
    draws = max(s.draws for s in skips)
    names = ", ".join(f"`{s.module}`" for s in skips[:3])
    more = f" and {len(skips) - 3} more" if len(skips) > 3 else ""
    n = len(skips)
    measured = [s for s in skips if s.in_measured]
    if measured:
        tail = (
            f"{'each' if n > 1 else 'it'} ran in {counts} of {draws} forwards, so "
            f"{'their' if n > 1 else 'its'} parameters get gradients on most steps"
        )
    else:
        tail = (
            f"{'each' if n > 1 else 'it'} ran in {counts} of {draws} forwards, and this report "
            "is about a redrawn forward in which every module ran"
        )
    message = (
        f"Module{'s' if n > 1 else ''} {names}{more} "
        f"{'were' if n > 1 else 'was'} skipped at random in the checked forward{why}; {tail}."
    )
    evidence: dict[str, object] = {
        "modules": {
            s.module: {
                "type": s.module_type,
                "ran": s.ran,
                "draws": s.draws,
                "in_report": s.in_measured,
                "params": len(s.params),
            }
            for s in skips
        }
    }
    if options:
        evidence["option"] = options[0] if len(options) == 1 else options
    yield get_rule("DW110").finding(
        message,
        params=[p for s in measured for p in s.params],
        location=Location(module=skips[0].module),
        evidence=evidence,
        fix="Nothing to do: the skipped layers learn on the steps they run.",
    )
