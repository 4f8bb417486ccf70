"""Rank bodies for the check tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import deadweight
from deadweight.demos import fused_rmsnorm
from deadweight.errors import DeadweightError


def fused_under_ddp(rank: int, world: int) -> dict[str, Any]:
    setup = fused_rmsnorm.make(diff=False)
    model = DDP(setup.model, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=fused_rmsnorm.LR)
    w1_before = setup.model.l1.weight.detach().clone()
    for _ in range(3):  # DDP trains without a word
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(setup.x), setup.y).backward()
        opt.step()
    report = deadweight.check(model, lambda: F.mse_loss(model(setup.x), setup.y), opt)
    # and training goes on afterwards: check left DDP's synchronisation as it was
    opt.zero_grad(set_to_none=True)
    F.mse_loss(model(setup.x), setup.y).backward()
    opt.step()
    return {
        "report": report.to_dict(),
        "w1_moved": float((setup.model.l1.weight - w1_before).abs().max()),
        "l2_grad_sum": float(setup.model.l2.weight.grad.sum()),
    }


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if dist.get_rank() == 0:  # rank-0 branch
            h = h + self.side(h)
        return self.head(h)


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)


def rank0_branch(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(Branchy(), find_unused_parameters=True)
    x, y = _data(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = deadweight.check(model, lambda: F.mse_loss(model(x), y), opt)
    return {"report": report.to_dict()}


class Healthy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def healthy(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(Healthy())
    x, y = _data(rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    report = deadweight.check(model, lambda: F.mse_loss(model(x), y), opt)
    # a normal synchronised step still works afterwards
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()
    return {"report": report.to_dict()}


def optimizer_differs(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(Healthy())
    x, y = _data(rank)
    params = [
        p for n, p in model.module.named_parameters() if rank == 0 or not n.startswith("net.2")
    ]
    opt = torch.optim.SGD(params, lr=1e-2)
    report = deadweight.check(model, lambda: F.mse_loss(model(x), y), opt)
    return {"report": report.to_dict()}


def rank_dies(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(Healthy())
    x, y = _data(rank)
    if rank == world - 1:
        os._exit(3)  # a crash: no report, no goodbye
    report = deadweight.check(model, lambda: F.mse_loss(model(x), y))
    return {"report": report.to_dict()}


def not_initialised(rank: int, world: int) -> dict[str, Any]:
    model = DDP(Healthy())
    x, y = _data(rank)
    dist.destroy_process_group()
    try:
        deadweight.check(model, lambda: F.mse_loss(model.module(x), y))
    except DeadweightError as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}
