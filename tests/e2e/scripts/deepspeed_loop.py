"""One DeepSpeed run on CPU (a single process, its own gloo group), watched through
the engine and optimizer `deepspeed.initialize` returns. Prints one JSON line."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in {
    "MASTER_ADDR": "127.0.0.1",
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
}.items():
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import deadweight  # noqa: E402


def main(stage: int, cut: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    if cut:  # the first layer's output is detached: it never gets a gradient
        model[0].register_forward_hook(lambda _m, _i, out: out.detach())
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, opt, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    try:
        deadweight.check(engine, lambda: engine(torch.randn(8, 4)).pow(2).mean(), opt)
        refused = ""
    except deadweight.InputError as exc:
        refused = str(exc)
    with deadweight.watch(engine, opt, every=10) as w:
        for _ in range(60):
            loss = engine(torch.randn(8, 4)).pow(2).mean()
            engine.backward(loss)
            engine.step()
    report = w.report()
    return {
        "optimizer": type(opt).__name__,
        "steps": report.subject["steps"],
        "params": sorted(w.stats.params),
        "findings": [{"code": f.code, "params": list(f.params)} for f in report.findings],
        "check_refused": refused,
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(int(sys.argv[1]), sys.argv[2] == "cut")))
