"""What `deadweight.check` costs next to one plain forward+backward of the same batch.

The model is transformers' GPT-2 code with a ~20M-parameter random config (no
download). The two variants run interleaved (plain, check, plain, check, ...) so
machine noise hits both alike; the figure is the median of the per-pair ratios.

    python benchmarks/check_overhead.py [--pairs 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import deadweight


def build(batch: int, seq: int) -> tuple[torch.nn.Module, torch.Tensor]:
    config = GPT2Config(
        vocab_size=8192,
        n_positions=seq,
        n_embd=512,
        n_layer=6,
        n_head=8,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, ids = build(args.batch, args.seq)
    n_params = sum(p.numel() for p in model.parameters())

    def loss_fn() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn().backward()

    def check() -> None:
        report = deadweight.check(model, loss_fn)
        assert not report.findings, report  # a healthy model: the check must be silent

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    for _ in range(2):  # warm-up: allocator, thread pool, first-call caches
        timed(plain)
        timed(check)

    ratios = []
    for _ in range(args.pairs):
        a = timed(plain)
        b = timed(check)
        ratios.append(b / a)

    ratios.sort()
    q1, q3 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
    print(
        f"model: transformers GPT2LMHeadModel, {n_params / 1e6:.1f}M parameters, "
        f"batch {args.batch}x{args.seq}, {args.threads} threads, torch {torch.__version__}"
    )
    print(
        f"check / plain forward+backward, median of {args.pairs} interleaved pairs: "
        f"{statistics.median(ratios):.2f}x (interquartile {q1:.2f}x-{q3:.2f}x)"
    )


if __name__ == "__main__":
    main()
