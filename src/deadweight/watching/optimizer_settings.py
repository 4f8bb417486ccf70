"""What a watched optimizer's parameter groups say, read on the host: a learning rate
or a beta as a float (never a device sync), and the growth of noise-driven updates a
reset of its state predicts."""

from __future__ import annotations

import math
from typing import Any

import torch


def host_float(value: Any) -> float | None:
    """A learning rate or step counter as a float, without a device sync."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" else None
    if isinstance(value, (int, float)):
        return float(value)
    return None


def predicted_reset_amplification(group: dict[str, Any]) -> float | None:
    # Right after a reset v ~ (1 - b2) g^2 instead of ~ g^2: noise-driven steps grow by
    # sqrt(1 / (1 - b2)) (the incident's sqrt(20) = 4.47 for b2 = 0.95).
    betas = group.get("betas")
    if betas is not None:
        b2 = host_float(betas[1])
        return math.sqrt(1 / (1 - b2)) if b2 is not None and b2 < 1 else None
    alpha = group.get("alpha")  # RMSprop's smoothing constant plays b2's part
    if alpha is not None and "eps" in group:
        a = host_float(alpha)
        return math.sqrt(1 / (1 - a)) if a is not None and a < 1 else None
    return None


def group_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's settings as the `optimizer` event records them."""
    return {
        "lr": host_float(group.get("lr")),
        "weight_decay": host_float(group.get("weight_decay", 0.0)),
        "betas": [host_float(b) for b in group["betas"]] if "betas" in group else None,
        "eps": host_float(group.get("eps")),
        "predicted_reset_amplification": predicted_reset_amplification(group),
    }
