"""DW301-DW307: each rule fires where it must and stays quiet on healthy training."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from torch import nn

import deadweight
from deadweight import Severity
from deadweight.homologous import robust_outlier
from tests.tiny_transformers import bert_config, gpt2_config, llama_config


def _loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int, loss_fn, **watch_kw):
    with deadweight.watch(model, opt, **{"every": 10, **watch_kw}) as w:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss_fn(step).backward()
            opt.step()
    return w.report()


# -- DW301 --------------------------------------------------------------------------------


def test_never_moved_param_outside_the_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)  # model[0] forgotten
    report = _loop(model, opt, 60, lambda s: model(torch.randn(8, 4)).pow(2).mean())
    found = report.by_code("DW301")
    assert len(found) == 1
    assert set(found[0].params) == {"0.weight", "0.bias"}
    assert "no watched optimizer" in found[0].message


def test_never_moved_lr_zero_group() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.Adam(
        [{"params": model[0].parameters(), "lr": 0.0}, {"params": model[1].parameters()}]
    )
    report = _loop(model, opt, 60, lambda s: model(torch.randn(8, 4)).pow(2).mean())
    (found,) = report.by_code("DW301")
    assert set(found.params) == {"0.weight", "0.bias"}
    assert "learning rate was 0" in found.message
    (skipped,) = report.by_code("DW304")
    assert skipped.evidence["cause"] == "learning rate 0"
    assert skipped.severity is Severity.WARNING
    assert skipped.evidence["skipped"] == {"0.weight": 60, "0.bias": 60}


def test_moved_by_a_single_bit_is_moved() -> None:
    """A large parameter whose norm stays bitwise equal: the raw-bit checksum decides."""
    torch.manual_seed(0)
    big = nn.Linear(100, 100)  # 10k elements: large
    opt = torch.optim.SGD(big.parameters(), lr=0.0)
    with deadweight.watch(big, opt, every=10) as w:
        for step in range(60):
            opt.zero_grad()
            big(torch.randn(2, 100)).sum().backward()
            opt.step()
            if step == 30:
                with torch.no_grad():  # swap two entries: same norm, different bits
                    a, b = big.weight[0, 0].item(), big.weight[0, 1].item()
                    big.weight[0, 0], big.weight[0, 1] = b, a
    names = {n for f in w.report().by_code("DW301") for n in f.params}
    assert names == {"bias"}


# -- DW304 --------------------------------------------------------------------------------


def test_skipped_updates_lost_to_bf16_precision() -> None:
    model = nn.Linear(4, 1)
    gain = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.SGD([*model.parameters(), gain], lr=1e-4)  # 1e-4 * |g| << bf16 ulp at 1
    with deadweight.watch(model, opt, every=10) as w:
        for _ in range(40):
            opt.zero_grad()
            (model(torch.randn(8, 4) * gain.float()) - 1).pow(2).mean().backward()
            opt.step()
    lost = [f for f in w.report().by_code("DW304") if "lost" in f.evidence["cause"]]
    assert len(lost) == 1
    name = next(iter(lost[0].evidence["skipped"]))
    assert name.endswith("param2[4]")  # not in the model: a fallback name with its shape
    assert lost[0].evidence["skipped"][name] == 40
    assert gain.eq(1).all()  # indeed never changed


def _lost_updates(dtype: torch.dtype, start: float) -> deadweight.Finding:
    """One small parameter whose every SGD step (lr 1e-4 times a gradient of exactly
    1e-3: 1e-7) is far below half the spacing of its values at `start`."""
    model = nn.Linear(4, 1)
    gain = nn.Parameter(torch.full((4,), start, dtype=dtype))
    opt = torch.optim.SGD([*model.parameters(), gain], lr=1e-4)
    with deadweight.watch(model, opt, every=10) as w:
        for _ in range(30):
            opt.zero_grad()
            loss = (model(torch.randn(8, 4)) - 1).pow(2).mean() + gain.float().sum() * 1e-3
            loss.backward()
            opt.step()
    assert gain.eq(start).all()
    (lost,) = [f for f in w.report().by_code("DW304") if "lost" in f.evidence["cause"]]
    return lost


def test_lost_updates_of_a_bf16_parameter_advise_an_fp32_master_copy() -> None:
    lost = _lost_updates(torch.bfloat16, 1.0)  # bf16 spacing at 1: 2^-7
    assert set(lost.evidence["dtypes"].values()) == {"bfloat16"}
    assert "fp32 master copy" in lost.fix and "bfloat16" in lost.fix


def test_lost_updates_of_an_fp32_parameter_do_not_advise_fp32_master_weights() -> None:
    lost = _lost_updates(torch.float32, 1e4)  # fp32 spacing at 1e4: 2^-10
    assert set(lost.evidence["dtypes"].values()) == {"float32"}
    assert "already float32" in lost.fix and "master copy would change nothing" in lost.fix
    assert "fp32 master" not in lost.fix


# -- DW305 is in tests/probes/test_step_monitor.py (first step and parameter) ---------------


# -- DW306 --------------------------------------------------------------------------------


class Experts(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(4, 4) for _ in range(n)])

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        # expert 0 always, expert 1 every other step, expert 3 one step in ten
        chosen = [0] + ([1] if step % 2 else []) + ([3] if step % 10 == 0 else []) + [2]
        return sum(self.experts[i](x) for i in chosen)


def test_intermittent_gradient_fractions() -> None:
    model = Experts()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    report = _loop(model, opt, 100, lambda s: model(torch.randn(8, 4), s).pow(2).mean())
    by_sev = {f.severity: f for f in report.by_code("DW306")}
    assert by_sev[Severity.INFO].evidence["fraction_with_grad"] == {
        "experts.1.weight": 0.5, "experts.1.bias": 0.5,
    }  # fmt: skip
    assert by_sev[Severity.WARNING].evidence["fraction_with_grad"] == {
        "experts.3.weight": 0.1, "experts.3.bias": 0.1,
    }  # fmt: skip
    assert not report.by_code("DW301")


# -- DW307 --------------------------------------------------------------------------------

# The incident's table: L0 0.656, L1-L14 0.3-0.8, L15 0.197, L16-L29 0.4-1.1, L30 1.203,
# L31 56.25.
INCIDENT = (
    [0.656]
    + [0.3 + 0.5 * i / 13 for i in range(14)]
    + [0.197]
    + [0.4 + 0.7 * i / 13 for i in range(14)]
    + [1.203, 56.25]
)


class Scalars(nn.Module):
    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module() for _ in values])
        for layer, v in zip(self.layers, values, strict=True):
            layer.layer_scalar = nn.Parameter(torch.tensor([v]))


def _outlier_report(values: list[float]) -> deadweight.Report:
    model = Scalars(values)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(len(values))
    return _loop(
        model,
        opt,
        20,
        lambda s: (torch.cat([layer.layer_scalar for layer in model.layers]) * x).sum(),
        every=5,
    )


def test_layer_outlier_incident_table() -> None:
    (found,) = _outlier_report(INCIDENT).by_code("DW307")
    assert found.params == ("layers.31.layer_scalar",)
    ev = found.evidence
    assert ev["value"] == pytest.approx(56.25, rel=1e-4)
    assert ev["since_step"] == 1
    # slow reference: the robust z-score of log(56.25) among the logs of all 32 values
    logs = [math.log(v) for v in INCIDENT]
    median = statistics.median(logs)
    mad = statistics.median(abs(v - median) for v in logs)
    assert ev["robust_z"] == pytest.approx(0.6745 * (math.log(56.25) - median) / mad, rel=1e-3)


@pytest.mark.parametrize(
    "values",
    [
        INCIDENT[:-1],  # the 31 healthy layers
        [1.0] * 8,  # at initialisation
        [1.0, 1.1, 0.9, 1.6, 1.2, 0.95, 1.05, 1.0],  # spread, nothing 2x away
        [0.02, -0.01, 0.015, 0.03, -0.02, 0.01],  # mixed signs near 0 (zero-init scalars)
        [-0.0601, -0.0609, 0.0610],  # ReZero's alphas after 50 Adam steps: signs differ
    ],
)
def test_layer_outlier_quiet(values: list[float]) -> None:
    assert not _outlier_report(values).by_code("DW307")


def test_outlier_threshold_is_what_the_docs_say() -> None:
    assert robust_outlier([1.0, 1.0, 1.0, 2.1]) is not None
    assert robust_outlier([-0.5, 0.3, -0.7, 0.4, 0.6, 0.5, 56.25]) is not None  # magnitudes
    assert robust_outlier([-1.0, 1.0, 1.0, -1.0]) is None  # a sign alone sets none apart
    assert robust_outlier([0.0, 0.0, 0.0, 0.5]) is not None  # linear beside an exact 0
    assert robust_outlier([1.0, 1.0, 1.0, 1.9]) is None  # under 2x
    assert robust_outlier([1.0, 1.0, 1.0, 0.4]) is not None  # 2.5x below


# -- DW302 negatives ----------------------------------------------------------------------


def test_no_drift_with_sgd() -> None:
    """SGD turns a noise-level gradient into noise-level steps: nothing drifts."""
    from deadweight.demos import layer_scalar_drift as d

    setup = d.make()
    setup.optimizer = torch.optim.SGD(setup.model.parameters(), lr=0.05)
    with deadweight.watch(setup.model, setup.optimizer, every=20) as w:
        d.train(setup, 400, every=400)
    assert not w.report().by_code("DW302")


def test_a_random_walk_is_not_a_drift() -> None:
    """Weak-but-real gradients of random sign (a fresh layer on random data) make Adam
    random-walk: 52% of steps one way, a net share of 1/sqrt(n). Not a drift."""
    from deadweight.watching.rules._drift import directed

    gen = torch.Generator().manual_seed(0)
    for steps in (100, 400, 3000):
        signs = torch.randint(0, 2, (steps,), generator=gen) * 2 - 1
        walk = signs.cumsum(0)
        same = max(int((signs > 0).sum()), int((signs < 0).sum())) / steps
        net = abs(int(walk[-1])) / steps
        assert not directed(same, steps, net, steps), (steps, same, net)
    # A biased walk (66% of steps one way, the toy port of the incident) is a drift.
    assert directed(0.66, 1000, 0.32, 1000)
    # So is a steady drift with few steps.
    assert directed(0.95, 100, 0.9, 100)
    # 60% one way in 100 steps is 2 standard deviations: chance, not a direction.
    assert not directed(0.6, 100, 0.2, 100)


# -- healthy models ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_healthy_transformers_quiet(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(gpt2_config(n_layer=4))
    elif family == "llama":
        model = transformers.LlamaForCausalLM(llama_config(num_hidden_layers=4))
    else:
        model = transformers.BertForSequenceClassification(bert_config(num_hidden_layers=4))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)

    def loss(step: int) -> torch.Tensor:
        ids = torch.randint(1, 100, (4, 16), generator=gen)
        if family == "bert":
            return model(ids, labels=ids[:, 0] % 3).loss
        return model(ids, labels=ids).loss

    report = _loop(model, opt, 200, loss, every=20)
    assert report.ok, str(report)
    # BERT's key bias is exactly cancelled by softmax (a structural true positive that
    # `check` reports as DW105), but AdamW's decay holds it: nothing drifts.
    assert not report.findings, str(report)


# -- DW310 --------------------------------------------------------------------------------


def _zeros_for_missing(model: nn.Module) -> None:
    """What DeepSpeed does after backward: a gradient of zeros where autograd left None."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def _loop_filling_zeros(model: nn.Module, opt: torch.optim.Optimizer, loss_fn):
    with deadweight.watch(model, opt, every=10) as w:
        for step in range(60):
            opt.zero_grad(set_to_none=True)
            loss_fn(step).backward()
            _zeros_for_missing(model)
            opt.step()
    return w.report()


def test_gradient_always_zero_under_a_framework_that_fills_it_in() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def loss(step: int) -> torch.Tensor:
        return model[1](model[0](torch.randn(8, 4)).detach()).pow(2).mean()

    report = _loop_filling_zeros(model, opt, loss)
    (found,) = report.by_code("DW310")
    assert set(found.params) == {"0.weight", "0.bias"}
    assert found.evidence["per_param"]["0.weight"]["steps_with_grad"] == 60
    assert not report.by_code("DW301")  # weight decay moved them: not unchanged


def test_gradient_always_zero_leaves_dw301_and_pinned_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(1, 1))
    deadweight.pin(model, "2.bias")  # pin zeroes its gradient on purpose
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no decay: zeros leave it unchanged

    def loss(step: int) -> torch.Tensor:
        return model[2](model[1](model[0](torch.randn(8, 4)).detach())).pow(2).mean()

    report = _loop_filling_zeros(model, opt, loss)
    assert not report.by_code("DW310")
    (never,) = report.by_code("DW301")
    assert set(never.params) == {"0.weight", "0.bias"}
