"""torchtune's own `lora_finetune_single_device` recipe, run by its `tune` CLI under
`deadweight run` on CPU. The config (torchtune_recipe/lora.yaml) points at torchtune's LoRA
Llama 2 builder, checkpointer, loss and scheduler; only what a real run downloads
(tokenizer file, dataset) and the base checkpoint are made here (torchtune_recipe/parts.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.zero_code import deadweight_run

pytestmark = pytest.mark.e2e

# torchtune's last release (0.6.1) imports torchao.dtypes.nf4tensor, which torchao
# dropped after 0.10, while PEFT refuses any torchao below 0.16: the two cannot share
# the test environment, so torchtune gets a venv of its own on top of it.
TORCHTUNE = ("torchtune==0.6.1", "torchao==0.10.0")

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
STEPS = 60  # past DW301's 50 steps
DETACHED = "tests.e2e.torchtune_recipe.parts.lora_llama2_first_layer_detached"


@pytest.fixture(scope="module")
def tune_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A venv over this environment (torch, deadweight) with torchtune installed from
    the package index."""
    venv = tmp_path_factory.mktemp("torchtune-venv")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    proc = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *TORCHTUNE],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return python


def _run(tmp_path: Path, python: str, model_component: str | None = None) -> dict:
    checkpoints, out = tmp_path / "base", tmp_path / "out"
    checkpoints.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    write = "import sys; from tests.e2e.torchtune_recipe.parts import write_base_checkpoint as w; w(sys.argv[1])"
    subprocess.run([python, "-c", write, str(checkpoints / "model.pt")], env=env, check=True)
    config = (HERE / "torchtune_recipe" / "lora.yaml").read_text()
    config = config.replace("CHECKPOINT_DIR", str(checkpoints)).replace("OUTPUT_DIR", str(out))
    if model_component is not None:
        config = config.replace("torchtune.models.llama2.lora_llama2\n", model_component + "\n")
        assert model_component in config
    (tmp_path / "lora.yaml").write_text(config)
    tune = "import sys; from torchtune._cli.tune import main; sys.exit(main())"
    recipe = ["run", "lora_finetune_single_device", "--config", str(tmp_path / "lora.yaml")]
    command = [python, "-c", tune, *recipe]
    report, _ = deadweight_run(
        python, command, cwd=tmp_path, env=env, log=tmp_path / "run.jsonl", timeout=600
    )
    assert report["subject"]["steps"] == STEPS
    return report


def test_a_healthy_torchtune_lora_recipe_has_no_findings(tmp_path: Path, tune_python: str) -> None:
    report = _run(tmp_path, tune_python)
    assert [f for f in report["findings"] if f["severity"] != "info"] == []
    # The step-0 check replays the recipe's own loss (a loss module after the model);
    # what it adds is true and informational: each lora_a starts with an exactly zero
    # gradient behind its zero-initialised lora_b (DW103), and the recipe hands AdamW
    # the frozen base weights too (DW202).
    assert report["subject"]["step0"]["mode"] == "replayed"
    info = {(f["code"], tuple(f["params"])) for f in report["findings"]}
    lora_a = {
        f"layers.{i}.attn.{proj}.lora_a.weight" for i in (0, 1) for proj in ("q_proj", "v_proj")
    }
    assert {p for code, params in info if code == "DW103" for p in params} == lora_a
    assert {code for code, _ in info} == {"DW103", "DW202"}
    # The adapters: q and v, lora_a and lora_b, 2 layers.
    assert report["subject"]["parameters"] == 8
    assert "layers.0.attn.q_proj.lora_a.weight" in (tmp_path / "run.jsonl").read_text()


def test_a_detached_layer_leaves_its_adapters_unchanged(tmp_path: Path, tune_python: str) -> None:
    report = _run(tmp_path, tune_python, DETACHED)
    layer0 = {
        f"layers.0.attn.{proj}.lora_{ab}.weight" for proj in ("q_proj", "v_proj") for ab in "ab"
    }
    serious = [f for f in report["findings"] if f["severity"] != "info"]
    assert sorted(f["code"] for f in serious) == ["DW101", "DW102", "DW301"]
    assert all(set(f["params"]) == layer0 for f in serious)
    # At step 0, at the line that detaches layer 0 (torchtune_recipe/parts.py).
    cut = next(f for f in serious if f["code"] == "DW102")
    assert cut["phase"] == "step 0"
    assert cut["location"]["file"].endswith("parts.py")
    parts = (HERE / "torchtune_recipe" / "parts.py").read_text().splitlines()
    assert "detach()" in parts[cut["location"]["line"] - 1]
