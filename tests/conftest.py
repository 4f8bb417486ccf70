from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import pytest
import torch
from torch import nn


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def marker_line(obj: object, marker: str) -> int:
    """Line number of the source line of `obj`'s file that carries the comment `# <marker>`."""
    path = inspect.getsourcefile(inspect.unwrap(obj))  # type: ignore[arg-type]
    assert path is not None
    with open(path) as fh:
        for number, line in enumerate(fh, start=1):
            if line.rstrip().endswith(f"# {marker}"):
                return number
    raise AssertionError(f"marker {marker!r} not found in {path}")


def reference_no_grad(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> set[str]:
    """Slow reference: a plain backward on a deep copy; names of trainable params left without grad."""
    clone = copy.deepcopy(model)
    loss = loss_fn(clone)
    if loss.requires_grad:
        loss.backward()
    return {n for n, p in clone.named_parameters() if p.requires_grad and p.grad is None}
