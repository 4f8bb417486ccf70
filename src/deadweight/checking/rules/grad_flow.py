"""DW1xx: gradient flow, as measured by `deadweight.check`."""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator

from deadweight.checking.check_stats import (
    CUT_KINDS,
    WRITE_KINDS,
    GradFlowStats,
    Site,
    display_path,
)
from deadweight.checking.rules._explain import CutGroup, explain
from deadweight.findings import Finding, Location, Severity
from deadweight.registry import get_rule, rule
from deadweight.wording import module_of

# Explanations that are often benign (data-dependent routing, a head that a
# fine-tuning recipe does not use) are warnings, not errors.
_SOFT_KINDS = frozenset({"never-ran"})

_FIXES = {
    "no-grad": "Run this code with gradients enabled when training: drop the torch.no_grad for the "
    "training path, or switch to a differentiable implementation; keep the no-grad kernel for "
    "inference only.",
    "inference-mode": "Do not run training code under torch.inference_mode; use a differentiable "
    "path when training.",
    "detach": "Use the tensor itself instead of .detach() in the forward; to freeze the parameters "
    "before it, say so with requires_grad_(False).",
    "data": "Use the tensor itself instead of .data; .data is for in-place updates outside autograd.",
    "item": "Keep the value as a tensor: do not round-trip through Python numbers.",
    "tolist": "Keep the values as a tensor: do not round-trip through Python lists.",
    "numpy": "Keep the values as a tensor: do not round-trip through NumPy.",
    "rebuilt-tensor": "Use the tensor itself (or torch.stack / torch.cat) instead of "
    "torch.tensor(...) on other tensors' values.",
    "non-differentiable": "Use a differentiable relaxation (e.g. softmax weights, or a "
    "straight-through estimator) so a gradient reaches the parameters before it.",
    "other": "Find why this op drops the graph; use an op with a derivative in training.",
    "function": "Do not mark outputs that feed the loss as non-differentiable "
    "(ctx.mark_non_differentiable) in this autograd.Function.",
    "reentrant-checkpoint": "Pass use_reentrant=False to torch.utils.checkpoint, or make an input "
    "of the checkpointed segment require grad (transformers: model.enable_input_require_grads()).",
    "dropped-in-backward": "Return a gradient for this input from the Function's backward (None "
    "only for inputs that never need one).",
    "no-autograd-kernel": "Register an autograd kernel for this op (torch.library.register_autograd, "
    "or a DispatchKey::Autograd implementation), or use a differentiable path in training.",
    "custom-op-no-autograd": "Register a backward for this op with "
    "torch.library.register_autograd(...), or use a differentiable path in training.",
    "module-cut": "Look inside this module's forward for the op that drops the graph (a fused "
    "kernel, a no-grad block, or an extension op without autograd support).",
    "never-ran": "Call the module in forward, or freeze it with requires_grad_(False) if it is "
    "meant to be unused; with data-dependent routing (mixture of experts), check on a batch that "
    "reaches it.",
    "cut-inside": "Look inside this module's forward for the op that drops the graph (a "
    "`.detach()`, a no-grad block, a fused kernel); `deadweight check` on a batch points at the line.",
    "output-unused": "Make the module's output part of the loss (e.g. add the auxiliary loss), or "
    "freeze the module with requires_grad_(False) if it is only for monitoring.",
    "loss-no-grad-fn": "Compute the loss from the model's outputs with gradients enabled: no "
    "torch.no_grad, .item(), .detach() or torch.tensor(...) on the way to it.",
}


@rule(
    code="DW101",
    name="no-gradient",
    severity=Severity.ERROR,
    summary="A trainable parameter gets no gradient, so the optimizer silently skips it.",
    consumes=GradFlowStats,
)
def no_gradient(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Runs the loss and one backward, then lists every parameter with
    `requires_grad=True` whose `.grad` is still None. Parameters cut off by the
    same cause are reported together, and the finding names the DW102 cut that
    explains them when one was found.

    ## Why is this bad
    Optimizers skip parameters whose gradient is None without a word. The loss still
    falls (the parameters after the cut learn), then plateaus: in the fused-RMSNorm
    incident the first layer and the norm weight never moved in 1000 steps while the
    loss went from 0.028 to 0.00075 and stayed there. Nothing but a per-parameter
    check after the first backward reveals it.

    ## Example
    ```python
    class FusedRMSNorm(nn.Module):
        @torch.no_grad()          # a kernel with no backward
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight

    model = nn.Sequential(nn.Linear(8, 8), FusedRMSNorm(8), nn.Linear(8, 1))
    # DW101: 0.weight, 0.bias, 1.weight get no gradient
    ```

    ## Fix
    Remove the cut that DW102 points at. If the parameters are meant to stay fixed,
    freeze them explicitly with `requires_grad_(False)` so the intent is visible.

    ## Evidence
    - `count`: how many trainable parameters get no gradient.
    - `numel`: their elements in total.
    - `in_optimizer`: whether the optimizer holds them (None without an optimizer).
    - `explained_by`: the DW102 graph cuts behind them: `code`, `kind` of cut, `location`,
      and `detail` where the cut has one (for an expert no token reached: the rows
      each sibling expert ran on, and the router).
    """
    explanation = explain(stats)
    by_cause: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for name, cause_ids in explanation.by_param.items():
        by_cause[cause_ids].append(name)
    params = {p.name: p for p in stats.params}
    skipper = f" ({stats.optimizer} skips them silently)" if stats.optimizer else ""

    for cause, names in by_cause.items():
        groups: list[CutGroup] = [explanation.groups[i] for i in cause]
        n = len(names)
        subject = f"{n} trainable parameter{'s' if n > 1 else ''} get{'' if n > 1 else 's'}"
        evidence: dict[str, object] = {
            "count": n,
            "numel": sum(_numel(params[x].shape) for x in names),
            "in_optimizer": _in_optimizer(names, params),
        }
        if groups:
            where = "; ".join(_short_ref(g) for g in groups)
            message = f"{subject} no gradient{skipper}: the graph is cut {where}."
            evidence["explained_by"] = [
                {
                    "code": "DW102",
                    "kind": g.first.kind,
                    "location": g.location.to_dict(),
                    **({"detail": g.first.detail} if g.first.detail else {}),
                }
                for g in groups
            ]
            soft = all(g.first.kind in _SOFT_KINDS for g in groups)
            yield get_rule("DW101").finding(
                message,
                params=names,
                location=groups[0].location,
                evidence=evidence,
                fix=_FIXES[groups[0].first.kind],
                severity=Severity.WARNING if soft else None,
            )
        else:
            message = (
                f"{subject} no gradient{skipper}: nothing that reaches the loss uses "
                f"{'them' if n > 1 else 'it'} in this forward."
            )
            yield get_rule("DW101").finding(
                message,
                params=names,
                location=module_of(names),
                evidence=evidence,
                fix="Use the parameter in the forward, or delete it or freeze it with "
                "requires_grad_(False) if it is not meant to be trained.",
                severity=Severity.WARNING,
            )


@rule(
    code="DW102",
    name="graph-cut",
    severity=Severity.ERROR,
    summary="Where the autograd graph was cut: the op, the source line and the parameters behind it.",
    consumes=GradFlowStats,
)
def graph_cut(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Finds the place where gradient flow to parameters without a gradient stopped:
    the op and the user's source line (file:line, function, module path), and the
    kind of cut: an op run under `torch.no_grad` / `inference_mode` (the PyTorch
    form of a fused kernel without backward), `.detach()`, `.data`, `.item()` /
    `.tolist()` / `.numpy()` round trips, `torch.tensor(...)` rebuilt from other
    tensors, an `autograd.Function` that marks its output non-differentiable or
    returns None for an input, a custom op registered without autograd support,
    reentrant `torch.utils.checkpoint` with no input requiring grad, a module that
    never ran, a module whose output never reaches the loss, or a loss that has no
    `grad_fn` at all. Only cuts that leave some parameter with no gradient at all
    are reported; a deliberate stop-gradient on a branch is not. An op run under
    `no_grad` / `inference_mode` is reported at the user's line that entered the
    region (`h = self.ln_2(x)` inside `with torch.no_grad():`, not the `F.layer_norm`
    line of the module called there, which is the evidence's `op_at`), and code that
    `torch.compile` split at a graph break under the user's function and line.

    ## Why is this bad
    PyTorch raises no error at any of these places: backward succeeds, the optimizer
    steps, and the parameters upstream never learn.

    ## Example
    ```python
    @torch.no_grad()                      # model.py:17
    def fused_rms_norm(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    # DW102 model.py:17 in fused_rms_norm: Tensor.mul ran under torch.no_grad, ...
    ```

    ## Fix
    Use a differentiable path for training at the reported line (for a fused
    kernel: its reference implementation, or register a backward for it).

    ## Evidence
    - `kind`: what cut the graph (`no-grad`, `inference-mode`, `detach`, `data`, `item`,
      `rebuilt-tensor`, `non-differentiable`, `function`, `never-ran`, `output-unused`,
      `cut-inside` (from `deadweight run`'s record of a forward it could not replay), ...).
    - `ops`, `lines`, `modules`: the ops, source lines and modules where it happened.
    - `result_reaches_loss`: whether the cut value still reaches the loss (without a gradient).
    - `called_from`: the caller of the function the cut happened in.
    - `op_at`: for an op run under `no_grad` / `inference_mode` in a function the
      reported line called, where that op ran (the location is the user's line
      inside the region, the one that entered it).
    - `detail`: more on the cut (the op's own words, the function's name).
    - `backward_error`: the error backward raised (a custom op without autograd).
    - `loss_value`, `grad_enabled_when_computed`: for a loss without `grad_fn`.
    """
    explanation = explain(stats)
    for group in explanation.groups:
        cut = group.first
        kind = cut.kind
        n = len(group.params)
        subject = _subject(group)
        if cut.op_site is not None:  # a no-grad region entered here, the op in a callee
            subject += f" (at {_where(cut.op_site)})"
        message = (
            f"{subject} {CUT_KINDS[kind]}; {n} parameter{'s' if n > 1 else ''} upstream "
            f"get{'' if n > 1 else 's'} no gradient."
        )
        if cut.site is not None:
            where = f"{os.path.basename(cut.site.file)}:{cut.site.line} in {cut.site.function}"
            message = f"{where}: {message}"
        evidence: dict[str, object] = {
            "kind": kind,
            "ops": sorted({c.op for c in group.cuts if c.op}),
            "lines": sorted({c.site.line for c in group.cuts if c.site}),
            "modules": sorted({c.module for c in group.cuts if c.module is not None}),
        }
        if any(c.flows_to_loss is not None for c in group.cuts):
            evidence["result_reaches_loss"] = any(c.flows_to_loss for c in group.cuts)
        if cut.caller is not None:
            evidence["called_from"] = str(cut.caller)
        if cut.op_site is not None:
            evidence["op_at"] = str(cut.op_site)
        if cut.detail:
            evidence["detail"] = cut.detail
        if kind == "custom-op-no-autograd" and stats.backward_error:
            evidence["backward_error"] = stats.backward_error
        if kind == "loss-no-grad-fn":
            evidence["loss_value"] = stats.loss.value
            if stats.loss.grad_enabled_at_site is False:
                evidence["grad_enabled_when_computed"] = False
        yield get_rule("DW102").finding(
            message,
            params=group.params,
            location=group.location,
            evidence=evidence,
            fix=_FIXES[kind],
            severity=Severity.WARNING if kind in _SOFT_KINDS else None,
        )


@rule(
    code="DW106",
    name="non-finite-loss",
    severity=Severity.ERROR,
    summary="The loss is NaN or infinite before any training step.",
    consumes=GradFlowStats,
)
def non_finite_loss(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Reports a loss value that is NaN or ±Inf on the checked batch.

    ## Why is this bad
    Every gradient computed from it is non-finite too; one optimizer step writes NaN
    into every parameter it updates, and a loss scaler may silently skip steps.

    ## Example
    ```python
    loss = -torch.log(probs)   # probs contains an exact 0 -> inf
    ```

    ## Fix
    Find the first non-finite value in the forward (torch.autograd.detect_anomaly
    on this batch), then clamp, use a numerically stable op (log_softmax,
    cross_entropy) or fix the input data.

    ## Evidence
    - `loss_value`: the loss as text (`nan`, `inf`).
    """
    if stats.loss.value is not None and not stats.loss.finite:
        yield get_rule("DW106").finding(
            f"The loss is {stats.loss.value} on the checked batch, so every gradient is non-finite.",
            evidence={"loss_value": str(stats.loss.value)},
        )


@rule(
    code="DW107",
    name="model-in-eval-mode",
    severity=Severity.INFO,
    summary="The model was in eval mode when checked; training usually needs model.train().",
    consumes=GradFlowStats,
)
def model_in_eval_mode(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Notes that the root module had `training=False` when the check ran. The check
    runs the model in the mode it finds it in, and restores every module's mode
    afterwards.

    ## Why is this bad
    Training in eval mode raises no error: dropout is off and BatchNorm normalises
    with running statistics it never updates. A model loaded with
    `from_pretrained` starts in eval mode, and a validation loop that ends with
    `model.eval()` leaves it there.

    ## Example
    ```python
    model = AutoModelForCausalLM.from_pretrained(...)   # eval mode
    for batch in loader:                                 # no model.train()
        model(**batch).loss.backward()
    ```

    ## Fix
    Call `model.train()` before training (and before `deadweight.check`, so the
    check sees the training graph).

    ## Evidence
    - `training`: the model's mode when checked (False).
    """
    if not stats.model_training:
        yield get_rule("DW107").finding(
            f"{stats.model} was in eval mode: dropout is off and BatchNorm uses running "
            "statistics; call model.train() if you train it like this.",
            evidence={"training": False},
        )


# Calls documented to write their parameter in the forward, by design: not a bug.
_DOCUMENTED_WRITES = frozenset({"torch.nn.functional.embedding"})  # nn.Embedding(max_norm=...)


@rule(
    code="DW109",
    name="forward-writes-parameter",
    severity=Severity.WARNING,
    summary="The forward changes a parameter's values itself (.data, .detach(), no_grad), "
    "outside the optimizer.",
    consumes=GradFlowStats,
)
def forward_writes_parameter(stats: GradFlowStats) -> Iterator[Finding]:
    """
    ## What it does
    Reports parameters whose values the forward changed: an in-place op on
    `p.data`, on `p.detach()` or a view of it, an in-place op on the parameter under
    `torch.no_grad`, assigning `p.data = ...`, or a write no tracer sees (through
    NumPy, or an extension kernel), which a checksum of every parameter before and
    after the check finds. The check puts the values (and the autograd version
    counters) back where it saw the write coming; a write it did not see cannot be
    undone, and is reported as an error. `nn.Embedding(max_norm=...)`, which
    renormalises its rows in place by design, is not reported.

    ## Why is this bad
    Such a write changes the model on every forward, outside the optimizer and
    invisibly to autograd: `.data` writes do not even bump the version counter, so a
    graph that saved the old values backpropagates through values that are no
    longer there. A decay written as `self.w.data.mul_(0.5)` halves the weight on
    every step, also during evaluation, and the optimizer's state no longer matches
    the parameter.

    ## Example
    ```python
    def forward(self, x):
        self.w.data.mul_(0.5)        # DW109: w is halved on every call
        return x @ self.w
    ```

    ## Fix
    Compute with a new tensor instead of writing the parameter (`w = self.w * 0.5`),
    or move the update into the training step (after `optimizer.step()`, under
    `torch.no_grad()`), where it is visible and runs once per step.

    ## Evidence
    - `writes`: per parameter: `param`, `how` (in-place, alias, rebind, unseen),
      `op` (the call that wrote, when seen), `file` and `line`, and `restored`
      (whether the check put the values back).
    """
    writes = [w for w in stats.param_writes if w.op not in _DOCUMENTED_WRITES]
    for restored in (True, False):
        mine = [w for w in writes if w.restored is restored]
        if not mine:
            continue
        names = [w.name for w in mine]
        first = next((w for w in mine if w.site is not None), mine[0])
        n = len(names)
        subject = f"The forward writes to {n} parameter{'s' if n > 1 else ''}"
        how = WRITE_KINDS[first.how]
        where = f" at {first.site}" if first.site is not None else ""
        if restored:
            tail = "; deadweight put the values back, training would keep them."
        else:
            tail = (
                "; deadweight could not see the write coming, so the values were not "
                "restored: the model now holds what the forward left there."
            )
        yield get_rule("DW109").finding(
            f"{subject} ({_few(names)}) through {how}{where}{tail}",
            params=names,
            location=Location(display_path(first.site.file), first.site.line, first.site.function)
            if first.site is not None
            else Location(module=names[0].rpartition(".")[0]),
            evidence={
                "writes": [
                    {
                        "param": w.name,
                        "how": w.how,
                        "op": w.op,
                        "file": display_path(w.site.file) if w.site else None,
                        "line": w.site.line if w.site else None,
                        "restored": w.restored,
                    }
                    for w in mine
                ]
            },
            severity=None if restored else Severity.ERROR,
        )


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


_MODULE_PHRASES = {
    "never-ran": "never ran",
    "output-unused": "ran but whose output never reaches the loss",
    "module-cut": "returns outputs without grad_fn",
    "cut-inside": "reaches the loss although the graph is cut inside it",
}


def _short_ref(group: CutGroup) -> str:
    cut = group.first
    if cut.kind == "loss-no-grad-fn":
        return "at the loss itself, which has no grad_fn (DW102)"
    if cut.kind in _MODULE_PHRASES:
        return f"at module `{cut.module}`, which {_MODULE_PHRASES[cut.kind]} (DW102)"
    if cut.site is None:
        return f"at {cut.op} ({cut.kind}, DW102)"
    where = f"{os.path.basename(cut.site.file)}:{cut.site.line} in {cut.site.function}"
    return f"at {where} ({cut.kind}, DW102)"


def _where(site: Site) -> str:
    return f"{os.path.basename(site.file)}:{site.line} in {site.function}"


def _subject(group: CutGroup) -> str:
    cut = group.first
    if cut.kind == "loss-no-grad-fn":
        return "The loss"
    if cut.kind in _MODULE_PHRASES:
        return f"Module `{cut.module}` ({cut.op})"
    ops = sorted({c.op for c in group.cuts if c.op})
    return ", ".join(ops[:3]) + (f" and {len(ops) - 3} more" if len(ops) > 3 else "")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _in_optimizer(names: list[str], params: dict) -> object:
    flags = [params[n].in_optimizer for n in names]
    if all(f is None for f in flags):
        return None
    return sum(1 for f in flags if f)
