"""Rank bodies for the watch and pin tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import deadweight


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)


def _train(
    rank: int,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    tamper_at: int | None = None,
    die_at: int | None = None,
) -> None:
    for step in range(steps):
        if step == tamper_at and rank == 0:
            with torch.no_grad():  # rank 0 alone changes its copy
                inner = model.module if isinstance(model, DDP) else model
                inner.head.weight.mul_(0.5)
        if step == die_at:
            os._exit(3)
        x, y = _batch(rank, step)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()


def _result(w: deadweight.Watch, log: Path) -> dict[str, Any]:
    return {"report": w.report().to_dict(), "log": w.log_path, "log_exists": log.exists()}


def ddp_watch(rank: int, world: int, out: str, tamper_at: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DDP(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    log = Path(out, "run.jsonl")
    with deadweight.watch(model, opt, log=log) as w:
        _train(rank, model, opt, 60, tamper_at=tamper_at)
    res = _result(w, log)
    res["replica_bytes"] = [(r.name_bytes, r.compare_bytes) for r in w._replicas.values()]
    res["replica_checks"] = [r.checks for r in w._replicas.values()]
    return res


def ddp_watch_optimizer_differs(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    params = list(net.body.parameters()) + (list(net.head.parameters()) if rank == 0 else [])
    opt = torch.optim.SGD(params, lr=1e-2)
    with deadweight.watch(model, opt) as w:
        _train(rank, model, opt, 25)
    return {"report": w.report().to_dict()}


def watch_rank_dies(rank: int, world: int, out: str) -> dict[str, Any]:
    # Ranks train on their own (no DDP), so only deadweight's collectives need the
    # other ranks: when rank 2 dies, those must fail within their timeout.
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with deadweight.watch(model, opt, log=Path(out, "run.jsonl")) as w:
        _train(rank, model, opt, 50, die_at=30 if rank == world - 1 else None)
    return {"report": w.report().to_dict()}


def pin_under_ddp(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    handle = deadweight.pin(net, "head.bias")
    before = net.head.bias.detach().clone()
    body_before = net.body.weight.detach().clone()
    # pinned parameters go to the no-decay group: decay would pull them towards 0
    opt = torch.optim.AdamW(deadweight.param_groups(net, weight_decay=0.1), lr=1e-2)
    for step in range(20):
        x, y = _batch(rank, step)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {
        "requires_grad": net.head.bias.requires_grad,
        "bias_moved": float((net.head.bias.detach() - before).abs().max()),
        "bias": net.head.bias.tolist(),
        "body_moved": float((net.body.weight.detach() - body_before).abs().max()),
        "body_sum": float(net.body.weight.sum()),
        "pin_moved": handle.moved(),
    }


class Stage(nn.Module):
    """A pipeline stage: each rank holds different layers."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.add_module(f"block{rank}", nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return next(iter(self.children()))(x)


def pipeline_stages(rank: int, world: int, out: str) -> dict[str, Any]:
    torch.manual_seed(rank)
    model = Stage(rank)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with deadweight.watch(model, opt) as w:
        for step in range(25):
            x, _ = _batch(rank, step)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    return {"report": w.report().to_dict()}


def _tamper_train(rank: int, model: nn.Module, opt: torch.optim.Optimizer, tamper: Any) -> None:
    for step in range(25):
        if step == 10 and rank == 0:
            with torch.no_grad():  # rank 0 alone changes its copy
                tamper()
        x, y = _batch(rank, step)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()


def replica_groups(rank: int, world: int) -> dict[str, Any]:
    """Two data-parallel layouts on 4 ranks where only some ranks hold copies.

    DDP in two groups, ranks {0, 2} and {1, 3}: each group trains its own replica
    on its own data, so the groups differ by design and only a copy changed inside
    a group is a divergence. HSDP on a (replicate 2, shard 2) mesh: ranks 0 and 2
    hold the same shards, as do 1 and 3. In both, rank 0 changes its copy of one
    parameter at step 10; the watched step 20 must see it.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    assert world == 4
    out: dict[str, Any] = {}
    subgroups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates both
    torch.manual_seed(0)
    net = Net()
    model = DDP(net, process_group=subgroups[rank % 2])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with deadweight.watch(model, opt) as w:
        _tamper_train(rank, model, opt, lambda: net.head.weight.mul_(0.5))
    out["ddp"] = w.report().to_dict()
    out["ddp_bytes"] = [r.compare_bytes for r in w._replicas.values()]

    torch.manual_seed(0)
    net = Net()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with deadweight.watch(net, opt) as w:
        _tamper_train(rank, net, opt, lambda: net.body.weight.to_local().mul_(0.5))
    out["hsdp"] = w.report().to_dict()
    out["hsdp_bytes"] = [r.compare_bytes for r in w._replicas.values()]
    return out
