"""DW2xx: what the optimizer will do with each parameter."""

from __future__ import annotations

from collections.abc import Iterator

from deadweight import param_roles
from deadweight.checking.check_stats import GradFlowStats, OptimizerFacts
from deadweight.checking.rules._effective import Ineffective, at_risk, movement, severity_of
from deadweight.findings import Finding, Location, Severity
from deadweight.registry import get_rule, rule
from deadweight.wording import module_of, name_list

_NO_DECAY_ROLES = (param_roles.BIAS, param_roles.NORM_WEIGHT, param_roles.TAGGED)


@rule(
    code="DW201",
    name="not-in-optimizer",
    severity=Severity.ERROR,
    summary="A trainable parameter is in no optimizer param group, so it is never updated.",
    consumes=GradFlowStats,
)
def not_in_optimizer(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Compares the model's trainable parameters (tied ones once) with every param
    group of the optimizer passed to `check`.

    ## Why is this bad
    The parameter gets gradients every step and never changes. The usual cause is a
    module replaced (a new head, a resized embedding, LoRA injected) after the
    optimizer was built from `model.parameters()`.

    ## Example
    ```python
    opt = torch.optim.AdamW(model.parameters())
    model.lm_head = nn.Linear(d, new_vocab)  # the new head is not in opt
    ```

    ## Fix
    Build the optimizer after the model is final, or add the missing parameters
    with `optimizer.add_param_group(...)`.

    ## Evidence
    - `optimizer`: the optimizer's class.
    - `groups`: how many param groups it has.
    """
    facts = stats.optimizer_facts
    if facts and facts.not_in_optimizer:
        names = facts.not_in_optimizer
        yield get_rule("DW201").finding(
            f"{len(names)} trainable parameter(s) are in no param group of {facts.name} "
            f"({name_list(names)}), so they are never updated.",
            params=names,
            location=module_of(names),
            evidence={"optimizer": facts.name, "groups": len(facts.groups)},
        )


@rule(
    code="DW202",
    name="optimizer-stale-param",
    severity=Severity.WARNING,
    summary="The optimizer holds a parameter that is frozen, not in the model, or listed twice.",
    consumes=GradFlowStats,
)
def optimizer_stale_param(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Finds optimizer entries that do not match the model: parameters with
    `requires_grad=False`, tensors that are not parameters of the model (left over
    from a module that was replaced), and parameters listed more than once.

    ## Why is this bad
    A stale entry means the optimizer was built for a different model than the one
    being trained: the replacement is usually missing from it (see DW201). A
    parameter listed twice is updated twice per step. Frozen entries only waste
    optimizer state (info).

    ## Example
    ```python
    opt = torch.optim.AdamW(model.parameters())
    model.classifier = nn.Linear(768, 3)   # opt still updates the old classifier
    ```

    ## Fix
    Rebuild the optimizer from the final model, with frozen parameters filtered out.

    ## Evidence
    - `tensors`: the optimizer's tensors that are not parameters of the model (at most 20).
    """
    facts = stats.optimizer_facts
    if not facts:
        return
    rule_ = get_rule("DW202")
    if facts.duplicates:
        yield rule_.finding(
            f"{len(facts.duplicates)} parameter(s) are listed more than once in {facts.name} "
            f"({name_list(facts.duplicates)}), so each step updates them more than once.",
            params=facts.duplicates,
            severity=Severity.ERROR,
        )
    if facts.foreign:
        yield rule_.finding(
            f"{facts.name} holds {len(facts.foreign)} tensor(s) that are not parameters of the "
            "model, probably from a module replaced after the optimizer was built.",
            evidence={"tensors": facts.foreign[:20]},
        )
    if facts.frozen_in_optimizer:
        names = facts.frozen_in_optimizer
        yield rule_.finding(
            f"{len(names)} frozen parameter(s) are in {facts.name} ({name_list(names)}); they "
            "never get a gradient.",
            params=names,
            severity=Severity.INFO,
            fix="Pass only trainable parameters: [p for p in model.parameters() if p.requires_grad].",
        )


def _proven_scalar(item: Ineffective) -> bool:
    """A single number the structure pass proved a normalization cancels (whatever its
    module is called), not one someone tagged _no_weight_decay on purpose."""
    return (
        item.structural
        and item.kind == "scale"
        and item.param.numel == 1
        and item.param.role != param_roles.TAGGED
    )


def _shape_rule(facts: OptimizerFacts, stats: GradFlowStats) -> str | None:
    """The shape rule a zero-decay group's membership matches, if it matches one."""
    shapes = {p.name: p.shape for p in stats.params}
    zero = [n for g in facts.groups if g.weight_decay == 0 for n in g.names]
    decayed = [n for g in facts.groups if g.weight_decay > 0 for n in g.names]
    if not zero or not decayed:
        return None
    if any(len(shapes[n]) >= 2 for n in zero):
        return None
    if any(len(shapes[n]) == 1 for n in decayed):
        return None
    zero_dim = [n for n in shapes if len(shapes[n]) == 0 and (n in zero or n in decayed)]
    if zero_dim and all(n in decayed for n in zero_dim):
        return "len(p.shape) == 1 (as in Megatron)"
    if zero_dim:
        return "p.ndim < 2 (as in nanoGPT and timm)"
    return "len(p.shape) == 1 (as in Megatron) or p.ndim < 2 (as in nanoGPT and timm)"


@rule(
    code="DW203",
    name="decay-by-shape",
    severity=Severity.WARNING,
    summary="A parameter left without weight decay by a shape rule, though it needs it to stay put.",
    consumes=GradFlowStats,
)
def decay_by_shape(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Recognises a weight-decay split made by shape (every parameter with one
    dimension or fewer in a zero-decay group, every other one decayed) and reports
    the parameters it excluded for their shape alone, neither a bias nor a
    normalization weight nor tagged `_no_weight_decay`, that have no effective
    gradient (DW103/DW104/DW105) and that the optimizer will move materially (a
    DW104 warning): for them weight decay was the only force keeping them in place.
    Measured evidence beats names: a shape-[1] scalar that the structure pass proved
    a normalization cancels is reported even when its module's class name says
    "norm" (which would otherwise make it a normalization weight). (The shape rule
    in source is `deadweight lint`'s DW502.)

    ## Why is this bad
    A rule such as `len(p.shape) == 1 -> no weight decay` is meant for biases and
    norm gains; a shape-[1] scalar matches it by accident. In the incident that left
    a cancelled layer scalar free to drift from 1.0 to 56.25.

    ## Example
    ```python
    no_decay = [p for p in model.parameters() if len(p.shape) == 1]  # catches scalars too
    ```

    ## Fix
    Decide decay by meaning, not shape: `deadweight.param_groups(model, weight_decay)`.
    For a parameter that cannot learn, `deadweight.pin` is the fix (decay alone would
    pull it towards an equilibrium, not keep it at its value; see DW204).

    ## Evidence
    - `rule`: the shape rule that left the parameter undecayed (`len(p.shape) == 1`, ...).
    - `group`: the index of the param group it is in.
    """
    facts = stats.optimizer_facts
    if not facts:
        return
    shape_rule = _shape_rule(facts, stats)
    if shape_rule is None:
        return
    risky = at_risk(stats)
    # Measured evidence beats names: a scalar the structure pass proved cancelled is
    # reported even when its module's class name says "norm" (a gain's role).
    flagged = [
        n
        for g in facts.groups
        if g.weight_decay == 0
        for n in g.names
        if n in risky
        and severity_of(risky[n], stats) is Severity.WARNING
        and (risky[n].param.role not in _NO_DECAY_ROLES or _proven_scalar(risky[n]))
    ]
    for name in flagged:
        yield get_rule("DW203").finding(
            f"{name} (shape {list(risky[name].param.shape)}) is excluded from weight decay by the "
            f"shape rule {shape_rule}, though it is neither a bias nor a normalization weight "
            "and nothing else holds it: it has no effective gradient.",
            params=[name],
            location=Location(module=risky[name].param.module),
            evidence={"rule": shape_rule, "group": facts.group_of[name]},
        )


@rule(
    code="DW204",
    name="drift-risk",
    severity=Severity.WARNING,
    summary="An adaptive optimizer without weight decay will move a parameter on gradient noise alone.",
    consumes=GradFlowStats,
)
def drift_risk(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    For each parameter with no effective gradient (DW103/DW104/DW105: it cannot
    learn, but its gradient is nonzero noise) in a param group with zero weight
    decay under an adaptive optimizer (Adam family, RMSprop, Adagrad, or an unknown
    rule), predicts what the optimizer will do with it:

    - the step per update: `lr * sqrt((1-b1)/(1+b1)) * s/(s+eps)` for noise of random
      sign and up to `lr * s/(s+eps)` when the noise keeps its sign, `s` the
      measured noise RMS (with |g| = 4e-8 and eps = 1e-8 that gives 0.18 lr, the
      mean step measured in a small reproduction);
    - how much larger the steps get right after an optimizer-state reset,
      `sqrt(1/(1-b2))` (4.47 for b2 = 0.95; the incident saw 5.4x);
    - where decoupled weight decay would hold it: `theta_eq = drift / (wd * lr)`,
      not its initial value (0.0007 / (0.1 * 0.00085) = 8.2 in the incident);
    - how far it gets within `drift-horizon-steps` (10k): `expected_step * horizon`.

    It follows DW104's severity: only a parameter the optimizer will move by at
    least `material-drift` (10%) of its size within the horizon is reported.

    A bf16 or fp16 parameter is judged as a float32 one: the verdict is about the
    parameter, and the run that steps a float32 master copy of it (autocast over fp32
    parameters, FSDP2 mixed precision, Megatron's main params) drifts as predicted.
    Where the parameter itself is what the optimizer steps, the message says what
    rounding does to the updates: below the smallest step the dtype keeps at the
    parameter's value (half the gap to the next number below: 2^-9 at 1.0 in bf16)
    every update is lost and it stays put while stored so (DW304 sees the same under
    watch); when only the typical update is below it, the largest land as whole
    steps of the dtype. When the gradient is rounding noise of random sign rather than
    an eps residue (DW104 says which), the message gives the random walk it makes
    (`lr * sqrt(T)`: about 0.1 within 10k steps at lr 1e-3) beside the steady drift. An
    exact shift redundancy (a key bias, a bias before BatchNorm) is not: nothing
    downstream sees where it goes (DW105, info).

    ## Why is this bad
    With nothing pulling it back, the parameter random-walks or drifts for the whole
    run with the loss unchanged; the damage shows later, in quantization or when the
    cancelling normalization is changed.

    ## Example
    The incident: a layer scalar before the final RMSNorm, AdamW lr 8.5e-4,
    b2 = 0.95, no decay; 1.0 -> 56.25 over 53k steps, 5x faster after a reset.

    ## Fix
    `deadweight.pin(model, name)`: keeps it exactly at its value with a zeroed
    gradient, stays trainable (DDP buckets unchanged), no weight decay. Adding weight
    decay only moves it to `theta_eq`.

    ## Evidence
    - `optimizer`, `rule` (`adam`, `rmsprop`, `adagrad`, ...), `lr`: the update rule applied.
    - `noise_rms`: the RMS of the gradient noise the optimizer sees.
    - `betas`, `eps`: the optimizer's settings, where it has them.
    - `expected_step`, `max_step`: the predicted step size per update, typical and at most.
    - `reset_amplification`: how much larger steps get after an optimizer-state reset.
    - `weight_decay_for_equilibrium`, `equilibrium_if_decayed_max`,
      `equilibrium_if_decayed_expected`: where weight decay would hold the parameter.
    - `horizon_steps`, `param_rms`, `drift_over_horizon`, `decay_over_horizon`,
      `material`: the move predicted within the horizon, against the parameter's size.
    - `prediction`: why there is no prediction, for an update rule deadweight does not know.
    - `param_dtype`, `smallest_step`, `updates_lost` (`all`, `some`, `none`): for a bf16
      or fp16 parameter, what rounding to its dtype does to the updates.
    - `gradient`, `random_walk_step`, `random_walk_over_horizon`: when the gradient is
      rounding noise (of random sign, DW104 says which), the walk it makes instead of
      a steady drift: `lr * sqrt(horizon)`. The severity follows the steady drift, what
      an eps residue gives in float32.
    """
    facts = stats.optimizer_facts
    if not facts:
        return
    for name, item in at_risk(stats).items():
        index = facts.group_of.get(name)
        if index is None:
            continue
        group = facts.groups[index]
        if group.weight_decay > 0 or group.rule == "sgd":
            continue  # decay pulls it back; plain SGD moves it by lr * noise: nothing
        if severity_of(item, stats) is not Severity.WARNING:
            continue  # an exact, harmless redundancy, or a move too small within the horizon
        evidence = movement(item, facts) or {}
        yield get_rule("DW204").finding(
            f"{name} cannot learn, has no weight decay and is updated by {facts.name}: "
            f"{_drift_words(evidence)}.",
            params=[name],
            location=Location(module=item.param.module),
            evidence=evidence,
        )


def _drift_words(evidence: dict[str, object]) -> str:
    """DW204's prediction in words, with what the gradient's sign and rounding in the
    parameter's dtype do to it."""
    if "reset_amplification" in evidence:
        detail = (
            f"steps of about {evidence['expected_step']:.2g} (up to "
            f"{evidence['max_step']:.2g}) per update, about "
            f"{evidence['drift_over_horizon']:.2g} within {evidence['horizon_steps']} steps, "
            f"{evidence['reset_amplification']:.2f}x larger right after an "
            "optimizer-state reset"
        )
    elif "max_step" in evidence:
        detail = f"steps of up to {evidence['max_step']:.2g} per update"
    else:
        return f"it will drift on gradient noise; {evidence['prediction']}"
    walk = evidence.get("random_walk_over_horizon")
    if isinstance(walk, float):
        # judged by the steady drift (what float32's eps residue gives), told as it is
        motion = (
            f"random-walks on its gradient ({evidence['gradient']}, of random sign): about "
            f"{walk:.2g} within {evidence['horizon_steps']} steps. Where the noise keeps its "
            f"sign, as an eps residue's does, it drifts instead: {detail}"
        )
    else:
        motion = f"drifts on gradient noise: {detail}"
    lost, dtype = evidence.get("updates_lost"), evidence.get("param_dtype")
    floor = evidence.get("smallest_step")
    size = evidence.get("param_rms")
    if lost == "all" and isinstance(floor, float) and isinstance(size, float):
        return (
            f"each of its updates (up to {evidence['max_step']:.2g}) is below the smallest step "
            f"{dtype} keeps at its value ({floor:.2g} at {size:.3g}) and is lost, so it stays "
            f"put while stored in {dtype}; with float32 master weights (fp32 parameters under "
            f"autocast, FSDP2 mixed precision, Megatron's main params) it {motion}"
        )
    if lost == "some" and isinstance(floor, float) and isinstance(size, float):
        return (
            f"its typical update ({evidence['expected_step']:.2g}) is below the smallest "
            f"step {dtype} keeps at its value ({floor:.2g} at {size:.3g}) and is lost, the "
            f"largest (up to {evidence['max_step']:.2g}) land as whole {dtype} steps; with "
            f"float32 master weights it {motion}"
        )
    return f"it {motion}"


@rule(
    code="DW205",
    name="lr-zero",
    severity=Severity.WARNING,
    summary="A param group's learning rate is 0 and no scheduler will raise it.",
    consumes=GradFlowStats,
)
def lr_zero(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Reports param groups whose `lr` is 0, unless an LR scheduler is warming up
    from 0 (the group's `initial_lr` is above 0).

    ## Why is this bad
    Every parameter in the group gets gradients and never moves.

    ## Example
    ```python
    opt = torch.optim.AdamW([{"params": head, "lr": 0.0}, {"params": body}], lr=1e-4)
    ```

    ## Fix
    Set the learning rate, or freeze the parameters with `requires_grad_(False)` if
    they are meant to stay fixed.

    ## Evidence
    - `group`: the index of the param group.
    - `lr`: its learning rate (0).
    """
    facts = stats.optimizer_facts
    if not facts:
        return
    for group in facts.groups:
        if group.lr == 0 and not (group.initial_lr or 0) > 0 and group.names:
            yield get_rule("DW205").finding(
                f"Param group {group.index} of {facts.name} has lr = 0: its "
                f"{len(group.names)} parameter(s) never move ({name_list(list(group.names))}).",
                params=list(group.names),
                evidence={"group": group.index, "lr": 0.0},
            )


@rule(
    code="DW206",
    name="decay-on-no-decay-param",
    severity=Severity.INFO,
    summary="A bias, normalization weight or parameter tagged _no_weight_decay is weight-decayed.",
    consumes=GradFlowStats,
)
def decay_on_no_decay_param(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Lists trainable parameters in param groups with weight decay above 0 that should
    not be decayed (a frozen one is never updated, its decay included): a parameter tagged `_no_weight_decay = True` (warning: someone said so
    explicitly), a normalization weight or a bias (info). Normalization weights are
    recognised by module type, so `ln_1`, `input_layernorm` and custom RMSNorm
    classes count, which name-substring rules such as `["bias", "LayerNorm.weight"]`
    miss.

    ## Why is this bad
    Decay pulls norm gains towards 0 and biases towards 0 for no benefit, and for a
    pinned or deliberately excluded parameter it silently undoes the intent.

    ## Example
    ```python
    no_decay = ["bias", "LayerNorm.weight"]   # misses GPT-2's ln_1 / ln_2 / ln_f
    ```

    ## Fix
    Build the groups with `deadweight.param_groups(model, weight_decay)`.

    ## Evidence
    None beyond the parameters named in `params`; the message says whether they are
    biases / normalization weights or tagged `_no_weight_decay`.
    """
    facts = stats.optimizer_facts
    if not facts:
        return
    roles = {p.name: p.role for p in stats.params}
    # A frozen parameter is never updated, its decay included (DW202 names it).
    trainable = {p.name for p in stats.params if p.trainable}
    decayed = [n for g in facts.groups if g.weight_decay > 0 for n in g.names if n in trainable]
    tagged = [n for n in decayed if roles[n] == param_roles.TAGGED]
    plain = [n for n in decayed if roles[n] in (param_roles.BIAS, param_roles.NORM_WEIGHT)]
    if tagged:
        yield get_rule("DW206").finding(
            f"{len(tagged)} parameter(s) tagged _no_weight_decay are weight-decayed "
            f"({name_list(tagged)}).",
            params=tagged,
            severity=Severity.WARNING,
        )
    if plain:
        yield get_rule("DW206").finding(
            f"{len(plain)} bias / normalization weight(s) are weight-decayed ({name_list(plain)}).",
            params=plain,
        )
