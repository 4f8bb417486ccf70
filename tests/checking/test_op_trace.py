from __future__ import annotations

import pytest
import torch

from deadweight.checking.op_trace import OpTracer, _op_name


def _stack_depth() -> int:
    return torch._C._len_torch_function_stack()


def test_tracer_is_removed_and_apply_restored_even_on_error():
    original = torch.autograd.Function.__dict__["apply"]
    depth = _stack_depth()
    with pytest.raises(RuntimeError, match="boom"), OpTracer():
        assert torch.autograd.Function.__dict__["apply"] is not original
        raise RuntimeError("boom")
    assert torch.autograd.Function.__dict__["apply"] is original
    assert _stack_depth() == depth


@pytest.mark.parametrize(
    "make,kind",
    [
        (lambda w: w.detach(), "detach"),
        (lambda w: w.data, "data"),
        (lambda w: w.item() if w.numel() == 1 else w.sum().item(), "item"),
        (lambda w: w.tolist(), "tolist"),
        (lambda w: w > 0, "non-differentiable"),
        (lambda w: w.argmax(), "non-differentiable"),
    ],
)
def test_event_kinds(make, kind):
    w = torch.randn(3, requires_grad=True)
    with OpTracer() as tracer:
        make(w)
    assert [e.kind for e in tracer.events][-1] == kind


def test_no_grad_and_inference_mode_kinds():
    w = torch.randn(3, requires_grad=True)
    with OpTracer() as tracer:
        with torch.no_grad():
            w * 2
        with torch.inference_mode():
            w * 2
    assert [e.kind for e in tracer.events] == ["no-grad", "inference-mode"]
    assert tracer.events[0].op == "Tensor.mul"


def test_ops_on_tensors_without_grad_are_not_events():
    x = torch.randn(3)
    with OpTracer() as tracer, torch.no_grad():
        (x * 2).sum().item()
        x.detach()
    assert tracer.events == []


def test_taint_follows_values_through_python_and_numpy():
    w = torch.randn(3, requires_grad=True)
    with OpTracer() as tracer:
        v = w.sum().item()
        a = torch.ones(3) * v
        arr = w.detach().numpy()
        b = torch.from_numpy(arr) + 1  # from_numpy itself is invisible to the mode
        c = torch.ones(3) * 2
    item_event, detach_event = (e.index for e in tracer.events)
    assert tracer.taint_of(a) == {item_event}
    assert tracer.taint_of(b) == {detach_event}
    assert tracer.taint_of(c) == frozenset()


def test_sites_point_at_this_file():
    w = torch.randn(3, requires_grad=True)
    with OpTracer() as tracer:
        w.detach()
    site = tracer.events[0].site
    assert site is not None and site.file == __file__
    assert site.function == "test_sites_point_at_this_file"


def test_function_with_non_differentiable_output_is_one_event_at_apply():
    class Marked(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = x * 2 + 1  # two ops inside, grad disabled: not events of their own
            ctx.mark_non_differentiable(out)
            return out

        @staticmethod
        def backward(ctx, g):
            return g

    w = torch.randn(3, requires_grad=True)
    with OpTracer() as tracer:
        Marked.apply(w)
    assert [(e.kind, e.op.rsplit(".", 1)[-1]) for e in tracer.events] == [("function", "Marked")]


def test_op_names():
    assert _op_name(torch._C.TensorBase.mul) == "Tensor.mul"
    assert _op_name(torch.rsqrt) == "torch.rsqrt"
    assert _op_name(torch.nn.functional.linear) == "torch.nn.functional.linear"
    assert _op_name(torch.ops.aten.mul.Tensor) == "aten::mul.Tensor"
    assert _op_name(torch._C.TensorBase.__dict__["data"].__get__) == "Tensor.data"


def test_metadata_of_a_cut_result_carries_no_taint():
    # x.size(-1) is the interned int 3: tainting it would taint every later use of 3.
    w = torch.randn(3, requires_grad=True)
    with OpTracer() as tracer:
        d = w.detach()
        n = d.size(-1)
        unrelated = torch.ones(n) * 2
    assert tracer.events and tracer.taint_of(unrelated) == frozenset()


def test_a_cut_drops_earlier_cuts_that_reach_it_through_a_graph():
    w = torch.randn(3, requires_grad=True)
    v = torch.randn(3, requires_grad=True)
    with OpTracer() as tracer:
        first = w.detach()  # event 0
        mixed = first * v  # has a graph again (through v), carries event 0
        with torch.no_grad():
            second = mixed * 2  # event 1: cuts `mixed`; fixing event 0 alone changes nothing
        kernel = second + 1
        with torch.no_grad():
            third = kernel * v  # event 2: its no-grad input chains events 1 and 2
    assert tracer.taint_of(mixed) == {0}
    assert tracer.taint_of(second) == {1}
    assert tracer.taint_of(third) == {1, 2}
