"""The structure pass: which parameters a cancelling op removes from the loss, by
construction, and the re-run that confirms it on the op's own output.

Each mechanism has a case that must be found (with its op named) and one that must
not; every "cancelled" verdict is checked against a slow reference in float64: the
loss of a deep copy with the parameter perturbed in random directions.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight import Severity
from deadweight.checking.cancellation import StructureTracker, _TensorCarriers
from deadweight.checking.cancellation_confirmation import relative_change
from deadweight.checking.carrier_algebra import EMPTY, SHIFT, Carrier
from deadweight.checking.check_stats import GradFlowStats
from deadweight.checking.flow_measurement import measure_grad_flow
from tests.conftest import marker_line

LossOf = Callable[[nn.Module], torch.Tensor]
X = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
LABELS = torch.randint(0, 4, (32,), generator=torch.Generator().manual_seed(3))


def stats_of(model: nn.Module, loss_of: LossOf) -> GradFlowStats:
    return measure_grad_flow(model, lambda: loss_of(model))


def insensitive_in_float64(model: nn.Module, loss_of: LossOf, name: str, kind: str) -> bool:
    """Slow reference: in float64, perturbing `name` in random directions (per-entry
    factors in [0.5, 2] for a scale, a shift of 10x its size for a shift) leaves the
    loss unchanged up to what a normalization's eps leaves (1e-4 relative)."""
    clone = copy.deepcopy(model).double()
    p = dict(clone.named_parameters())[name]
    gen = torch.Generator().manual_seed(0)

    def loss() -> float:
        with torch.no_grad():
            return float(loss_of_double(clone, loss_of))

    base = loss()
    for _ in range(3):
        saved = p.detach().clone()
        with torch.no_grad():
            if kind == "scale":
                p.mul_(torch.empty(p.shape, dtype=p.dtype).uniform_(0.5, 2.0, generator=gen))
            else:
                size = max(float(p.abs().max()), 1.0)
                p.add_(torch.randn(p.shape, dtype=p.dtype, generator=gen) * 10 * size)
        changed = abs(loss() - base) / max(abs(base), 1e-12)
        with torch.no_grad():
            p.copy_(saved)
        if changed > 1e-4:
            return False
    return True


def loss_of_double(model: nn.Module, loss_of: LossOf) -> torch.Tensor:
    global X, Y
    saved = X, Y
    X, Y = X.double(), Y.double()
    try:
        return loss_of(model)
    finally:
        X, Y = saved


def mse(m: nn.Module) -> torch.Tensor:
    return F.mse_loss(m(X), Y)


# -- models -------------------------------------------------------------------------


class ScalarBefore(nn.Module):
    """head(norm(s * W x)): the incident in a few lines, for any normalization."""

    def __init__(self, norm: Callable[[torch.Tensor], torch.Tensor] | nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.scalar = nn.Parameter(torch.ones(1))
        self.norm = norm
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.scalar * self.inp(x)))  # the cancelling call


def rms_by_hand(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def layer_norm_by_hand(x: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()


NORMS: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor] | nn.Module]] = {
    "LayerNorm": lambda: nn.LayerNorm(32),
    "RMSNorm": lambda: nn.RMSNorm(32, eps=1e-6),
    "GroupNorm": lambda: nn.GroupNorm(4, 32),
    "F.layer_norm": lambda: lambda x: F.layer_norm(x, (32,)),
    "rms-by-hand": lambda: rms_by_hand,
    "layer-norm-by-hand": lambda: layer_norm_by_hand,
    "F.normalize": lambda: lambda x: F.normalize(x, dim=-1),
}


class GainBefore2d(nn.Module):
    """A per-channel gain before a per-channel normalization of images."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, bias=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.norm = norm
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.conv(x) * self.gain.view(1, -1, 1, 1))
        return self.head(F.relu(h).mean((2, 3)))


IMAGES = torch.randn(8, 3, 10, 10, generator=torch.Generator().manual_seed(4))


def image_mse(m: nn.Module) -> torch.Tensor:
    return F.mse_loss(m(IMAGES), Y[:8])


class Attention(nn.Module):
    """Single-head attention written out; the key bias is cancelled by the softmax."""

    def __init__(self, sdpa: bool = False) -> None:
        super().__init__()
        self.sdpa = sdpa
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(4, 8, 16)
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.sdpa:
            h = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
            h = h.squeeze(1)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(16)
            h = torch.softmax(scores, dim=-1) @ v  # the softmax over keys
        return self.out(h).reshape(32, 4)


class ChoiceBias(nn.Module):
    """One bias added to every class score: cross-entropy removes it."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 4, bias=False)
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + self.bias


def ce(m: nn.Module) -> torch.Tensor:
    return F.cross_entropy(m(X), LABELS)


# -- found, with the mechanism named --------------------------------------------------


@pytest.mark.parametrize("norm", list(NORMS))
def test_a_scalar_before_a_normalization_is_cancelled_in_every_direction(norm):
    model = ScalarBefore(NORMS[norm]())
    stats = stats_of(model, mse)
    assert set(stats.cancellations) == {"scalar"}, stats.cancellations
    found = stats.cancellations["scalar"]
    assert found.kind == "scale" and found.full and found.confirmed is True
    assert insensitive_in_float64(model, mse, "scalar", "scale")
    (mechanism, *_) = found.mechanisms
    expected = {"LayerNorm": "LayerNorm", "RMSNorm": "RMSNorm", "GroupNorm": "GroupNorm"}
    assert expected.get(norm, "") in mechanism.op
    if norm == "F.normalize":
        assert mechanism.op == "F.normalize"
    if "by-hand" in norm:
        assert mechanism.op.startswith("hand-written")
    # The user's line: the call in ScalarBefore.forward, or the written-out norm's own.
    assert mechanism.site is not None
    if norm in ("LayerNorm", "RMSNorm", "GroupNorm"):
        assert mechanism.module == "norm"
        assert mechanism.site.line == marker_line(ScalarBefore.forward, "the cancelling call")


@pytest.mark.parametrize("norm", ["BatchNorm", "InstanceNorm", "GroupNorm-per-channel"])
def test_a_per_channel_gain_before_a_per_channel_norm_is_cancelled(norm):
    module = {
        "BatchNorm": lambda: nn.BatchNorm2d(8),
        "InstanceNorm": lambda: nn.InstanceNorm2d(8, affine=True),
        "GroupNorm-per-channel": lambda: nn.GroupNorm(8, 8),
    }[norm]()
    model = GainBefore2d(module)
    stats = stats_of(model, image_mse)
    found = stats.cancellations["gain"]
    assert found.kind == "scale" and found.full and found.confirmed is True
    assert insensitive_in_float64_images(model, "gain")


def insensitive_in_float64_images(model: nn.Module, name: str) -> bool:
    clone = copy.deepcopy(model).double()
    p = dict(clone.named_parameters())[name]
    with torch.no_grad():
        base = F.mse_loss(clone(IMAGES.double()), Y[:8].double()).item()
        p.mul_(torch.linspace(0.6, 1.9, p.numel(), dtype=p.dtype))
        after = F.mse_loss(clone(IMAGES.double()), Y[:8].double()).item()
    return abs(after - base) / abs(base) < 1e-4


def test_a_per_channel_gain_before_a_groupnorm_of_several_channels_is_not():
    model = GainBefore2d(nn.GroupNorm(2, 8))  # 4 channels a group: their ratios matter
    stats = stats_of(model, image_mse)
    # scaling the whole gain is still cancelled (any norm does that), its direction is not
    assert not stats.cancellations["gain"].full
    assert not insensitive_in_float64_images(model, "gain")


@pytest.mark.parametrize("sdpa", [False, True], ids=["softmax", "sdpa"])
def test_the_key_bias_is_cancelled_by_the_softmax_over_keys(sdpa):
    model = Attention(sdpa)
    stats = stats_of(model, mse)
    assert set(stats.cancellations) == {"k.bias"}
    found = stats.cancellations["k.bias"]
    assert found.kind == "shift" and found.full and found.confirmed is True
    assert "softmax" in found.mechanisms[0].op
    assert insensitive_in_float64(model, mse, "k.bias", "shift")
    # the query bias and the key weights are not: they change the attention pattern
    for name in ("q.bias", "q.weight", "k.weight", "v.bias"):
        assert name in stats.influencing
        assert not insensitive_in_float64(model, mse, name, "shift")


def test_one_bias_over_every_class_is_cancelled_by_cross_entropy():
    model = ChoiceBias()
    stats = stats_of(model, ce)
    found = stats.cancellations["bias"]
    assert found.kind == "shift" and found.full and found.confirmed is True
    assert "cross_entropy" in found.mechanisms[0].op
    assert insensitive_in_float64(model, ce, "bias", "shift")


def test_a_conv_bias_before_batchnorm_is_cancelled_per_channel():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten())
    stats = measure_grad_flow(model, lambda: model(IMAGES).pow(2).mean())
    found = stats.cancellations["0.bias"]
    assert found.kind == "shift" and found.full and found.confirmed is True
    # in eval mode BatchNorm uses its running statistics and cancels nothing
    model.eval()
    stats = measure_grad_flow(model, lambda: model(IMAGES).pow(2).mean())
    assert "0.bias" not in stats.cancellations


def test_a_projection_before_a_norm_has_only_its_norm_free():
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.RMSNorm(32), nn.Linear(32, 4))
    stats = stats_of(model, mse)
    found = stats.cancellations["0.weight"]
    assert found.kind == "scale" and not found.full and found.confirmed is True


# -- not found ------------------------------------------------------------------------


def test_sixteen_chained_scalars_share_one_pair_of_reruns():
    # h * s1 * ... * s16 -> LayerNorm: the op sees the product of their factors, so
    # they split the x10 between them instead of multiplying it to 10^16.
    class Chain(ScalarBefore):
        def __init__(self) -> None:
            super().__init__(nn.LayerNorm(32))
            self.chain = nn.ParameterList([nn.Parameter(torch.ones(1)) for _ in range(15)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.scalar * self.inp(x)
            for s in self.chain:
                h = h * s
            return self.head(self.norm(h))

    model = Chain()
    calls = [0]

    def loss() -> torch.Tensor:
        calls[0] += 1
        return mse(model)

    stats = measure_grad_flow(model, loss)
    assert len(stats.cancellations) == 16
    assert all(c.confirmed is True for c in stats.cancellations.values())
    assert calls[0] <= 3


def test_a_use_the_pass_cannot_see_keeps_the_parameter_out():
    # The scalar also reaches the loss through a call no TorchFunctionMode sees (as a
    # compiled region or a C extension would): the autograd graph has a path around
    # the LayerNorm, so it is not cancelled.
    class SideUse(ScalarBefore):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch._C.DisableTorchFunction():
                side = self.scalar * 1.0
            return self.head(self.norm(self.scalar * self.inp(x))) + side.sum()

    model = SideUse(nn.LayerNorm(32))
    stats = stats_of(model, mse)
    assert "scalar" not in stats.cancellations
    assert not insensitive_in_float64(model, mse, "scalar", "scale")


class Healthy(nn.Module):
    """Scalars that do matter: a branch scalar, a gain after the norm, a temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.branch = nn.Linear(32, 32)
        self.branch_scalar = nn.Parameter(torch.full((1,), 0.5))
        self.norm = nn.LayerNorm(32)
        self.gain_after = nn.Parameter(torch.ones(1))
        self.temperature = nn.Parameter(torch.ones(1))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.branch_scalar * self.branch(F.gelu(h))
        h = self.norm(h) * self.gain_after
        return torch.log_softmax(self.temperature * self.head(h), dim=-1)


def test_scalars_that_matter_are_not_candidates():
    model = Healthy()
    stats = stats_of(model, lambda m: F.nll_loss(m(X), LABELS))
    assert not stats.cancellations
    for name in ("branch_scalar", "gain_after", "temperature"):
        assert name in stats.influencing
        assert not insensitive_in_float64(model, lambda m: F.nll_loss(m(X), LABELS), name, "scale")


def test_a_temperature_before_logsumexp_is_not_a_scale_cancellation():
    # logsumexp(x + c) = logsumexp(x) + c, but logsumexp(t * x) is not t * logsumexp(x)
    model = nn.Linear(16, 4)
    temperature = nn.Parameter(torch.ones(1))
    model.register_parameter("temperature", temperature)

    def loss() -> torch.Tensor:
        logits = model(X) * model.temperature
        return (torch.logsumexp(logits, dim=-1) - logits.mean(-1)).mean()

    stats = measure_grad_flow(model, loss)
    assert "temperature" not in stats.cancellations
    assert "temperature" in stats.influencing


class JointlyCancelled(nn.Module):
    """LN(a * W x + c * offset): LN cancels a and c only when both are scaled together."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32, bias=False)
        self.offset = nn.Parameter(torch.randn(32))
        self.a = nn.Parameter(torch.ones(1))
        self.c = nn.Parameter(torch.ones(1))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.a * self.proj(x) + self.c * self.offset))


def test_parameters_cancelled_only_jointly_are_not_candidates():
    model = JointlyCancelled()
    stats = stats_of(model, mse)
    assert "a" not in stats.cancellations and "c" not in stats.cancellations
    assert not insensitive_in_float64(model, mse, "a", "scale")


class Opaque(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        return g * 2


def test_a_call_the_pass_cannot_see_into_leaves_the_parameter_to_the_screens():
    class Model(ScalarBefore):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(Opaque.apply(self.scalar * self.inp(x))))

    model = Model(nn.LayerNorm(32))
    stats = stats_of(model, mse)
    assert "scalar" in stats.unstructured and "scalar" not in stats.cancellations
    # the numerical fallback still finds it
    assert stats.invariance[("scalar", "scale")].invariant


def test_a_free_mean_cancelled_later_does_not_make_its_parameter_opaque():
    """A shift whose mean one norm absorbs (a free mean, never reported) is still
    followed exactly afterwards: a BatchNorm that then cancels it fully removes it, so
    the call the pass cannot see into, fed only by that BatchNorm, does not take the
    parameter out of the pass's hands (it would then go to the numerical screens,
    whose verdict on a coupling of 1e-11 is a false "does not depend")."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.randn(6))
            self.bn = nn.BatchNorm1d(6, affine=False)
            self.w = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            lat = self.p.expand(8, 6)
            a = F.layer_norm(lat + 0.0 * x, (6,))  # p's shift: its mean absorbed here
            y = Opaque.apply(self.bn(lat * 2.0))  # BatchNorm cancels p's scale and shift
            weak = (a * x).sum() + (torch.tanh(lat) * x).sum()
            return 1e-11 * weak + 0.0 * (y * x).sum() + (self.w(x) ** 2).sum()

    torch.manual_seed(0)
    model, x = Model(), torch.randn(8, 6)
    stats = measure_grad_flow(model, lambda: model(x))
    assert "p" not in stats.unstructured
    assert not deadweight.check(model, lambda: model(x)).findings


def test_a_scale_cancelled_before_a_call_the_pass_cannot_see_into_still_holds():
    # Megatron's shape: the final norm, then an output projection in an autograd.Function
    # (ColumnParallelLinear). The scalar's scale ends at the norm; only its shift (a
    # plain dependence by then) goes on into the Function, which hides no use of it.
    class Model(ScalarBefore):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(Opaque.apply(self.norm(self.scalar * self.inp(x))))

    model = Model(nn.LayerNorm(32))
    stats = stats_of(model, mse)
    found = stats.cancellations["scalar"]
    assert found.kind == "scale" and found.full and found.confirmed is True
    assert insensitive_in_float64(model, mse, "scalar", "scale")


# -- independent of the loss's form and scale -----------------------------------------


LOSS_FORMS: dict[str, LossOf] = {
    "mse": mse,
    "mse-to-zero": lambda m: m(X).pow(2).mean(),
    "sum": lambda m: m(X).sum(),
    "ce": lambda m: F.cross_entropy(m(X), LABELS),
    "ce-plus-1000": lambda m: F.cross_entropy(m(X), LABELS) + 1000.0,
    "exactly-zero": lambda m: (lambda v: v - v.detach())(F.cross_entropy(m(X), LABELS)),
}


@pytest.mark.parametrize("form", list(LOSS_FORMS))
@pytest.mark.parametrize("width", [8, 512])
def test_the_verdict_does_not_depend_on_the_loss(form, width):
    torch.manual_seed(width)
    model = nn.Sequential()
    model.inp = nn.Linear(16, width, bias=False)
    scalar = nn.Parameter(torch.ones(1))
    model.register_parameter("scalar", scalar)
    model.norm = nn.LayerNorm(width, eps=1e-5)
    model.head = nn.Linear(width, 4)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model.head(model.norm(model.scalar * model.inp(x)))

    model.forward = forward  # type: ignore[method-assign]
    stats = measure_grad_flow(model, lambda: LOSS_FORMS[form](model))
    found = stats.cancellations["scalar"]
    assert found.full and found.confirmed is True
    assert found.evidence["op_output_change"] < 1e-3


def test_bf16_autocast_keeps_the_verdict():
    model = ScalarBefore(nn.LayerNorm(32))

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.mse_loss(model(X).float(), Y)

    stats = measure_grad_flow(model, loss)
    found = stats.cancellations["scalar"]
    assert found.full and found.confirmed is True


# -- severity: what will happen to the run ---------------------------------------------


def test_severity_follows_what_the_optimizer_will_do():
    model = ScalarBefore(nn.LayerNorm(32))
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    warned = deadweight.check(model, lambda: mse(model), adam)
    (dw104,) = warned.by_code("DW104")
    assert dw104.severity is Severity.WARNING and "LayerNorm" in dw104.message
    assert "within 10000 steps" in dw104.message
    # plain SGD moves it by lr * noise: nothing within the horizon
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    quiet = deadweight.check(model, lambda: mse(model), sgd)
    (dw104,) = quiet.by_code("DW104")
    assert dw104.severity is Severity.INFO
    assert dw104.evidence["params"]["scalar"]["material"] is False
    # a shorter horizon (a configurable threshold) can make Adam's move immaterial too
    short = deadweight.check(model, lambda: mse(model), adam, thresholds={"drift-horizon-steps": 1})
    assert short.by_code("DW104")[0].severity is Severity.INFO
    # no optimizer to tell: a scalar that cannot learn is a warning
    alone = deadweight.check(model, lambda: mse(model))
    assert alone.by_code("DW104")[0].severity is Severity.WARNING


def test_exact_shift_redundancies_are_info_with_the_fix():
    model = Attention()
    adam = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    report = deadweight.check(model, lambda: mse(model), adam)
    (dw105,) = report.by_code("DW105")
    assert dw105.severity is Severity.INFO and dw105.params == ("k.bias",)
    assert "softmax" in dw105.message and "bias=False" in (dw105.fix or "")
    assert not report.by_code("DW204")


# -- cost and state --------------------------------------------------------------------


def test_a_healthy_transformer_costs_no_rerun():
    transformers = pytest.importorskip("transformers")
    from tests.tiny_transformers import gpt2_config

    model = transformers.GPT2LMHeadModel(gpt2_config()).train()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    calls = [0]

    def loss() -> torch.Tensor:
        calls[0] += 1
        return model(input_ids=ids, labels=ids).loss

    stats = measure_grad_flow(model, loss)
    assert calls[0] == 1
    assert not stats.cancellations and not stats.unstructured
    assert stats.structure_note is None


@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_the_confirming_reruns_compare_the_ops_own_output(eps):
    # A reference for the evidence: the LayerNorm's output with the scalar x16 against
    # x1, and x256 against x16. With eps = 1e-5 the first point is unchanged within
    # rounding and settles it; eps = 1e-2 leaves a residue above rounding, so the
    # second point must show it shrinking.
    model = ScalarBefore(nn.LayerNorm(32, eps=eps))
    stats = stats_of(model, mse)
    found = stats.cancellations["scalar"]
    assert found.confirmed is True
    evidence = found.evidence
    outputs = []
    for factor in (1.0, 16.0, 256.0):
        clone = copy.deepcopy(model)
        seen: list[torch.Tensor] = []
        clone.norm.register_forward_hook(lambda m, a, out, seen=seen: seen.append(out.detach()))
        with torch.no_grad():
            clone.scalar.mul_(factor)
            mse(clone)
        outputs.append(seen[0])
    assert evidence["op_output_change"] == pytest.approx(
        relative_change(outputs[1], outputs[0]), rel=1e-3, abs=1e-9
    )
    if eps == 1e-5:
        assert evidence["probe"] == "x16" and "op_output_growth" not in evidence
        return
    assert evidence["probe"] == "x16, x256"
    assert evidence["op_output_growth"] == pytest.approx(
        relative_change(outputs[2], outputs[1]), rel=1e-3, abs=1e-9
    )
    assert evidence["op_output_growth"] < 0.1 * evidence["op_output_change"]


def test_a_tensor_that_reuses_a_dead_ones_id_carries_nothing_from_it() -> None:
    """Carriers outlive their tensors (one forward's worth); an entry is only read for
    the very tensor it was made for."""
    carriers = _TensorCarriers()
    gone = torch.zeros(2)
    carriers.set(gone, Carrier(lost=0b10))
    ref = carriers.by_id[id(gone)][0]
    del gone
    assert ref() is None and len(carriers.by_id) == 1
    live = torch.ones(2)
    carriers.by_id[id(live)] = (ref, Carrier(lost=0b10))  # as if its id had been reused
    assert carriers.get(live) is EMPTY
    carriers.set(live, Carrier(lost=0b100))
    assert carriers.get(live) == Carrier(lost=0b100)
    carriers.discard(live)
    assert carriers.get(live) is EMPTY


def test_parameter_entries_are_shared_between_checks_and_unique_within_one() -> None:
    """A parameter's own carrier is looked up by (index, shape): two trackers over
    the same parameters share it, and within one tracker no two parameters share a
    shift tag, whatever was looked up before."""
    first = [nn.Parameter(torch.ones(s)) for s in ((3,), (3,), (2, 3), ())]
    second = [nn.Parameter(torch.ones(s)) for s in ((3,), (4,), (2, 3), ())]

    def entries(params: list[nn.Parameter]) -> list[Carrier]:
        tracker = StructureTracker({id(p): p for p in params}, {})
        return [tracker.carrier(p) for p in params]

    a, b = entries(first), entries(second)
    for same in (0, 2, 3):  # same index, same shape
        assert b[same] is a[same]
    assert b[1] is not a[1]  # same index, another shape
    for carriers in (a, b):
        tags = [f.tag for c in carriers for f in c.pure.values() if f.kind == SHIFT]
        assert len(tags) == len(set(tags)) == len(carriers)
        for i, c in enumerate(carriers):
            assert set(c.pure) == {2 * i, 2 * i + 1}
    # a parameter's effects vary along every dim of it longer than 1
    assert a[2].pure[4].full == frozenset({0, 1}) and a[3].pure[6].full == frozenset()


@pytest.mark.parametrize("order", [("shift", "scale"), ("scale", "shift")])
def test_of_two_full_cancellations_of_one_parameter_the_scale_is_reported(order) -> None:
    """Which of a parameter's effects a call records first follows the order its
    carriers hold them in, which is no conclusion of the pass: when both are cancelled
    in full, the verdict names the scale either way."""
    from deadweight.checking.cancellation import _Absorbed

    p = nn.Parameter(torch.ones(3))
    tracker = StructureTracker({id(p): p}, {id(p): "p"})
    for kind in order:
        entity = 0 if kind == "scale" else 1
        where = (None, None, 2.0**-24)
        tracker.absorbed[entity] = [
            _Absorbed("torch.layer_norm", 0, "LayerNorm", where, {0}, True, False, 2.0**-24)
        ]
    found = tracker.result(torch.zeros(()), lambda i: True).cancellations
    assert found["p"].kind == "scale" and found["p"].full
