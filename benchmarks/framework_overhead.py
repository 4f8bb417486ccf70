"""What `deadweight.watch` costs per step inside the frameworks of tests/e2e.

Each framework trains transformers' Llama code at a small random config (no
download) on random tokens: a plain PyTorch loop, an Accelerate loop (through the
AcceleratedOptimizer it hands back), a Lightning Fabric loop (through its
_FabricOptimizer), DeepSpeed's engine at ZeRO stages 2 and 3 (through the
optimizer `deepspeed.initialize` returns; one CPU process with a gloo group), and
megatron-core's GPTModel of the same size under its DDP and its own optimizer, fp32
and bf16 (fp32 main copies). One model and optimizer train throughout; unwatched and watched
blocks of `--block` steps take turns (A B A B ...), and each figure is the median
over rounds of watched block time / the unwatched block just before it. The first
step of each block is left out (attaching the watch measures it in full).

nanoGPT's unmodified train.py is timed as its user would: the script's own
per-iteration times ("time X ms"), plain `python train.py` against
`deadweight run -- python train.py`, runs alternating; the figure is the median of
the per-run ratios of median iteration times.

    python benchmarks/framework_overhead.py [--rounds 8] [--block 20] [--nanogpt-runs 3]
        [--only megatron]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

import deadweight

transformers.logging.set_verbosity_error()
# DeepSpeed's ZeRO-3 calls a deprecated torch collective on every step.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
ROOT = Path(__file__).parents[1]
SEQ, BATCH, VOCAB = 64, 8, 2048


def llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(n)]


Step = Callable[[torch.Tensor], None]


def loop(prepare: Callable[[Any, Any], tuple[Any, Any]], backward: Callable[[Any], None]) -> Any:
    """A model, its optimizer as the framework hands it back, and one training step."""
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    model, opt = prepare(model, opt)

    def step(ids: torch.Tensor) -> None:
        backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def plain() -> tuple[Any, Any, Step]:
    return loop(lambda m, o: (m, o), lambda loss: loss.backward())


def accelerate_loop() -> tuple[Any, Any, Step]:
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    return loop(accelerator.prepare, accelerator.backward)


def fabric_loop() -> tuple[Any, Any, Step]:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    return loop(fabric.setup, fabric.backward)


def deepspeed_loop(stage: int) -> tuple[Any, Any, Step]:
    """DeepSpeed's engine at a ZeRO stage, one process with its own gloo group, over the
    usual two decay groups (so DeepSpeed steps its torch optimizer twice per step)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517"),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):  # fmt: skip
        os.environ.setdefault(key, value)
    import deepspeed

    model = llama()
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)

    def step(ids: torch.Tensor) -> None:
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    return engine, opt, step


def megatron_loop(bf16: bool) -> tuple[Any, Any, Step]:
    """megatron-core's GPTModel (4 layers, width 256) under its DDP and the optimizer
    `get_megatron_optimizer` builds (bf16: fp32 main copies), on CPU with the pieces
    tests/e2e/megatron_cpu.py replaces; one process with a gloo group."""
    sys.path.insert(0, str(ROOT))
    from tests.e2e import megatron_cpu as mc

    # The same size as the Llama above (the module's sizes are read when a model is built).
    mc.HIDDEN, mc.LAYERS, mc.HEADS, mc.VOCAB, mc.SEQ = 256, 4, 8, VOCAB, SEQ
    mc.start()
    model = mc.ddp(mc.gpt(bf16=bf16))
    config = mc.optimizer_config(bf16=bf16)
    opt, scheduler = mc.megatron_optimizer(model, config)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)

    def step(ids: torch.Tensor) -> None:
        model.zero_grad_buffer()
        opt.zero_grad()
        model(ids, positions, mask, labels=ids).float().mean().backward()
        model.finish_grad_sync()
        opt.step()
        scheduler.step(1)

    return model, opt, step


def block_ratio(build: Callable[[], Any], rounds: int, block: int) -> tuple[float, list[float]]:
    model, opt, step = build()
    data = batches(block)
    for ids in data[:3]:  # warm-up
        step(ids)

    def timed(watched: bool) -> float:
        w = deadweight.watch(model, opt) if watched else None
        try:
            step(data[0])  # not timed: the first watched step measures in full
            start = time.perf_counter()
            for ids in data[1:]:
                step(ids)
            return time.perf_counter() - start
        finally:
            if w is not None:
                w.close()

    ratios = []
    for _ in range(rounds):
        base = timed(False)
        ratios.append(timed(True) / base)
    return statistics.median(ratios), ratios


# -- nanoGPT ----------------------------------------------------------------------------

NANOGPT_ARGS = [
    "--dataset=tiny", "--device=cpu", "--dtype=float32", "--compile=False",
    "--n_layer=4", "--n_head=4", "--n_embd=128", "--block_size=64", "--batch_size=8",
    "--gradient_accumulation_steps=1", "--max_iters=120", "--eval_interval=100000",
    "--eval_iters=1", "--log_interval=1", "--warmup_iters=0",
    "--always_save_checkpoint=False",
]  # fmt: skip
ITER = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", re.M)


def nanogpt_dir(tmp: Path) -> Path:
    work = tmp / "nanogpt"
    shutil.copytree(ROOT / "tests" / "e2e" / "nanogpt", work)
    data = work / "data" / "tiny"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, 64, 1 << 16, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": 64}, fh)
    return work


# The DeepSpeed loops set these for their own process group: nanoGPT would take
# them for a torchrun launch.
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    return {**env, "PYTHONPATH": str(ROOT / "src")}


def nanogpt_iter_ms(work: Path, watched: bool) -> float:
    cmd = [sys.executable, "train.py", *NANOGPT_ARGS]
    if watched:
        log = work / "run.jsonl"
        log.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "deadweight", "run", "--fail-on=never", "--isolated",
               "--log", str(log), "--", *cmd]  # fmt: skip
    env = _child_env()
    out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=True)
    times = [float(ms) for it, ms in ITER.findall(out.stdout) if int(it) >= 20]
    return statistics.median(times)


def nanogpt_first_iteration(work: Path, check: bool) -> tuple[float, float]:
    """`deadweight run` with or without its step-0 check: iteration 0's time (the
    check runs inside its optimizer step) and the median of iterations 20 on."""
    log = work / "run.jsonl"
    log.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "deadweight", "run", "--fail-on=never", "--isolated",
           "--log", str(log), *([] if check else ["--no-check"]), "--",
           sys.executable, "train.py", *NANOGPT_ARGS]  # fmt: skip
    env = _child_env()
    out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=True)
    times = {int(it): float(ms) for it, ms in ITER.findall(out.stdout)}
    return times[0], statistics.median(ms for it, ms in times.items() if it >= 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--nanogpt-runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed loops")
    parser.add_argument("--no-megatron", action="store_true", help="skip the megatron-core loops")
    parser.add_argument("--first-step-runs", type=int, default=5)
    parser.add_argument("--only", help="only the loops whose name contains this (e.g. megatron)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, blocks of {args.block} steps")
    print("framework          watched/unwatched (median)   per round")
    frameworks: list[tuple[str, Callable[[], Any]]] = [
        ("plain PyTorch", plain),
        ("Accelerate", accelerate_loop),
        ("Lightning Fabric", fabric_loop),
    ]
    if not args.no_deepspeed:
        frameworks += [
            ("DeepSpeed ZeRO-2", lambda: deepspeed_loop(2)),
            ("DeepSpeed ZeRO-3", lambda: deepspeed_loop(3)),
        ]
    if not args.no_megatron and importlib.util.find_spec("megatron.core") is not None:
        frameworks += [
            ("megatron-core fp32", lambda: megatron_loop(bf16=False)),
            ("megatron-core bf16", lambda: megatron_loop(bf16=True)),
        ]
    if args.only:
        frameworks = [(n, b) for n, b in frameworks if args.only.lower() in n.lower()]
    for name, build in frameworks if args.rounds > 0 else []:
        med, ratios = block_ratio(build, args.rounds, args.block)
        print(f"{name:18} {med:8.3f}x                    {' '.join(f'{r:.3f}' for r in ratios)}")
    with tempfile.TemporaryDirectory() as tmp:
        work = nanogpt_dir(Path(tmp))
        first_step(work, args.first_step_runs)
        if args.nanogpt_runs < 1:
            return
        ratios = []
        for _ in range(args.nanogpt_runs):
            base = nanogpt_iter_ms(work, watched=False)
            ratios.append(nanogpt_iter_ms(work, watched=True) / base)
        print(
            f"{'nanoGPT train.py':18} {statistics.median(ratios):8.3f}x (deadweight run)   "
            + " ".join(f"{r:.3f}" for r in ratios)
        )


def first_step(work: Path, runs: int) -> None:
    """The step-0 check's cost: iteration 0 with it / without it (`--no-check`), runs
    alternating, and its extra time in plain iterations."""
    if runs < 1:
        return
    ratios, extra = [], []
    for _ in range(runs):
        plain0, plain_iter = nanogpt_first_iteration(work, check=False)
        checked0, _ = nanogpt_first_iteration(work, check=True)
        ratios.append(checked0 / plain0)
        extra.append((checked0 - plain0) / plain_iter)
    print(
        f"{'nanoGPT step 0':18} {statistics.median(ratios):8.3f}x (iteration 0, check / "
        f"--no-check)   {' '.join(f'{r:.2f}' for r in ratios)}; extra = "
        f"{statistics.median(extra):.1f} plain iterations"
    )


if __name__ == "__main__":
    main()
