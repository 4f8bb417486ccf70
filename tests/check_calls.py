"""The aten calls one `deadweight.check` makes beyond a plain forward+backward, counted
with a TorchDispatchMode: one measurement for tests/checking/test_check_cost.py and
`benchmarks/check_overhead.py --case dispatch`. On a GPU each call is Python and
dispatch time that a check pays. A GPT-2 of width 64 built in code; nothing is
downloaded."""

from __future__ import annotations

from collections import Counter

import torch

import deadweight
from tests.watch_step_calls import AtenCalls


def added_by_check(layers: int) -> tuple[int, Counter[str]]:
    """The number of parameter tensors of a GPT-2 of `layers` blocks, and per op the
    aten calls one check of it made beyond one plain forward+backward of the same batch
    (ops whose count did not grow left out)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=layers, n_head=2, vocab_size=64, n_positions=8
    )
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (1, 4), generator=torch.Generator().manual_seed(1))

    def loss_fn() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    deadweight.check(model, loss_fn)  # first-call work (imports, caches) left out
    plain, checked = AtenCalls(), AtenCalls()
    with plain:
        model.zero_grad(set_to_none=True)
        loss_fn().backward()
    model.zero_grad(set_to_none=True)
    with checked:
        deadweight.check(model, loss_fn)
    added = checked.calls - plain.calls
    return len(list(model.parameters())), added
