"""watch and `deadweight run` on the second seed in mixed and half precision: fp32
parameters under bf16 autocast, a pure bf16 model, and FSDP2 mixed precision (fp32
sharded parameters, bf16 compute: tests/distributed/test_fsdp2_check_watch.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import deadweight
from deadweight.demos import layer_scalar_drift

LAST = f"blocks.{layer_scalar_drift.LAYERS - 1}.layer_scalar"
STEPS = 400  # the drift under autocast stands out by step ~300


def _train(setting: str, steps: int, pinned: bool = False) -> tuple[deadweight.Report, float]:
    torch.manual_seed(0)
    setup = layer_scalar_drift.make_watchable()
    model = setup.model
    if setting == "bf16":
        model.to(torch.bfloat16)
        setup.x, setup.y = setup.x.bfloat16(), setup.y.bfloat16()
    if pinned:
        deadweight.pin(model, LAST)
    optimizer = torch.optim.AdamW(
        layer_scalar_drift.shape_rule_groups(model),
        lr=layer_scalar_drift.WATCH_LR,
        betas=layer_scalar_drift.BETAS,
        eps=layer_scalar_drift.WATCH_EPS,
    )
    with deadweight.watch(model, optimizer, every=20) as w:
        for _ in range(steps):
            setup.next_batch()
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast"):
                loss = setup.loss()
            loss.backward()
            optimizer.step()
    return w.report(), float(setup.last_scalar.detach())


def test_fp32_parameters_under_bf16_autocast_drift_and_dw302_says_so():
    report, last = _train("autocast", STEPS)
    (drift,) = report.by_code("DW302")
    assert drift.params == (LAST,), str(report)
    assert abs(last - 1.0) > 0.1  # the fp32 copy really drifted
    assert drift.evidence["last_value"] == pytest.approx(last)
    assert not report.by_code("DW304")


def test_pure_bf16_updates_are_lost_and_dw304_says_so_not_dw302():
    report, last = _train("bf16", STEPS)
    assert not report.by_code("DW302"), str(report)
    lost = [
        f for f in report.by_code("DW304") if f.evidence.get("cause", "").startswith("update lost")
    ]
    assert lost, str(report)
    dtypes = lost[0].evidence["dtypes"]
    assert dtypes and set(dtypes.values()) == {"bfloat16"}
    assert "fp32 master copy" in (lost[0].fix or "")
    assert "pin it" in (lost[0].fix or "")  # unless it cannot learn at all
    # the slow reference: in bf16 the cancelled scalar is where rounding left it
    assert abs(last - 1.0) <= 2.0**-8


def test_pinned_under_autocast_nothing_drifts():
    report, last = _train("autocast", STEPS, pinned=True)
    assert last == 1.0
    assert not {f.code for f in report.findings} & {"DW301", "DW302", "DW304"}, str(report)


SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    from deadweight.demos import layer_scalar_drift as d

    setting = sys.argv[1]
    torch.manual_seed(0)
    setup = d.make_watchable()
    model = setup.model
    if setting == "bf16":
        model.to(torch.bfloat16)
        setup.x, setup.y = setup.x.bfloat16(), setup.y.bfloat16()
    if setting == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
        dist.init_process_group("gloo", rank=0, world_size=1)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(d.shape_rule_groups(model), lr=d.WATCH_LR, betas=d.BETAS,
                                  eps=d.WATCH_EPS)
    for _ in range(20):
        setup.next_batch()
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "autocast"):
            loss = torch.nn.functional.mse_loss(model(setup.batch[0]), setup.batch[1])
        loss.backward()
        optimizer.step()
    if setting == "fsdp2":
        dist.destroy_process_group()
    """
)


@pytest.mark.e2e
@pytest.mark.parametrize("setting", ["autocast", "bf16", "fsdp2"])
def test_the_step_0_check_of_deadweight_run_sees_the_cancellation(tmp_path: Path, setting):
    from tests.distributed.harness import free_port

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    log = tmp_path / "run.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "deadweight", "run", "--log", str(log), "--format", "json",
         "--", sys.executable, str(script), setting, str(free_port())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    at_step_0 = {
        f["code"] for f in report["findings"] if f.get("phase") == "step 0" and LAST in f["params"]
    }
    assert {"DW104", "DW203", "DW204"} <= at_step_0, done.stdout
    events = [json.loads(line) for line in log.read_text().splitlines()]
    (check,) = [e for e in events if e.get("event") == "check"]
    assert check["mode"] in ("replayed", "structure-only")
