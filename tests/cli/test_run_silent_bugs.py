"""`deadweight run` on unmodified scripts with the classic silent bugs of issue 35: a
missing `zero_grad()`, a model left in eval mode, a module that never gets a gradient,
and a raw pickle given to `inspect`; each next to its healthy twin."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.cli.test_run import dw_run

# One script, the bug chosen by BUG (none: the healthy twin of all three). An MNIST-like
# loop: a small CNN with BatchNorm and dropout 0.3, Adam, 60 steps (40 for `unused`).
SCRIPT = """
import os
import torch
import torch.nn.functional as F
from torch import nn

bug = os.environ.get("BUG", "")
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.3)
        self.fc = nn.Linear(4 * 6 * 6, 10)
        self.aux = nn.Linear(10, 10)  # used in forward, except by the `unused` bug

    def forward(self, x):
        h = self.drop(F.relu(self.bn(self.conv(x)))).flatten(1)
        out = self.fc(h)
        return out if bug == "unused" else self.aux(out)


model = Net()
steps = 40 if bug == "unused" else 60
opt = (torch.optim.AdamW if bug == "unused" else torch.optim.Adam)(model.parameters(), lr=1e-3)
if bug == "unused-accelerate":
    import accelerate

    accelerator = accelerate.Accelerator(cpu=True)
    bug = "unused"
    model, opt = accelerator.prepare(model, opt)
    steps = 40
for step in range(steps):
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    if step % 10 == 5:
        model.eval()
        with torch.no_grad():
            model(torch.randn(8, 1, 8, 8))  # validation
        if bug != "eval":
            model.train()
    if bug != "no-zero-grad":
        opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
"""


@pytest.mark.parametrize(
    ("bug", "code"),
    [
        ("no-zero-grad", "DW311"),
        ("eval", "DW312"),
        ("unused", "DW313"),
        ("unused-accelerate", "DW313"),
        ("", None),
    ],
)
def test_each_bug_is_caught_and_the_healthy_twin_is_clean(tmp_path, bug, code) -> None:
    if bug == "unused-accelerate":
        pytest.importorskip("accelerate")
    result = dw_run(tmp_path, SCRIPT, "--format", "json", env={**os.environ, "BUG": bug})
    assert result.returncode in (0, 1), result.stderr
    import json

    findings = json.loads(result.stdout)["findings"]
    codes = {f["code"] for f in findings}
    if code is None:
        assert not {f["code"] for f in findings if f["severity"] != "info"}, findings
        assert result.returncode == 0
        return
    assert code in codes, findings
    (found,) = [f for f in findings if f["code"] == code]
    if code == "DW311":
        assert found["evidence"]["step"] == 2 and result.returncode == 1
    elif code == "DW312":
        assert found["evidence"]["start"] == 6 and found["severity"] == "warning"
        assert set(found["evidence"]["modules"]) == {"bn", "drop"}
    else:
        assert set(found["params"]) == {"aux.weight", "aux.bias"} and result.returncode == 1


def _inspect(path: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", "inspect", str(path), *options],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_inspect_says_what_a_raw_pickle_is_and_reads_it_only_when_told(tmp_path) -> None:
    path = tmp_path / "model.bin"
    with open(path, "wb") as f:
        pickle.dump({"w": torch.ones(4, 4)}, f)
    refused = _inspect(path)
    assert refused.returncode == 2
    said = " ".join(refused.stderr.split())
    assert "a raw Python pickle" in said and "no code from it ran" in said
    assert "--unsafe-pickle" in said and "safetensors" in said
    trusted = _inspect(path, "--unsafe-pickle")
    assert trusted.returncode in (0, 1), trusted.stderr
    assert "ran this file's pickle" in " ".join(trusted.stderr.split())
    # the healthy twin: the same weights through torch.save read as they always did
    torch.save({"w": torch.ones(4, 4)}, tmp_path / "model.pt")
    assert _inspect(tmp_path / "model.pt").returncode in (0, 1)
