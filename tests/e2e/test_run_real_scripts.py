"""`deadweight run` on training scripts as people write and start them (issue 31).

HF's run_clm.py (vendored unmodified under hf_examples/, Apache-2.0; it imports
datasets and transformers before torch) with its Trainer, under `python` and under
`accelerate launch`; hand-written scripts in scripts/: a VAE with an Accelerate loop
that imports transformers first (under `accelerate launch`), a GAN with two optimizers
that imports datasets first (under `torchrun`), a Sequential's members called one by
one with torch imported inside main() (under `python -m`), and a Lightning
`Trainer.fit`. Each runs healthy (no finding), with a cut seeded in its first module
(DW101 and DW102 at the seeded line, at step 0), and seeded again with torch imported
before anything else (scripts/torch_first.py): the findings must be the same.

Everything is local: a word-level tokenizer built here, text files written here, a
tiny GPT-2 from --config_overrides. run_clm.py imports `evaluate` (a test dependency)
at its top; evaluate.load, which needs the hub, is only called with --do_eval, which
these runs do not pass. The cut in GPT-2 is seeded from outside the script
(seed_gpt2/: the last block's MLP output detached, 6 parameters cut off).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.e2e
pytest.importorskip("transformers")
pytest.importorskip("datasets")
pytest.importorskip("accelerate")
pytest.importorskip("evaluate")

HERE = Path(__file__).parent
SCRIPTS = HERE / "scripts"
RUN_CLM = HERE / "hf_examples" / "run_clm.py"
SEED_GPT2 = HERE / "seed_gpt2"
ROOT = HERE.parents[1]
STEPS = 3  # the step-0 check is what is tested; a few steps show the watch went on
TIMEOUT = 600
MARK = "# the seeded cut"
ACCELERATE = [
    "accelerate",
    "launch",
    "--cpu",
    "--num_processes=1",
    "--num_machines=1",
    "--mixed_precision=no",
    "--dynamo_backend=no",
]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
WORDS = [f"w{i}" for i in range(60)]


def _env(cut: bool, extra_path: Path | None = None) -> dict[str, str]:
    env = {
        **os.environ,
        "SEED_CUT": "1" if cut else "0",
        "STEPS": str(STEPS),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    paths = [str(extra_path)] if extra_path is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _run(cwd: Path, command: list[str], env: dict[str, str], name: str) -> dict[str, Any]:
    """`deadweight run --format json -- COMMAND`: its report; the script's own output
    goes to stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "deadweight", "run", "--format=json", "--fail-on=never",
         "--isolated", "--log", f"{name}.jsonl", "--", *command],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads(proc.stdout)
    assert report["kind"] == "watch"
    return report


def _seeded_line(path: Path) -> int:
    (line,) = [i for i, text in enumerate(path.read_text().splitlines(), 1) if MARK in text]
    return line


def _step0(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f.get("phase") == "step 0"]


def _facts(report: dict[str, Any]) -> set[tuple[str, tuple[str, ...], str, int]]:
    return {
        (
            f["code"],
            tuple(sorted(f["params"])),
            Path(f["location"]["file"]).name,
            f["location"]["line"],
        )
        for f in _step0(report)
    }


def _assert_healthy(report: dict[str, Any], modes: tuple[str, ...]) -> None:
    assert report["findings"] == [], report["findings"]
    assert report["subject"]["steps"] == STEPS
    assert report["subject"]["step0"]["mode"] in modes, report["subject"]["step0"]


def _assert_cut(report: dict[str, Any], params: set[str], file: Path) -> None:
    """DW101 and DW102 at step 0 on exactly the cut-off parameters, at the seeded line;
    nothing else."""
    assert report["subject"]["steps"] == STEPS
    assert _facts(report) == {
        (code, tuple(sorted(params)), file.name, _seeded_line(file)) for code in ("DW101", "DW102")
    }, report["findings"]
    assert report["findings"] == _step0(report)


# -- HF's run_clm.py, its Trainer -------------------------------------------------------------


@pytest.fixture(scope="module")
def clm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer and local text: nothing comes from the hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    work = tmp_path_factory.mktemp("clm")
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", model_max_length=64
    ).save_pretrained(work / "tokenizer")
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(20)) for _ in range(200)]
    (work / "train.txt").write_text("\n".join(lines) + "\n")
    return work


def _clm_args(work: Path, name: str) -> list[str]:
    return [
        "--model_type=gpt2",
        f"--config_overrides=n_layer=2,n_head=2,n_embd=32,n_positions=64,vocab_size={len(WORDS) + 2}",
        f"--tokenizer_name={work / 'tokenizer'}",
        f"--train_file={work / 'train.txt'}",
        f"--cache_dir={work / 'cache'}",
        f"--output_dir={work / name}",
        "--do_train",
        f"--max_steps={STEPS}",
        "--per_device_train_batch_size=4",
        "--block_size=32",
        "--use_cpu",
        "--report_to=none",
        "--save_strategy=no",
        "--disable_tqdm=true",
        "--learning_rate=1e-3",
        "--seed=0",
    ]


CLM_CUT = {
    f"transformer.h.1.{module}.{p}"
    for module in ("ln_2", "mlp.c_fc", "mlp.c_proj")
    for p in ("weight", "bias")
}


@pytest.fixture(scope="module")
def clm_runs(clm: Path) -> dict[str, dict[str, Any]]:
    torch_first = [sys.executable, str(SCRIPTS / "torch_first.py")]
    runs = {
        "healthy": ([sys.executable, str(RUN_CLM)], _env(False)),
        "cut": ([sys.executable, str(RUN_CLM)], _env(True, SEED_GPT2)),
        "torch first": ([*torch_first, str(RUN_CLM)], _env(True, SEED_GPT2)),
        "accelerate launch": ([*ACCELERATE, str(RUN_CLM)], _env(True, SEED_GPT2)),
    }
    return {
        name: _run(
            clm, [*command, *_clm_args(clm, name.replace(" ", "_"))], env, name.replace(" ", "_")
        )
        for name, (command, env) in runs.items()
    }


def test_run_clm_healthy_is_quiet(clm_runs: dict[str, dict[str, Any]]) -> None:
    # The loss is the model's own output: the step-0 check replays it exactly.
    _assert_healthy(clm_runs["healthy"], ("replayed",))


@pytest.mark.parametrize("how", ["cut", "torch first", "accelerate launch"])
def test_run_clm_cut_is_found_at_step_0(clm_runs: dict[str, dict[str, Any]], how: str) -> None:
    report = clm_runs[how]
    _assert_cut(report, CLM_CUT, SEED_GPT2 / "gpt2_cut.py")
    assert report["subject"]["step0"]["mode"] == "replayed"
    assert {f["location"]["module"] for f in _step0(report)} == {"transformer.h.1.mlp"}
    assert _facts(report) == _facts(clm_runs["torch first"])


# -- hand-written scripts, each started its own way -------------------------------------------


SCRIPTED: dict[str, tuple[list[str], Path, set[str], tuple[str, ...]]] = {
    # name: (command, the file with the seeded cut, its cut-off parameters, step-0 modes)
    "vae, transformers first, accelerate launch": (
        [*ACCELERATE, "vae_accelerate.py"],
        SCRIPTS / "vae_accelerate.py",
        {"Encoder:hidden.weight", "Encoder:hidden.bias"},
        ("structure-only",),
    ),
    "gan, datasets first, torchrun": (
        [*TORCHRUN, "gan_datasets.py"],
        SCRIPTS / "gan_datasets.py",
        {"Generator:first.weight", "Generator:first.bias"},
        ("structure-only",),
    ),
    "members one by one, python -m": (
        [sys.executable, "-m", "members.train"],
        SCRIPTS / "members" / "train.py",
        {"0.hidden.weight", "0.hidden.bias"},
        ("replayed",),
    ),
    "lightning Trainer.fit": (
        [sys.executable, "lightning_autoencoder.py"],
        SCRIPTS / "lightning_autoencoder.py",
        {"AutoEncoder:encoder.hidden.weight", "AutoEncoder:encoder.hidden.bias"},
        ("structure-only",),
    ),
}


def _torch_first(command: list[str]) -> list[str]:
    """The same command with scripts/torch_first.py in front of the script."""
    wrapper = "torch_first.py"
    if "-m" in command:
        at = command.index("-m")
        return [*command[:at], wrapper, *command[at:]]
    script = next(i for i, part in enumerate(command) if part.endswith(".py"))
    return [*command[:script], wrapper, *command[script:]]


@pytest.fixture(scope="module", params=sorted(SCRIPTED))
def scripted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    if "lightning" in request.param:
        pytest.importorskip("lightning")
    command, file, params, modes = SCRIPTED[request.param]
    work = tmp_path_factory.mktemp("scripted") / "scripts"
    shutil.copytree(SCRIPTS, work)
    runs = {
        "healthy": _run(work, command, _env(False), "healthy"),
        "cut": _run(work, command, _env(True), "cut"),
        "torch first": _run(work, _torch_first(command), _env(True), "first"),
    }
    return request.param, runs, file, params, modes


def test_a_hand_written_script_is_watched_however_it_starts(scripted) -> None:
    name, runs, file, params, modes = scripted
    _assert_healthy(runs["healthy"], modes)
    for how in ("cut", "torch first"):
        _assert_cut(runs[how], params, file)
        assert runs[how]["subject"]["step0"]["mode"] in modes, (name, how)
    assert _facts(runs["cut"]) == _facts(runs["torch first"])
