"""Seed incident 1, ported from candle to PyTorch: a fused RMSNorm that records no backward.

Linear(8 -> 8) -> RMSNorm -> Linear(8 -> 1), parameters w1, g (the norm's weight)
and w2, trained with SGD (lr 0.1) to imitate a teacher network of the same shape
with a different first layer. `RMSNorm.forward` takes the fused kernel whenever its
input is contiguous, which a Linear's output always is, exactly like candle's
`RmsNorm::forward`; `forward_diff` is the differentiable path. The fused path
raises no error: backward succeeds, SGD steps, the loss falls and then plateaus,
because w1 and g never receive a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DIM = 8
BATCH = 64
LR = 0.1
STEPS = 1000
LOG_STEPS = (0, 250, 500, 750, 1000)
# The seed's names for the three parameters.
PARAM_LABELS = {"l1.weight": "w1", "norm.weight": "g", "l2.weight": "w2"}


@torch.no_grad()  # stands in for a fused kernel: the result records no backward op
def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight  # the fused kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_contiguous():  # the fast path, taken for every Linear output
            return fused_rms_norm(x, self.weight, self.eps)
        return self.forward_diff(x)

    def forward_diff(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Net(nn.Module):
    def __init__(self, diff: bool) -> None:
        super().__init__()
        self.diff = diff
        self.l1 = nn.Linear(DIM, DIM, bias=False)
        self.norm = RMSNorm(DIM)
        self.l2 = nn.Linear(DIM, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h = self.norm.forward_diff(h) if self.diff else self.norm(h)
        return self.l2(h)


@dataclass
class Setup:
    model: Net
    optimizer: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor

    def loss(self) -> torch.Tensor:
        return F.mse_loss(self.model(self.x), self.y)


def make(diff: bool, seed: int = 0) -> Setup:
    """The student, its SGD optimizer and the teacher's data; identical init for both paths."""
    gen = torch.Generator().manual_seed(seed)
    student = Net(diff)
    teacher = Net(diff=True)
    with torch.no_grad():
        for net in (student, teacher):
            for p in (net.l1.weight, net.l2.weight):
                p.copy_(torch.randn(p.shape, generator=gen) / DIM**0.5)
        # the teacher's first layer differs; everything else is shared
        teacher.l1.weight.copy_(torch.randn(DIM, DIM, generator=gen) / DIM**0.5)
        teacher.l2.weight.copy_(student.l2.weight)
        x = torch.randn(BATCH, DIM, generator=gen)
        y = teacher(x)
    return Setup(student, torch.optim.SGD(student.parameters(), lr=LR), x, y)


@dataclass
class TrainResult:
    grads_present: dict[str, bool]  # after the first backward, by seed label
    losses: dict[int, float]  # at LOG_STEPS
    max_change: dict[str, float]  # max |theta_1000 - theta_0| by seed label


def train(setup: Setup, steps: int = STEPS) -> TrainResult:
    model, opt = setup.model, setup.optimizer
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads_present: dict[str, bool] = {}
    losses: dict[int, float] = {}
    for step in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = setup.loss()
        loss.backward()
        if step == 0:
            grads_present = {
                PARAM_LABELS[n]: p.grad is not None for n, p in model.named_parameters()
            }
        if step in LOG_STEPS:
            losses[step] = loss.item()
        if step < steps:
            opt.step()
    max_change = {
        PARAM_LABELS[n]: (p.detach() - start[n]).abs().max().item()
        for n, p in model.named_parameters()
    }
    return TrainResult(grads_present, losses, max_change)
