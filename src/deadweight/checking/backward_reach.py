"""What the checked backward reached: the one record the gradient-flow measurement
(`flow_measurement`) and its sharded counterpart (`sharded_flow`) both read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deadweight.checking.check_stats import Cut


@dataclass
class BackwardReach:
    """What the backward reached."""

    error: str | None  # a custom op without autograd stopped it
    cuts: list[Cut]  # ops that dropped or refused the gradient in backward
    reached: set[int]  # ids of the parameters (and stand-ins) it reached
    has_grad: dict[int, bool]
    grads: dict[str, torch.Tensor | None]  # taken before the model's own grads go back
