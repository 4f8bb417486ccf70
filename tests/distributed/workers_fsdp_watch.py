"""Rank bodies for check and watch on FSDP2 models (module level, so spawned processes
can import them). Each body also runs in one process (`world=1`, no process group)
to give the single-process reference on the same model and the same data."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight.demos import fused_rmsnorm, layer_scalar_drift

# Divisible by 2 and 3: each rank gets an equal slice of the global batch, so the mean
# of the ranks' losses is the loss of the whole batch, as in one process.
GLOBAL_BATCH = 60
DRIFT_STEPS = 300  # DW302 judges after 100 steps; the drift is ~0.2 by step 300


def _shard(
    model: nn.Module,
    world: int,
    parts: list[nn.Module],
    hsdp: bool = False,
    mixed: bool = False,
) -> None:
    """FSDP2 over all ranks; with `hsdp`, HSDP on 4 ranks: a (2, 2) mesh, each
    parameter sharded over 2 ranks and the shards replicated twice. With `mixed`,
    FSDP2 mixed precision: fp32 sharded parameters (what the optimizer steps), bf16
    compute."""
    if world == 1:
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if hsdp:
        assert world == 4
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mixed else None,
        reduce_dtype=torch.float32 if mixed else None,
    )
    for part in parts:
        fully_shard(part, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def _summary(report: deadweight.Report) -> dict[str, Any]:
    return {
        "findings": [[f.code, list(f.params), f.message] for f in report.findings],
        "evidence": {f.code: f.evidence for f in report.findings},
        "subject": report.subject,
    }


def fused_check(rank: int, world: int, hsdp: bool = False) -> dict[str, Any]:
    """The first seed's fused RMSNorm, checked once; parameters untouched afterwards."""
    setup = fused_rmsnorm.make(diff=False)
    model = setup.model
    _shard(model, world, [], hsdp)
    x, y = _slice(setup.x[:GLOBAL_BATCH], rank, world), _slice(setup.y[:GLOBAL_BATCH], rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=fused_rmsnorm.LR)  # after fully_shard
    before = {n: deadweight_local(p).clone() for n, p in model.named_parameters()}
    report = deadweight.check(model, lambda: F.mse_loss(model(x), y), opt)
    out = _summary(report)
    out["untouched"] = all(
        torch.equal(before[n], deadweight_local(p)) for n, p in model.named_parameters()
    )
    out["grads_left"] = [n for n, p in model.named_parameters() if p.grad is not None]
    out["dtensor"] = all(hasattr(p, "to_local") for p in model.parameters()) if world > 1 else None
    # The gradient statistics check judges by, combined from the shards ...
    from deadweight.checking.flow_measurement import measure_grad_flow
    from deadweight.distributed import ranks as distributed

    shards = distributed.Shards(distributed.ranks_for(model))
    stats = measure_grad_flow(model, lambda: F.mse_loss(model(x), y), shards=shards)
    out["measured"] = {
        q.name: [q.grad.grad_norm, q.grad.grad_dot_param, q.grad.grad_sum, q.grad.param_norm]
        for q in stats.params
        if q.grad is not None
    }
    # ... and the slow reference on the whole tensors, from a plain backward
    F.mse_loss(model(x), y).backward()
    out["reference"] = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            g, theta = _full(p.grad).double(), _full(p).double()
            out["reference"][n] = [
                float(g.norm()),
                float((g * theta).sum()),
                float(g.sum()),
                float(theta.norm()),
            ]
    opt.zero_grad(set_to_none=True)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach()


def deadweight_local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (to_local() if callable(to_local) else t).detach()


def drift_watch(
    rank: int, world: int, log: str | None = None, hsdp: bool = False, mixed: bool = False
) -> dict[str, Any]:
    """The second seed under watch: a shape-[1] scalar before RMSNorm drifts under AdamW
    (with `mixed`, the forward computes in bf16 and the scalar's gradient is rounding
    noise, so its fp32 sharded copy only random-walks)."""
    torch.manual_seed(0)
    setup = layer_scalar_drift.make_watchable()
    model = setup.model
    _shard(model, world, list(model.blocks), hsdp, mixed)
    groups = layer_scalar_drift.shape_rule_groups(model)  # over the DTensors
    opt = torch.optim.AdamW(
        groups,
        lr=layer_scalar_drift.WATCH_LR,
        betas=layer_scalar_drift.BETAS,
        eps=layer_scalar_drift.WATCH_EPS,
    )
    gen = torch.Generator().manual_seed(1)
    # The slow reference, whole tensors assembled in the test only (deadweight never
    # gathers): start values, and the squared gradient norms of the last window.
    start = {n: _full(p).clone() for n, p in model.named_parameters()}
    window_gsq = {n: 0.0 for n in start}
    with deadweight.watch(model, opt, every=20, log=log) as w:
        for step in range(1, DRIFT_STEPS + 1):
            idx = torch.randint(0, setup.x.shape[0], (GLOBAL_BATCH,), generator=gen)
            x, y = _slice(setup.x[idx], rank, world), _slice(setup.y[idx], rank, world)
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            if step > DRIFT_STEPS - 20:
                for n, p in model.named_parameters():
                    window_gsq[n] += float(_full(p.grad).double().norm() ** 2)
            if step == DRIFT_STEPS:
                before_last = {n: _full(p).double() for n, p in model.named_parameters()}
            opt.step()
    out = _summary(w.report())
    tracks = w.stats.params
    out["measured"] = {
        n: {
            "param_norm": t.series.param_norm[-1],
            "grad_rms": t.series.grad_rms[-1],
            "value": t.series.value[-1] if t.series.value else None,
            "drift": t.small_stats.drift if t.small_stats else None,
            "update_norm": t.series.update_norm[-1],
        }
        for n, t in tracks.items()
    }
    out["reference"] = {
        n: {
            "param_norm": float(_full(p).double().norm()),
            "grad_rms": (window_gsq[n] / 20) ** 0.5,
            "value": _full(p).reshape(-1).tolist() if p.numel() <= 16 else None,
            "drift": float((_full(p) - start[n]).double().norm()),
            "update_norm": float((_full(p).double() - before_last[n]).norm()),
        }
        for n, p in model.named_parameters()
    }
    last = dict(model.named_parameters())[f"blocks.{layer_scalar_drift.LAYERS - 1}.layer_scalar"]
    out["last_scalar_local"] = deadweight_local(last).tolist()
    out["shard_bytes"] = [b.shard_bytes for m in w._monitors.values() for b in m.buckets]
    out["watched_steps"] = sum(1 for _ in range(1, DRIFT_STEPS + 1))
    return out


def _sharded_drift(world: int) -> tuple[Any, torch.optim.Optimizer, torch.Generator]:
    """The drift model sharded over the ranks, plain AdamW, and the batch generator."""
    torch.manual_seed(0)
    setup = layer_scalar_drift.make_watchable()
    _shard(setup.model, world, list(setup.model.blocks))
    opt = torch.optim.AdamW(setup.model.parameters(), lr=1e-3)
    return setup, opt, torch.Generator().manual_seed(1)


def _train_step(
    setup: Any, opt: torch.optim.Optimizer, gen: torch.Generator, rank: int, world: int
) -> None:
    idx = torch.randint(0, setup.x.shape[0], (GLOBAL_BATCH,), generator=gen)
    x, y = _slice(setup.x[idx], rank, world), _slice(setup.y[idx], rank, world)
    opt.zero_grad(set_to_none=True)
    F.mse_loss(setup.model(x), y).backward()
    opt.step()


def watch_one_rank_missing(rank: int, world: int) -> dict[str, Any]:
    """Only rank 0 watches: its combining collective must time out, not hang training."""
    import time

    setup, opt, gen = _sharded_drift(world)
    model = setup.model

    def train(steps: int) -> None:
        for _ in range(steps):
            _train_step(setup, opt, gen, rank, world)

    start = time.monotonic()
    if rank != 0:
        train(25)
        return {"seconds": time.monotonic() - start}
    with deadweight.watch(model, opt, every=20) as w:
        train(25)
    rep = w.report()
    trained = {int(state["step"]) for state in opt.state.values()}
    return {
        "seconds": time.monotonic() - start,
        "trained": sorted(trained),
        "errors": rep.subject["detector_errors"],
    }


def drift_check(
    rank: int, world: int, fail_on_call: int | None = None, mixed: bool = False
) -> dict[str, Any]:
    """The second seed's model checked once at step 0: the scalar before the final
    RMSNorm is confirmed invariant by the functional probes (DW104).

    `fail_on_call`: rank 1's loss_fn raises on that call (1 is the checked run, 2 the
    first probe), after the model's forward, so FSDP2's own collectives stay matched.
    `mixed`: FSDP2 mixed precision, and an evaluation forward under no_grad before the
    check, which leaves the root's parameters gathered.
    """
    torch.manual_seed(0)
    setup = layer_scalar_drift.make()
    model = setup.model
    _shard(model, world, list(model.blocks), mixed=mixed)
    opt = torch.optim.AdamW(
        layer_scalar_drift.shape_rule_groups(model),  # after fully_shard
        lr=layer_scalar_drift.LR,
        betas=layer_scalar_drift.BETAS,
        eps=layer_scalar_drift.EPS,
    )
    x = _slice(setup.x[:GLOBAL_BATCH], rank, world)
    y = _slice(setup.y[:GLOBAL_BATCH], rank, world)
    calls = [0]

    def loss_fn() -> torch.Tensor:
        calls[0] += 1
        loss = F.mse_loss(model(x), y)
        if calls[0] == fail_on_call and rank == 1:
            raise RuntimeError("rank 1's loss_fn fails in a probe")
        return loss

    before = {n: deadweight_local(p).clone() for n, p in model.named_parameters()}
    if mixed:
        with torch.no_grad():
            model(x)
    report = deadweight.check(model, loss_fn, opt)
    out = _summary(report)
    out["calls"] = calls[0]
    out["untouched"] = all(
        torch.equal(before[n], deadweight_local(p)) for n, p in model.named_parameters()
    )
    # the probes leave no gathered copy behind: training's next forward sees the shards
    with torch.no_grad():
        out["next_loss"] = float(F.mse_loss(model(x), y))
    return out


class WeakBranch(nn.Module):
    """Healthy, with a weak residual branch: its weight starts 1000x smaller than
    usual, so its gradient screen makes it a probe candidate, yet the loss does
    depend on it (scaling it 10x and 100x moves the loss by different amounts)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.branch = nn.Linear(32, 32)
        self.out = nn.Linear(32, 4)
        with torch.no_grad():
            self.branch.weight.mul_(1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + self.branch(h))


def healthy_check(rank: int, world: int) -> dict[str, Any]:
    """No parameter the loss ignores; the weak branch is proven to reach the loss.

    `branch` is left in the root's FSDP2 group, which a forward under no_grad leaves
    gathered: the structure pass must follow it through the root's unsharded copy.
    """
    torch.manual_seed(0)
    model = WeakBranch()
    _shard(model, world, [model.inp, model.out])
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(GLOBAL_BATCH, 16, generator=gen)
    y = torch.randn(GLOBAL_BATCH, 4, generator=gen)
    x, y = _slice(x, rank, world), _slice(y, rank, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    calls = [0]

    def loss_fn() -> torch.Tensor:
        calls[0] += 1
        return F.mse_loss(model(x), y)

    report = deadweight.check(model, loss_fn, opt)
    out = _summary(report)
    out["calls"] = calls[0]
    return out


def rank_dies(rank: int, world: int, out: str) -> dict[str, Any]:
    """The last rank exits mid-run; the others' FSDP2 collectives fail, their
    training loop raises, and they close the watch and keep its report."""
    import os
    from pathlib import Path

    setup, opt, gen = _sharded_drift(world)
    trained, error = 0, None
    with deadweight.watch(setup.model, opt, every=10, log=Path(out, "run.jsonl")) as w:
        try:
            for step in range(40):
                if step == 25 and rank == world - 1:
                    os._exit(3)
                _train_step(setup, opt, gen, rank, world)
                trained += 1
        except Exception as exc:  # FSDP2's own collective lost its peer
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return {"report": w.report().to_dict(), "trained": trained, "error": error, "log": w.log_path}
