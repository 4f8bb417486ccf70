"""Which zero-initialised gate holds a parameter's gradient at exactly zero?

ReZero (`x + alpha * f(x)`, alpha = 0), adaLN-Zero and DiT's zero-initialised output
layers, Flamingo's `tanh(gate)` with gate = 0, and LoRA's B = 0 all multiply a
branch by a tensor that is exactly zero at init. Everything inside the branch then
gets an exactly zero gradient at step 0, while the gate itself gets a real one and
opens on the first step. This module finds, from the autograd graph of the loss,
the gate behind each parameter with an exactly zero gradient:

- a tensor is *zero* when it is a trainable parameter whose values are all 0, or the
  result of an op that keeps zeros (a view, a transpose, tanh, a product with a
  zero factor, a sum or a Linear whose every term is zero);
- a parameter is *gated* by the zero factor of a product (mul, matmul, a Linear's
  weight, a convolution's weight) whose other factor it feeds.

The graph is read, not re-run: no forward, no transfer beyond one for the
parameters' zero test.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Ops whose output is zero when their (first) input is: views, reshapes, tanh, sin,
# negation, multiplication by a constant, copies.
_KEEPS_ZERO = frozenset(
    {
        "TanhBackward0",
        "SinBackward0",
        "NegBackward0",
        "MulBackward1",
        "DivBackward1",
        "ViewBackward0",
        "UnsafeViewBackward0",
        "ReshapeAliasBackward0",
        "ExpandBackward0",
        "UnsqueezeBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "UnsafeSplitBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "TBackward0",
        "PermuteBackward0",
        "TransposeBackward0",
        "CloneBackward0",
        "ToCopyBackward0",
        "AliasBackward0",
    }
)
# Products: (operand positions in next_functions). A zero operand zeroes the result
# and the gradient of every other operand.
_PRODUCTS = {
    "MulBackward0": (0, 1),
    "MmBackward0": (0, 1),
    "BmmBackward0": (0, 1),
    "MvBackward0": (0, 1),
    "AddmmBackward0": (1, 2),  # bias, mat1, mat2
    "BaddbmmBackward0": (1, 2),
    "AddmvBackward0": (1, 2),
    "ConvolutionBackward0": (0, 1),  # input, weight, bias
}
# Sums: zero when every term is.
_SUMS = frozenset({"AddBackward0", "SubBackward0"})
_WITH_BIAS = frozenset({"AddmmBackward0", "BaddbmmBackward0", "AddmvBackward0"})


def zero_valued(params: Sequence[tuple[str, torch.Tensor]]) -> set[int]:
    """Ids of the parameters whose values are all exactly 0, in one transfer."""
    if not params:
        return set()
    with torch.no_grad():
        per_param = [(p.detach() != 0).any() for _, p in params]
        devices = {f.device for f in per_param}
        if len(devices) == 1:  # the usual case: stacked where they are, moved once
            flags = torch.stack(per_param).tolist()
        else:
            flags = torch.stack([f.cpu() for f in per_param]).tolist()
    return {id(p) for (_, p), nonzero in zip(params, flags, strict=True) if not nonzero}


def gated_by(
    loss: torch.Tensor, gates: dict[int, str], gated: dict[int, str]
) -> dict[str, tuple[str, ...]]:
    """For each parameter in `gated` (id -> name: those with an exactly zero gradient),
    the zero parameters in `gates` that multiply the branch it feeds, when the loss's
    graph shows them; the first is the one nearest the loss.

    A gate counts for a parameter when the parameter feeds the product's other
    operand directly, not through a second zero product: in ReZero, block 0's
    weights are behind block 0's alpha, not also behind block 2's, whose input
    they reach only through block 0's (already zero) branch.
    """
    root = loss.grad_fn
    if root is None or not gates or not gated:
        return {}
    order, children = _graph(root)
    zero: dict[Any, str | None] = {}
    # the gated parameters a node reaches without crossing a zeroed operand
    reach: dict[Any, frozenset[int]] = {}
    for node in reversed(order):  # leaves first
        kids = children[node]
        if type(node).__name__ == "AccumulateGrad":
            var = id(node.variable)
            zero[node] = gates.get(var)
            reach[node] = frozenset({var}) if var in gated else frozenset()
            continue
        zero[node] = _zero_of(node, kids, zero)
        killed = _zeroed_operands(node, kids, zero)
        reach[node] = frozenset().union(
            *(reach[k] for i, k in enumerate(kids) if k is not None and i not in killed)
        )
    out: dict[str, list[str]] = {}
    for node in order:  # nearest the loss first
        kids = children[node]
        for i, gate in _zeroed_operands(node, kids, zero).items():
            for pid in reach[kids[i]]:
                names = out.setdefault(gated[pid], [])
                if gate not in names:
                    names.append(gate)
    return {name: tuple(found) for name, found in out.items()}


def _zeroed_operands(node: Any, kids: list[Any], zero: dict[Any, str | None]) -> dict[int, str]:
    """Operand index -> the gate whose zero factor this product multiplies it by."""
    positions = _PRODUCTS.get(type(node).__name__)
    if positions is None:
        return {}
    operands = [i for i in positions if i < len(kids) and kids[i] is not None]
    out = {}
    for i in operands:
        gate = zero.get(kids[i])
        if gate is None:
            continue
        for j in operands:
            if j != i and zero.get(kids[j]) is None:
                out[j] = gate
    return out


def _zero_of(node: Any, kids: list[Any], zero: dict[Any, str | None]) -> str | None:
    name = type(node).__name__
    gates = [zero.get(k) if k is not None else None for k in kids]
    if name in _KEEPS_ZERO:
        return gates[0] if gates else None
    positions = _PRODUCTS.get(name)
    if positions is not None:
        factor = next((gates[i] for i in positions if i < len(gates) and gates[i]), None)
        if factor is None:
            return None
        if name in _WITH_BIAS:  # bias + product: zero only with a zero bias
            return factor if gates[0] else None
        if name == "ConvolutionBackward0" and len(kids) > 2 and kids[2] is not None:
            return factor if gates[2] else None
        return factor
    if name in _SUMS:
        present = [g for k, g in zip(kids, gates, strict=True) if k is not None]
        return present[0] if present and all(present) else None
    return None


def _graph(root: Any) -> tuple[list[Any], dict[Any, list[Any]]]:
    """The nodes below `root`, each after every node that feeds it (a topological
    order from the loss down), and each node's inputs (None where an input needs
    no gradient)."""
    children: dict[Any, list[Any]] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if node in children:
            continue
        kids = [fn for fn, _ in getattr(node, "next_functions", ())]
        children[node] = kids
        stack.extend(k for k in kids if k is not None and k not in children)
    # Kahn's algorithm from the root: a node comes after all that consume it.
    consumers: dict[Any, int] = dict.fromkeys(children, 0)
    for kids in children.values():
        for k in kids:
            if k is not None:
                consumers[k] += 1
    order, ready = [], [root]
    while ready:
        node = ready.pop()
        order.append(node)
        for k in children[node]:
            if k is None:
                continue
            consumers[k] -= 1
            if consumers[k] == 0:
                ready.append(k)
    return order, children
