"""Models that take and return dicts, tuples and dataclasses, and losses built from several modules.

Healthy variants must give no DW101; a variant with one broken branch must give
DW101 on exactly that branch's parameters and a DW102 that names the branch.
Every verdict is compared with a plain `loss.backward()` on a deep copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight import Severity
from tests.conftest import reference_no_grad
from tests.tiny_transformers import gpt2_config

X = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(2))


def _quiet(report: deadweight.Report) -> bool:
    """Nothing found but info-level notes on scale/shift invariance (DW103-DW105),
    which healthy models with normalization layers have."""
    return all(
        f.code in ("DW103", "DW104", "DW105") and f.severity is deadweight.Severity.INFO
        for f in report.findings
    )


def _dw101(report: deadweight.Report) -> set[str]:
    return {p for f in report.by_code("DW101") for p in f.params}


def _check(model: nn.Module, loss_of: Callable[[nn.Module], torch.Tensor]) -> deadweight.Report:
    """check, plus the reference: DW101 names exactly what a plain backward leaves without grad."""
    expected = reference_no_grad(model, loss_of)
    report = deadweight.check(model, lambda: loss_of(model))
    assert _dw101(report) == expected, report
    return report


def _params(module: nn.Module, prefix: str) -> set[str]:
    return {f"{prefix}.{n}" for n, p in module.named_parameters() if p.requires_grad}


def _single_cut(report: deadweight.Report, kind: str, module: str, params: set[str]) -> None:
    [cut] = report.by_code("DW102")
    assert cut.evidence["kind"] == kind
    assert cut.location is not None and cut.location.module == module
    assert set(cut.params) == params
    [finding] = report.by_code("DW101")
    assert set(finding.params) == params
    assert [e["kind"] for e in finding.evidence["explained_by"]] == [kind]


# -- dict in, dict out ------------------------------------------------------------


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)
        self.aux_head = nn.Linear(16, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.encoder(batch["x"])
        return {"logits": self.head(h), "aux": self.aux_head(h), "hidden": h}


BATCH = {"x": X, "y": Y}


def test_dict_io_healthy() -> None:
    def loss_of(m: nn.Module) -> torch.Tensor:
        out = m(BATCH)
        return F.cross_entropy(out["logits"], BATCH["y"]) + 0.1 * out["aux"].pow(2).mean()

    report = _check(DictModel(), loss_of)
    assert _quiet(report)


def test_dict_io_unused_aux_entry() -> None:
    model = DictModel()
    report = _check(model, lambda m: F.cross_entropy(m(BATCH)["logits"], BATCH["y"]))
    aux = _params(model.aux_head, "aux_head")
    assert _dw101(report) == aux == {"aux_head.weight", "aux_head.bias"}
    _single_cut(report, "output-unused", "aux_head", aux)
    [cut] = report.by_code("DW102")
    assert cut.severity is Severity.ERROR
    assert "aux_head" in cut.message


def test_dict_io_aux_used_only_for_logging() -> None:
    model = DictModel()
    logged: list[float] = []

    def loss_of(m: nn.Module) -> torch.Tensor:
        out = m(BATCH)
        logged.append(out["aux"].detach().mean().item())
        return F.cross_entropy(out["logits"], BATCH["y"])

    report = _check(model, loss_of)
    aux = {"aux_head.weight", "aux_head.bias"}
    assert _dw101(report) == aux
    _single_cut(report, "output-unused", "aux_head", aux)


def test_kwargs_input_healthy() -> None:
    class KwModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 4)
            self.b = nn.Linear(5, 4)

        def forward(self, *, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
            return self.a(left) * self.b(right)

    right = torch.randn(6, 5)
    report = _check(KwModel(), lambda m: m(left=X, right=right).sum())
    assert _quiet(report)


# -- tuples -----------------------------------------------------------------------


class TupleModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.left = nn.Linear(16, 3)
        self.right = nn.Linear(16, 2)

    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = xs
        h = torch.tanh(self.trunk(a + b))
        return self.left(h), self.right(h)


XS = (X, torch.randn(6, 8))


def test_tuple_io_healthy() -> None:
    def loss_of(m: nn.Module) -> torch.Tensor:
        logits, reg = m(XS)
        return F.cross_entropy(logits, Y) + F.mse_loss(reg, torch.zeros_like(reg))

    assert _quiet(_check(TupleModel(), loss_of))


def test_tuple_io_second_output_unused() -> None:
    model = TupleModel()
    report = _check(model, lambda m: F.cross_entropy(m(XS)[0], Y))
    right = _params(model.right, "right")
    assert _dw101(report) == right
    _single_cut(report, "output-unused", "right", right)


class Pair(NamedTuple):
    main: torch.Tensor
    extra: torch.Tensor


class NamedTupleModel(TupleModel):
    def forward(self, xs: tuple[torch.Tensor, torch.Tensor]) -> Pair:  # type: ignore[override]
        return Pair(*super().forward(xs))


def test_namedtuple_output_healthy_and_broken() -> None:
    model = NamedTupleModel()
    ok = _check(model, lambda m: m(XS).main.sum() + m(XS).extra.sum())
    assert _quiet(ok)
    broken = _check(model, lambda m: F.cross_entropy(m(XS).main, Y))
    _single_cut(broken, "output-unused", "right", _params(model.right, "right"))


# -- dataclasses ------------------------------------------------------------------


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    embedding: torch.Tensor
    aux_logits: torch.Tensor | None = None
    note: str = ""


class DataclassModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU())
        self.cls = nn.Linear(16, 3)
        self.proj = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> Output:
        h = self.body(x)
        return Output(self.cls(h), self.proj(h), self.aux(h), note="ok")


def test_dataclass_output_healthy() -> None:
    def loss_of(m: nn.Module) -> torch.Tensor:
        out = m(X)
        return (
            F.cross_entropy(out.logits, Y)
            + out.embedding.pow(2).mean()
            + 0.3 * F.cross_entropy(out.aux_logits, Y)
        )

    assert _quiet(_check(DataclassModel(), loss_of))


def test_dataclass_output_field_unused() -> None:
    model = DataclassModel()

    def loss_of(m: nn.Module) -> torch.Tensor:
        out = m(X)
        return F.cross_entropy(out.logits, Y) + 0.3 * F.cross_entropy(out.aux_logits, Y)

    report = _check(model, loss_of)
    proj = _params(model.proj, "proj")
    assert _dw101(report) == proj
    _single_cut(report, "output-unused", "proj", proj)


def test_dataclass_submodule_output_unused() -> None:
    """The dataclass comes from a submodule: its unused field's producer is the cut."""

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = DataclassModel()
            self.final = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.final(self.inner(x).logits)

    model = Outer()
    report = _check(model, lambda m: F.cross_entropy(m(X), Y))
    lost = _params(model.inner.proj, "inner.proj") | _params(model.inner.aux, "inner.aux")
    assert _dw101(report) == lost
    cuts = report.by_code("DW102")
    assert {c.evidence["kind"] for c in cuts} == {"output-unused"}
    assert {c.location.module for c in cuts if c.location} == {"inner.proj", "inner.aux"}
    assert set().union(*(set(c.params) for c in cuts)) == lost


# -- several modules in one container ---------------------------------------------


def _container() -> nn.ModuleDict:
    return nn.ModuleDict(
        {
            "encoder": nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16)),
            "head": nn.Linear(16, 3),
            "critic": nn.Linear(16, 1),
        }
    )


def test_container_loss_from_submodules_healthy() -> None:
    def loss_of(c: nn.Module) -> torch.Tensor:
        h = c["encoder"](X)
        return F.cross_entropy(c["head"](h), Y) + c["critic"](h).pow(2).mean()

    report = _check(_container(), loss_of)
    assert _quiet(report)
    assert report.subject["model"] == "ModuleDict"


def test_container_submodule_never_called() -> None:
    container = _container()
    report = _check(container, lambda c: F.cross_entropy(c["head"](c["encoder"](X)), Y))
    critic = _params(container["critic"], "critic")
    assert _dw101(report) == critic
    _single_cut(report, "never-ran", "critic", critic)
    # a module that never ran may be data-dependent routing: a warning, not an error
    assert all(
        f.severity is Severity.WARNING for f in report.findings if f.code in ("DW101", "DW102")
    )


def test_container_submodule_output_unused() -> None:
    container = _container()
    values: list[torch.Tensor] = []

    def loss_of(c: nn.Module) -> torch.Tensor:
        h = c["encoder"](X)
        values.append(c["critic"](h))  # computed, kept around, never in the loss
        return F.cross_entropy(c["head"](h), Y)

    report = _check(container, loss_of)
    critic = _params(container["critic"], "critic")
    assert _dw101(report) == critic
    _single_cut(report, "output-unused", "critic", critic)


def test_plain_container_module_called_directly() -> None:
    """A user-defined container with no forward of its own; loss_fn wires the modules."""

    class Parts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(8, 16)
            self.decoder = nn.Linear(16, 8)
            self.classifier = nn.Linear(16, 3)

    parts = Parts()

    def healthy(p: nn.Module) -> torch.Tensor:
        z = torch.relu(p.encoder(X))
        return F.mse_loss(p.decoder(z), X) + F.cross_entropy(p.classifier(z), Y)

    assert _quiet(_check(parts, healthy))

    def broken(p: nn.Module) -> torch.Tensor:
        z = torch.relu(p.encoder(X))
        return F.mse_loss(p.decoder(z), X) + F.cross_entropy(p.classifier(z.detach()), Y) * 0

    # classifier still gets a (zero) gradient; the detach cuts nothing that lacks one
    assert _quiet(_check(parts, broken))


def test_container_with_detached_encoder_output() -> None:
    container = _container()

    def loss_of(c: nn.Module) -> torch.Tensor:
        h = c["encoder"](X).detach()  # the encoder never learns
        return F.cross_entropy(c["head"](h), Y) + c["critic"](h).pow(2).mean()

    report = _check(container, loss_of)
    encoder = _params(container["encoder"], "encoder")
    assert _dw101(report) == encoder
    [cut] = report.by_code("DW102")
    assert cut.evidence["kind"] == "detach"
    assert set(cut.params) == encoder
    assert cut.evidence.get("result_reaches_loss") is True


class MultiHead(nn.Module):
    """Heads held in a ModuleList (or ModuleDict), which is never called itself."""

    def __init__(self, as_dict: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        heads = [nn.Linear(8, 2) for _ in range(3)]
        self.heads: nn.Module = (
            nn.ModuleDict({str(i): h for i, h in enumerate(heads)})
            if as_dict
            else nn.ModuleList(heads)
        )
        self.skip_last = False

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.trunk(x)
        heads = list(self.heads.values() if isinstance(self.heads, nn.ModuleDict) else self.heads)
        if self.skip_last:
            heads = heads[:2]
        return [head(h) for head in heads]


@pytest.mark.parametrize("as_dict", [False, True])
def test_module_list_of_heads_healthy(as_dict: bool) -> None:
    report = _check(MultiHead(as_dict), lambda m: sum(o.sum() for o in m(X)))
    assert _quiet(report)


@pytest.mark.parametrize("as_dict", [False, True])
def test_module_list_one_head_output_unused_is_found(as_dict: bool) -> None:
    model = MultiHead(as_dict)
    report = _check(model, lambda m: sum(o.sum() for o in m(X)[:2]))
    assert _dw101(report) == {"heads.2.weight", "heads.2.bias"}
    assert len(report.by_code("DW102")) == 1


@pytest.mark.parametrize("as_dict", [False, True])
def test_module_list_one_head_output_unused_names_the_head(as_dict: bool) -> None:
    model = MultiHead(as_dict)
    report = _check(model, lambda m: sum(o.sum() for o in m(X)[:2]))
    lost = _params(model.heads["2"] if as_dict else model.heads[2], "heads.2")
    _single_cut(report, "output-unused", "heads.2", lost)
    assert all(f.severity is Severity.ERROR for f in report.findings)


@pytest.mark.parametrize("as_dict", [False, True])
def test_module_list_one_head_never_ran_names_the_head(as_dict: bool) -> None:
    model = MultiHead(as_dict)
    model.skip_last = True
    report = _check(model, lambda m: sum(o.sum() for o in m(X)))
    lost = _params(model.heads["2"] if as_dict else model.heads[2], "heads.2")
    assert _dw101(report) == lost
    _single_cut(report, "never-ran", "heads.2", lost)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_nested_output_structures(depth: int) -> None:
    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 2)
            self.b = nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> object:
            out: object = {"a": self.a(x), "b": [self.b(x)]}
            for _ in range(depth - 1):
                out = {"level": (out,)}
            return out

    def unwrap(out: object) -> dict:
        for _ in range(depth - 1):
            out = out["level"][0]  # type: ignore[index]
        return out  # type: ignore[return-value]

    model = Nested()
    assert _quiet(_check(model, lambda m: unwrap(m(X))["a"].sum() + unwrap(m(X))["b"][0].sum()))
    broken = _check(model, lambda m: unwrap(m(X))["a"].sum())
    assert _dw101(broken) == {"b.weight", "b.bias"}


# -- a transformers ModelOutput (an OrderedDict subclass) --------------------------


def _double_heads() -> nn.Module:
    from transformers import GPT2DoubleHeadsModel

    config = gpt2_config()
    return GPT2DoubleHeadsModel(config).train()


# batch, choices, tokens. Fixed data, not the global RNG at import time.
IDS = torch.randint(0, 100, (2, 3, 8), generator=torch.Generator().manual_seed(0))
MC_TOKEN = torch.full((2, 3), 7)
MC_LABEL = torch.tensor([0, 2])


def _only_mc_bias_redundant(report: deadweight.Report) -> None:
    """The multiple-choice head's single bias adds the same number to every choice's
    score, which the cross-entropy over choices removes exactly: an exact, harmless
    redundancy (DW105 info) found from the graph's structure, whatever the dropout draw
    made of its rounding-noise gradient (exactly 0 for some, ~1e-8 for others). Nothing
    else is reported."""
    bias = ("multiple_choice_head.summary.bias",)
    (redundant,) = report.findings
    assert (redundant.code, redundant.severity, redundant.params) == ("DW105", Severity.INFO, bias)
    assert "cross_entropy" in redundant.message


def test_model_output_both_heads_in_loss() -> None:
    model = _double_heads()

    def loss_of(m: nn.Module) -> torch.Tensor:
        out = m(input_ids=IDS, mc_token_ids=MC_TOKEN, labels=IDS, mc_labels=MC_LABEL)
        return out.loss + out.mc_loss  # .loss alone is only the LM loss

    _only_mc_bias_redundant(_check(model, loss_of))


def test_model_output_multiple_choice_head_unused() -> None:
    model = _double_heads()
    report = _check(model, lambda m: m(input_ids=IDS, mc_token_ids=MC_TOKEN, labels=IDS).loss)
    lost = _params(model.multiple_choice_head, "multiple_choice_head")
    assert lost == {"multiple_choice_head.summary.weight", "multiple_choice_head.summary.bias"}
    assert _dw101(report) == lost
    _single_cut(report, "output-unused", "multiple_choice_head", lost)


def test_model_output_used_through_its_fields() -> None:
    model = _double_heads()

    def loss_of(m: nn.Module) -> torch.Tensor:
        out = m(input_ids=IDS, mc_token_ids=MC_TOKEN)
        lm = F.cross_entropy(out.logits[..., :-1, :].reshape(-1, 100), IDS[..., 1:].reshape(-1))
        return lm + F.cross_entropy(out["mc_logits"], MC_LABEL)

    _only_mc_bias_redundant(_check(model, loss_of))
