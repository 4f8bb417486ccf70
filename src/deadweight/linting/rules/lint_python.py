"""DW501-DW504: patterns in PyTorch source that lose gradients before a run starts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from deadweight.findings import Finding, Severity
from deadweight.linting.python_facts import (
    PythonRunFacts,
    PythonSourceFacts,
    RankDecayChoice,
    ScalarParameter,
)
from deadweight.linting.rules._source import location
from deadweight.registry import get_rule, rule

_CUT_WORDING = {
    "no_grad": "is read under `torch.no_grad()`",
    "inference_mode": "is read under `torch.inference_mode()`",
    "set_grad_enabled(False)": "is read under `torch.set_grad_enabled(False)`",
    "no_grad decorator": "is read in a function decorated with `{construct}`",
    "detach": "is detached (`.detach()`)",
    ".data": "is read through `.data`",
    "item": "becomes a Python number (`.item()`)",
    "tolist": "becomes a Python list (`.tolist()`)",
    "numpy": "becomes a numpy array (`.numpy()`)",
    "float()": "becomes a Python float (`float()`)",
    "tensor rebuild": "is copied into a new tensor (`{construct}`)",
    "new_tensor": "is copied into a new tensor (`new_tensor`)",
}


def _access(name: str) -> str:
    """An attribute path as the source spells it: "transformer.h.0" -> `self.transformer.h[0]`."""
    text = "self"
    for part in name.split("."):
        text += (
            f"[{part}]" if part.isdigit() else f".{part}" if part.isidentifier() else f"[{part!r}]"
        )
    return f"`{text}`"


def _names(names: list[str]) -> str:
    quoted = [_access(n) for n in names]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


@rule(
    code="DW501",
    name="forward-gradient-cut",
    severity=Severity.WARNING,
    summary="A module's own parameter or submodule reaches forward's output only through a gradient cut.",
    consumes=PythonSourceFacts,
)
def forward_gradient_cut(facts: PythonSourceFacts) -> Iterator[Finding]:
    """
    ## What it does
    Follows each parameter and trainable submodule a class creates in `__init__`
    (`self.w = nn.Parameter(...)`, `self.proj = nn.Linear(...)`) through `forward`
    and the methods and functions of the same file it calls, and reports the place
    where every value of it that reaches forward's output has lost its gradient:
    a `torch.no_grad()` / `torch.inference_mode()` block or decorator, `.detach()`,
    `.data`, `.item()` / `.tolist()` / `.numpy()` / `float()` turned back into tensor
    math, or a tensor rebuilt with `torch.tensor(...)`.

    Containers built in place are followed member by member: nanoGPT's and minGPT's
    `self.transformer = nn.ModuleDict(dict(wte=..., h=nn.ModuleList([...]),
    ln_f=...))` gives `self.transformer.wte`, `self.transformer.h` and
    `self.transformer.ln_f`, reached by attribute, key or index
    (`self.transformer["ln_f"]`, `self.mlp[0]`) and by loops over them; a key known
    only at run time reaches every member. A container built from a comprehension or
    `*layers`, or changed after it is built, counts as one submodule. A lambda stored
    on the module (minGPT's `self.mlpf = lambda x: m.c_proj(m.c_fc(x))`) is followed
    where it is called.

    It stays quiet when any value of the attribute reaches an output with its
    gradient intact (a straight-through estimator, a detached copy kept for
    logging, a stop-gradient on one of two branches, a weight tied to one that
    learns, as nanoGPT's `wte` is to `lm_head`), when the cut value never
    reaches the output (a metric, a printed loss, a shape), when the class turns
    the gradient off itself (`requires_grad_(False)`, `requires_grad = False`), and
    for classes that run their own backward pass (reversible layers).

    ## Why is this bad
    Nothing fails: backward runs, the optimizer steps, the loss falls. The
    parameters behind the cut simply never receive a gradient, so the optimizer
    skips them; the first incident's norm weight and first layer stayed at their
    initial values for 1000 steps behind a fused kernel that recorded no backward.
    In PyTorch the same cut is one `torch.no_grad()` around a lookup "that needs no
    gradient" whose table is a trainable weight.

    ## Example
    ```python
    def _bias(self, buckets):
        with torch.no_grad():          # DW501: self.rel_pos_bias never learns
            return self.rel_pos_bias.weight[:, buckets]
    ```

    ## Fix
    Compute the trainable part outside the cut: keep only index arithmetic
    (buckets, masks, positions) under `no_grad`, and use the tensor itself rather
    than `.detach()`, `.data` or `.item()`. If the attribute is frozen on purpose,
    say so in `__init__` with `self.<name>.requires_grad_(False)` (which also keeps it
    out of the optimizer), or add `# deadweight: ignore[DW501]` on the line.

    ## Evidence
    - `class`: the module class.
    - `attributes`: the parameters or submodules that get no gradient, by the names torch
      gives them (`transformer.ln_f`, `mlp.0`).
    - `cut`: the kind of cut (a no-grad block, `.detach()`, `.data`, `.item()`, ...).
    - `construct`: the code construct that cut it.
    """
    rule_ = get_rule("DW501")
    for module in facts.modules:
        for cut in module.cuts:
            cut_off = [a for a in cut.attributes
                       if not module.attributes[a].live and not module.attributes[a].frozen]  # fmt: skip
            if not cut_off:
                continue
            how = _CUT_WORDING.get(cut.kind, "crosses a gradient cut").format(
                construct=cut.construct
            )
            kinds = sorted({module.attributes[a].constructor for a in cut_off})
            verb = "gets" if len(cut_off) == 1 else "get"
            yield rule_.finding(
                f"{_names(cut_off)} ({', '.join(kinds)}) of {module.owner} {verb} no gradient "
                f"from forward: on every path to its output the value {how} here, so the "
                f"optimizer never updates {'it' if len(cut_off) == 1 else 'them'}.",
                location=location(facts.path, cut.span, cut.function),
                evidence={
                    "class": module.owner,
                    "attributes": cut_off,
                    "cut": cut.kind,
                    "construct": cut.construct,
                },
            )


@rule(
    code="DW502",
    name="shape-based-decay",
    severity=Severity.WARNING,
    summary="Weight-decay groups chosen by tensor rank (len(p.shape) == 1, p.ndim < 2, p.dim() >= 2).",
    consumes=PythonRunFacts,
)
def shape_based_decay(run: PythonRunFacts) -> Iterator[Finding]:
    """
    ## What it does
    Finds comparisons of a tensor's rank (`len(p.shape) == 1`, `len(p.size()) == 1`,
    `p.ndim < 2`, `p.dim() >= 2`, `p.ndimension() == 1`) that decide something
    about weight decay: the `if` they test, the list they filter or the value they
    choose mentions decay (`no_decay`, `"weight_decay"`, `wd`, `wd_mult`). When the
    statement itself does not say, the result is followed for a few steps: through
    the names it is stored in or fills, and out of a helper through its return value
    to its callers. So Megatron-LM's
    `ParamPredicate(fn=lambda param: len(param.shape) == 1)`, stored in a `ParamKey`
    whose override sets `wd_mult=0.0`, is found, and so is `def is_matrix(p): return
    p.dim() >= 2` when its caller builds the decay group; each is reported at the rank
    test. A value handed to a function beside other arguments, or stored in a
    container the whole function reads (`state`), is not followed. Shape checks that
    have nothing to do with weight decay (in `forward`, in weight initialisation, a
    learning-rate override) are left alone. One rule written once per group, like
    nanoGPT's `p.dim() >= 2` for the decayed parameters and `p.dim() < 2` for the
    others, is reported once, at the first comparison, with the others of the same
    function that draw the same line as its partners; the two branches of an
    if/else are two rules.

    A warning says what will happen to the run; a choice that is exact and harmless
    is info. So the finding is a warning when the code in sight of the rule creates
    a parameter of shape `[]` or `[1]` (`nn.Parameter(torch.ones(1))`,
    `torch.zeros(())`, `torch.tensor(0.5)`, `init * torch.ones(1)`, ...), the
    tensor such a rule exempts by accident, named in the finding; and info when
    none is in sight, because the rule then exempts only biases and normalization
    weights, what it is meant to do, and harms nothing (stock nanoGPT, whose
    `p.dim() < 2` group holds only biases and LayerNorm weights, lints to exit 0).
    The info says what would change that. In sight are the rule's own file, the
    linted files that import it, and every linted file those import, directly or
    not: a `train.py` that imports `model.py`, or the scripts that import a helper
    holding the rule and the models they import. A scalar in a test or another
    model that none of them imports does not count, and neither does a model that
    is not linted: lint the model files together with the training script.

    ## Why is this bad
    The rule is meant to exempt biases and normalization weights, but it exempts
    every tensor of rank 1 or less. In the second incident a shape-[1] layer scalar
    right before the final RMSNorm landed in the no-decay group; the norm cancelled
    its gradient, Adam turned the noise into lr-sized steps, and with nothing
    pulling it back it drifted from 1.0 to 56.25 while the loss stayed flat, until
    INT4 quantization broke.

    ## Example
    ```python
    decay = [p for n, p in params.items() if p.dim() >= 2]      # DW502
    no_decay = [p for n, p in params.items() if p.dim() < 2]    # its partner
    self.scale = nn.Parameter(torch.ones(1))                    # makes it a warning
    ```

    ## Fix
    Decide by what a parameter is, not by its shape:
    `torch.optim.AdamW(deadweight.param_groups(model, weight_decay=0.1), lr=...)`
    exempts biases, normalization weights and parameters tagged
    `_no_weight_decay`, and decays everything else, scalars included. With
    Megatron-LM's overrides, key the exemption on that attribute or on names instead
    of the rank (see docs/megatron.md).

    ## Evidence
    - `expression`: the rank test (`p.ndim < 2`, `len(p.shape) == 1`, ...).
    - `decay_words`: the words nearby that tie it to weight decay.
    - `partners`: the other comparisons of the same rule (`line`, `column`, `expression`).
    - `scalar_parameters`: the parameters of shape [] or [1] the code in sight creates
      (`file`, `line`, `parameter`, `construct`); empty when the finding is info.
    """
    for facts in run.files:
        if not facts.rank_decay:
            continue
        sight = run.in_sight.get(facts.path, frozenset({facts.path}))
        scalars = [(other.path, p) for other in run.files if other.path in sight
                   for p in other.scalar_parameters]  # fmt: skip
        for choice in facts.rank_decay:
            yield _decay_finding(facts.path, choice, scalars)


def _decay_finding(
    path: str, choice: RankDecayChoice, scalars: list[tuple[str, ScalarParameter]]
) -> Finding:
    # No line numbers in the message: SARIF fingerprints hash it, and must survive code
    # moving. The lines are in the evidence.
    rule_text = f"`{choice.expression}`"
    if choice.partners:
        quoted = [f"`{t.expression}`" for t in choice.partners]
        listed = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]
        rule_text += f" (with its partner{'s' if len(quoted) > 1 else ''} {listed})"
    evidence = {
        "expression": choice.expression,
        "decay_words": list(choice.decay_words),
        "partners": [
            {"line": t.span.line, "column": t.span.column, "expression": t.expression}
            for t in choice.partners
        ],
        "scalar_parameters": [
            {"file": file, "line": p.span.line, "parameter": p.target, "construct": p.construct}
            for file, p in scalars
        ],
    }
    where = location(path, choice.span, choice.function)
    rule_ = get_rule("DW502")
    if not scalars:
        return rule_.finding(
            f"{rule_text} picks weight-decay groups by tensor rank. No file in sight of it "
            "(this one, the linted files that import it and what they import) creates a "
            "scalar or shape-[1] parameter, so today it exempts only biases and norm "
            "weights; a layer scalar added later would be exempted too. "
            "deadweight.param_groups(model, weight_decay=...) decides by role.",
            location=where,
            evidence=evidence,
            severity=Severity.INFO,
        )
    file, first = scalars[0]
    name = f"`{first.target}`" if first.target else "a parameter"
    elsewhere = "" if file == path else f" in {Path(file).name}"
    count = "" if len(scalars) == 1 else f" ({len(scalars)} in all)"
    return rule_.finding(
        f"{rule_text} picks weight-decay groups by tensor rank, which exempts every scalar "
        "and 1-D parameter along with biases and norm weights, and the code in sight "
        f"creates one{count}: {name} (`{first.construct}`{elsewhere}). Use "
        "deadweight.param_groups(model, weight_decay=...) to decide by role.",
        location=where,
        evidence=evidence,
    )


_GAP_WORDING = {
    "all-backward-none": "{subject}: {detail}; every parameter upstream of it gets no gradient",
    "backward-none": "{subject}: {detail}, so that tensor gets no gradient through it",
    "custom-op": "custom op {subject!r} (torch.library.custom_op) has {detail}: backward through it raises",
    "library-op": "op {subject!r} defined with torch.library has {detail}: backward through it warns, and when its kernel runs outside autograd (C++, CUDA, Triton, numpy) leaves upstream gradients None",
    "non-differentiable": "{subject}: {detail}; nothing upstream of it gets a gradient",
}


@rule(
    code="DW503",
    name="autograd-gap",
    severity=Severity.WARNING,
    summary="An autograd.Function or custom op gives some input needing a gradient none.",
    consumes=PythonSourceFacts,
)
def autograd_gap(facts: PythonSourceFacts) -> Iterator[Finding]:
    """
    ## What it does
    Reports, in the file that defines them:

    - a `torch.autograd.Function` whose `backward` returns `None` for an input that
      needs a gradient: the input is named like one (`weight`, `bias`, `gamma`,
      `beta`, `*_weight`, `*_bias`) or a `.weight` / `.bias` attribute is passed in
      that position to `.apply(...)`; or whose `backward` returns `None` for every
      input;
    - a `torch.autograd.Function` that marks every output with
      `ctx.mark_non_differentiable` and still defines a `backward` that computes
      gradients;
    - an op made with `torch.library.custom_op` without `register_autograd`, and an
      op declared with `torch.library` (`Library.define`, `torch.library.define`)
      that returns a tensor but has no implementation for the `Autograd` or
      `CompositeImplicitAutograd` key.

    Returning `None` for flags, shapes, masks and other non-tensor inputs is normal
    and not reported.

    ## Why is this bad
    Autograd trusts these declarations. A `None` gradient stops the chain there:
    every parameter upstream of that input is skipped by the optimizer. A library op
    without an autograd implementation only warns at backward; when its kernel runs
    outside autograd (C++, CUDA, Triton) no gradient passes it. A `custom_op` without
    a formula raises only when backward reaches it.

    ## Example
    ```python
    class ScaledMatmul(torch.autograd.Function):
        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors
            return grad @ weight.T, None        # DW503: weight gets no gradient
    ```

    ## Fix
    Return the gradient of every input that can require one (or `None` only for
    inputs that never do), register a formula with `op.register_autograd(...)` or
    an `Autograd` implementation, and mark only truly integer outputs
    (indices, counts) non-differentiable.

    ## Evidence
    - `kind`: the kind of gap (a backward returning None, outputs marked
      non-differentiable, an op without an autograd kernel).
    - `subject`: the autograd.Function or op.
    """
    rule_ = get_rule("DW503")
    for gap in facts.autograd_gaps:
        text = _GAP_WORDING[gap.kind].format(subject=gap.subject, detail=gap.detail)
        yield rule_.finding(
            text[0].upper() + text[1:] + ".",
            location=location(facts.path, gap.span, gap.function),
            evidence={"kind": gap.kind, "subject": gap.subject},
        )


@rule(
    code="DW504",
    name="reentrant-checkpoint",
    severity=Severity.WARNING,
    summary="torch.utils.checkpoint called without use_reentrant=False.",
    consumes=PythonSourceFacts,
)
def reentrant_checkpoint(facts: PythonSourceFacts) -> Iterator[Finding]:
    """
    ## What it does
    Finds calls of `torch.utils.checkpoint.checkpoint` and `checkpoint_sequential`
    (under any import name, also through `functools.partial`) that pass no
    `use_reentrant` or pass `use_reentrant=True`. Calls that forward `**kwargs`, or
    decide the flag at run time, are left alone.

    ## Why is this bad
    Without the argument, torch (2.4 to at least 2.13) warns and runs the reentrant
    variant. When none of the checkpointed call's tensor inputs requires grad (the
    first layer fed raw inputs or embeddings of a frozen model, a PEFT model with
    checkpointing turned on afterwards), the reentrant variant records nothing and
    every parameter inside the checkpointed function gets no gradient, with only
    that warning to show for it. It also does not support `torch.autograd.grad`
    or keyword arguments.

    ## Example
    ```python
    h = torch.utils.checkpoint.checkpoint(self.block, h)   # DW504
    ```

    ## Fix
    Pass `use_reentrant=False`:
    `torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)`.

    ## Evidence
    - `callee`: the checkpoint function called.
    - `use_reentrant`: the value passed (None when not given).
    """
    rule_ = get_rule("DW504")
    for call in facts.checkpoints:
        why = (
            "passes no use_reentrant, so torch runs the reentrant variant"
            if call.use_reentrant == "missing"
            else "passes use_reentrant=True"
        )
        yield rule_.finding(
            f"`{call.callee.rsplit('.', 1)[-1]}` {why}: when no input of the checkpointed "
            "call requires grad, every parameter inside it silently gets no gradient. "
            "Pass use_reentrant=False.",
            location=location(facts.path, call.span, call.function),
            evidence={"callee": call.callee, "use_reentrant": call.use_reentrant},
        )
