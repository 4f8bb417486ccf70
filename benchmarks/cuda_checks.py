"""The checks that need a CUDA GPU, in one prepared run (benchmarks/README.md has the
figures, with the device named).

    python benchmarks/cuda_checks.py [--part half,megatron,cost] [--small]

- `half`: the second incident in transformers' Llama code (width 256, 4 layers, a
  shape-[1] scalar right before `model.norm`, decay chosen by shape) checked on the GPU
  in fp32, bf16 autocast, bf16 and fp16 parameters; which findings the scalar gets, and
  how many warnings the healthy twin gets (it must get none).
- `megatron`: megatron-core's own bf16 path on the GPU (its DDP,
  `get_megatron_optimizer` with fp32 main copies, no CPU replacements): the step-0
  style `check` and a watched run; which findings the scalar gets.
- `cost`: what watch and check cost next to plain steps, timed with CUDA events,
  variants interleaved (A B A B ...), medians of paired ratios: GPT-2 124M (16x512
  tokens) and a ~1.1B Llama (8x1024), bf16 autocast, fused AdamW.

`--small` shrinks every model so the script can be dry-run on a CPU (no figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.e2e.megatron_cpu

import deadweight
from deadweight import Severity

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCALAR = "model.layer_scalar"


def _print(part: str, **fields: Any) -> None:
    print("RESULT " + json.dumps({"part": part, **fields}, default=str), flush=True)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# -- half: the incident in Llama code on the GPU, four dtypes -----------------------------


def _llama(scalar: bool, setting: str, small: bool) -> tuple[nn.Module, Any]:
    import transformers

    transformers.logging.set_verbosity_error()
    width = 64 if small else 256
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=2 if small else 4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    if scalar:
        inner = model.model
        inner.layer_scalar = nn.Parameter(torch.ones(1))
        norm = inner.norm
        forward = type(norm).forward
        norm.forward = lambda x: forward(norm, x * inner.layer_scalar)  # type: ignore[method-assign]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(setting)
    model.to(DEVICE, dtype) if dtype is not None else model.to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (8, 64), generator=gen).to(DEVICE)

    def loss_fn() -> torch.Tensor:
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=setting == "bf16_autocast"):
            return model(input_ids=ids, labels=ids).loss.float()

    return model, loss_fn


def _shape_rule(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3)


def half(small: bool) -> None:
    for setting in ("fp32", "bf16_autocast", "bf16", "fp16"):
        model, loss_fn = _llama(True, setting, small)
        report = deadweight.check(model, loss_fn, _shape_rule(model))
        on_scalar = sorted({f.code for f in report.findings if SCALAR in f.params})
        entry = next(
            (f.evidence["params"][SCALAR] for f in report.findings if f.code == "DW104"), {}
        )
        twin, twin_loss = _llama(False, setting, small)
        healthy = deadweight.check(twin, twin_loss, _shape_rule(twin))
        warned = [f.code for f in healthy.findings if f.severity is not Severity.INFO]
        _print(
            "half", setting=setting, device=DEVICE, scalar=on_scalar,
            mechanism=[m.get("module") for m in entry.get("mechanism", [])],
            probe=entry.get("probe"), healthy_warnings=warned,
        )  # fmt: skip


# -- megatron: its own bf16 path, unpatched, on the GPU -----------------------------------


def megatron(steps: int) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from tests.e2e import megatron_cpu as mc

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    on_cpu = DEVICE == "cpu"  # a dry run: the e2e tests' CPU replacements
    if on_cpu:
        mc.start()
    else:
        model_parallel_cuda_manual_seed(0)
    for distributed in (False, True):
        model = mc.gpt(scalar=True, bf16=True).to(DEVICE)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed
        )
        with mc.cpu_device() if on_cpu else contextlib.nullcontext():
            wrapped = DistributedDataParallel(model.config, ddp_config, model)
        config = mc.optimizer_config(bf16=True, distributed=distributed)
        with (
            mc.cuda_types_on_cpu() if on_cpu else contextlib.nullcontext(),
            mc.cpu_device() if on_cpu else contextlib.nullcontext(),
        ):
            optimizer = get_megatron_optimizer(config, [wrapped])
        scheduler = mc.scheduler_for(optimizer, config)
        scheduler.step(1)

        def loss_of(step: int, wrapped: Any = wrapped) -> torch.Tensor:
            ids, positions, mask = (t.to(DEVICE) for t in mc.batch(step))
            return wrapped(ids, positions, mask, labels=ids).float().mean()

        def train(
            step: int,
            wrapped: Any = wrapped,
            optimizer: Any = optimizer,
            scheduler: Any = scheduler,
        ) -> Any:
            wrapped.zero_grad_buffer()
            optimizer.zero_grad()
            loss = loss_of(step)
            loss.backward()
            wrapped.finish_grad_sync()
            optimizer.step()
            scheduler.step(1)
            return loss

        train(0)
        wrapped.zero_grad_buffer()
        loss_of(1).backward()
        checked = deadweight.check(wrapped, lambda: loss_of(1), optimizer)
        wrapped.finish_grad_sync()
        optimizer.step()
        scheduler.step(1)
        inner = wrapped.module.module
        scalar = dict(inner.named_parameters())[mc.SCALAR]
        main = getattr(scalar, "main_param", None)
        before = float(main.float().sum()) if main is not None else None
        with deadweight.watch(wrapped, optimizer) as watch:
            for step in range(2, steps + 2):
                watch.log_loss(train(step))
        report = watch.report()
        after = float(main.float().sum()) if main is not None else None

        def on(rep: Any) -> list[str]:
            return sorted({f.code for f in rep.findings if mc.SCALAR in f.params})

        _print(
            "megatron", device=DEVICE, optimizer=type(optimizer).__name__,
            distributed_optimizer=distributed,
            inner=[type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [])],
            check_on_scalar=on(checked),
            check_warnings=sorted({f.code for f in checked.findings
                                   if f.severity is not Severity.INFO}),
            watch_on_scalar=on(report), watch_steps=steps,
            watch_warnings=sorted({f.code for f in report.findings
                                   if f.severity is not Severity.INFO}),
            main_copy=[before, after], errors=[e.get("message") for e in watch.stats.errors],
        )  # fmt: skip


# -- cost: watch and check against plain steps, CUDA events -------------------------------


def _gpt2(small: bool) -> tuple[nn.Module, torch.Tensor]:
    import transformers

    config = (
        transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64)
        if small
        else transformers.GPT2Config()  # 124M
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).to(DEVICE).train()
    batch, seq = (2, 32) if small else (16, 512)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=DEVICE)
    return model, ids


def _tinyllama(small: bool) -> tuple[nn.Module, torch.Tensor]:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512 if small else 32000, hidden_size=64 if small else 2048,
        intermediate_size=128 if small else 5632, num_hidden_layers=2 if small else 22,
        num_attention_heads=4 if small else 32, num_key_value_heads=2 if small else 4,
        max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(DEVICE).train()
    batch, seq = (2, 32) if small else (8, 1024)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=DEVICE)
    return model, ids


def _timer() -> Any:
    """Starts a timer; calling what it returns gives the milliseconds since."""
    if DEVICE == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()

        def elapsed() -> float:
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))

        return elapsed
    t0 = time.perf_counter()
    return lambda: 1000 * (time.perf_counter() - t0)


def _ratios(name: str, build: Any, small: bool, blocks: int, steps: int) -> None:
    model, ids = build(small)
    fused = DEVICE == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()

    def block(variant: str) -> float:
        if variant == "plain":
            timer = _timer()
            for _ in range(steps):
                step()
            return timer() / steps
        with deadweight.watch(model, optimizer, full=variant == "full"):
            timer = _timer()
            for _ in range(steps):
                step()
            return timer() / steps

    for _ in range(3):
        step()
    _sync()
    times: dict[str, list[float]] = {"plain": [], "watch": [], "full": []}
    for _ in range(blocks):
        for variant in times:
            times[variant].append(block(variant))

    def fwd_bwd() -> float:
        optimizer.zero_grad(set_to_none=True)
        timer = _timer()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return timer()

    def checked() -> float:
        timer = _timer()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            deadweight.check(model, lambda: model(input_ids=ids, labels=ids).loss)
        return timer()

    pairs = [(fwd_bwd(), checked()) for _ in range(max(3, blocks // 2))]
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
        fwd_bwd()
        plain_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        checked()
        check_peak = torch.cuda.max_memory_allocated()
    else:
        plain_peak = check_peak = 0

    def median_ratio(variant: str) -> float:
        pairs_ = zip(times[variant], times["plain"], strict=True)
        return statistics.median(v / p for v, p in pairs_)

    _print(
        "cost", model=name, device=DEVICE, tensors=len(list(model.parameters())),
        plain_step_ms=statistics.median(times["plain"]),
        watch=median_ratio("watch"), watch_full=median_ratio("full"),
        check_vs_fwd_bwd=statistics.median(c / f for f, c in pairs),
        fwd_bwd_ms=statistics.median(f for f, _ in pairs),
        peak_gb=[plain_peak / 2**30, check_peak / 2**30], blocks=blocks, steps=steps,
    )  # fmt: skip
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def cost(small: bool) -> None:
    _ratios("gpt2-124M", _gpt2, small, blocks=7, steps=10)
    _ratios("llama-1.1B", _tinyllama, small, blocks=5, steps=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="half,megatron,cost")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--megatron-steps", type=int, default=200)
    args = parser.parse_args()
    for part in args.part.split(","):
        start = time.perf_counter()
        try:
            if part == "half":
                half(args.small)
            elif part == "megatron":
                megatron(20 if args.small else args.megatron_steps)
            elif part == "cost":
                cost(args.small)
            else:
                raise SystemExit(f"unknown part {part!r}")
        except Exception as exc:  # the next parts still run
            import traceback

            traceback.print_exc()
            _print(part, error=f"{type(exc).__name__}: {exc}")
        print(f"# {part}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
