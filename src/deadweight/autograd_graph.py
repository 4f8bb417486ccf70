"""Walking the autograd graph: what reaches the loss, and which nodes drop gradients.

Nodes are compared by identity: `t.grad_fn is t.grad_fn` holds, and a node stays
reachable through `next_functions` after backward (only saved tensors are freed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

# The node the autograd fallback puts behind an op with no autograd kernel
# (a legacy torch.library op with only a CPU/CUDA kernel): it warns once, then
# passes no gradient on.
_NOT_IMPLEMENTED_NODE = "torch::autograd::WarnNotImplemented"


@dataclass
class GraphWalk:
    """Everything reachable backwards from a set of root nodes."""

    nodes: set[Any] = field(default_factory=set)
    leaves: dict[int, torch.Tensor] = field(default_factory=dict)  # id -> leaf that gets a grad


def walk(roots: Iterable[Any], stop: frozenset[Any] = frozenset()) -> GraphWalk:
    """Nodes and leaf tensors upstream of `roots` (nodes or leaf tensors), not passing `stop`."""
    result = GraphWalk()
    stack = list(roots)
    while stack:
        item = stack.pop()
        if item is None:
            continue
        if isinstance(item, torch.Tensor):  # a leaf that requires grad, used directly
            result.leaves[id(item)] = item
            continue
        if item in result.nodes or item in stop:
            continue
        result.nodes.add(item)
        variable = getattr(item, "variable", None)  # AccumulateGrad
        if variable is not None:
            result.leaves[id(variable)] = variable
            continue
        stack.extend(fn for fn, _ in item.next_functions)
    return result


def may_drop_gradients(node: Any) -> bool:
    """Nodes whose backward is user code or a fallback, and so may return None for an input."""
    if isinstance(node, BackwardCFunction):
        return True
    return type(node).__name__ == "CppFunction" and node.name() == _NOT_IMPLEMENTED_NODE


@dataclass
class Drop:
    """A node that returned no gradient for inputs that needed one."""

    node: Any
    inputs: list[int]  # positions in next_functions


class DropWatch:
    """Hooks on the nodes that may drop gradients; use as a context manager around backward."""

    def __init__(self, nodes: Iterable[Any]) -> None:
        self._nodes = [n for n in nodes if may_drop_gradients(n)]
        self._handles: list[Any] = []
        self.drops: list[Drop] = []

    def __enter__(self) -> DropWatch:
        for node in self._nodes:
            self._handles.append(node.register_hook(self._hook_for(node)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook_for(self, node: Any) -> Callable[[tuple, tuple], None]:
        def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
            missing = [
                i
                for i, (grad, (fn, _)) in enumerate(
                    zip(grad_inputs, node.next_functions, strict=False)
                )
                if grad is None and fn is not None
            ]
            if missing:
                self.drops.append(Drop(node, missing))

        return hook


def raising_nodes(nodes: Iterable[Any], op_name: str) -> list[Any]:
    """Nodes of the custom op named in a 'no autograd formula was registered' error."""
    suffix = "GeneratedBackwardFor_" + op_name.replace(".", "_").replace("::", "_")
    return [n for n in nodes if type(n).__name__.startswith(suffix)]
