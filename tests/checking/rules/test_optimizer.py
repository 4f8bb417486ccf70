"""DW201-DW206: what the optimizer will do with each parameter.

The incident model (demos/layer_scalar_drift) supplies the cancelled scalar; tiny
transformers models supply real parameter layouts (tied heads, ln_1/ln_2, RMSNorm).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight import Severity
from deadweight.demos import layer_scalar_drift as d
from tests.tiny_transformers import gpt2_config, tiny_llama

LAST = f"blocks.{d.LAYERS - 1}.layer_scalar"
X = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def check_mlp(model: nn.Module, optimizer: torch.optim.Optimizer) -> deadweight.Report:
    return deadweight.check(model, lambda: F.mse_loss(model(X), Y), optimizer)


def check_incident(setup: d.Setup, optimizer=None) -> deadweight.Report:
    return deadweight.check(setup.model, setup.loss, optimizer or setup.optimizer)


def only(report: deadweight.Report, code: str) -> deadweight.Finding:
    found = report.by_code(code)
    assert len(found) == 1, [(f.code, f.message) for f in report.findings]
    return found[0]


def worst_rank(report: deadweight.Report) -> int:
    return max((f.severity.rank for f in report.findings), default=-1)


# -- DW201 --------------------------------------------------------------------------


def test_dw201_module_replaced_after_the_optimizer_was_built():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    model[2] = nn.Linear(16, 2)  # a new head; opt still holds the old one
    report = check_mlp(model, opt)
    dw201 = only(report, "DW201")
    assert dw201.severity is Severity.ERROR
    assert set(dw201.params) == {"2.weight", "2.bias"}
    # the old head's tensors are still in the optimizer: stale entries
    foreign = [f for f in report.by_code("DW202") if "not parameters" in f.message]
    assert len(foreign) == 1 and len(foreign[0].evidence["tensors"]) == 2


def test_dw201_silent_when_built_after_the_model_is_final():
    model = mlp()
    model[2] = nn.Linear(16, 2)
    report = check_mlp(model, torch.optim.AdamW(model.parameters()))
    assert not report.by_code("DW201")
    assert not report.by_code("DW202")


def test_dw201_ignores_frozen_parameters_left_out():
    model = mlp()
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    report = check_mlp(model, opt)
    assert not report.by_code("DW201")
    assert not report.by_code("DW202")


# -- DW202 --------------------------------------------------------------------------


def test_dw202_frozen_parameter_in_optimizer_is_info():
    model = mlp()
    model[0].weight.requires_grad_(False)
    report = check_mlp(model, torch.optim.AdamW(model.parameters()))
    dw202 = only(report, "DW202")
    assert dw202.severity is Severity.INFO
    assert dw202.params == ("0.weight",)


def test_dw202_foreign_tensor_is_warning():
    model = mlp()
    stray = nn.Parameter(torch.zeros(3, 3))
    opt = torch.optim.AdamW([*model.parameters(), stray])
    report = check_mlp(model, opt)
    dw202 = only(report, "DW202")
    assert dw202.severity is Severity.WARNING
    assert dw202.evidence["tensors"] == [{"group": 0, "shape": [3, 3], "dtype": "torch.float32"}]
    assert not report.by_code("DW201")


def test_dw202_duplicate_listing_is_error():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    opt.param_groups[0]["params"].append(model[0].weight)  # torch refuses this at build time
    report = check_mlp(model, opt)
    dw202 = only(report, "DW202")
    assert dw202.severity is Severity.ERROR
    assert dw202.params == ("0.weight",)


def test_dw202_duplicate_within_one_group_as_torch_allows_it():
    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch only warns about duplicates in one group
        opt = torch.optim.SGD([model[2].bias, *model.parameters()], lr=0.1)
    dw202 = only(check_mlp(model, opt), "DW202")
    assert dw202.severity is Severity.ERROR
    assert dw202.params == ("2.bias",)


# -- DW203 --------------------------------------------------------------------------


class WithTemperature(d.ScalarStack):
    """The incident model plus a 0-dim parameter, which tells the two shape rules apart."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.temperature


def megatron(model: nn.Module) -> list[dict]:
    return d.shape_rule_groups(model)


def nanogpt(model: nn.Module) -> list[dict]:
    return [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]


def with_temperature(groups) -> tuple[d.Setup, torch.optim.Optimizer]:
    setup = d.make()
    torch.manual_seed(0)
    model = WithTemperature()
    setup.model = model
    opt = torch.optim.AdamW(groups(model), lr=d.LR, betas=d.BETAS, eps=d.EPS)
    return setup, opt


def test_dw203_fires_only_on_the_cancelled_scalar_under_a_shape_rule():
    setup = d.make()
    report = check_incident(setup)
    dw203 = only(report, "DW203")
    assert dw203.severity is Severity.WARNING
    assert dw203.params == (LAST,)  # not the learning scalars, biases or norm gains
    assert "len(p.shape) == 1" in dw203.evidence["rule"]
    assert dw203.evidence["group"] == 1


@pytest.mark.parametrize(
    ("groups", "rule"),
    [(megatron, "len(p.shape) == 1 (as in Megatron)"), (nanogpt, "p.ndim < 2 (as in nanoGPT")],
)
def test_dw203_names_the_shape_rule(groups, rule):
    setup, opt = with_temperature(groups)
    dw203 = only(check_incident(setup, opt), "DW203")
    assert dw203.params == (LAST,)
    assert dw203.evidence["rule"].startswith(rule)


def test_dw203_silent_with_deadweight_param_groups():
    setup = d.make(groups=lambda m: deadweight.param_groups(m, d.WEIGHT_DECAY))
    report = check_incident(setup)
    assert not report.by_code("DW203")
    assert not report.by_code("DW204")


def test_dw203_silent_under_a_shape_rule_when_nothing_is_cancelled():
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))
    model.register_parameter("gain", nn.Parameter(torch.ones(1)))
    opt = torch.optim.AdamW(megatron(model), lr=1e-3)
    report = deadweight.check(model, lambda: F.mse_loss(model(X) * model.gain, Y), opt)
    assert not report.by_code("DW203")


# -- DW204 --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adamw_no_decay() -> tuple[deadweight.Finding, dict]:
    setup = d.make()
    hyper = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8}
    opt = torch.optim.AdamW(setup.model.parameters(), weight_decay=0.0, **hyper)
    return only(check_incident(setup, opt), "DW204"), hyper


def test_dw204_fires_under_adamw_without_decay(adamw_no_decay):
    dw204, _ = adamw_no_decay
    assert dw204.severity is Severity.WARNING
    assert dw204.params == (LAST,)
    assert dw204.evidence["optimizer"] == "AdamW"
    assert dw204.evidence["rule"] == "adam"


def test_dw204_prediction_numbers(adamw_no_decay):
    dw204, hyper = adamw_no_decay
    ev = dw204.evidence
    lr, (b1, b2), eps = hyper["lr"], hyper["betas"], hyper["eps"]
    s = ev["noise_rms"]
    assert 0 < s < 1e-4  # noise: the scalar's gradient RMS (one entry: |g|)
    assert ev["lr"] == lr and ev["betas"] == [b1, b2] and ev["eps"] == eps
    assert ev["expected_step"] == pytest.approx(lr * math.sqrt((1 - b1) / (1 + b1)) * s / (s + eps))
    assert ev["max_step"] == pytest.approx(lr * s / (s + eps))
    assert ev["expected_step"] < ev["max_step"] <= lr
    assert ev["reset_amplification"] == pytest.approx(math.sqrt(1 / (1 - b2)))
    assert ev["reset_amplification"] == pytest.approx(4.4721, rel=1e-4)
    wd = ev["weight_decay_for_equilibrium"]
    assert wd == 0.1  # no group decays: the reference decay is the default 0.1
    assert ev["equilibrium_if_decayed_max"] == pytest.approx(ev["max_step"] / (wd * lr))
    assert ev["equilibrium_if_decayed_expected"] == pytest.approx(ev["expected_step"] / (wd * lr))


def test_dw204_noise_rms_matches_a_plain_backward():
    import copy

    setup = d.make()
    setup.next_batch()
    x, y = setup.batch  # type: ignore[misc]
    dw204 = only(check_incident(setup), "DW204")
    clone = copy.deepcopy(setup.model)
    F.mse_loss(clone(x), y).backward()
    g = dict(clone.named_parameters())[LAST].grad
    assert g is not None
    assert dw204.evidence["noise_rms"] == pytest.approx(g.norm().item(), rel=1e-4)
    # the equilibrium uses the decay the user's other group applies (0.1 in the demo)
    assert dw204.evidence["weight_decay_for_equilibrium"] == d.WEIGHT_DECAY


def test_dw204_silent_under_sgd():
    setup = d.make()
    opt = torch.optim.SGD(setup.model.parameters(), lr=0.1, momentum=0.9)
    assert not check_incident(setup, opt).by_code("DW204")


def test_dw204_silent_when_the_scalar_is_decayed():
    setup = d.make(groups=d.forced_decay_groups)
    report = check_incident(setup)
    assert not report.by_code("DW204")
    assert not report.by_code("DW203")
    assert LAST in {p for f in report.by_code("DW104") for p in f.params}  # still cancelled


def test_dw204_silent_after_pin():
    setup = d.make()
    handle = deadweight.pin(setup.model, LAST, optimizer=setup.optimizer)
    try:
        report = check_incident(setup)
    finally:
        handle.remove()
    assert not report.by_code("DW204")
    assert not report.by_code("DW203")
    assert worst_rank(report) <= Severity.INFO.rank


class Unfamiliar(torch.optim.Optimizer):
    """An optimizer whose hyper-parameter names deadweight does not know."""

    def __init__(self, params, lr: float = 1e-3, gamma: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "gamma": gamma})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def test_dw204_unknown_update_rule_says_prediction_unavailable():
    setup = d.make()
    dw204 = only(check_incident(setup, Unfamiliar(setup.model.parameters())), "DW204")
    assert dw204.params == (LAST,)
    assert dw204.evidence["rule"] == "unknown"
    assert dw204.evidence["prediction"].startswith("unavailable")
    assert "Unfamiliar" in dw204.evidence["prediction"]
    assert "unavailable" in dw204.message
    assert "expected_step" not in dw204.evidence


def test_dw204_rmsprop_bound():
    setup = d.make()
    opt = torch.optim.RMSprop(setup.model.parameters(), lr=1e-3, eps=1e-8)
    ev = only(check_incident(setup, opt), "DW204").evidence
    s = ev["noise_rms"]
    assert ev["rule"] == "rmsprop"
    assert ev["max_step"] == pytest.approx(1e-3 * s / (s + 1e-8))


# -- DW205 --------------------------------------------------------------------------


def test_dw205_lr_zero_fires():
    model = mlp()
    opt = torch.optim.AdamW(
        [{"params": model[2].parameters(), "lr": 0.0}, {"params": model[0].parameters()}],
        lr=1e-3,
    )
    dw205 = only(check_mlp(model, opt), "DW205")
    assert dw205.severity is Severity.WARNING
    assert set(dw205.params) == {"2.weight", "2.bias"}
    assert dw205.evidence == {"group": 0, "lr": 0.0}


def test_dw205_silent_during_a_warm_up_from_zero():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: step / 100)
    assert opt.param_groups[0]["lr"] == 0.0  # the scheduler did set it to 0
    assert opt.param_groups[0]["initial_lr"] > 0
    assert not check_mlp(model, opt).by_code("DW205")


# -- DW206 --------------------------------------------------------------------------


def test_dw206_tagged_parameter_in_a_decay_group_is_warning():
    model = mlp()
    model[0].bias._no_weight_decay = True  # type: ignore[attr-defined]
    model[2].weight._no_weight_decay = True  # type: ignore[attr-defined]
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    report = check_mlp(model, opt)
    tagged = [f for f in report.by_code("DW206") if f.severity is Severity.WARNING]
    assert len(tagged) == 1
    assert set(tagged[0].params) == {"0.bias", "2.weight"}
    plain = [f for f in report.by_code("DW206") if f.severity is Severity.INFO]
    assert [f.params for f in plain] == [("2.bias",)]  # an untagged bias: info


def test_dw206_silent_without_decay():
    model = mlp()
    model[0].bias._no_weight_decay = True  # type: ignore[attr-defined]
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.0)
    assert not check_mlp(model, opt).by_code("DW206")


def test_dw206_silent_for_a_frozen_bias_in_a_decay_group():
    """An optimizer built over every parameter, frozen ones too (torchtune's LoRA
    recipe): a frozen bias is never updated, so its decay does nothing (DW202 says it
    is frozen)."""
    model = mlp()
    model[2].bias.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), weight_decay=0.1)
    report = check_mlp(model, opt)
    assert [f.params for f in report.by_code("DW206")] == [("0.bias",)]  # the trainable one
    assert any("2.bias" in f.params for f in report.by_code("DW202"))


# -- real transformers code ------------------------------------------------------------

IDS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def tiny_gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(gpt2_config(n_head=4, n_inner=None)).train()


def check_lm(model: nn.Module, optimizer: torch.optim.Optimizer) -> deadweight.Report:
    return deadweight.check(model, lambda: model(input_ids=IDS, labels=IDS).loss, optimizer)


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return tiny_gpt2()


def test_dw206_gpt2_name_rule_misses_ln_1_ln_2_ln_f(gpt2):
    no_decay = ["bias", "LayerNorm.weight"]  # the classic BERT recipe
    named = list(gpt2.named_parameters())
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for n, p in named if not any(k in n for k in no_decay)],
                "weight_decay": 0.01,
            },
            {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
        ]
    )
    dw206 = only(check_lm(gpt2, opt), "DW206")
    assert dw206.severity is Severity.INFO
    expected = {n for n, _ in named if ".ln_" in n and n.endswith(".weight")}
    assert expected == {
        "transformer.h.0.ln_1.weight",
        "transformer.h.0.ln_2.weight",
        "transformer.h.1.ln_1.weight",
        "transformer.h.1.ln_2.weight",
        "transformer.ln_f.weight",
    }
    assert set(dw206.params) == expected


def test_tied_parameters_count_once(gpt2):
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    report = check_lm(gpt2, torch.optim.AdamW(gpt2.parameters()))
    assert not report.by_code("DW201")  # lm_head.weight is wte.weight, in the optimizer
    assert not report.by_code("DW202")  # and listed once
    assert all("lm_head.weight" not in f.params for f in report.findings)


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_healthy_transformers_with_param_groups_have_nothing_above_info(build):
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(deadweight.param_groups(model, 0.1), lr=3e-4)
    report = check_lm(model, opt)
    above = [(f.code, f.severity.value, f.params) for f in report.findings if f.severity.rank > 0]
    assert above == []
    assert not report.by_code("DW206")  # every norm weight and bias was recognised
