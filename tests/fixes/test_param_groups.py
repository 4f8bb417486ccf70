"""deadweight.param_groups: weight decay decided by what a parameter is, not its shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight


class TinyRMSNorm(nn.Module):
    """Not a torch class: recognised by its name."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Zoo(nn.Module):
    """One of every kind of parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.ln = nn.LayerNorm(8)
        self.rms = TinyRMSNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.scale = nn.Parameter(torch.ones(1))  # a shape-[1] layer scalar
        self.gate = nn.Parameter(torch.zeros(8))
        self.gate._no_weight_decay = True  # type: ignore[attr-defined]
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.rms(self.ln(self.proj(self.embed(ids)))))
        return self.head(self.frozen(h * self.scale + self.gate))


DECAYED = {"proj.weight", "scale", "embed.weight"}
NOT_DECAYED = {"proj.bias", "ln.weight", "ln.bias", "rms.weight", "bn.weight", "bn.bias", "gate"}


def names(model: nn.Module, params) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in params}


def split(model: nn.Module, groups: list[dict]) -> tuple[set[str], set[str]]:
    decayed = {n for g in groups if g["weight_decay"] > 0 for n in names(model, g["params"])}
    kept = {n for g in groups if g["weight_decay"] == 0 for n in names(model, g["params"])}
    return decayed, kept


def test_default_split_by_meaning():
    model = Zoo()
    groups = deadweight.param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decayed, kept = split(model, groups)
    assert decayed == DECAYED  # the scalar is decayed like any weight; embeddings too
    assert kept == NOT_DECAYED  # bias, LayerNorm, *RMSNorm by name, BatchNorm, tagged


def test_shape_one_scalar_is_decayed_unless_tagged():
    model = Zoo()
    model.scale._no_weight_decay = True  # type: ignore[attr-defined]
    decayed, kept = split(model, deadweight.param_groups(model, 0.1))
    assert "scale" in kept and "scale" not in decayed


def test_embeddings_excluded_on_request():
    model = Zoo()
    groups = deadweight.param_groups(model, 0.1, no_decay=("bias", "norm", "embedding"))
    decayed, kept = split(model, groups)
    assert decayed == {"proj.weight", "scale"}
    assert kept == NOT_DECAYED | {"embed.weight"}


def test_only_biases_excluded_on_request():
    model = Zoo()
    decayed, kept = split(model, deadweight.param_groups(model, 0.1, no_decay=("bias",)))
    assert kept == {"proj.bias", "ln.bias", "bn.bias", "gate"}  # the tag still counts
    assert {"ln.weight", "rms.weight", "bn.weight"} <= decayed


def test_frozen_left_out_and_tied_once():
    model = Zoo()
    groups = deadweight.param_groups(model, 0.1)
    listed = [p for g in groups for p in g["params"]]
    assert len(listed) == len({id(p) for p in listed})  # nothing twice
    assert all(p.requires_grad for p in listed)
    assert id(model.frozen.weight) not in {id(p) for p in listed}
    assert {id(p) for p in listed} == {id(p) for p in model.parameters() if p.requires_grad}
    assert sum(1 for p in listed if p is model.head.weight) == 1


def test_explain_gives_a_reason_per_name():
    model = Zoo()
    groups, reasons = deadweight.param_groups(model, 0.1, explain=True)
    assert isinstance(groups, list)
    assert set(reasons) == {n for n, _ in model.named_parameters()}  # tied once, frozen too
    assert reasons["frozen.weight"].startswith("left out: frozen")
    assert reasons["proj.bias"].startswith("no decay: bias")
    assert reasons["rms.weight"] == "no decay: normalization weight (TinyRMSNorm)"
    assert reasons["bn.weight"].startswith("no decay: normalization weight")
    assert reasons["gate"].startswith("no decay: tagged _no_weight_decay")
    assert reasons["scale"].startswith("decay 0.1")
    assert "embedding decay was not excluded" in reasons["embed.weight"]
    assert all(reason for reason in reasons.values())


@pytest.mark.parametrize("bad", [("bias", "weights"), ("layernorm",), "bias"])
def test_bad_no_decay_raises(bad):
    with pytest.raises(ValueError, match="no_decay"):
        deadweight.param_groups(Zoo(), 0.1, no_decay=bad)


def test_negative_weight_decay_raises():
    with pytest.raises(ValueError, match="weight_decay"):
        deadweight.param_groups(Zoo(), -0.1)


def test_zero_weight_decay_and_empty_groups():
    model = nn.Linear(4, 4, bias=False)
    groups = deadweight.param_groups(model, 0.0)
    assert len(groups) == 1  # no empty no-decay group
    assert groups[0]["weight_decay"] == 0.0


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda g: torch.optim.AdamW(g, lr=1e-2),
        lambda g: torch.optim.SGD(g, lr=1e-2, momentum=0.9),
    ],
    ids=["AdamW", "SGD"],
)
def test_groups_work_with_torch_optimizers(make_opt):
    model = Zoo()
    opt = make_opt(deadweight.param_groups(model, 0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    ids = torch.randint(0, 10, (16,))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(model(ids), ids).backward()
        opt.step()
    after = dict(model.named_parameters())
    assert not torch.equal(after["scale"], before["scale"])
    assert torch.equal(after["frozen.weight"], before["frozen.weight"])
    report = deadweight.check(model, lambda: F.cross_entropy(model(ids), ids), opt)
    assert not report.by_code("DW201")
    assert not report.by_code("DW202")
    assert not report.by_code("DW206")
