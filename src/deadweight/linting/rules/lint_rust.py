"""DW511: candle kernels that record no backward, called in code that may train."""

from __future__ import annotations

from collections.abc import Iterator

from deadweight.findings import Finding, Severity
from deadweight.linting.rules._source import location
from deadweight.linting.rust_facts import RustSourceFacts
from deadweight.registry import get_rule, rule


@rule(
    code="DW511",
    name="fused-op-no-backward",
    severity=Severity.WARNING,
    summary="A candle fused kernel that records no backward op (softmax_last_dim, rms_norm, RmsNorm::forward, ...).",
    consumes=RustSourceFacts,
)
def fused_op_no_backward(facts: RustSourceFacts) -> Iterator[Finding]:
    """
    ## What it does
    Finds calls in Rust sources of the candle_nn kernels that build their result
    with `apply_op*_no_bwd`: `ops::softmax_last_dim`, `ops::rms_norm`,
    `ops::layer_norm`, `ops::sdpa`, `rotary_emb::rope` / `rope_i` / `rope_thd`;
    `forward` of a candle_nn `RmsNorm` or `LayerNorm` through the `Module` trait
    (`norm.forward(&x)`, `x.apply(&norm)`), which takes the fused kernel on
    contiguous input; and any `apply_op1_no_bwd` / `apply_op2_no_bwd` /
    `apply_op3_no_bwd` of your own. Names are resolved through the file's `use`
    declarations; a type of your own called `RmsNorm` is not candle's.

    ## Why is this bad
    The result carries no backward op, so `loss.backward()` stops there without an
    error: every variable before the call, and the norm's own weight, gets no
    gradient, and `Optimizer::step` skips them silently. In the first incident
    (Linear → RmsNorm → Linear, SGD) the first layer and the norm weight did not
    move once in 1000 steps while the loss fell to a plateau of 0.00075; with
    `forward_diff` it kept falling to 0.00053.

    ## Example
    ```rust
    let h = norm.forward(&h)?;                    // DW511: use norm.forward_diff(&h)
    let p = candle_nn::ops::softmax_last_dim(&h)?; // DW511: use ops::softmax(&h, D::Minus1)
    ```

    ## Fix
    In training code use the differentiable version the message names:
    `RmsNorm::forward_diff`, `ops::softmax(&xs, D::Minus1)`, `ops::rms_norm_slow`,
    `ops::layer_norm_slow` (LayerNorm with a bias has no `forward_diff`),
    `rotary_emb::rope_slow` / `rope_i_slow`. They are 9-13x slower on Metal, so
    models that serve and train can switch on a flag. Files or functions that only
    run inference can be marked in `[tool.deadweight] inference-only`
    (`"src/generate.rs"`, `"src/model.rs::generate"`), or a line silenced with
    `// deadweight: ignore[DW511]`.

    ## Evidence
    - `op`: the candle kernel called.
    - `replacement`: the differentiable replacement.
    """
    rule_ = get_rule("DW511")
    for call in facts.calls:
        replacement = call.replacement
        if call.op.endswith("::forward"):
            kind = call.op.split("::")[0]
            receiver = (call.receiver or "norm").lstrip("&")
            what = (
                f"`{receiver}` is a candle_nn {kind}, whose Module::forward takes a fused "
                "kernel that records no backward op"
            )
            replacement = replacement.replace("norm.", f"{receiver}.", 1)
        else:
            what = f"`{call.op}` records no backward op"
        yield rule_.finding(
            f"{what}: nothing before it gets a gradient when this runs in training. "
            f"Use {replacement}.",
            location=location(facts.path, call.span, call.function),
            evidence={"op": call.op, "replacement": call.replacement},
        )
