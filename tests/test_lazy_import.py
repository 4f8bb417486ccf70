"""`import deadweight` is cheap (the pytest plugin loads in every pytest run): public names
are imported on first use, and every one of them resolves."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import deadweight


def test_import_deadweight_does_not_import_torch() -> None:
    code = "import sys, deadweight\nassert 'torch' not in sys.modules\nprint(deadweight.check)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "function check" in out.stdout  # and the name still resolves, importing torch


def test_every_public_name_resolves() -> None:
    assert set(deadweight.__all__) == {"__version__", *deadweight._EXPORTS}
    for name in deadweight.__all__:
        assert getattr(deadweight, name) is not None, name
    assert set(deadweight.__all__) <= set(dir(deadweight))
    try:
        deadweight.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


# Runs the command line as `python -m deadweight ARGS` does, then fails if anything
# imported torch: commands that only read text (the version, the rule pages, the
# configuration, lint, a watch log) must not pay torch's second of import time.
WITHOUT_TORCH = """
import runpy, sys
sys.argv = ["deadweight", *sys.argv[1:]]
try:
    runpy.run_module("deadweight", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, f"imported {loaded[:5]}"
sys.stderr.write(f"exit {code}\\n")
"""


@pytest.fixture(scope="module")
def watch_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from torch import nn

    log = tmp_path_factory.mktemp("log") / "run.jsonl"
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadweight.watch(model, opt, log=log):
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return log


@pytest.mark.parametrize(
    "args",
    [
        ["--version"],
        ["--help"],
        ["rules"],
        ["rules", "DW302"],
        ["rules", "--format", "json"],
        ["config"],
        ["run", "--help"],
        ["check", "--help"],
        ["inspect", "--help"],
        ["lint", "{tmp}/model.py"],
        ["report", "{tmp}/run.jsonl"],
    ],
    ids=" ".join,
)
def test_commands_that_need_no_torch_do_not_import_it(
    args: list[str], tmp_path: Path, watch_log: Path
) -> None:
    (tmp_path / "model.py").write_text("def forward(x):\n    return x.detach()\n")
    shutil.copy(watch_log, tmp_path / "run.jsonl")
    argv = [a.format(tmp=tmp_path) for a in args]
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *argv], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.rstrip().splitlines()[-1] in ("exit 0", "exit 1", "exit None"), out.stderr


def test_the_constants_that_stand_in_for_torch_values_are_torch_s() -> None:
    import torch

    from deadweight.checking.check_stats import FLOAT32_EPS
    from deadweight.cli.demo import SEED_STEPS
    from deadweight.demos import fused_rmsnorm

    assert torch.finfo(torch.float32).eps == FLOAT32_EPS
    assert fused_rmsnorm.STEPS == SEED_STEPS
