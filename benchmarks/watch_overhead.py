"""What `deadweight.watch` costs per training step, next to no monitoring and a peer.

The model is transformers' GPT-2 code with a ~23M-parameter random config (no
download), trained with AdamW on random tokens. One model and optimizer train
throughout; the variants take turns in blocks of `--block` steps (none, watch at the
default cadence, watch with full statistics every step, wandb.watch(log="all") in
offline mode at the same cadence as watch's default), round after round, so machine
noise hits all alike. Each figure is the median over rounds of block time / the
adjacent unmonitored block's time. The first step of every block is left out of the
timing (attaching watch measures that step in full), so a watch block times one
watched step in `block - 1`, slightly more than the 1 in `every` of a long run.

Memory: the bytes deadweight holds between steps (device accumulators, start norms
and checksums, the small parameters' start values and per-step ring) and the most it
allocates during a watched step (the round-robin copy), against the bytes of
parameters + gradients + AdamW state.

Aten calls: what watch adds to each step, counted with a TorchDispatchMode over 40
steps at the default cadence, on GPT-2s of 12 and 48 blocks (148 and 580 tensors).

    python benchmarks/watch_overhead.py [--rounds 6] [--block 20] [--threads 2] [--calls-only]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import deadweight
from deadweight.watching.loop_checks import LoopChecks
from deadweight.watching.step_monitor import StepMonitor

transformers.logging.set_verbosity_error()


def build(
    batch: int, seq: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    config = GPT2Config(
        vocab_size=8192, n_positions=seq, n_embd=512, n_layer=6, n_head=8,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)

    def step() -> None:
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        opt.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        opt.step()

    return model, opt, step


@contextlib.contextmanager
def no_monitor(model: Any, opt: Any) -> Iterator[None]:
    yield


def watch_variant(**kw: Any) -> Callable[[Any, Any], Any]:
    log = os.path.join(tempfile.mkdtemp(prefix="dw-bench-"), "run.jsonl")

    @contextlib.contextmanager
    def variant(model: Any, opt: Any) -> Iterator[None]:
        with deadweight.watch(model, opt, log=log, **kw):  # with its event log, as in use
            yield

    return variant


_WANDB_RUN: list[Any] = []


def wandb_variant(log_freq: int) -> Callable[[Any, Any], Any] | None:
    try:
        import wandb
    except ImportError:
        return None
    if not _WANDB_RUN:  # one offline run for every wandb variant
        os.environ.setdefault("WANDB_SILENT", "true")
        directory = tempfile.mkdtemp(prefix="dw-bench-wandb-")
        # console="off": wandb would otherwise capture stdout, and this script's figures
        # went into its run log instead of the terminal when run as a background job
        _WANDB_RUN.append(
            wandb.init(
                mode="offline",
                dir=directory,
                project="deadweight-bench",
                settings=wandb.Settings(console="off"),
            )
        )

    @contextlib.contextmanager
    def variant(model: Any, opt: Any) -> Iterator[None]:
        wandb.watch(model, log="all", log_freq=log_freq)
        try:
            yield
        finally:
            wandb.unwatch(model)

    return variant


def added_calls(layers: int, steps: int = 40) -> tuple[int, float, list[tuple[str, float]]]:
    """Aten calls watch adds per step at the default cadence, on a GPT-2 of `layers`
    blocks (width 64): the tensor count, the calls per step, the largest kinds. The
    count is tests/watch_step_calls.py's, the one tests/watching/test_step_cost.py bounds."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # called once per depth
        sys.path.insert(0, root)
    from tests.watch_step_calls import added_per_step

    tensors, added = added_per_step(layers, steps)
    top = sorted(((op, n / steps) for op, n in added.items() if n), key=lambda kv: -kv[1])
    return tensors, sum(added.values()) / steps, top[:5]


def time_in_hooks(
    model: Any, opt: Any, step: Callable[[], None], steps: int, **kw: Any
) -> tuple[float, float]:
    """Seconds per step spent inside deadweight's hooks, and per step overall, timed
    directly around the hook bodies: far less noisy than a difference of step times."""
    spent = [0.0]
    originals = StepMonitor.before_step, StepMonitor.after_step
    loop_checks = LoopChecks.after_step  # zero_grad and train-mode checks, every step

    def timed(body: Callable[..., None]) -> Callable[..., None]:
        def run(self: Any, *args: Any) -> None:
            start = time.perf_counter()
            body(self, *args)
            spent[0] += time.perf_counter() - start

        return run

    StepMonitor.before_step, StepMonitor.after_step = map(timed, originals)  # type: ignore[method-assign,assignment]
    LoopChecks.after_step = timed(loop_checks)  # type: ignore[method-assign]
    try:
        log = os.path.join(tempfile.mkdtemp(prefix="dw-bench-"), "run.jsonl")
        with deadweight.watch(model, opt, log=log, **kw):
            step()  # the baseline record at attach time, as in the blocks
            spent[0] = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                step()
            total = time.perf_counter() - start
    finally:
        StepMonitor.before_step, StepMonitor.after_step = originals  # type: ignore[method-assign]
        LoopChecks.after_step = loop_checks  # type: ignore[method-assign]
    return spent[0] / steps, total / steps


def tensor_bytes(obj: Any) -> int:
    total = 0
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            total += sum(
                v.numel() * v.element_size() for v in value.values() if isinstance(v, torch.Tensor)
            )
    return total


def memory(model: Any, opt: Any, step: Callable[[], None]) -> dict[str, float]:
    base = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    training = 2 * base + state  # params + grads + AdamW moments
    held = transient = 0
    with deadweight.watch(model, opt) as w:
        for _ in range(2):
            step()
        for monitor in w._monitors.values():
            for bucket in monitor.buckets:
                held += tensor_bytes(bucket)
            # The round-robin copy of one watched step (10% of the large parameters).
            budget = int(
                sum(p.numel() * p.element_size() for b in monitor.buckets for p in
                    (b.params[i] for i in b.large)) * monitor.config.copy_fraction
            )  # fmt: skip
            biggest = max(p.numel() * p.element_size() for p in monitor.params)
            transient = max(budget, biggest)
    return {
        "training_bytes": training,
        "held": held / training,
        "peak": (held + transient) / training,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block", type=int, default=20, help="steps per variant per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--no-wandb", action="store_true")
    parser.add_argument("--calls-only", action="store_true", help="only count aten calls")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for layers in (12, 48):
        tensors, per_step, top = added_calls(layers)
        print(
            f"aten calls watch adds per step (default cadence, 40 steps), GPT-2 of {layers} "
            f"blocks, {tensors} tensors: {per_step:.1f}; most: "
            + ", ".join(f"{op} {n:.1f}" for op, n in top)
        )
    if args.calls_only:
        return
    model, opt, step = build(args.batch, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    for _ in range(3):  # warm-up: allocator, AdamW state
        step()
    mem = memory(model, opt, step)

    variants: dict[str, Callable[[Any, Any], Any]] = {
        "watch (default: every=20)": watch_variant(every=args.block),
        "watch full (every=1, full=True)": watch_variant(every=1, full=True),
    }
    peer = None if args.no_wandb else wandb_variant(log_freq=args.block)
    if peer is not None:
        variants[f'wandb.watch(log="all", log_freq={args.block})'] = peer
        variants['wandb.watch(log="all", log_freq=1)'] = wandb_variant(log_freq=1) or peer
    ratios: dict[str, list[float]] = {name: [] for name in variants}
    base_times: list[float] = []

    def block(context: Callable[[Any, Any], Any]) -> float:
        with context(model, opt):
            # The first step after attaching is watched in full (the baseline record);
            # leave it out so the timed steps hold the steady-state share of watched
            # steps (one in `block - 1` here, one in `every` in a long run).
            step()
            start = time.perf_counter()
            for _ in range(args.block - 1):
                step()
            return time.perf_counter() - start

    for _ in range(args.rounds):
        for name, context in variants.items():
            plain = block(no_monitor)
            timed = block(context)
            base_times.append(plain / (args.block - 1))
            ratios[name].append(timed / plain)

    print(
        f"GPT-2 {n_params / 1e6:.1f}M parameters, AdamW, batch {args.batch}x{args.seq}, "
        f"{args.threads} threads; {args.rounds} rounds of {args.block}-step blocks, "
        f"each variant next to its own unmonitored block"
    )
    print(f"unmonitored step: median {statistics.median(base_times) * 1e3:.0f} ms")
    for name, values in ratios.items():
        med = statistics.median(values)
        print(
            f"{name:<40} {med:.4f}x  (+{(med - 1) * 100:.2f}%; rounds "
            + ", ".join(f"{v:.3f}" for v in values)
            + ")"
        )
    for label, kw in (
        ("default: every=20", {"every": 20}),
        ("full: every=1, full=True", {"every": 1, "full": True}),
    ):
        inside, per_step = time_in_hooks(model, opt, step, 2 * args.block, **kw)
        print(
            f"time inside deadweight's hooks ({label}), timed directly over {2 * args.block} "
            f"steps: {inside * 1e3:.2f} ms per step = {inside / per_step * 100:.3f}% of a step"
        )
    print(
        f"memory: deadweight holds {mem['held'] * 100:.3f}% of params+grads+AdamW state "
        f"({mem['training_bytes'] / 2**20:.0f} MiB) between steps, at most "
        f"{mem['peak'] * 100:.2f}% during a watched step"
    )
    for run in _WANDB_RUN:
        run.finish()


if __name__ == "__main__":
    main()
