"""megatron-core, the second incident's own framework, on CPU (tests/e2e/megatron_cpu.py
names what is replaced to run it there): its GPTModel with the incident's layer
scalars, its own parameter groups (`_get_param_groups`, wd × wd_mult set by its
scheduler), its DDP with gradients in `main_grad` buffers, and its optimizers,
`FP32Optimizer` and the mixed-precision `Float16OptimizerWithFloat16Params`, which
steps fp32 main copies of the bf16 parameters and copies them back.

Every run shares one process (megatron_loop.py), started once for the module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.script_results import process_env, script_results
from tests.e2e.zero_code import deadweight_run

pytestmark = pytest.mark.e2e
pytest.importorskip("megatron.core", reason="megatron-core is installed by .ci/run")

SCRIPT = Path(__file__).parent / "scripts" / "megatron_loop.py"
SCALAR = "decoder.layers.2.layer_scalar"  # the last of 3 blocks: megatron_cpu.SCALAR
INCIDENT = {"DW104", "DW203", "DW204"}
# Found wrongly, any of these would say a healthy Megatron run's parameters do not learn.
NOT_LEARNING = {"DW301", "DW302", "DW306", "DW310"}
DRIFT_STEPS = 200
SPECS = [
    "check:healthy",
    "check:scalar",
    "check:scalar:roles",
    "check:scalar:tagged",
    "ddp-fp32:scalar:0",
    "ddp-fp32:healthy:60",
    "ddp-bf16:healthy:60",
    f"ddp-bf16:scalar:{DRIFT_STEPS}",
    "ddp-dist:healthy:60",
    f"ddp-dist:scalar:{DRIFT_STEPS}",
    "pin-fp32",
    "pin-bf16",
]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, Any]]:
    return script_results(SCRIPT, SPECS, env=process_env(), timeout=600)


def _run(runs: dict[str, dict[str, Any]], spec: str) -> dict[str, Any]:
    result = runs[spec]
    assert "error" not in result, result["error"]
    return result


def _scalars(wd_mult: dict[str, float]) -> dict[int, float]:
    return {int(n.split(".")[2]): m for n, m in wd_mult.items() if n.endswith("layer_scalar")}


def _codes(findings: list[dict[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in findings:
        out.setdefault(f["code"], []).extend(f["params"])
    return out


def test_megatron_groups_exempt_the_scalars_and_check_names_the_cancelled_one(
    runs: dict[str, dict[str, Any]],
) -> None:
    result = _run(runs, "check:scalar")
    # megatron-core's own rule: len(param.shape) == 1 -> wd_mult 0.0, every scalar
    assert _scalars(result["wd_mult"]) == {0: 0.0, 1: 0.0, 2: 0.0}
    assert result["wd_mult"]["decoder.layers.0.mlp.linear_fc1.weight"] == 1.0
    assert result["weight_decay"] == [0.0, 0.1]  # wd × wd_mult, set by its scheduler
    assert _codes(result["findings"]) == {code: [SCALAR] for code in INCIDENT}
    assert _run(runs, "check:healthy")["findings"] == []


@pytest.mark.parametrize("groups", ["roles", "tagged"])
def test_docs_overrides_decide_decay_by_role(runs: dict[str, dict[str, Any]], groups: str) -> None:
    """docs/megatron.md: deadweight's groups, or the `_no_weight_decay` tag, as
    megatron-core ParamKey overrides. Biases and norm weights keep wd_mult 0, matrices
    1; the cancelled scalar is decayed, so DW203/DW204 go, and DW104 stays: it still
    cannot learn (pin it)."""
    result = _run(runs, f"check:scalar:{groups}")
    wd_mult = result["wd_mult"]
    assert wd_mult["decoder.final_layernorm.weight"] == 0.0
    assert wd_mult["decoder.layers.0.mlp.linear_fc1.bias"] == 0.0
    assert wd_mult["decoder.layers.0.mlp.linear_fc1.weight"] == 1.0
    # roles: every scalar decayed; tagged: the two live ones were tagged by hand
    assert _scalars(wd_mult) == (
        {0: 1.0, 1: 1.0, 2: 1.0} if groups == "roles" else {0: 0.0, 1: 0.0, 2: 1.0}
    )
    assert _codes(result["findings"]) == {"DW104": [SCALAR]}


@pytest.mark.parametrize(
    "spec",
    ["ddp-fp32:scalar:0", f"ddp-bf16:scalar:{DRIFT_STEPS}", f"ddp-dist:scalar:{DRIFT_STEPS}"],
)
def test_check_under_megatron_ddp_reads_its_own_gradients_and_leaves_the_buffers(
    runs: dict[str, dict[str, Any]], spec: str
) -> None:
    """Megatron's DDP moves every gradient into `main_grad` (`.grad` stays None); the
    check's own backward still sees them, adds nothing to the script's buffers, and
    counts Megatron's fp32 main copies as the parameters they stand for (no DW201 /
    DW202). In bf16 the last block's output is kept in fp32, as Megatron's
    fp32_residual_connection does (megatron_cpu.gpt)."""
    result = _run(runs, spec)
    assert result["grads_none_before_check"]
    assert result["buffers_untouched_by_check"]
    assert _codes(result["check"]) == {code: [SCALAR] for code in INCIDENT}


@pytest.mark.parametrize("precision", ["fp32", "bf16", "dist"])
def test_a_healthy_megatron_run_is_watched_by_name_without_findings(
    runs: dict[str, dict[str, Any]], precision: str
) -> None:
    result = _run(runs, f"ddp-{precision}:healthy:60")
    assert result["check"] == []
    assert result["findings"] == [] and result["errors"] == [], result["findings"]
    assert result["steps"] == 60
    assert result["watched"] == result["names"]  # the model's own names, no `module.`
    if precision != "fp32":  # what the watch measured are the fp32 main copies
        assert result["main_dtypes"] == ["torch.float32"]
        assert result["main_count"] == len(result["names"])
    else:
        assert result["main_count"] == 0


@pytest.mark.parametrize("optimizer", ["bf16", "dist"])
def test_the_incidents_drift_is_found_on_the_fp32_main_copy(
    runs: dict[str, dict[str, Any]], optimizer: str
) -> None:
    """bf16 model, fp32 main copies stepped by AdamW and copied back (whole, or this
    rank's flat shard under the distributed optimizer): the cancelled scalar's main copy
    drifts a few hundred steps in and watch says so, measured on the main copy (the
    bf16 parameter follows it in steps of 2^-7)."""
    result = _run(runs, f"ddp-{optimizer}:scalar:{DRIFT_STEPS}")
    found = _codes(result["findings"])
    assert found == {"DW302": [SCALAR]}, result["findings"]
    (drift,) = [f for f in result["findings"] if f["code"] == "DW302"]
    logged, real, moved, model_moved = result["moved"][SCALAR]
    assert logged == pytest.approx(real, rel=1e-5)  # the watch's value is the main copy's
    assert drift["evidence"]["last_value"] == pytest.approx(real, rel=1e-5)
    assert moved > 0.1  # ~0.9 lr per step, one way
    assert model_moved == pytest.approx(moved, abs=2**-7)  # copied back into the bf16 one
    for other in ("decoder.layers.0.layer_scalar", "decoder.layers.1.layer_scalar"):
        assert other in result["watched"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_pin_holds_under_megatron_ddp(runs: dict[str, dict[str, Any]], precision: str) -> None:
    """Megatron's DDP adds each gradient into its buffer from a hook on the gradient
    accumulator, which runs after the pin's post-accumulate-grad hook: it adds zeros."""
    result = _run(runs, f"pin-{precision}")
    assert result["bit_exact"] and result["moved"] == 0.0
    if precision == "bf16":
        assert result["main_bit_exact"]  # the fp32 main copy too
    # The model itself trained: bf16 rounds a few tiny updates away in 30 steps.
    assert result["others_moved"] >= result["others"] - 2
    assert "weight_decay=0.1" in result["refused"]  # through the main copy's group


@pytest.mark.parametrize("spec", ["plain", "plain-bf16"])
def test_deadweight_run_on_a_megatron_script(tmp_path: Path, spec: str) -> None:
    """The unmodified script under `deadweight run`: a torch AdamW over megatron-core's
    groups, and Megatron's own bf16 path (its DDP, `get_megatron_optimizer`). Its loss
    is computed outside the model (as in Megatron's own loop), so the step-0 check runs
    structure-only and keeps the optimizer audit and the structural proof of the
    cancellation (DW104): the final norm cancels the scale before the custom autograd
    Functions behind its output (Megatron's ColumnParallelLinear and vocab-parallel
    cross-entropy), which hide only what reaches them. In bf16 the watch finds the model through the main copies the optimizer steps and
    names them after its parameters."""
    report, _ = deadweight_run(
        sys.executable,
        [sys.executable, str(SCRIPT), f"{spec}:scalar:20"],
        cwd=tmp_path,
        env=process_env(),
        log=tmp_path / "log.jsonl",
        timeout=300,
    )
    found = _codes(report["findings"])
    assert found == {"DW104": [SCALAR], "DW203": [SCALAR], "DW204": [SCALAR]}, report["findings"]
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    (check,) = [e for e in events if e.get("event") == "check"]
    assert check["mode"] == "structure-only"
    (optimizer,) = [e for e in events if e.get("event") == "optimizer"]
    watched = [p["name"] for p in optimizer["params"]]
    # every parameter: 2 embeddings, 3 blocks of 11 (the scalar included), final norm, output
    assert SCALAR in watched and len(watched) == 37
    assert not any(n.startswith(("module.", "optimizer0.")) for n in watched)
    assert {p["dtype"] for p in optimizer["params"]} == {"float32"}  # the main copies in bf16
