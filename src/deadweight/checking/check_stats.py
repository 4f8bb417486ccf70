"""What `check` measured, as the rules read it: plain statistics, no tracing.

The tracers (flow_measurement, op_trace, module_trace, cancellation, invariance, state,
optimizer_groups) fill these in; the rules in `checking/rules/` judge them and
import nothing else of the check, so a rule can never re-measure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deadweight import param_roles, thresholds

if TYPE_CHECKING:  # the rules (and `deadweight rules`) load this module without torch
    import torch

# torch.finfo(torch.float32).eps, the spacing of float32 values at 1.0: 2^-23.
FLOAT32_EPS = 2.0**-23

# -- where: source positions --------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """A source position: file, line, and the function's qualified name."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{display_path(self.file)}:{self.line} in {self.function}"


def display_path(path: str) -> str:
    """A path relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


# -- what a forward wrote to the model (checking/state.py) ---------------------------

# How a forward wrote to a parameter (`ParamWrite.how`).
WRITE_KINDS = {
    "in-place": "an in-place op on the parameter itself (under torch.no_grad)",
    "alias": "an in-place op on a tensor sharing its memory (.data, .detach(), a view)",
    "rebind": "assigning a new tensor to its .data",
    "unseen": "a write the op tracer could not see (NumPy, an extension kernel)",
}


@dataclass(frozen=True)
class ParamWrite:
    """A parameter whose values the checked forward changed."""

    name: str
    how: str  # a key of WRITE_KINDS
    op: str | None  # the call that wrote, when seen
    site: Site | None  # the user's line, when seen
    restored: bool  # deadweight put the values back


# -- gradient screens and functional probes (checking/invariance.py) -----------------

SCALE_FACTOR = 10.0
SHIFT_RMS = 10.0
SHIFT_FOR_ZERO = 10.0


@dataclass(frozen=True)
class GradStats:
    """The numbers the gradient screens need, for one parameter."""

    grad_norm: float
    # <g, theta> and sum(g): None where nothing reads them. They are taken for the
    # parameters the screens judge and those a finding's evidence shows (an exactly
    # zero gradient, a structural cancellation); a check of a healthy model needs none.
    grad_dot_param: float | None
    grad_sum: float | None
    param_norm: float
    param_rms: float
    exact_zero: bool  # every gradient entry is exactly 0

    def scale_score(self, loss: float) -> float:
        return (SCALE_FACTOR - 1) * abs(_taken(self.grad_dot_param)) / loss_scale(loss)

    def shift_step(self) -> float:
        return SHIFT_RMS * self.param_rms if self.param_rms > 0 else SHIFT_FOR_ZERO

    def at_noise_floor(self, loss: float, eps: float) -> bool:
        ulps = thresholds.current().noise_floor_ulps
        return self.grad_norm * max(self.param_norm, 1.0) <= ulps * eps * loss_scale(loss)

    def shift_score(self, loss: float) -> float:
        return self.shift_step() * abs(_taken(self.grad_sum)) / loss_scale(loss)


def _taken(value: float | None) -> float:
    if value is None:
        raise ValueError("this gradient statistic was not taken for this parameter")
    return value


@dataclass(frozen=True)
class ProbeResult:
    """The measured effect of scaling or shifting a parameter (or a group holding it)."""

    kind: str  # "scale" or "shift"
    screen_score: float
    relative_change: float | None  # None: not probed (budget spent or probe impossible)
    invariant: bool
    group_size: int  # how many candidates were perturbed together in the deciding probe


def loss_scale(loss: float) -> float:
    # A loss of exactly 0 would make every relative change infinite; 1e-12 keeps the
    # ratio finite and still flags any real change.
    return max(abs(loss), 1e-12)


# -- cancellations by construction (checking/cancellation.py) -------------------------


@dataclass(frozen=True)
class Mechanism:
    """One op call that cancelled a parameter's effect."""

    op: str  # the cancelling op, as users know it ("LayerNorm", "softmax over keys", ...)
    call: str  # the traced callable's name
    ordinal: int  # which call of `call` in the forward (for the confirming re-run)
    site: Site | None
    module: str | None
    dims: tuple[int, ...]  # the dims it normalizes over
    facet: str  # "full" or "uniform"
    approx: bool  # the cancellation holds up to the op's eps
    # The unit roundoff of the coarsest floating dtype the effect passed through on its
    # way to the op, the op's output included (2^-24 float32, 2^-8 bfloat16, 2^-11
    # float16): the resolution at which a re-run can see the op's output unchanged.
    rounding: float = 2.0**-24

    def describe(self) -> str:
        """ "LayerNorm in module ln_f at model.py:88 in GPT.forward"."""
        module = f" in module {self.module}" if self.module else ""
        where = f" at {_short(self.site)}" if self.site is not None else ""
        return f"{self.op}{module}{where}"


def _short(site: Site) -> str:
    """A site, with an installed package's file named from the package on."""
    text = str(site)
    marker = "site-packages" + os.sep
    at = text.find(marker)
    return text[at + len(marker) :] if at >= 0 else text


@dataclass(frozen=True)
class Cancellation:
    """A parameter that a cancelling op removes from the loss, by construction."""

    name: str
    kind: str  # "scale" or "shift"
    full: bool  # every direction cancelled (it cannot learn at all)
    mechanisms: tuple[Mechanism, ...]
    confirmed: bool | None = None  # None: not confirmed by a re-run (impossible or skipped)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def mechanism(self) -> str:
        shown = "; ".join(m.describe() for m in self.mechanisms[:2])
        more = len(self.mechanisms) - 2
        return shown + (f" and {more} more" if more > 0 else "")


# -- the optimizer's groups (checking/optimizer_groups.py) ----------------------------


@dataclass(frozen=True)
class GroupInfo:
    index: int
    lr: float | None
    initial_lr: float | None  # set by LR schedulers; lr may be 0 during warm-up
    weight_decay: float
    decoupled: bool  # AdamW-style decay (theta *= 1 - lr*wd) rather than L2 in the gradient
    rule: str  # "adam", "rmsprop", "adagrad", "sgd" or "unknown"
    betas: tuple[float, float] | None
    eps: float | None
    names: tuple[str, ...]  # model parameter names in this group (tied ones once)


@dataclass
class OptimizerFacts:
    name: str
    groups: list[GroupInfo]
    group_of: dict[str, int] = field(default_factory=dict)  # param name -> group index
    not_in_optimizer: list[str] = field(default_factory=list)  # trainable, in no group
    frozen_in_optimizer: list[str] = field(default_factory=list)
    foreign: list[dict[str, Any]] = field(default_factory=list)  # not in the model
    duplicates: list[str] = field(default_factory=list)  # listed more than once


# -- gradient flow (checking/flow_measurement.py) --------------------------------------


@dataclass(frozen=True)
class ParamInfo:
    name: str
    module: str  # path of the module that owns it ("" for the root)
    shape: tuple[int, ...]
    dtype: str
    trainable: bool
    has_grad: bool
    reaches_loss: bool  # the parameter's node is in the loss's autograd graph
    in_optimizer: bool | None  # None when no optimizer was given
    numel: int = 0
    role: str = param_roles.OTHER  # bias, normalization weight, embedding, tagged, other
    module_type: str = ""
    grad: GradStats | None = None  # None without a gradient
    pinned: bool = False  # deadweight.pin holds it
    moved_since_pin: float | None = None  # largest change since the pin, if pinned


@dataclass(frozen=True)
class Cut:
    """A candidate explanation for parameters that got no gradient.

    kind: how the graph was cut (see `CUT_KINDS`); op: the call; site: the user's
    line (for a no-grad region, the line that entered it); module: the module path
    running at the time; params: trainable
    parameters upstream of the cut; flows_to_loss: whether the cut's result was seen
    reaching the loss (None when that does not apply to this kind).
    """

    kind: str
    op: str | None
    site: Site | None
    module: str | None
    params: frozenset[str]
    flows_to_loss: bool | None = None
    detail: str = ""
    caller: Site | None = None
    # Where the op ran, when `site` is elsewhere: a cut under no_grad is shown at the
    # user's line that entered the region, and the op inside the callee is this.
    op_site: Site | None = None


CUT_KINDS = {
    "no-grad": "ran under torch.no_grad, so its output has no grad_fn while its input requires grad",
    "inference-mode": "ran under torch.inference_mode, so its output has no grad_fn while its input requires grad",
    "detach": "detached its input with .detach(), so no gradient flows back through it",
    "data": "read .data, which returns the values without the autograd graph",
    "item": "turned a tensor into a Python number (.item() / float()), which carries no gradient",
    "tolist": "turned a tensor into a Python list (.tolist()), which carries no gradient",
    "numpy": "turned a tensor into a NumPy array, which carries no gradient",
    "rebuilt-tensor": "built a new tensor from another tensor's values (torch.tensor), which starts a new graph",
    "non-differentiable": "has no derivative (its output is an integer or boolean tensor)",
    "other": "returned a result without grad_fn although its input requires grad",
    "function": "is an autograd.Function whose outputs come back without grad_fn (ctx.mark_non_differentiable)",
    "reentrant-checkpoint": "is torch.utils.checkpoint with use_reentrant=True and no input that requires grad, so the checkpointed parameters get no gradient",
    "dropped-in-backward": "returned None from backward for an input that needs a gradient",
    "no-autograd-kernel": "is a custom op registered without an autograd kernel: backward warns once and then passes no gradient",
    "custom-op-no-autograd": "is a torch.library.custom_op with no register_autograd: backward through it raises",
    "module-cut": "returned outputs without grad_fn although its inputs or parameters require grad",
    "never-ran": "never ran in this forward",
    "skipped-at-random": "was skipped at random in this forward (LayerDrop, stochastic depth)",
    "output-unused": "ran, but its output never reaches the loss",
    "cut-inside": "ran and its output reaches the loss, yet parameters inside it got no gradient: the graph is cut somewhere inside it",
    "loss-no-grad-fn": "has no grad_fn, so backward cannot reach any parameter",
}


@dataclass(frozen=True)
class RandomSkip:
    """A module that sat out a forward by chance: it ran in other random draws."""

    module: str
    module_type: str
    params: tuple[str, ...]  # trainable parameters under it
    ran: int  # forwards (of `draws`) in which it ran
    draws: int  # forwards looked at: the checked one and the redraws
    in_measured: bool  # it sat out the forward the report is about
    option: str | None  # the setting that skips it ("layerdrop=0.1"), when known


@dataclass(frozen=True)
class LossInfo:
    value: float | None
    finite: bool
    has_graph: bool
    site: Site | None  # the line that produced a loss without grad_fn, when traced
    grad_enabled_at_site: bool | None = None


@dataclass
class GradFlowStats:
    """What one forward+backward showed about gradient flow."""

    model: str
    model_training: bool
    optimizer: str | None
    loss: LossInfo
    params: list[ParamInfo]
    cuts: list[Cut]
    backward_error: str | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict, repr=False)
    # (name, "scale" | "shift") -> the functional probe's result, for screened candidates
    invariance: dict[tuple[str, str], ProbeResult] = field(default_factory=dict)
    probe_note: str | None = None  # why probes were skipped, when they were
    # Parameters a cancelling op removes from the loss by construction (the structure
    # pass, checking/cancellation.py), with the re-run that confirmed them.
    cancellations: dict[str, Cancellation] = field(default_factory=dict)
    # Parameters the structure pass proved to reach the loss through ops it knows:
    # a tiny gradient there is a weak coupling (a fresh layer), not noise.
    influencing: frozenset[str] = frozenset()
    # Parameters the structure pass could not follow (a custom op or autograd.Function
    # on their way, or the pass off); only these get the numerical screens.
    unstructured: frozenset[str] = frozenset()
    structure_note: str | None = None
    # Parameters with an exactly zero gradient -> the zero-initialised gates that
    # multiply the branch they feed (ReZero's alpha, LoRA's B; checking/gates.py),
    # the one nearest the loss first.
    gated_by: dict[str, tuple[str, ...]] = field(default_factory=dict)
    loss_eps: float = FLOAT32_EPS
    optimizer_facts: OptimizerFacts | None = None
    # Parameters whose values a forward run by the check changed (and whether they
    # were put back): a forward that writes `.data` changes the model every step.
    param_writes: list[ParamWrite] = field(default_factory=list)
    state_note: str | None = None  # what of the model's state could not be put back
    # Modules skipped at random (LayerDrop) in the checked forward or the one reported
    # (checking/random_skips.py), by path.
    random_skips: dict[str, RandomSkip] = field(default_factory=dict)

    def param(self, name: str) -> ParamInfo:
        return self._by_name[name]

    @property
    def _by_name(self) -> dict[str, ParamInfo]:
        return {p.name: p for p in self.params}

    @property
    def no_grad_params(self) -> list[ParamInfo]:
        return [p for p in self.params if p.trainable and not p.has_grad]
