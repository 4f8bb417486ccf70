"""A tiny model with the first seed incident's bug: a fused RMSNorm kernel that records no
backward op, so `w1` and the norm's gain `g` never get a gradient.

`TinyNet(fused=False)` takes the differentiable path instead. test_model.py checks both.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()  # stands in for a fused kernel without a backward
def fused_rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


class TinyNet(nn.Module):
    def __init__(self, dim: int = 8, fused: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(dim, dim) / dim**0.5)
        self.g = nn.Parameter(torch.ones(dim))
        self.w2 = nn.Parameter(torch.randn(1, dim) / dim**0.5)
        self.norm = fused_rms_norm if fused else rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x @ self.w1.T, self.g) @ self.w2.T
