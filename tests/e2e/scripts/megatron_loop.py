"""megatron-core runs on CPU (tests/e2e/megatron_cpu.py), one after the other in this
process, each printing one `RESULT {json}` line.

    megatron_loop.py SPEC [...]

SPEC:
- `check:BUG[:GROUPS]`: `deadweight.check` on a GPTModel (BUG: healthy | scalar) with
  megatron-core's own parameter groups under a torch AdamW, whose weight decay
  megatron-core's scheduler sets (wd × wd_mult). GROUPS: megatron (its standard rule),
  roles | tagged (docs/megatron.md's overrides, `megatron_cpu.role_overrides` and
  `tagged_overrides`).
- `ddp-PRECISION:BUG:STEPS`: the same model under megatron-core's DDP and its own
  optimizer (fp32: `FP32Optimizer`; bf16: a bf16 model under `Float16Module`, and
  `Float16OptimizerWithFloat16Params` stepping fp32 main copies; dist: the same model
  under the distributed optimizer, whose main copies are flat shards), checked once,
  then watched for STEPS steps (none: the check only).
- `pin-PRECISION`: the incident's fix under megatron-core's DDP and its optimizer:
  `deadweight.pin` on the cancelled scalar, 30 steps.
- `plain:scalar:STEPS`, `plain-bf16:scalar:STEPS`: the `check` run, and the bf16 run
  under megatron-core's DDP and optimizer, with no deadweight at all, for `deadweight run`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[3]))  # the repository, for tests.e2e

import torch
from tests.e2e import megatron_cpu as mc

mc.start()


def _findings(report: Any) -> list[dict[str, Any]]:
    return [
        {"code": f.code, "params": list(f.params), "evidence": f.evidence, "message": f.message}
        for f in report.findings
    ]


# A norm weight, a bias and a matrix: whose decay each grouping decides.
_SAMPLES = (
    "decoder.final_layernorm.weight",
    "decoder.layers.0.mlp.linear_fc1.bias",
    "decoder.layers.0.mlp.linear_fc1.weight",
)


def check(bug: str, groups: str = "megatron") -> dict[str, Any]:
    import deadweight

    model = mc.gpt(scalar=bug == "scalar")
    overrides = None
    if groups == "roles":
        overrides = mc.role_overrides(model)
    elif groups == "tagged":
        for layer in model.decoder.layers[:-1]:  # the live scalars may stay undecayed
            layer.layer_scalar._no_weight_decay = True
        overrides = mc.tagged_overrides()
    optimizer, scheduler = mc.megatron_adamw(model, mc.optimizer_config(), overrides)
    scheduler.step(1)
    report = deadweight.check(model, lambda: mc.loss_of(model, 0), optimizer)
    return {
        "findings": _findings(report),
        "wd_mult": {
            n: g["wd_mult"]
            for g in optimizer.param_groups
            for p in g["params"]
            for n, q in model.named_parameters()
            if p is q and (n.endswith("layer_scalar") or n in _SAMPLES)
        },
        "weight_decay": sorted({g["weight_decay"] for g in optimizer.param_groups}),
    }


def _step(wrapped: Any, optimizer: Any, scheduler: Any, step: int) -> torch.Tensor:
    wrapped.zero_grad_buffer()
    optimizer.zero_grad()
    loss = mc.loss_of(wrapped, step)
    loss.backward()
    wrapped.finish_grad_sync()
    optimizer.step()
    scheduler.step(1)
    return loss


def ddp(precision: str, bug: str, steps: int) -> dict[str, Any]:
    import deadweight

    bf16 = precision in ("bf16", "dist")
    distributed = precision == "dist"
    model = mc.gpt(scalar=bug == "scalar", bf16=bf16)
    wrapped = mc.ddp(model, distributed_optimizer=distributed)
    config = mc.optimizer_config(bf16=bf16, distributed=distributed)
    optimizer, scheduler = mc.megatron_optimizer(wrapped, config)
    scheduler.step(1)
    inner = wrapped.module.module if bf16 else wrapped.module
    params = dict(inner.named_parameters())
    # One training step first: its gradients sit in the buffers when check runs.
    _step(wrapped, optimizer, scheduler, 0)
    wrapped.zero_grad_buffer()
    mc.loss_of(wrapped, 1).backward()
    buffers = [b.grad_data.clone() for b in wrapped.buffers]
    grads_none = all(p.grad is None for p in params.values())
    checked = deadweight.check(wrapped, lambda: mc.loss_of(wrapped, 1), optimizer)
    untouched = all(
        torch.equal(b.grad_data, c) for b, c in zip(wrapped.buffers, buffers, strict=True)
    )
    wrapped.finish_grad_sync()
    optimizer.step()
    scheduler.step(1)
    main = {
        n: p.main_param for n, p in params.items() if getattr(p, "main_param", None) is not None
    }
    start = {n: m.detach().clone() for n, m in main.items()}
    model_start = {n: p.detach().clone() for n, p in params.items()}
    if steps == 0:  # the check only
        return {"check": _findings(checked), "grads_none_before_check": grads_none,
                "buffers_untouched_by_check": untouched}  # fmt: skip
    watch = deadweight.watch(wrapped, optimizer)
    for step in range(2, steps + 2):
        watch.log_loss(_step(wrapped, optimizer, scheduler, step))
    report = watch.report()
    watch.close()
    tracks = watch.stats.params
    return {
        "check": _findings(checked),
        "grads_none_before_check": grads_none,
        "buffers_untouched_by_check": untouched,
        "findings": _findings(report),
        "errors": [e.get("message") for e in watch.stats.errors],
        "names": sorted(params),
        "watched": sorted(tracks),
        "main_dtypes": sorted({str(m.dtype) for m in main.values()}),
        "main_count": len(main),
        # movement: what the watch logged for each main copy against its real change
        "moved": {
            n: _moved(tracks.get(n), main[n], start[n], params[n], model_start[n])
            for n in main
            if n.endswith("layer_scalar")
        },
        "steps": watch.stats.steps,
    }


def _moved(
    track: Any,
    main: torch.Tensor,
    start: torch.Tensor,
    param: torch.Tensor,
    param_start: torch.Tensor,
) -> list[float | None]:
    """The norm the watch logged last, the main copy's real norm, how far the main copy
    moved and how far the model's parameter moved."""
    return [
        track.series.param_norm[-1] if track is not None else None,
        float(main.norm()),
        float((main - start).abs().max()),
        float((param.float() - param_start.float()).abs().max()),
    ]


def pin(precision: str) -> dict[str, Any]:
    import deadweight

    bf16 = precision == "bf16"
    model = mc.gpt(scalar=True, bf16=bf16)
    inner = model.module if bf16 else model
    wrapped = mc.ddp(model)
    optimizer, scheduler = mc.megatron_optimizer(wrapped, mc.optimizer_config(bf16=bf16))
    scheduler.step(1)
    # After the DDP and its hooks, with Megatron's optimizer: as a fix arrives mid-run.
    handle = deadweight.pin(wrapped, mc.SCALAR, optimizer=optimizer)
    decayed = "decoder.layers.0.mlp.linear_fc1.weight"
    try:  # its main copy sits in the decayed group: refused
        deadweight.pin(wrapped, decayed, optimizer=optimizer)
        refused = ""
    except deadweight.InputError as exc:
        refused = str(exc)
    scalar = dict(inner.named_parameters())[mc.SCALAR]
    before = scalar.detach().clone()
    main_before = scalar.main_param.detach().clone() if bf16 else None
    others = {n: p.detach().clone() for n, p in inner.named_parameters() if n != mc.SCALAR}
    for step in range(30):
        _step(wrapped, optimizer, scheduler, step)
    moved_others = sum(
        not torch.equal(p, others[n]) for n, p in inner.named_parameters() if n != mc.SCALAR
    )
    return {
        "bit_exact": torch.equal(scalar.detach(), before),
        "main_bit_exact": None
        if main_before is None
        else torch.equal(scalar.main_param, main_before),
        "moved": handle.moved(),
        "others_moved": moved_others,
        "others": len(others),
        "refused": refused,
    }


def plain(steps: int) -> dict[str, Any]:
    model = mc.gpt(scalar=True)
    optimizer, scheduler = mc.megatron_adamw(model, mc.optimizer_config())
    for step in range(steps):
        scheduler.step(1)
        optimizer.zero_grad()
        mc.loss_of(model, step).backward()
        optimizer.step()
    return {"scalar": float(dict(model.named_parameters())[mc.SCALAR])}


def plain_ddp(steps: int) -> dict[str, Any]:
    """Megatron's own bf16 path, no deadweight: its DDP and `get_megatron_optimizer`."""
    wrapped = mc.ddp(mc.gpt(scalar=True, bf16=True))
    optimizer, scheduler = mc.megatron_optimizer(wrapped, mc.optimizer_config(bf16=True))
    scheduler.step(1)
    for step in range(steps):
        _step(wrapped, optimizer, scheduler, step)
    return {"scalar": float(dict(wrapped.module.module.named_parameters())[mc.SCALAR])}


def run(spec: str) -> dict[str, Any]:
    kind, *rest = spec.split(":")
    if kind == "check":
        return check(*rest)
    if kind.startswith("ddp-"):
        return ddp(kind[4:], rest[0], int(rest[1]))
    if kind.startswith("pin-"):
        return pin(kind[4:])
    if kind == "plain":
        return plain(int(rest[1]))
    if kind == "plain-bf16":
        return plain_ddp(int(rest[1]))
    raise SystemExit(f"unknown spec {spec!r}")


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        try:
            result = run(spec)
        except Exception as exc:  # the next specs still run; the test names this one
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print("RESULT " + json.dumps({"spec": spec, **result}, default=str), flush=True)
