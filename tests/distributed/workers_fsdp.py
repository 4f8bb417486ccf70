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


def fsdp2_refused(rank: int, world: int, out: str) -> dict[str, Any]:
    """watch and check on an FSDP2 model: a clear error on every rank, and no hang."""
    import deadweight
    from deadweight.errors import DeadweightError
    from deadweight.watcher import watch_all

    model = _sharded(world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
    errors = {}
    try:
        deadweight.watch(model, opt)
    except DeadweightError as exc:
        errors["watch"] = str(exc)
    try:
        deadweight.check(model, lambda: F.mse_loss(model(x), y))
    except DeadweightError as exc:
        errors["check"] = str(exc)
    # zero-code mode meets the optimizer only when it steps: left unwatched, training goes on
    with watch_all() as wt:
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    errors["watch_all"] = [e["message"] for e in wt.report().subject["detector_errors"]]
    return errors
