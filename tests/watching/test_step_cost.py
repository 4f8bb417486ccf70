"""What watch adds to each training step, counted in aten calls (each one is Python and
dispatch time on the step's critical path, which on a GPU is what a step pays): a
constant number, whatever the number of parameter tensors."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import deadweight

transformers = pytest.importorskip("transformers")

STEPS = 40  # two cadences of the default every=20, with the baseline record


class _Calls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _calls(layers: int, watched: bool) -> tuple[int, Counter[str]]:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=layers, n_head=2, vocab_size=64, n_positions=8
    )
    model = transformers.GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(1))
    counter = _Calls()
    watch = deadweight.watch(model, optimizer) if watched else None
    try:
        with counter:
            for _ in range(STEPS):
                optimizer.zero_grad(set_to_none=True)
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
    finally:
        if watch is not None:
            watch.close()
    return len(list(model.parameters())), counter.calls


@pytest.mark.parametrize("layers, tensors", [(12, 148), (48, 580)])
def test_watch_adds_a_constant_number_of_aten_calls_per_step(layers: int, tensors: int) -> None:
    count, plain = _calls(layers, watched=False)
    _, watched = _calls(layers, watched=True)
    assert count == tensors
    added = {op: watched[op] - plain[op] for op in watched if watched[op] != plain[op]}
    per_step = sum(added.values()) / STEPS
    assert per_step <= 64, sorted(added.items(), key=lambda kv: -kv[1])[:10]
    # the per-tensor views and detaches of the old per-step path stay gone
    assert added.get("aten.view.default", 0) / STEPS < 5, added
    assert added.get("aten.detach.default", 0) / STEPS < 5, added
