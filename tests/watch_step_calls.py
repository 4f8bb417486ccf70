"""The aten calls a watched training step makes, counted with a TorchDispatchMode: one
measurement for tests/watching/test_step_cost.py and `benchmarks/watch_overhead.py
--calls-only`. Each call is Python and dispatch time on the step's critical path,
which on a GPU is what a step pays. A GPT-2 of width 64 built in code (some tensors
small, some large); nothing is downloaded."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deadweight


class AtenCalls(TorchDispatchMode):
    """Counts the aten calls made inside it, by op."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def training_calls(layers: int, watched: bool, steps: int) -> tuple[int, Counter[str]]:
    """The number of parameter tensors of a GPT-2 of `layers` blocks, and the aten calls
    of `steps` AdamW steps on it, under `deadweight.watch` (default cadence) or not."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=layers, n_head=2, vocab_size=64, n_positions=8
    )
    model = transformers.GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(1))
    counter = AtenCalls()
    watch = deadweight.watch(model, optimizer) if watched else None
    try:
        with counter:
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
    finally:
        if watch is not None:
            watch.close()
    return len(list(model.parameters())), counter.calls


def added_per_step(layers: int, steps: int) -> tuple[int, dict[str, int]]:
    """The tensor count, and per op the calls watch added over `steps` steps (ops whose
    count did not change left out)."""
    tensors, plain = training_calls(layers, watched=False, steps=steps)
    _, watched = training_calls(layers, watched=True, steps=steps)
    return tensors, {op: watched[op] - plain[op] for op in watched if watched[op] != plain[op]}
