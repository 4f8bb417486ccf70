"""What recording the loss costs a training step: `Watch.log_loss(loss)` in the loop, and
the `Tensor.backward` wrapper through which `deadweight run` sees it.

A deliberately small step (an MLP, 2 × 256 wide, batch 32, AdamW, one CPU thread: about a
millisecond) so a few microseconds per step would show. One model trains throughout;
blocks of `--block` steps take turns, round after round: watch without the loss, then
with `log_loss`; `watch_all(loss=False)`, then `watch_all()` with the wrapper. Each
figure is the median over rounds of (block with) / (adjacent block without). Beside
the ratios, the time spent inside deadweight's loss code is timed directly (the
per-step call, and the read-back at watched steps), which on a shared machine is the
sharper figure.

    python benchmarks/loss_logging_cost.py [--rounds 10] [--block 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import deadweight
from deadweight.watching.global_watch import GlobalWatch, watch_all

EVERY = 20  # watch's default cadence


def build() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(32, 256), torch.randn(32, 256)

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return model, opt, forward_backward


class Timed:
    """Wall time spent inside some methods of a watch and its parts (wrapped on the
    instances)."""

    def __init__(self, methods: list[tuple[Any, str]]) -> None:
        self.ns = 0
        for owner, name in methods:
            original = getattr(owner, name)

            def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                start = time.perf_counter_ns()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.ns += time.perf_counter_ns() - start

            setattr(owner, name, timed)


def block(opt: torch.optim.Optimizer, fb: Callable[[], torch.Tensor], steps: int,
          log: Callable[[torch.Tensor], None] | None) -> float:  # fmt: skip
    start = time.perf_counter()
    for _ in range(steps):
        loss = fb()
        opt.step()
        if log is not None:
            log(loss)
    return time.perf_counter() - start


def wrapper_call_cost(pairs: int = 5, calls: int = 4000) -> float:
    """Microseconds the wrapper itself adds to a `backward()` call (its Python frame and
    checks, without the recording timed above): a trivial backward, with the wrapper
    and without, interleaved; the median of the paired differences."""
    x = torch.ones((), requires_grad=True)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            (x * 1.0).backward()
        return (time.perf_counter() - start) / calls

    diffs = []
    for _ in range(pairs):
        bare = run()
        with watch_all(every=EVERY) as g:
            g._losses.off = True  # the wrapper's frame and checks only
            wrapped = run()
        diffs.append(wrapped - bare)
    return max(0.0, statistics.median(diffs)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, opt, fb = build()
    block(opt, fb, 50, None)  # warm up
    explicit: list[float] = []
    wrapper: list[float] = []
    plain_s: list[float] = []
    inside_log_ns = inside_wrapper_ns = 0
    logged_steps = wrapped_steps = 0
    for _ in range(args.rounds):
        with deadweight.watch(model, opt, every=EVERY) as w:
            without = block(opt, fb, args.block, None)
        with deadweight.watch(model, opt, every=EVERY) as w:
            timer = Timed([(w, "log_loss"), (w._losses, "flush")])
            with_loss = block(opt, fb, args.block, w.log_loss)
            inside_log_ns += timer.ns
            logged_steps += args.block
        explicit.append(with_loss / without)
        plain_s.append(without / args.block)
        with watch_all(every=EVERY, loss=False):
            without = block(opt, fb, args.block, None)
        with watch_all(every=EVERY) as g:
            assert isinstance(g, GlobalWatch)
            timer = Timed([(g._losses, "record"), (g._losses, "flush")])
            with_loss = block(opt, fb, args.block, None)
            inside_wrapper_ns += timer.ns
            wrapped_steps += args.block
            assert len(g.stats.loss_values) + len(g._losses) == args.block
        wrapper.append(with_loss / without)
    wrapper_frame_us = wrapper_call_cost()
    step_ms = statistics.median(plain_s) * 1e3
    per_log_us = inside_log_ns / logged_steps / 1e3
    per_wrap_us = inside_wrapper_ns / wrapped_steps / 1e3 + wrapper_frame_us
    print(f"MLP step (watched, no loss): median {step_ms:.2f} ms; {args.rounds} rounds of "
          f"{args.block} steps, {args.threads} threads")  # fmt: skip
    print(f"log_loss:        median ratio {statistics.median(explicit):.3f}x "
          f"(range {min(explicit):.3f}-{max(explicit):.3f}); inside deadweight "
          f"{per_log_us:.1f} us/step = {per_log_us / step_ms / 10:.2f}% of a step")  # fmt: skip
    print(f"backward wrapper: median ratio {statistics.median(wrapper):.3f}x "
          f"(range {min(wrapper):.3f}-{max(wrapper):.3f}); inside deadweight "
          f"{per_wrap_us:.1f} us/step = {per_wrap_us / step_ms / 10:.2f}% of a step")  # fmt: skip


if __name__ == "__main__":
    main()
