from __future__ import annotations

import torch

from deadweight.autograd_graph import DropWatch, may_drop_gradients, walk


def test_walk_finds_leaves_and_stops():
    a = torch.randn(2, requires_grad=True)
    b = torch.randn(2, requires_grad=True)
    mid = a * 2
    out = (mid + b).sum()
    full = walk([out.grad_fn])
    assert set(full.leaves) == {id(a), id(b)}
    assert set(walk([out.grad_fn], stop=frozenset({mid.grad_fn})).leaves) == {id(b)}
    assert set(walk([a]).leaves) == {id(a)}  # a leaf used directly


def test_drop_watch_sees_a_function_returning_none():
    class Drop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return None

    a = torch.randn(2, requires_grad=True)
    out = Drop.apply(a).sum()
    nodes = walk([out.grad_fn]).nodes
    assert sum(may_drop_gradients(n) for n in nodes) == 1
    with DropWatch(nodes) as watch:
        out.backward()
    assert len(watch.drops) == 1 and watch.drops[0].inputs == [0]


def test_builtin_nodes_are_not_watched():
    a = torch.randn(2, requires_grad=True)
    out = (a * 2).sum()
    assert not any(may_drop_gradients(n) for n in walk([out.grad_fn]).nodes)
