"""DW103 / DW104 / DW105: gradients that carry no information, screened and probed.

Every case is checked against a slow reference where numbers are involved: the
relative loss change of a perturbation is recomputed on a deep copy, <g, theta> and
sum(g) with a plain backward on a deep copy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight import Severity
from deadweight.checking import check_stats, invariance
from deadweight.checking.flow_measurement import measure_grad_flow
from deadweight.demos import layer_scalar_drift as d
from tests.tiny_transformers import bert_config

LAST = f"blocks.{d.LAYERS - 1}.layer_scalar"
SCALARS = {f"blocks.{i}.layer_scalar" for i in range(d.LAYERS)}
LossOf = Callable[[nn.Module], torch.Tensor]


# -- helpers ------------------------------------------------------------------------


def check(model: nn.Module, loss_of: LossOf, optimizer=None) -> deadweight.Report:
    return deadweight.check(model, lambda: loss_of(model), optimizer)


def flagged(report: deadweight.Report, code: str, severity: Severity | None = None) -> set[str]:
    return {
        p
        for f in report.by_code(code)
        if severity is None or f.severity is severity
        for p in f.params
    }


def all_flagged(report: deadweight.Report) -> set[str]:
    return {p for f in report.findings for p in f.params}


def no_decay_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)


# The probe's "unchanged" bar, relative to |loss|.
TOL = invariance.CONFIRM_ULPS * torch.finfo(torch.float32).eps  # the shift bar


def relative_change_alone(model: nn.Module, loss_of: LossOf, name: str, kind: str) -> float:
    """Slow reference: perturb only `name` on a deep copy, re-run the loss under no_grad."""
    clone = copy.deepcopy(model)
    p = dict(clone.named_parameters())[name]
    with torch.no_grad():
        base = loss_of(clone).item()
        if kind == "scale":
            p.mul_(check_stats.SCALE_FACTOR)
        else:
            rms = p.float().pow(2).mean().sqrt().item()
            p.add_(check_stats.SHIFT_RMS * rms if rms > 0 else check_stats.SHIFT_FOR_ZERO)
        return abs(loss_of(clone).item() - base) / abs(base)


def plain_grads(model: nn.Module, loss_of: LossOf) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Slow reference: name -> (grad, value) from a plain backward on a deep copy."""
    clone = copy.deepcopy(model)
    loss_of(clone).backward()
    return {n: (p.grad, p.detach()) for n, p in clone.named_parameters() if p.grad is not None}


def snapshot(model: nn.Module) -> dict[str, bytes]:
    return {
        n: bytes(p.detach().contiguous().view(torch.uint8).flatten().tolist())
        for n, p in model.named_parameters()
    }


# -- models -------------------------------------------------------------------------


def incident(norm_eps: float | None = None) -> tuple[d.Setup, LossOf]:
    """The seed-2 demo with its batch fixed, and a loss that takes the model."""
    setup = d.make()
    if norm_eps is not None:
        for m in setup.model.modules():
            if isinstance(m, d.RMSNorm):
                m.eps = norm_eps
    setup.next_batch()
    x, y = setup.batch  # type: ignore[misc]
    return setup, lambda m: F.mse_loss(m(x), y)


X = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
Y = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))


def mse(m: nn.Module) -> torch.Tensor:
    return F.mse_loss(m(X), Y)


class ScalarBeforeNorm(nn.Module):
    """h -> s * h -> norm -> head: the incident in six lines."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.scalar = nn.Parameter(torch.ones(1))
        self.norm = norm
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.scalar * torch.tanh(self.inp(x))))


class ProjectionBeforeNorm(nn.Module):
    """QK-norm style: q = norm(W x), the normalized output is used; W's norm is free."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.q = nn.Linear(16, 32, bias=False)
        self.norm = norm
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.q(x)))


def conv_bn(bias: bool) -> tuple[nn.Module, LossOf]:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=bias),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    )
    x = torch.randn(8, 3, 10, 10)
    y = torch.randn(8, 4)
    return model, lambda m: F.mse_loss(m(x), y)


def linear_layernorm() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


class LoRA(nn.Module):
    """base(x) + B(A(x)) with B zero-initialised: A's gradient is exactly zero at step 0."""

    def __init__(self, zero_b: bool = True) -> None:
        super().__init__()
        self.base = nn.Linear(16, 4)
        self.A = nn.Linear(16, 4, bias=False)
        self.B = nn.Linear(4, 4, bias=False)
        if zero_b:
            nn.init.zeros_(self.B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


class FittedGain(nn.Module):
    """gain * lin(x) with the gain set to its least-squares optimum: the loss depends on
    it strongly, but its gradient is rounding noise far below the floor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4, bias=False)
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * self.lin(x)


def fitted_gain() -> FittedGain:
    torch.manual_seed(1)  # a seed whose float32 optimum leaves a nonzero residue
    model = FittedGain()
    with torch.no_grad():
        f = model.lin(X).double()
        model.gain.fill_(((f * Y.double()).sum() / (f * f).sum()).item())
    return model


# -- DW104 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def incident_report() -> tuple[d.Setup, LossOf, deadweight.Report]:
    torch.manual_seed(0)
    setup, loss_of = incident()
    return setup, loss_of, deadweight.check(setup.model, setup.loss, setup.optimizer)


def test_dw104_warns_on_the_incident_scalar_and_nothing_else(incident_report):
    _, _, report = incident_report
    (dw104,) = [f for f in report.by_code("DW104") if f.severity is Severity.WARNING]
    assert dw104.params == (LAST,)
    assert dw104.location is not None and dw104.location.module == f"blocks.{d.LAYERS - 1}"
    assert all_flagged(report) & SCALARS == {LAST}  # the scalars that learn: silent
    assert not report.by_code("DW103")  # confirmed invariant: DW104's story, not DW103's


def final_norm_change(model: nn.Module, loss_of: LossOf, name: str, factors: list[float]) -> float:
    """Slow reference: the final RMSNorm's output on a deep copy with `name` scaled by
    factors[1] against factors[0] (its weight is all ones, so this is the output of the
    normalization itself), relative."""
    outputs = []
    for factor in factors:
        clone = copy.deepcopy(model)
        seen: list[torch.Tensor] = []
        clone.final_norm.register_forward_hook(
            lambda m, a, out, seen=seen: seen.append(out.detach())
        )
        with torch.no_grad():
            dict(clone.named_parameters())[name].mul_(factor)
            loss_of(clone)
        outputs.append(seen[0].double())
    return float((outputs[1] - outputs[0]).norm() / outputs[0].norm())


def test_dw104_evidence_matches_a_slow_reference(incident_report):
    setup, loss_of, report = incident_report
    (dw104,) = report.by_code("DW104")
    entry = dw104.evidence["params"][LAST]
    # the structure: the final RMSNorm (written out) divides the scalar out
    assert entry["by_construction"] and entry["confirmed"] is True
    (mechanism,) = entry["mechanism"]
    assert mechanism["module"] == "final_norm" and mechanism["directions"] == "every"
    assert "fused_rmsnorm.py" in mechanism["site"]
    # the confirmation: that op's own output under x16, unchanged within rounding
    # (eps = 1e-6 leaves a residue of ~1e-6), so no second point was needed
    assert entry["probe"] == "x16" and "op_output_growth" not in entry
    ref10 = final_norm_change(setup.model, loss_of, LAST, [1.0, 16.0])
    assert entry["op_output_change"] == pytest.approx(ref10, rel=1e-2, abs=1e-8)
    assert entry["op_output_change"] < 1e-5
    ref_change = relative_change_alone(setup.model, loss_of, LAST, "scale")
    assert entry["relative_loss_change"] == pytest.approx(ref_change, abs=1e-7)
    assert entry["relative_loss_change"] <= TOL
    # what AdamW will do with it within the horizon, against its size (1.0)
    assert entry["horizon_steps"] == 10_000 and entry["material"] is True
    assert entry["predicted_move"] > 1.0

    grads = plain_grads(setup.model, loss_of)
    g, theta = grads[LAST]
    assert entry["grad_dot_param"] == pytest.approx((g * theta).sum().item(), rel=1e-4)
    assert entry["grad_norm"] == pytest.approx(g.norm().item(), rel=1e-4)
    assert entry["param_norm"] == pytest.approx(theta.norm().item(), rel=1e-6)
    assert dw104.evidence["loss"] == pytest.approx(loss_of(copy.deepcopy(setup.model)).item())


@pytest.mark.parametrize(
    "norm",
    [
        lambda: nn.LayerNorm(32, eps=1e-6),
        lambda: nn.RMSNorm(32),
        lambda: d.RMSNorm(32),
    ],
    ids=["LayerNorm", "nn.RMSNorm", "custom-RMSNorm"],
)
def test_dw104_warns_on_a_scalar_right_before_a_norm(norm):
    model = ScalarBeforeNorm(norm())
    report = check(model, mse, no_decay_adamw(model))
    assert flagged(report, "DW104", Severity.WARNING) == {"scalar"}
    assert flagged(report, "DW204") == {"scalar"}
    assert relative_change_alone(model, mse, "scalar", "scale") <= TOL


@pytest.mark.parametrize(
    "norm",
    [lambda: nn.LayerNorm(32, eps=1e-6), lambda: nn.RMSNorm(32)],
    ids=["LayerNorm", "RMSNorm"],
)
def test_dw104_is_info_for_a_projection_whose_direction_still_learns(norm):
    model = ProjectionBeforeNorm(norm())
    report = check(model, mse, no_decay_adamw(model))
    (dw104,) = report.by_code("DW104")
    assert dw104.severity is Severity.INFO
    assert dw104.params == ("q.weight",)
    assert "q.weight" not in flagged(report, "DW204")  # its direction learns: no drift
    assert "q.weight" not in flagged(report, "DW103")
    # the reference agrees: scaling alone leaves the loss alone, yet the gradient is real
    assert relative_change_alone(model, mse, "q.weight", "scale") <= TOL
    g, theta = plain_grads(model, mse)["q.weight"]
    assert g.norm() * theta.norm() / mse(model).detach() > invariance.SCREEN
    entry = dw104.evidence["params"]["q.weight"]
    assert entry["grad_dot_param"] == pytest.approx((g * theta).sum().item(), rel=1e-3, abs=1e-9)


def test_dw104_silent_on_a_healthy_mlp():
    model = mlp()
    report = check(model, mse, no_decay_adamw(model))
    assert not report.by_code("DW103")
    assert not report.by_code("DW104")
    assert not report.by_code("DW105")
    assert not report.by_code("DW204")


def test_incident_scalar_is_caught_with_rmsnorm_eps_1e_5():
    torch.manual_seed(0)
    setup, _ = incident(norm_eps=1e-5)
    report = deadweight.check(setup.model, setup.loss, setup.optimizer)
    assert flagged(report, "DW104", Severity.WARNING) == {LAST}
    assert flagged(report, "DW204") == {LAST}


class JointlyCancelled(nn.Module):
    """main(x) + k * head(LN(a * W x + c * offset)): LN cancels the scalars a and c only
    when both are scaled together; scaling `a` alone changes the loss."""

    def __init__(self, k: float = 2e-3) -> None:
        super().__init__()
        self.k = k
        self.main = nn.Linear(8, 2)
        self.proj = nn.Linear(8, 16, bias=False)
        self.offset = nn.Parameter(torch.randn(16))
        self.a = nn.Parameter(torch.ones(1))
        self.c = nn.Parameter(torch.ones(1))
        self.norm = nn.LayerNorm(16, eps=1e-6)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.a * self.proj(x) + self.c * self.offset
        return self.main(x) + self.k * self.head(self.norm(mixed))


def test_group_probe_does_not_confirm_parameters_that_are_only_jointly_invariant():
    torch.manual_seed(2)
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    model = JointlyCancelled()

    def loss_of(m: nn.Module) -> torch.Tensor:
        return F.mse_loss(m(x), y)

    report = check(model, loss_of, no_decay_adamw(model))
    # Every flagged parameter is invariant on its own, by the probe's definition,
    # recomputed here: a shift within CONFIRM_ULPS; a scale moving the loss by at
    # most SCALE_LOSS_RESIDUE at x10 (a normalization's eps residue) and flat beyond.
    for name in sorted(flagged(report, "DW105")):
        change = relative_change_alone(model, loss_of, name, "shift")
        assert change <= TOL, (name, f"{change / TOL:.1f} x the tolerance")
    for name in sorted(flagged(report, "DW104")):
        at10 = relative_change_alone(model, loss_of, name, "scale")
        assert at10 <= invariance.SCALE_LOSS_RESIDUE, (name, at10)


# -- DW105 --------------------------------------------------------------------------


def batchnorm_change_per_channel(model: nn.Module, loss_of: LossOf, seed: int) -> float:
    """Slow reference: BatchNorm's output on a deep copy with the conv bias shifted by
    a random amount per channel, relative."""
    outputs = []
    for shift in (False, True):
        clone = copy.deepcopy(model)
        seen: list[torch.Tensor] = []
        clone[1].register_forward_hook(lambda m, a, out, seen=seen: seen.append(out.detach()))
        bias = clone[0].bias
        with torch.no_grad():
            if shift:
                gen = torch.Generator().manual_seed(seed)
                bias.add_(torch.randn(bias.shape, generator=gen) * 10)
            loss_of(clone)
        outputs.append(seen[0].double())
    return float((outputs[1] - outputs[0]).norm() / outputs[0].norm())


def test_dw105_is_info_for_a_conv_bias_right_before_batchnorm():
    # Exact, and harmless: BatchNorm subtracts any per-channel constant again, so the
    # bias learns nothing and nothing downstream sees where it drifts.
    model, loss_of = conv_bn(bias=True)
    report = check(model, loss_of, no_decay_adamw(model))
    (finding,) = report.by_code("DW105")
    assert finding.params == ("0.bias",) and finding.severity is Severity.INFO
    assert "BatchNorm" in finding.message and "bias=False" in (finding.fix or "")
    assert not report.by_code("DW204")  # not a drift to warn about
    assert "0.bias" not in flagged(report, "DW104")  # a shift story
    entry = finding.evidence["params"]["0.bias"]
    assert entry["probe"] == "+shift" and entry["confirmed"] is True
    assert entry["mechanism"][0]["directions"] == "every"  # every channel on its own
    assert entry["op_output_change"] <= 2e-4
    for seed in range(3):  # the reference: any per-channel shift leaves BN's output alone
        assert batchnorm_change_per_channel(model, loss_of, seed) <= 2e-4
    assert entry["relative_loss_change"] == pytest.approx(
        relative_change_alone(model, loss_of, "0.bias", "shift"), abs=1e-6
    )
    g, theta = plain_grads(model, loss_of)["0.bias"]
    assert entry["grad_sum"] == pytest.approx(g.sum().item(), rel=1e-3, abs=1e-9)
    assert entry["grad_dot_param"] == pytest.approx((g * theta).sum().item(), rel=1e-3, abs=1e-9)


def test_dw105_silent_when_the_conv_has_no_bias():
    model, loss_of = conv_bn(bias=False)
    report = check(model, loss_of, no_decay_adamw(model))
    assert not flagged(report, "DW105", Severity.WARNING)
    assert not report.by_code("DW204")
    assert not report.by_code("DW103")


def test_dw105_is_silent_when_only_the_mean_of_a_bias_is_free():
    # A bias whose uniform shift a LayerNorm removes still learns its other
    # directions: not a finding (the probes' budget goes to would-be warnings).
    model = linear_layernorm()
    report = check(model, mse, no_decay_adamw(model))
    assert "0.bias" not in flagged(report, "DW105")
    assert "0.bias" not in flagged(report, "DW204")
    # the reference: a uniform shift is cancelled, a non-uniform change is not
    assert relative_change_alone(model, mse, "0.bias", "shift") <= TOL
    assert relative_change_alone(model, mse, "0.bias", "scale") > 1e-4


def test_dw105_silent_on_biases_that_learn():
    model = mlp()
    report = check(model, mse)
    assert not report.by_code("DW105")


# -- DW103 --------------------------------------------------------------------------


def test_dw103_is_info_for_an_exactly_zero_gradient():
    model = LoRA(zero_b=True)
    report = check(model, mse, no_decay_adamw(model))
    (dw103,) = report.by_code("DW103")
    assert dw103.severity is Severity.INFO
    assert dw103.params == ("A.weight",)
    assert dw103.evidence["params"]["A.weight"]["grad_norm"] == 0.0
    # an exact zero is not noise Adam could amplify, and is never probed
    assert "A.weight" not in flagged(report, "DW104") | flagged(report, "DW105")
    assert not report.by_code("DW204")
    stats = measure_grad_flow(model, lambda: mse(model))
    assert not any(name == "A.weight" for name, _ in stats.invariance)


def test_dw103_silent_once_lora_b_is_nonzero():
    model = LoRA(zero_b=False)
    report = check(model, mse, no_decay_adamw(model))
    assert not report.by_code("DW103")


def test_a_gradient_below_the_floor_at_an_optimum_is_not_a_finding():
    # A gain fitted to its least-squares optimum: its gradient is a rounding residue,
    # but the structure shows the loss depends on it (gain * lin(x) -> MSE). It sits at
    # an optimum; it is not a parameter that cannot learn, so neither DW103 nor DW204
    # fires, and no numerical screen is spent on it.
    model = fitted_gain()
    stats = measure_grad_flow(model, lambda: mse(model))
    gain = stats.param("gain").grad
    assert gain is not None and not gain.exact_zero  # precondition: rounding residue
    assert "gain" in stats.influencing and "gain" not in stats.unstructured
    assert not stats.cancellations and not stats.invariance
    assert relative_change_alone(model, mse, "gain", "scale") > 1e-2  # it does matter
    report = check(model, mse, torch.optim.AdamW(model.parameters(), weight_decay=0.0))
    assert "gain" not in flagged(report, "DW103")
    assert "gain" not in flagged(report, "DW104")
    assert "gain" not in flagged(report, "DW204")
    # the floor: |g| * max(|theta|, 1) <= 16 ulps of the loss
    g, theta = plain_grads(model, mse)["gain"]
    floor = 16 * torch.finfo(torch.float32).eps * mse(model).item()
    assert 0 < g.norm().item() * max(theta.norm().item(), 1.0) <= floor


# -- probes: state, random batches, budget -------------------------------------------


@pytest.mark.parametrize("case", ["incident", "conv_bn", "linear_layernorm", "projection"])
def test_probes_leave_parameters_bitwise_unchanged(case):
    if case == "incident":
        setup, loss_of = incident()
        model = setup.model
    elif case == "conv_bn":
        model, loss_of = conv_bn(bias=True)
    elif case == "linear_layernorm":
        model, loss_of = ScalarBeforeNorm(nn.LayerNorm(32)), mse
    else:
        model, loss_of = ProjectionBeforeNorm(nn.RMSNorm(32)), mse
    before = snapshot(model)
    stats = measure_grad_flow(model, lambda: loss_of(model))
    # the confirming re-runs did run: the comparison is not vacuous
    assert any(c.confirmed is not None for c in stats.cancellations.values())
    assert snapshot(model) == before
    check(model, loss_of)
    assert snapshot(model) == before


def test_loss_fn_drawing_a_new_batch_each_call_skips_the_probes():
    setup = d.make()

    def fresh_batch() -> torch.Tensor:
        setup.next_batch()  # a private generator: restoring the global RNG does not help
        return setup.loss()

    stats = measure_grad_flow(setup.model, fresh_batch, setup.optimizer)
    # The structure still finds the scalar; the re-runs cannot confirm it, and say why.
    assert stats.cancellations[LAST].confirmed is None
    assert stats.structure_note is not None and "fixed batch" in stats.structure_note
    report = deadweight.check(setup.model, fresh_batch, setup.optimizer)
    assert not [f for f in report.findings if f.severity.rank >= Severity.WARNING.rank]
    (dw104,) = report.by_code("DW104")
    assert dw104.params == (LAST,) and "did not confirm" in dw104.message


def test_fixed_batch_control_does_probe():
    setup, _ = incident()
    stats = measure_grad_flow(setup.model, setup.loss, setup.optimizer)
    assert stats.structure_note is None
    assert stats.cancellations[LAST].confirmed is True
    assert set(stats.cancellations) == {LAST}


def _counting(loss_of: LossOf, model: nn.Module) -> tuple[Callable[[], torch.Tensor], list[int]]:
    calls = [0]

    def loss_fn() -> torch.Tensor:
        calls[0] += 1
        return loss_of(model)

    return loss_fn, calls


def test_many_free_bias_means_cost_no_probe():
    layers = 30  # many biases whose mean a LayerNorm removes, none a would-be warning
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(8, 8), nn.LayerNorm(8), nn.GELU()]
    model = nn.Sequential(*blocks, nn.Linear(8, 2))
    x, y = torch.randn(16, 8), torch.randn(16, 2)

    loss_fn, calls = _counting(lambda m: F.mse_loss(m(x), y), model)
    report = deadweight.check(model, loss_fn)
    # the checked run and one grouped confirmation (x10, x100) of the Linear weights'
    # free norms; a free mean is not a candidate at all
    assert calls[0] <= 3
    assert not any(n.endswith("bias") for n in all_flagged(report))
    assert not [f for f in report.findings if f.severity.rank > Severity.INFO.rank]


def test_one_rerun_confirms_every_bias_before_batchnorm():
    layers = 30
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(8, 2))
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    biases = {f"{3 * i}.bias" for i in range(layers)}

    loss_fn, calls = _counting(lambda m: F.mse_loss(m(x), y), model)
    report = deadweight.check(model, loss_fn)
    # every bias perturbed by its own random amounts: groups of 16, one re-run each
    assert calls[0] == 1 + 2
    assert flagged(report, "DW105") == biases
    assert not [f for f in report.findings if f.severity.rank >= Severity.WARNING.rank]


def test_small_but_real_attention_gradients_are_not_called_noise():
    transformers = pytest.importorskip("transformers")
    config = bert_config()
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()  # no dropout
    ids = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 2])

    def loss_of(m: nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=labels).loss

    query = [
        f"bert.encoder.layer.{i}.attention.self.query.{k}"
        for i in (0, 1)
        for k in ("weight", "bias")
    ]
    # reference: the float32 gradient is the float64 one, so it is signal, not rounding noise
    g32 = plain_grads(model, loss_of)
    g64 = plain_grads(copy.deepcopy(model).double(), loss_of)
    for name in query:
        cos = F.cosine_similarity(g32[name][0].double().flatten(), g64[name][0].flatten(), dim=0)
        assert cos > 0.999, (name, cos)

    opt = torch.optim.AdamW(deadweight.param_groups(model, 0.1), lr=1e-4)
    report = check(model, loss_of, opt)
    warned = {
        p for f in report.findings if f.severity.rank >= Severity.WARNING.rank for p in f.params
    }
    assert not warned & set(query), sorted(warned & set(query))
