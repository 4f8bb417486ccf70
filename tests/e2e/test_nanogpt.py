"""nanoGPT's own train.py and model.py (vendored unmodified in nanogpt/, MIT licence),
run on CPU at a tiny size under `deadweight run`, with torch.compile off and on.

The seeded bugs are made by editing a copy of model.py the way a user would: a
detached attention block (its parameters never get a gradient) and a layer scalar
in front of ln_f (which cancels it). The scalar is caught at step 0 by the README's
two added lines, pasted into the copy of train.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.zero_code import deadweight_run

pytestmark = pytest.mark.e2e

VENDORED = Path(__file__).parent / "nanogpt"
VOCAB = 64
# A tiny GPT, 51 optimizer steps (iterations 0..50): past DW301's 50 steps.
ARGS = [
    "--dataset=tiny",
    "--device=cpu",
    "--dtype=float32",
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--block_size=32",
    "--batch_size=4",
    "--gradient_accumulation_steps=1",
    "--max_iters=50",
    "--eval_interval=1000",
    "--eval_iters=1",
    "--log_interval=25",
    "--warmup_iters=0",
    "--always_save_checkpoint=False",
    "--learning_rate=1e-3",
]

# The README's two added lines, after the script's first batch.
FIRST_BATCH = "X, Y = get_batch('train') # fetch the very first batch\n"
README_CHECK = (
    "import deadweight, json\n"
    "report = deadweight.check(model, lambda: model(X, Y)[1], optimizer)\n"
    "print('CHECK', json.dumps(json.loads(report.to_json())))\n"
)


def _workdir(tmp_path: Path, *, model_edit: tuple[str, str] | None = None) -> Path:
    work = tmp_path / "nanogpt"
    shutil.copytree(VENDORED, work)
    data = work / "data" / "tiny"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        rng.integers(0, VOCAB, 4096, dtype=np.uint16).tofile(data / f"{split}.bin")
    with open(data / "meta.pkl", "wb") as fh:
        pickle.dump({"vocab_size": VOCAB}, fh)
    train = (work / "train.py").read_text()
    assert FIRST_BATCH in train
    (work / "train.py").write_text(train.replace(FIRST_BATCH, FIRST_BATCH + README_CHECK))
    if model_edit is not None:
        model = (work / "model.py").read_text()
        old, new = model_edit
        assert model.count(old) == 1, old
        (work / "model.py").write_text(model.replace(old, new))
    return work


def _run(work: Path, compile_: bool) -> tuple[dict, list[dict], str]:
    """`deadweight run` on train.py: its JSON report, the check's findings, stderr."""
    # Dynamo says why it recompiles: deadweight's hooks must never be the reason.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if compile_:
        env["TORCH_LOGS"] = "recompiles"
    env.pop("RANK", None)
    command = [sys.executable, "train.py", *ARGS, f"--compile={compile_}"]
    report, proc = deadweight_run(
        sys.executable, command, cwd=work, env=env, log=work / "run.jsonl", timeout=900
    )
    # The script's own prints: on stderr, as --format json keeps stdout for the report.
    check_lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("CHECK ")]
    assert len(check_lines) == 1, proc.stderr[-3000:]
    check = json.loads(check_lines[0][len("CHECK ") :])
    return report, check["findings"], proc.stderr


def _codes(findings: list[dict]) -> set[str]:
    return {f["code"] for f in findings}


DETACHED_ATTENTION = (
    "x = x + self.attn(self.ln_1(x))",
    "x = x + self.attn(self.ln_1(x)).detach()",
)
SCALAR_BEFORE_LN_F = (
    "x = self.transformer.ln_f(x)",
    "x = self.transformer.ln_f(x * self.scale)",
)


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
def test_healthy_nanogpt_has_no_findings(tmp_path: Path, compile_: bool) -> None:
    report, check, stderr = _run(_workdir(tmp_path), compile_)
    assert check == []
    assert report["findings"] == [], report["findings"]
    assert report["subject"]["steps"] == 51
    # Names as in the model's own code, never the compile wrapper's.
    log = (tmp_path / "nanogpt" / "run.jsonl").read_text()
    assert "transformer.h.1.attn.c_attn.weight" in log and "_orig_mod" not in log
    # Nothing deadweight does makes Dynamo complain in the user's compiled model.
    assert "Traceback" not in stderr
    assert "graph break" not in stderr.lower() and "_getframe" not in stderr
    # Its one recompilation is nanoGPT's own (evaluation under no_grad, then training);
    # the step-0 check's hooks, gone after step 0, are not among the guards.
    reasons = [ln for ln in stderr.splitlines() if "__recompiles" in ln and " - " in ln]
    assert not [r for r in reasons if "hooks" in r or "deadweight" in r], reasons


def test_a_detached_attention_block_is_named(tmp_path: Path) -> None:
    work = _workdir(tmp_path, model_edit=DETACHED_ATTENTION)
    report, check, _ = _run(work, compile_=False)
    # Every block's attention is cut off: its weights and ln_1 get no gradient.
    expected = {
        f"transformer.h.{i}.{name}"
        for i in range(2)
        for name in ("ln_1.weight", "attn.c_attn.weight", "attn.c_proj.weight")
    }
    assert "DW101" in _codes(check)
    never = [f for f in report["findings"] if f["code"] == "DW301"]
    assert len(never) == 1, report["findings"]
    assert set(never[0]["params"]) == expected
    assert never[0]["evidence"]["cause"] == "they never received a gradient"
    # ...and at step 0, with no change to the script, the cut and its line, as check says.
    step0 = [f for f in report["findings"] if f.get("phase") == "step 0"]
    assert report["subject"]["step0"]["mode"] == "replayed"
    assert _facts(step0) == _facts(check)
    (cut,) = [f for f in step0 if f["code"] == "DW102"]
    assert set(cut["params"]) == expected
    line = (work / "model.py").read_text().splitlines().index("        " + DETACHED_ATTENTION[1])
    assert cut["location"]["file"].endswith("model.py") and cut["location"]["line"] == line + 1


def _facts(findings: list[dict]) -> set[tuple]:
    return {(f["code"], tuple(sorted(f["params"])), json.dumps(f["location"])) for f in findings}


def test_a_scalar_before_ln_f_is_caught_at_step_0_compiled(tmp_path: Path) -> None:
    work = _workdir(tmp_path, model_edit=SCALAR_BEFORE_LN_F)
    model = (work / "model.py").read_text()
    init = "ln_f = LayerNorm(config.n_embd, bias=config.bias),\n        ))\n"
    assert model.count(init) == 1
    (work / "model.py").write_text(
        model.replace(init, init + "        self.scale = nn.Parameter(torch.ones(1))\n")
    )
    report, check, _ = _run(work, compile_=True)
    codes = _codes(check)
    step0 = [f for f in report["findings"] if f.get("phase") == "step 0"]
    assert _facts(step0) == _facts(check)  # the zero-code step-0 check, compiled too
    # Cancelled by ln_f; nanoGPT's configure_optimizers leaves dim < 2 undecayed; Adam drifts it.
    assert {"DW104", "DW203", "DW204"} <= codes, check
    for f in check:
        if f["code"] in ("DW104", "DW203", "DW204"):
            assert f["params"] == ["scale"], f
