"""What `deadweight.check` costs next to one plain forward+backward of the same batch.

The model is transformers' GPT-2 code with a ~20M-parameter random config (no
download): healthy (no findings: the structure pass finds no cancelled parameter,
so nothing is re-run); with 1, 4 or 16 scalars that ln_f cancels (candidates the
structure pass finds and one grouped re-run pair, x10 and x100, confirms); and with
every LayerNorm run as a no-grad "fused" kernel (the check traces and reports the
cuts). The variants
run interleaved (plain, check, plain, check, ...) so machine noise hits both alike;
each figure is the median of the per-pair ratios.

A second, *dispatch-bound* case follows: the same GPT-2 code at 12 layers of width
64, batch 2x32, one thread. Its kernels are tiny, so a step costs what Python and
torch's dispatch cost per op, as on a GPU: there the tracer's cost per intercepted
call is what `check` adds. It also prints the aten calls one check adds beyond a plain
forward+backward, which on a GPU is dispatch time paid per call. `--case` runs one of
the two only; `--layers` sets the dispatch-bound model's depth.

    python benchmarks/check_overhead.py [--pairs 15] [--threads 2] [--case 20m|dispatch|all]
        [--layers 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import deadweight

transformers.logging.set_verbosity_error()  # config chatter, not results


def build(
    batch: int, seq: int, width: int = 512, layers: int = 6, heads: int = 8
) -> tuple[torch.nn.Module, torch.Tensor]:
    config = GPT2Config(
        vocab_size=8192,
        n_positions=seq,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, ids


def fuse_layernorms(model: torch.nn.Module) -> int:
    """Run every LayerNorm under no_grad, as a kernel without backward would."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    for norm in norms:
        norm.forward = torch.no_grad()(norm.forward)  # type: ignore[method-assign]
    return len(norms)


class ScaledNorm(torch.nn.Module):
    """k shape-[1] scalars multiplying the hidden state right before ln_f: the second
    incident k times over. ln_f divides every one of them out."""

    def __init__(self, norm: torch.nn.Module, k: int) -> None:
        super().__init__()
        self.norm = norm
        self.scalars = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(1)) for _ in range(k)])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for s in self.scalars:
            h = h * s
        return self.norm(h)


def add_cancelled_scalars(model: torch.nn.Module, k: int) -> None:
    model.transformer.ln_f = ScaledNorm(model.transformer.ln_f, k)  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--case", choices=("20m", "dispatch", "all"), default="all")
    parser.add_argument(
        "--layers",
        type=int,
        default=12,
        help="depth of the dispatch-bound model (the structure pass's per-call cost "
        "must not grow with it)",
    )
    args = parser.parse_args()
    if args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")

    if args.case in ("20m", "all"):
        torch.set_num_threads(args.threads)
        model, ids = build(args.batch, args.seq)
        variants: dict[str, tuple[torch.nn.Module, str | None]] = {"healthy": (model, None)}
        for k in (1, 4, 16):
            m, _ = build(args.batch, args.seq)
            add_cancelled_scalars(m, k)
            variants[f"+{k} cancelled scalar{'s' if k > 1 else ''}"] = (m, "DW104")
        broken, _ = build(args.batch, args.seq)
        n_fused = fuse_layernorms(broken)
        variants[f"{n_fused} LayerNorms fused"] = (broken, "DW102")
        compare(variants, ids, args.pairs, args.threads, f"batch {args.batch}x{args.seq}")

    if args.case in ("dispatch", "all"):
        # Dispatch-bound: 12 layers of width 64 (or --layers), batch 2x32, one thread.
        torch.set_num_threads(1)
        model, ids = build(2, 32, width=64, layers=args.layers, heads=4)
        print()
        compare({"healthy": (model, None)}, ids, args.pairs, 1, "batch 2x32, dispatch-bound")
        tensors, added = added_calls(args.layers)
        top = ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in added.most_common(4))
        print(
            f"aten calls one check adds beyond a plain forward+backward ({tensors} parameter "
            f"tensors): {sum(added.values())} ({top})"
        )


def added_calls(layers: int) -> tuple[int, Counter[str]]:
    """The parameter tensors of a GPT-2 of `layers` blocks (width 64), and the aten
    calls one check adds beyond a plain step: tests/check_calls.py's count, the one
    tests/checking/test_check_cost.py bounds."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.check_calls import added_by_check

    return added_by_check(layers)


def compare(
    variants: dict[str, tuple[torch.nn.Module, str | None]],
    ids: torch.Tensor,
    pairs: int,
    threads: int,
    setting: str,
) -> None:
    """Interleaved pairs (plain, check) per variant; prints the medians of the ratios."""
    calls = {name: 0 for name in variants}

    def plain(m: torch.nn.Module) -> None:
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()

    def check(name: str) -> None:
        m, expected = variants[name]

        def loss_fn() -> torch.Tensor:
            calls[name] += 1
            return m(input_ids=ids, labels=ids).loss

        report = deadweight.check(m, loss_fn)
        found = {f.code for f in report.findings if f.severity.rank >= 1}
        assert found == ({expected} if expected else set()) | (
            {"DW101"} if expected == "DW102" else set()
        ), report

    def timed(fn, *a) -> float:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        fn(*a)
        return time.perf_counter() - start

    for name, (m, _) in variants.items():  # warm-up: allocator, thread pool, first-call caches
        for _ in range(2):
            timed(plain, m)
            timed(check, name)
    forwards = {name: calls[name] / 2 for name in variants}

    ratios: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(pairs):
        for name, (m, _) in variants.items():
            a = timed(plain, m)
            b = timed(check, name)
            ratios[name].append(b / a)

    model = next(iter(variants.values()))[0]
    n_params = sum(p.numel() for p in model.parameters())
    layers = len(model.transformer.h)  # type: ignore[union-attr,arg-type]
    print(
        f"model: transformers GPT2LMHeadModel, {n_params / 1e6:.1f}M parameters, "
        f"{layers} layers of width {model.config.n_embd}, {setting}, {threads} thread(s), "
        f"torch {torch.__version__}"
    )
    print(
        f"check / plain forward+backward of the same model, median of {pairs} "
        "interleaved pairs (loss_fn calls per check in brackets):"
    )
    for name, values in ratios.items():
        values.sort()
        q1, q3 = values[len(values) // 4], values[(3 * len(values)) // 4]
        print(
            f"  {name:<26} [{forwards[name]:.0f} calls] {statistics.median(values):.2f}x "
            f"(interquartile {q1:.2f}x-{q3:.2f}x)"
        )


if __name__ == "__main__":
    main()
