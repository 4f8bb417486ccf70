"""DW102 for a cut under no_grad / inference_mode is reported at the user's line that
entered the region, not at the innocent op inside the module called there; the op is
the evidence (`op_at`).

The models are nanoGPT's shapes: a LayerNorm class of the user's own whose forward
calls F.layer_norm, called from a Block under `with torch.no_grad():`. Each expected
line carries a marker comment, so no line number is typed in.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from tests.conftest import marker_line

X = torch.randn(4, 8)


class LayerNorm(nn.Module):
    """nanoGPT's: LayerNorm with an optional bias."""

    def __init__(self, ndim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)  # OP-ln


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(8)
        self.attn = nn.Linear(8, 8)
        self.ln_2 = LayerNorm(8)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        with torch.no_grad():
            h = self.ln_2(x)  # CUT-region
        return x + self.mlp(h)


class GPT(nn.Module):
    def __init__(self, block: type[nn.Module] = Block) -> None:
        super().__init__()
        self.h = nn.ModuleList([block() for _ in range(2)])
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)  # CALLER
        return self.head(x)


def _dw102(model: nn.Module, loss_fn=None) -> deadweight.Finding:
    report = deadweight.check(model, loss_fn or (lambda: model(X).pow(2).mean()))
    [found] = report.by_code("DW102")
    return found


def test_the_with_line_is_the_headline_and_the_op_the_detail() -> None:
    found = _dw102(GPT())
    assert found.evidence["kind"] == "no-grad"
    assert found.location is not None
    assert found.location.line == marker_line(Block, "CUT-region"), found.message
    assert found.location.function == "Block.forward"
    assert found.message.startswith(f"{__name__.rsplit('.', 1)[-1]}.py:")
    op_line = marker_line(LayerNorm, "OP-ln")
    assert found.evidence["op_at"].endswith(f".py:{op_line} in LayerNorm.forward")
    assert f"(at test_grad_flow_no_grad_sites.py:{op_line} in LayerNorm.forward)" in found.message
    # who called Block.forward, not who called LayerNorm.forward
    assert found.evidence["called_from"].endswith(f":{marker_line(GPT, 'CALLER')} in GPT.forward")
    assert found.evidence["lines"] == [marker_line(Block, "CUT-region")]  # both blocks: one


def _outer_helper(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _inner_helper(norm, x)  # HELPER-outer


def _inner_helper(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x)


class ThroughHelpers(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        with torch.no_grad():
            h = _outer_helper(self.ln_2, x)  # CUT-helpers
        return x + self.mlp(h)


def test_helpers_between_the_region_and_the_op() -> None:
    found = _dw102(GPT(ThroughHelpers))
    assert found.location is not None
    assert found.location.line == marker_line(ThroughHelpers, "CUT-helpers")
    assert found.location.function == "ThroughHelpers.forward"
    assert "LayerNorm.forward" in found.evidence["op_at"]


class NestedNoGrad(nn.Module):
    """The user's own norm is no_grad too; the region began in the Block."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return x * self.weight


class OuterRegion(Block):
    def __init__(self) -> None:
        super().__init__()
        self.ln_2 = NestedNoGrad()  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        with torch.no_grad():
            h = self.ln_2(x)  # CUT-outer
        return x + self.mlp(h)


def test_a_no_grad_inside_a_no_grad_is_shown_where_grad_went_off() -> None:
    found = _dw102(GPT(OuterRegion))
    assert found.location is not None
    assert found.location.line == marker_line(OuterRegion, "CUT-outer")


class ReEnabled(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        with torch.no_grad(), torch.enable_grad():
            h = _no_grad_norm(self.ln_2, x)
        return x + self.mlp(h)


def _no_grad_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return norm(x)  # CUT-inner


def test_a_no_grad_inside_enable_grad_is_its_own_region() -> None:
    found = _dw102(GPT(ReEnabled))
    assert found.location is not None
    assert found.location.line == marker_line(_no_grad_norm, "CUT-inner")
    assert found.location.function == "_no_grad_norm"


@torch.no_grad()
def fused_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return norm(x)  # CUT-decorated


class Decorated(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(fused_norm(self.ln_2, x))


def test_a_decorated_function_is_its_own_region() -> None:
    # the decorator is the region: the headline is the decorated function's own line
    found = _dw102(GPT(Decorated))
    assert found.location is not None
    assert found.location.line == marker_line(fused_norm, "CUT-decorated")
    assert found.location.function == "fused_norm"
    assert "LayerNorm.forward" in found.evidence["op_at"]


class InferenceRegion(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        with torch.inference_mode():
            h = self.ln_2(x)  # CUT-inference
        return x + self.mlp(h.clone())


def test_inference_mode_region() -> None:
    found = _dw102(GPT(InferenceRegion))
    assert found.evidence["kind"] == "inference-mode"
    assert found.location is not None
    assert found.location.line == marker_line(InferenceRegion, "CUT-inference")


class Direct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(x)
        with torch.no_grad():
            h = F.layer_norm(x, (8,))  # CUT-direct
        return self.mlp(h)


def test_an_op_on_the_with_line_has_no_separate_op_site() -> None:
    found = _dw102(Direct())
    assert found.location is not None
    assert found.location.line == marker_line(Direct, "CUT-direct")
    assert "op_at" not in found.evidence and "(at " not in found.message


def _loss_of(model: nn.Module) -> torch.Tensor:
    return model(X).pow(2).mean()


def test_a_loss_computed_in_a_no_grad_region_is_shown_where_it_was_entered() -> None:
    model = nn.Linear(8, 1)

    def loss_fn() -> torch.Tensor:
        with torch.no_grad():
            return _loss_of(model)  # CUT-loss

    found = _dw102(model, loss_fn)
    assert found.evidence["kind"] == "loss-no-grad-fn"
    assert found.location is not None
    assert found.location.line == marker_line(
        test_a_loss_computed_in_a_no_grad_region_is_shown_where_it_was_entered, "CUT-loss"
    )


def test_grad_mode_managers_are_restored() -> None:
    originals = {
        cls: (cls.__enter__, cls.__exit__)
        for cls in (torch.no_grad, torch.enable_grad, torch.set_grad_enabled, torch.inference_mode)
    }
    model = GPT()
    _dw102(model)

    def broken() -> torch.Tensor:
        with torch.no_grad():
            raise RuntimeError("boom")

    with pytest.raises(deadweight.LossFnError):
        deadweight.check(model, broken)
    for cls, (enter, exit_) in originals.items():
        assert (cls.__enter__, cls.__exit__) == (enter, exit_), cls
    assert torch.is_grad_enabled()
