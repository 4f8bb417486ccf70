"""What the ranks reported, as the cross-rank rules read it: which parameter got a
gradient, or sits in the optimizer, on which rank. `distributed/ranks.py` gathers it;
this module imports no torch, so loading the rules (`deadweight rules`) needs none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class RankPresence:
    """Per parameter and rank: did the parameter get a gradient, reach the loss, sit in the optimizer.

    Arrays are (world_size, P) bools in the order of `names`; `in_optimizer` is
    None when no optimizer was given, `has_grad` when gradients were not looked at
    (watch: DDP has already averaged them by the time an optimizer steps).
    """

    names: tuple[str, ...]
    world_size: int
    trainable: tuple[bool, ...]
    has_grad: torch.Tensor | None
    in_optimizer: torch.Tensor | None
    wrapper: str  # "DistributedDataParallel", "FSDP2" or "" (a plain module)

    def ranks_where(self, flags: torch.Tensor, j: int, value: bool = True) -> list[int]:
        return [r for r in range(self.world_size) if bool(flags[r, j]) is value]
