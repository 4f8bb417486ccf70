"""Rank bodies for the FSDP2 tests (module level, so spawned processes can import them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def _sharded(world: int) -> Stack:
    torch.manual_seed(0)
    model = Stack()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_checkpoint(rank: int, world: int, out: str) -> dict[str, Any]:
    model = _sharded(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    state = model.state_dict()  # DTensor shards: each rank writes its own
    sharded = all(hasattr(v, "to_local") for v in state.values())
    dcp.save({"model": state}, checkpoint_id=str(Path(out, "ckpt")))
    # The reference: the whole tensors, assembled here only to compare with the reader.
    full = {k: v.full_tensor() for k, v in state.items()}
    return {
        "sharded": sharded,
        "local_rows": {k: v.to_local().shape[0] if v.dim() else 1 for k, v in state.items()},
        "full": {
            k: {"shape": list(t.shape), "mean": float(t.mean()), "absmax": float(t.abs().max())}
            for k, t in full.items()
        },
    }


def fsdp2_entry_points(rank: int, world: int, out: str) -> dict[str, Any]:
    """watch, check and zero-code watching on a healthy FSDP2 model: they run, and agree."""
    import deadweight
    from deadweight.watching.global_watch import watch_all

    model = _sharded(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()

    with deadweight.watch(model, opt, every=2) as w:
        for _ in range(5):
            step()
    checked = deadweight.check(model, lambda: F.mse_loss(model(x), y), opt)
    with watch_all(every=2) as wt:
        for _ in range(3):
            step()
    return {
        "watch": w.report().to_dict(),
        "check": checked.to_dict(),
        "watch_all": wt.report().to_dict(),
    }


def fsdp2_pair(rank: int, world: int, out: str) -> dict[str, Any]:
    """Two DCP checkpoints of one FSDP2 run, a few AdamW steps apart."""
    model = _sharded(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    for k in range(2):
        for _ in range(3):
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(Path(out, f"step{k}")))
    return {}
