"""Forward-time record of which modules ran, where they were called, and what they returned.

Global module hooks (removable, installed only for the duration of the trace) see
every module call, including modules the loss function calls directly.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import CodeType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from deadweight.checking.check_stats import Site
from deadweight.checking.op_trace import tensors_in
from deadweight.checking.sites import site_at, user_place


@dataclass
class ModuleCalls:
    """What one module did during the forward."""

    name: str
    calls: int = 0
    # For a member of a ModuleList or ModuleDict (the experts of a mixture): the
    # leading-dim size of its first tensor input, summed over calls (tokens routed).
    # 0 for other modules: only a never-ran cut's routing detail reads it.
    rows: int = 0
    # the first call's user frame, as code and line (`sites.user_place`): its Site is
    # made only for the few modules a cut names
    place: tuple[CodeType, int] | None = field(default=None, repr=False)
    # grad_fn nodes of outputs that required grad, over all calls.
    output_nodes: list[Any] = field(default_factory=list, repr=False)
    # Calls whose float outputs came back without a graph although inputs or
    # parameters needed one: the module cut the graph somewhere inside.
    cut_roots: list[Any] = field(default_factory=list, repr=False)

    @property
    def call_site(self) -> Site | None:
        """Where the module was first called from."""
        return site_at(self.place)


class ModuleTracer:
    """Use as a context manager around the user's forward."""

    def __init__(self, model: nn.Module, named: list[tuple[str, nn.Module]] | None = None) -> None:
        """`named`: `model.named_modules()`, when the caller has just listed them."""
        if named is None:
            named = list(model.named_modules())
        self._names = {id(m): name for name, m in named}
        self._members = {
            id(child)
            for _, m in named
            if isinstance(m, (nn.ModuleList, nn.ModuleDict))
            for child in m.children()
        }
        self.calls: dict[str, ModuleCalls] = {}
        self._stack: list[str | None] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def current(self) -> str | None:
        """Path of the innermost module of the model running right now."""
        for name in reversed(self._stack):
            if name is not None:
                return name
        return None

    def __enter__(self) -> ModuleTracer:
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._stack.clear()

    def _pre(self, module: nn.Module, args: tuple) -> None:
        name = self._names.get(id(module))
        self._stack.append(name)
        if name is None:
            return
        record = self.calls.get(name)
        if record is None:
            record = self.calls[name] = ModuleCalls(name, place=user_place(sys._getframe(1)))
        record.calls += 1
        if id(module) not in self._members:
            return
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is None:
            first = next(iter(tensors_in(args)), None)
            if first is None:
                return
        # The hooks' own tensor queries (shape, grad_fn, ...) are not the user's calls:
        # they run with torch functions untraced (about half the calls a traced
        # GPT-2 forward made were theirs).
        with torch._C.DisableTorchFunction():
            if first.dim() > 0:
                record.rows += int(first.shape[0])

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._stack:
            self._stack.pop()
        name = self._names.get(id(module))
        if name is None:
            return
        with torch._C.DisableTorchFunction():
            self._note_return(self.calls[name], module, args, output)

    @staticmethod
    def _note_return(record: ModuleCalls, module: nn.Module, args: tuple, output: Any) -> None:
        if isinstance(output, torch.Tensor):  # most modules: one tensor, with a graph
            node = output.grad_fn
            if node is not None and (output.is_floating_point() or output.is_complex()):
                record.output_nodes.append(node)
                return
        outputs = [t for t in tensors_in(output) if t.is_floating_point() or t.is_complex()]
        nodes = [t.grad_fn for t in outputs if t.requires_grad and t.grad_fn is not None]
        if nodes:
            record.output_nodes.extend(nodes)
        elif outputs:
            roots = [t.grad_fn or t for t in tensors_in(args) if t.requires_grad]
            roots += [p for p in module.parameters() if p.requires_grad]
            record.cut_roots.extend(roots)


def took_part(ran: Iterable[str]) -> set[str]:
    """The module paths that took part in a forward: those that ran, and every module
    above them (containers such as ModuleList and ModuleDict are never called)."""
    out: set[str] = set()
    for path in ran:
        parts = path.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return out
