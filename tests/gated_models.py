"""Models whose first step is special, for the tests and the detection benchmark:
gates that start at zero (ReZero, DiT's adaLN-Zero, Flamingo's tanh gate). Built in
code from random initialisation; nothing is downloaded."""

from __future__ import annotations

import torch
from torch import nn


class ReZeroBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.alpha = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.alpha * self.attn(x, x, x, need_weights=False)[0]
        return x + self.alpha * self.ff(x)


class ReZero(nn.Module):
    def __init__(self, d: int = 32, n: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.blocks = nn.ModuleList([ReZeroBlock(d) for _ in range(n)])
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class AdaLNZeroBlock(nn.Module):
    """DiT's block: modulation from the condition, a zero-initialised Linear."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        nn.init.zeros_(self.ada[1].weight)
        nn.init.zeros_(self.ada[1].bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(c).unsqueeze(1).chunk(6, -1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * self.attn(h, h, h, need_weights=False)[0]
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.mlp(h)


class DiT(nn.Module):
    def __init__(self, d: int = 32, n: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.t = nn.Sequential(nn.Linear(1, d), nn.SiLU(), nn.Linear(d, d))
        self.blocks = nn.ModuleList([AdaLNZeroBlock(d) for _ in range(n)])
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.final = nn.Sequential(nn.SiLU(), nn.Linear(d, 2 * d))
        self.out = nn.Linear(d, 8)
        for layer in (self.final[1], self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        c, h = self.t(t), self.inp(x)
        for block in self.blocks:
            h = block(h, c)
        shift, scale = self.final(c).unsqueeze(1).chunk(2, -1)
        return self.out(self.norm(h) * (1 + scale) + shift)


class TanhGated(nn.Module):
    """Flamingo's gated cross-attention: tanh(gate) with gate = 0."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, d)
        self.xattn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ff = nn.Linear(d, d)
        self.ff_gate = nn.Parameter(torch.zeros(1))
        self.head = nn.Linear(d, 64)

    def forward(self, ids: torch.Tensor, media: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + torch.tanh(self.attn_gate) * self.xattn(h, media, media, need_weights=False)[0]
        h = h + torch.tanh(self.ff_gate) * self.ff(h)
        return self.head(h)
