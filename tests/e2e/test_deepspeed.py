"""DeepSpeed on CPU, ZeRO stages 0-3, fp32 and bf16, each run in its own process
(DeepSpeed sets up a process group): `watch` takes the engine and optimizer as
`deepspeed.initialize` returns them, and `deadweight run` watches the unmodified
script. DeepSpeed steps fp32 master copies in flat partitions, once per parameter
group; the watch sees one step per training step, named after the model's own
parameters (watching/deepspeed_partitions.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.e2e.script_results import process_env, script_results
from tests.e2e.zero_code import deadweight_run

pytestmark = pytest.mark.e2e
pytest.importorskip("deepspeed")

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_loop.py"
STEPS = 60

# The tiny Llama's cut-off parameters (the embedding and layer 0): DeepSpeed gives
# them zero gradients, not None, so AdamW's weight decay moves the decayed ones.
LAYER0_NORMS = {
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
}


HEALTHY = [(0, "fp32"), (0, "bf16"), (1, "bf16"), (2, "fp32"), (3, "bf16"), (3, "fp32-offload")]
CUT = [(0, "bf16"), (1, "fp32"), (2, "bf16"), (2, "fp32-offload"), (3, "fp32")]
# Every library-API run, in one process (DeepSpeed's start-up is most of each run's cost).
SPECS = [
    *(f"{stage}:healthy:{precision}:watch" for stage, precision in HEALTHY),
    *(f"{stage}:cut:{precision}:watch" for stage, precision in CUT),
    "2:scalar:fp32:watch",
    "1:inf:fp32:watch",
    "3:inf:fp32:watch",
    "2:cut:fp32:unmapped",  # last: it forgets deadweight's layouts for the process
]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    return script_results(SCRIPT, SPECS, env=process_env(), timeout=1200)


def _run(runs: dict[str, dict], stage: int, bug: str = "healthy", precision: str = "fp32",
         mode: str = "watch") -> dict:  # fmt: skip
    return runs[f"{stage}:{bug}:{precision}:{mode}"]


def _by_code(findings: list[dict]) -> dict[str, set[str]]:
    return {f["code"]: set(f["params"]) for f in findings}


def _model_names() -> set[str]:
    from tests.e2e import seeded

    return {n for n, _ in seeded.tiny_llama().named_parameters()}


@pytest.mark.parametrize(("stage", "precision"), HEALTHY)
def test_a_healthy_run_is_watched_by_name_without_findings(
    runs: dict[str, dict], stage: int, precision: str
) -> None:
    result = _run(runs, stage, precision=precision)
    assert result["steps"] == STEPS  # one per training step, not one per group
    assert result["findings"] == [] and result["errors"] == [], result
    assert set(result["params"]) == _model_names()  # no flat, nameless partitions
    assert result["check"] == []
    assert "before deepspeed.initialize()" in result["check_refused"]
    assert result["step_restored"]  # DeepSpeed has its own step back after the watch


@pytest.mark.parametrize(("stage", "precision"), CUT)
def test_a_detached_layer_is_named_at_every_stage(
    runs: dict[str, dict], stage: int, precision: str
) -> None:
    """The cut-off parameters split by weight decay: those without it never move
    (DW301); those with it move, but their gradient is always zero (DW310)."""
    from tests.e2e import seeded

    cut = seeded.detach_first_layer(seeded.tiny_llama())
    result = _run(runs, stage, "cut", precision)
    found = _by_code(result["findings"])
    assert set(found) == {"DW301", "DW310"}, result["findings"]
    assert found["DW301"] == LAYER0_NORMS
    assert found["DW310"] == cut - LAYER0_NORMS
    assert _by_code(result["check"])["DW101"] == cut  # and check before initialize


def test_a_cancelled_scalar_is_caught_before_initialize(runs: dict[str, dict]) -> None:
    result = _run(runs, 2, "scalar")
    found = _by_code(result["check"])
    for code in ("DW104", "DW203", "DW204"):
        assert "model.scale" in found.get(code, set()), result["check"]
    assert "model.scale" in result["params"]  # and watched by name under ZeRO


@pytest.mark.parametrize("stage", [1, 3])
def test_gradients_that_are_always_inf_are_named_when_deepspeed_skips_every_step(
    runs: dict[str, dict], stage: int
) -> None:
    """DeepSpeed skips a step with inf/NaN gradients itself (no GradScaler): the
    skips are counted (DW304) and the parameters whose gradient is never finite named
    (DW305)."""
    result = _run(runs, stage, "inf")
    found = _by_code(result["findings"])
    names = _model_names()
    # Everything at or before layer 1's MLP gets the inf; the head and final norm do not.
    finite = {"lm_head.weight", "model.norm.weight"}
    assert found["DW305"] == names - finite, result["findings"]
    assert found["DW304"] == names - finite
    assert found["DW301"] == names  # no step went through


def test_an_unknown_layout_is_said_and_watched_for_movement_only(runs: dict[str, dict]) -> None:
    """A DeepSpeed whose partitions deadweight cannot map: one step per training step
    still, the parameters watched for movement, and the report says why."""
    result = _run(runs, 2, "cut", mode="unmapped")
    assert result["steps"] == STEPS
    assert [e["detector"] for e in result["errors"]] == ["deepspeed"]
    assert "watched for movement only" in result["errors"][0]["message"]
    # No gradients are seen, so only what never moved is found: the undecayed cut-offs.
    assert _by_code(result["findings"]) == {"DW301": LAYER0_NORMS}


def _zero_code(tmp_path: Path, bug: str) -> dict:
    report, _ = deadweight_run(
        sys.executable,
        [sys.executable, str(SCRIPT), f"2:{bug}:fp32:plain"],
        cwd=tmp_path,
        env=process_env(),
        log=tmp_path / f"{bug}.jsonl",
        timeout=600,
    )
    return report


def test_deadweight_run_watches_an_unmodified_deepspeed_script(tmp_path: Path) -> None:
    """Zero-code: the torch optimizer inside DeepSpeed's steps once per group; the run
    finds DeepSpeed's optimizer from it and watches that, by name, from the second
    training step on."""
    healthy = _zero_code(tmp_path, "healthy")
    assert healthy["findings"] == [], healthy["findings"]
    assert healthy["subject"]["steps"] == STEPS - 1
    cut = _zero_code(tmp_path, "cut")
    found = _by_code(cut["findings"])
    assert found.get("DW301") == LAYER0_NORMS, cut["findings"]
    assert "model.embed_tokens.weight" in found.get("DW310", set())
