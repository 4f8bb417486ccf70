"""What `deadweight.watch` costs per step under 2-process DDP (gloo, CPU), and its traffic.

Two ranks, spawned here, each train the same GPT-2-style model (transformers' code,
random config, no download) wrapped in DistributedDataParallel on random tokens.
As in `watch_overhead.py`, one model and optimizer train throughout and the
variants take turns in blocks of `--block` steps, round after round (none, watch at
the default cadence every=20), so machine noise hits both alike; a figure is the
median over rounds of a watch block's time / the adjacent unmonitored block's time,
timed on rank 0. The first step of each block is left out (attaching watch measures
it in full and exchanges the parameter names once), so a watch block times one
watched step (with its cross-rank replica comparison) in `block - 1`.

Also timed directly: seconds inside deadweight's hooks per step (the step monitor's
and the replica comparison's, including its all-reduce), against the step time.

Traffic: the bytes deadweight hands to its collectives per watched step, for the
model and for one with the same parameter tensors at a quarter of the width (8x fewer
elements), to show it grows with the number of parameter tensors, not with their
elements.

    python benchmarks/watch_ddp_overhead.py [--rounds 8] [--block 20] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch


def build(
    n_embd: int, batch: int, seq: int
) -> tuple[torch.nn.Module, torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    import transformers
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    config = GPT2Config(
        vocab_size=8192, n_positions=seq, n_embd=n_embd, n_layer=4, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    inner = GPT2LMHeadModel(config).train()
    model = DDP(inner)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))

    def step() -> None:
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        opt.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        opt.step()

    return model, inner, opt, step


def rank_main(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ["WORLD_SIZE"] = "2"
    import torch.distributed as dist

    import deadweight
    from deadweight.distributed.replicas import ReplicaCheck
    from deadweight.watching.step_monitor import StepMonitor

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=300))
    _ddp, inner, opt, step = build(args.n_embd, args.batch, args.seq)
    for _ in range(3):  # warm-up: allocator, AdamW state, DDP buckets
        step()
    log_dir = tempfile.mkdtemp(prefix="dw-bench-ddp-")

    spent = [0.0, 0.0]  # in the step monitor's hooks, in the replica comparison

    def timed(body: Callable[..., None], slot: int) -> Callable[..., None]:
        def run(*a: Any) -> None:
            start = time.perf_counter()
            body(*a)
            spent[slot] += time.perf_counter() - start

        return run

    originals = StepMonitor.before_step, StepMonitor.after_step, ReplicaCheck.after_step
    StepMonitor.before_step = timed(originals[0], 0)  # type: ignore[method-assign]
    StepMonitor.after_step = timed(originals[1], 0)  # type: ignore[method-assign]
    ReplicaCheck.after_step = timed(originals[2], 1)  # type: ignore[method-assign]

    def block(watched: bool) -> tuple[float, list[float], dict[str, int]]:
        """(seconds per timed step, seconds per step in each part, traffic) of one block."""
        traffic: dict[str, int] = {}
        if watched:
            w = deadweight.watch(inner, opt, log=os.path.join(log_dir, "run.jsonl"))
            w.__enter__()
        step()  # left out of the timing (attach time)
        dist.barrier()  # the ranks start each timed stretch together
        spent[:] = [0.0, 0.0]
        start = time.perf_counter()
        for _ in range(args.block - 1):
            step()
        total = time.perf_counter() - start
        if watched:
            w.close()
            for r in w._replicas.values():
                traffic = {
                    "tensors": len(r.params),
                    "checks": r.checks,
                    "compare_bytes": r.compare_bytes,
                    "name_bytes": r.name_bytes,
                }
        return total / (args.block - 1), [x / (args.block - 1) for x in spent], traffic

    ratios: list[float] = []
    base_times: list[float] = []
    hook_shares: list[float] = []
    replica_shares: list[float] = []
    traffic: dict[str, int] = {}
    for k in range(args.rounds):
        # alternate which variant goes first, so drift within a round cancels
        order = [False, True] if k % 2 == 0 else [True, False]
        times = {}
        for watched in order:
            per_step, in_hooks, t = block(watched)
            times[watched] = per_step
            if watched:
                hook_shares.append(sum(in_hooks) / per_step)
                replica_shares.append(in_hooks[1] / per_step)
                traffic = t
        ratios.append(times[True] / times[False])
        base_times.append(times[False])

    # The same tensors at a quarter of the width: the same bytes per watched step.
    _small_ddp, small_inner, small_opt, small_step = build(args.n_embd // 4, args.batch, args.seq)
    with deadweight.watch(small_inner, small_opt) as w:
        for _ in range(41):  # watched steps 1, 20, 40
            small_step()
    small = next(iter(w._replicas.values()))
    StepMonitor.before_step, StepMonitor.after_step, ReplicaCheck.after_step = originals  # type: ignore[method-assign]
    if rank == 0:
        result = {
            "ratios": ratios,
            "base_step_s": base_times,
            "hook_shares": hook_shares,
            "replica_shares": replica_shares,
            "traffic": traffic,
            "params": sum(p.numel() for p in inner.parameters()),
            "small": {
                "tensors": len(small.params),
                "checks": small.checks,
                "compare_bytes": small.compare_bytes,
                "params": sum(p.numel() for p in small_inner.parameters()),
            },
        }
        with open(out, "w") as fh:
            json.dump(result, fh)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--n-embd", type=int, default=384)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(prefix="dw-bench-ddp-"), "result.json")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    with open(out) as fh:
        res = json.load(fh)

    r = sorted(res["ratios"])
    t = res["traffic"]
    per_check = t["compare_bytes"] / t["checks"]
    s = res["small"]
    print(f"2 ranks (gloo), GPT-2-style {res['params'] / 1e6:.1f}M parameters in "
          f"{t['tensors']} tensors, {args.threads} thread(s) per rank, block {args.block}, "
          f"{args.rounds} rounds")  # fmt: skip
    print(f"unmonitored step (median): {statistics.median(res['base_step_s']) * 1e3:.1f} ms")
    print(
        f"watch (every=20) / none, median of {len(r)} paired block ratios: "
        f"{statistics.median(r):.4f}x (range {r[0]:.4f}x-{r[-1]:.4f}x)"
    )
    print(
        f"time inside deadweight's hooks per step / step time (median): "
        f"{statistics.median(res['hook_shares']) * 100:.2f}%, of which the cross-rank "
        f"replica comparison {statistics.median(res['replica_shares']) * 100:.3f}%"
    )
    print(
        f"collective payload per watched step: {per_check:.0f} B "
        f"({per_check / t['tensors']:.0f} B per parameter tensor); names once: "
        f"{t['name_bytes']} B"
    )
    print(
        f"same {s['tensors']} tensors, {s['params'] / 1e6:.2f}M parameters: "
        f"{s['compare_bytes'] / s['checks']:.0f} B per watched step"
    )


if __name__ == "__main__":
    main()
