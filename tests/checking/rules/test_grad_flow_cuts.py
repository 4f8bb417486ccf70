"""DW101 / DW102: each kind of graph cut is found, at the right line, naming the right parameters.

Every test model below is small and broken in exactly one way; the line of the cut
carries a `# CUT` marker so the expected location is read from this file, not typed in.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import deadweight
from tests.conftest import marker_line, reference_no_grad

X = torch.randn(16, 8)
Y = torch.randn(16, 1)


def run(model: nn.Module, loss_of=None) -> deadweight.Report:
    loss_of = loss_of or (lambda m: F.mse_loss(m(X), Y))
    return deadweight.check(model, lambda: loss_of(model))


def only(report: deadweight.Report, code: str) -> deadweight.Finding:
    found = report.by_code(code)
    assert len(found) == 1, [f.message for f in report.findings]
    return found[0]


def assert_cut(report, kind: str, params: set[str], line: int | None, model=None, loss_of=None):
    dw101 = only(report, "DW101")
    dw102 = only(report, "DW102")
    assert set(dw101.params) == params
    assert set(dw102.params) == params
    assert dw102.evidence["kind"] == kind, dw102.message
    assert dw101.evidence["explained_by"][0]["kind"] == kind
    if line is not None:
        assert dw102.location.file.endswith("test_grad_flow_cuts.py"), dw102.location
        assert dw102.location.line == line, (dw102.location, line)
        assert dw101.location == dw102.location
    if model is not None:  # slow reference: a plain backward on a copy agrees
        ref = reference_no_grad(model, loss_of or (lambda m: F.mse_loss(m(X), Y)))
        assert ref == params
    return dw101, dw102


class Block(nn.Module):
    """Linear -> (something) -> Linear; the first Linear's params are upstream of the cut."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 1)


# --- kernels under no_grad / inference_mode ---------------------------------------------


@torch.no_grad()
def fused_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w  # CUT-decorated


class DecoratedNoGrad(Block):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.second(fused_scale(self.first(x), self.gain))


def test_kernel_decorated_with_no_grad():
    model = DecoratedNoGrad()
    _, dw102 = assert_cut(
        run(model),
        "no-grad",
        {"first.weight", "first.bias", "gain"},
        marker_line(fused_scale, "CUT-decorated"),
        model,
    )
    assert dw102.location.function == "fused_scale"
    assert "DecoratedNoGrad.forward" in dw102.evidence["called_from"]
    assert dw102.location.module == ""  # the root module was running
    assert "torch.no_grad" in dw102.message


class NoGradBlock(Block):
    def forward(self, x):
        h = self.first(x)
        with torch.no_grad():
            h = torch.relu(h)  # CUT-block
        return self.second(h)


def test_no_grad_block_in_forward():
    model = NoGradBlock()
    assert_cut(
        run(model),
        "no-grad",
        {"first.weight", "first.bias"},
        marker_line(NoGradBlock, "CUT-block"),
        model,
    )


class InferenceModeBlock(Block):
    def forward(self, x):
        h = self.first(x)
        with torch.inference_mode():
            h = torch.tanh(h)  # CUT-inference
        return self.second(h.clone())


def test_inference_mode_block():
    model = InferenceModeBlock()
    assert_cut(
        run(model),
        "inference-mode",
        {"first.weight", "first.bias"},
        marker_line(InferenceModeBlock, "CUT-inference"),
    )


# --- detach, .data, Python round trips ---------------------------------------------------


class Detach(Block):
    def forward(self, x):
        h = self.first(x).detach()  # CUT-detach
        return self.second(h)


def test_detach():
    model = Detach()
    assert_cut(
        run(model),
        "detach",
        {"first.weight", "first.bias"},
        marker_line(Detach, "CUT-detach"),
        model,
    )


class InplaceDetach(Block):
    def forward(self, x):
        h = self.first(x) * 1.0
        h.detach_()  # CUT-detach_
        return self.second(h)


def test_inplace_detach():
    assert_cut(
        run(InplaceDetach()),
        "detach",
        {"first.weight", "first.bias"},
        marker_line(InplaceDetach, "CUT-detach_"),
    )


class DataAccess(Block):
    def forward(self, x):
        h = self.first(x).data  # CUT-data
        return self.second(h)


def test_data_attribute():
    model = DataAccess()
    assert_cut(
        run(model),
        "data",
        {"first.weight", "first.bias"},
        marker_line(DataAccess, "CUT-data"),
        model,
    )


class ItemRoundTrip(Block):
    def forward(self, x):
        scale = self.first(x).mean().item()  # CUT-item
        return self.second(x) * scale


def test_item_round_trip():
    model = ItemRoundTrip()
    _, dw102 = assert_cut(
        run(model),
        "item",
        {"first.weight", "first.bias"},
        marker_line(ItemRoundTrip, "CUT-item"),
        model,
    )
    assert dw102.evidence["result_reaches_loss"] is True


class TolistRoundTrip(Block):
    def forward(self, x):
        values = self.first(x).tolist()  # CUT-tolist
        return self.second(torch.tensor(values))


def test_tolist_round_trip():
    model = TolistRoundTrip()
    _, dw102 = assert_cut(
        run(model),
        "tolist",
        {"first.weight", "first.bias"},
        marker_line(TolistRoundTrip, "CUT-tolist"),
        model,
    )
    assert dw102.evidence["result_reaches_loss"] is True


class NumpyRoundTrip(Block):
    def forward(self, x):
        array = self.first(x).detach().numpy()  # CUT-numpy
        return self.second(torch.from_numpy(array))


def test_numpy_round_trip_is_reported_at_its_detach():
    # x.numpy() on a tensor that requires grad raises; the silent form detaches first.
    model = NumpyRoundTrip()
    assert_cut(
        run(model),
        "detach",
        {"first.weight", "first.bias"},
        marker_line(NumpyRoundTrip, "CUT-numpy"),
        model,
    )


class RebuiltTensor(Block):
    def forward(self, x):
        h = self.first(x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about copy-constructing a tensor
            h = torch.tensor(h)  # CUT-rebuilt
        return self.second(h)


def test_tensor_rebuilt_with_torch_tensor():
    model = RebuiltTensor()
    assert_cut(
        run(model),
        "rebuilt-tensor",
        {"first.weight", "first.bias"},
        marker_line(RebuiltTensor, "CUT-rebuilt"),
    )


class HardRouting(nn.Module):
    """A router that picks an expert with argmax only: the router never learns."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.experts = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])

    def forward(self, x):
        choice = self.router(x).argmax(-1)  # CUT-argmax
        outs = torch.stack([e(x) for e in self.experts], -1).squeeze(1)
        return outs.gather(-1, choice[:, None])


def test_non_differentiable_op():
    model = HardRouting()
    assert_cut(
        run(model),
        "non-differentiable",
        {"router.weight", "router.bias"},
        marker_line(HardRouting, "CUT-argmax"),
        model,
    )


# --- autograd.Function and custom ops ----------------------------------------------------


class NonDiffFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x * 2
        ctx.mark_non_differentiable(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class MarkedNonDifferentiable(Block):
    def forward(self, x):
        h = NonDiffFunction.apply(self.first(x))  # CUT-function
        return self.second(h)


def test_function_marking_output_non_differentiable():
    model = MarkedNonDifferentiable()
    _, dw102 = assert_cut(
        run(model),
        "function",
        {"first.weight", "first.bias"},
        marker_line(MarkedNonDifferentiable, "CUT-function"),
        model,
    )
    assert "NonDiffFunction" in dw102.message


class NoneBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return None


class NoneReturningFunction(Block):
    def forward(self, x):
        h = NoneBackward.apply(self.first(x))  # CUT-none
        return self.second(h)


def test_function_returning_none_for_an_input():
    model = NoneReturningFunction()
    _, dw102 = assert_cut(
        run(model),
        "dropped-in-backward",
        {"first.weight", "first.bias"},
        marker_line(NoneReturningFunction, "CUT-none"),
        model,
    )
    assert "NoneBackward" in dw102.message


def test_legitimate_functions_are_not_cuts():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    class Healthy(Block):
        def forward(self, x):
            return self.second(Double.apply(self.first(x)))

    report = run(Healthy())
    assert not report.findings


_LIB = torch.library.Library("deadweight_test", "DEF")
_LIB.define("scale2(Tensor x) -> Tensor")


def _scale2_cpu(x):
    # A kernel below autograd, like a C++ extension's: it records nothing.
    with torch._C._AutoDispatchBelowAutograd():
        return x * 2


_LIB.impl("scale2", _scale2_cpu, "CPU")


class LegacyOp(Block):
    def forward(self, x):
        h = torch.ops.deadweight_test.scale2(self.first(x))  # CUT-legacy
        return self.second(h)


def test_legacy_library_op_without_autograd_kernel():
    model = LegacyOp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the op warns once at backward
        report = run(model)
    _, dw102 = assert_cut(
        report,
        "no-autograd-kernel",
        {"first.weight", "first.bias"},
        marker_line(LegacyOp, "CUT-legacy"),
    )
    assert "deadweight_test::scale2" in dw102.message


@torch.library.custom_op("deadweight_test::triple", mutates_args=())
def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


class CustomOp(Block):
    def __init__(self) -> None:
        super().__init__()
        self.skip = nn.Linear(8, 1)  # a path around the op: keeps its gradient

    def forward(self, x):
        h = triple(self.first(x))  # CUT-custom
        return self.second(h) + self.skip(x)


def test_custom_op_without_autograd_is_a_finding_not_a_crash():
    model = CustomOp()
    report = run(model)
    _, dw102 = assert_cut(
        report,
        "custom-op-no-autograd",
        {"first.weight", "first.bias"},
        marker_line(CustomOp, "CUT-custom"),
    )
    assert "deadweight_test::triple" in dw102.message
    assert "no autograd formula" in dw102.evidence["backward_error"]


# --- checkpointing, modules, the loss itself ---------------------------------------------


class ReentrantCheckpoint(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = checkpoint(self.body, x, use_reentrant=True)  # CUT-checkpoint
        return self.head(h)


def test_reentrant_checkpoint_without_input_requiring_grad():
    model = ReentrantCheckpoint()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "None of the inputs have requires_grad"
        report = run(model)
    assert_cut(
        report,
        "reentrant-checkpoint",
        {"body.0.weight", "body.0.bias"},
        marker_line(ReentrantCheckpoint, "CUT-checkpoint"),
    )


def test_reentrant_checkpoint_with_input_requiring_grad_is_fine():
    model = ReentrantCheckpoint()
    x = X.clone().requires_grad_(True)
    report = deadweight.check(model, lambda: F.mse_loss(model(x), Y))
    assert not report.by_code("DW101") and not report.by_code("DW102")


def test_non_reentrant_checkpoint_is_fine():
    class NonReentrant(ReentrantCheckpoint):
        def forward(self, x):
            return self.head(checkpoint(self.body, x, use_reentrant=False))

    assert not run(NonReentrant()).findings


class UnusedAuxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        self.aux = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 1))

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        aux_logits = self.aux(h)  # CUT-aux
        del aux_logits  # computed, then forgotten: never added to the loss
        return self.head(h)


def test_module_output_never_reaches_the_loss():
    model = UnusedAuxHead()
    params = {"aux.0.weight", "aux.0.bias", "aux.2.weight", "aux.2.bias"}
    _, dw102 = assert_cut(
        run(model), "output-unused", params, marker_line(UnusedAuxHead, "CUT-aux"), model
    )
    assert dw102.location.module == "aux"  # the outermost module whose output was dropped


class NeverRan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 1)
        self.pooler = nn.Linear(8, 8)

    def forward(self, x):
        return self.body(x)


def test_module_that_never_ran():
    model = NeverRan()
    report = run(model)
    dw101, dw102 = assert_cut(report, "never-ran", {"pooler.weight", "pooler.bias"}, None, model)
    assert dw102.location.module == "pooler"
    assert dw101.severity is deadweight.Severity.WARNING
    assert dw102.severity is deadweight.Severity.WARNING  # often data-dependent routing


class Healthy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def test_loss_without_grad_fn_under_no_grad():
    model = Healthy()

    def loss_fn():
        with torch.no_grad():
            return F.mse_loss(model(X), Y)  # CUT-loss-nograd

    report = deadweight.check(model, loss_fn)
    dw101 = only(report, "DW101")
    dw102 = only(report, "DW102")
    assert set(dw101.params) == {n for n, _ in model.named_parameters()}
    assert dw102.evidence["kind"] == "loss-no-grad-fn"
    assert dw102.location.line == marker_line(
        test_loss_without_grad_fn_under_no_grad, "CUT-loss-nograd"
    )
    assert dw102.evidence["grad_enabled_when_computed"] is False


def test_loss_rebuilt_from_item():
    model = Healthy()

    def loss_fn():
        value = F.mse_loss(model(X), Y).item()
        return torch.tensor(value)  # CUT-loss-item

    report = deadweight.check(model, loss_fn)
    dw102 = only(report, "DW102")
    assert dw102.evidence["kind"] == "loss-no-grad-fn"
    assert dw102.location.line == marker_line(test_loss_rebuilt_from_item, "CUT-loss-item")
    assert len(only(report, "DW101").params) == 4


def test_unused_parameter_is_dw101_without_a_cut():
    class Leftover(Healthy):
        def __init__(self) -> None:
            super().__init__()
            self.temperature = nn.Parameter(torch.ones(1))

    model = Leftover()
    report = run(model)
    dw101 = only(report, "DW101")
    assert dw101.params == ("temperature",)
    assert "explained_by" not in dw101.evidence
    assert not report.by_code("DW102")
    assert reference_no_grad(model, lambda m: F.mse_loss(m(X), Y)) == {"temperature"}


# --- grouping and precision --------------------------------------------------------------


class FusedNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        with torch.no_grad():
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight  # CUT-norm


class Deep(nn.Module):
    """Residual pre-norm blocks whose norms are fused: only the norm weights lose their grads."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.norms = nn.ModuleList([FusedNorm(8) for _ in range(layers)])
        self.mlps = nn.ModuleList([nn.Linear(8, 8) for _ in range(layers)])
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            x = x + mlp(norm(x))
        return self.out(x)


def test_one_cause_in_many_layers_is_one_finding():
    model = Deep()
    report = run(model)
    params = {f"norms.{i}.weight" for i in range(4)}
    _, dw102 = assert_cut(report, "no-grad", params, marker_line(FusedNorm, "CUT-norm"), model)
    assert dw102.evidence["modules"] == [f"norms.{i}" for i in range(4)]


def test_stop_gradient_used_only_for_logging_is_not_reported():
    class Logged(Healthy):
        def forward(self, x):
            h = torch.relu(self.l1(x))
            self.last_norm = h.detach().norm().item()
            return self.l2(h)

    assert not run(Logged()).findings


def test_two_independent_cuts_are_two_findings():
    class TwoCuts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            left = self.a(x).detach()
            with torch.no_grad():
                right = self.b(x)
            return self.head(torch.cat([left, right], -1))

    report = run(TwoCuts())
    kinds = {f.evidence["kind"]: set(f.params) for f in report.by_code("DW102")}
    assert kinds == {"detach": {"a.weight", "a.bias"}, "no-grad": {"b.weight", "b.bias"}}
    assert {frozenset(f.params) for f in report.by_code("DW101")} == {
        frozenset({"a.weight", "a.bias"}),
        frozenset({"b.weight", "b.bias"}),
    }


def test_frozen_parameters_are_not_reported():
    model = Detach()
    model.first.requires_grad_(False)
    assert not run(model).findings


@pytest.mark.parametrize(
    "select,expected",
    [("DW102", {"DW102"}), ("no-gradient", {"DW101"}), ("DW1", {"DW101", "DW102"})],
)
def test_select(select, expected):
    model = Detach()
    report = deadweight.check(model, lambda: F.mse_loss(model(X), Y), select=[select])
    assert {f.code for f in report.findings} == expected


def test_ignore():
    model = Detach()
    report = deadweight.check(model, lambda: F.mse_loss(model(X), Y), ignore=["DW102"])
    assert {f.code for f in report.findings} == {"DW101"}


def test_unknown_rule_in_select_is_an_error():
    model = Detach()
    with pytest.raises(ValueError, match="DW999"):
        deadweight.check(model, lambda: F.mse_loss(model(X), Y), select=["DW999"])
