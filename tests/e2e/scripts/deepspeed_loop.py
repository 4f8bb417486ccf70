"""DeepSpeed runs on CPU (one process, its own gloo group) of a tiny Llama with the
usual decay groups, 60 steps each through `deepspeed.initialize`'s engine, one after
the other in this process (each from a fresh model and engine).

    deepspeed_loop.py STAGE:BUG:PRECISION:MODE [...]

BUG: healthy | cut (layer 0's output detached) | scalar (a scalar before the final
norm) | inf (layer 1's MLP gets inf gradients on every step). PRECISION: fp32 | bf16,
with `-offload` for ZeRO-Offload (the optimizer on the CPU, stepping pinned copies).
MODE: watch (the library API; prints one `RESULT {json}` line) | unmapped (the same,
with DeepSpeed's layout unknown to deadweight, as a future DeepSpeed's might be) |
plain (no deadweight at all, for `deadweight run`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {
    "MASTER_ADDR": "127.0.0.1",
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
}.items():
    os.environ.setdefault(key, value)
sys.path.insert(0, str(Path(__file__).parents[3]))  # the repository, for tests.e2e.seeded

import deepspeed  # noqa: E402
import torch  # noqa: E402
from tests.e2e import seeded  # noqa: E402

STEPS = 60


def build(bug: str) -> tuple[Any, str | None]:
    model = seeded.tiny_llama()
    scalar = None
    if bug == "cut":
        seeded.detach_first_layer(model)
    elif bug == "scalar":
        scalar = seeded.scalar_before_final_norm(model)
    elif bug == "inf":

        def poisoned(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
            output.register_hook(lambda g: g * float("inf"))

        model.model.layers[1].mlp.register_forward_hook(poisoned)
    return model, scalar


def main(stage: int, bug: str, precision: str, mode: str) -> dict[str, Any] | None:
    model, _ = build(bug)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    if precision.endswith("-offload"):
        precision = precision.removesuffix("-offload")
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False  # the torch AdamW, not a built op
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    data = seeded.batches(STEPS + 1)
    if mode == "plain":
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=seeded.decay_groups(model), config=config
        )
        for ids in data[:STEPS]:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        return None

    import deadweight

    if mode == "unmapped":
        from deadweight.watching import deepspeed_partitions

        deepspeed_partitions._LAYOUTS.clear()

    # The README's order: check the model before DeepSpeed wraps it, with the
    # optimizer DeepSpeed's config will build (AdamW over the same groups).
    first = data[-1]
    planned = torch.optim.AdamW(seeded.decay_groups(model), lr=1e-3)
    check = deadweight.check(model, lambda: model(input_ids=first, labels=first).loss, planned)
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=seeded.decay_groups(model), config=config
    )
    try:
        deadweight.check(engine, lambda: engine(input_ids=first, labels=first).loss, opt)
        refused = ""
    except deadweight.InputError as exc:
        refused = str(exc)
    with deadweight.watch(engine, opt, every=10) as w:
        for ids in data[:STEPS]:
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
    report = w.report()

    def findings(r: Any) -> list[dict[str, Any]]:
        return [
            {"code": f.code, "severity": f.severity.value, "params": sorted(f.params)}
            for f in r.findings
        ]

    return {
        "optimizer": type(opt).__name__,
        "steps": report.subject["steps"],
        "params": sorted(w.stats.params),
        "check": findings(check),
        "findings": findings(report),
        "errors": report.subject["detector_errors"],
        "check_refused": refused,
        "step_restored": "step" not in vars(opt),
    }


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        stage, bug, precision, mode = spec.split(":")
        result = main(int(stage), bug, precision, mode)
        if result is not None:
            print("RESULT " + json.dumps({"spec": spec, **result}), flush=True)
