"""Forwarders: the scalars they send, checked against a slow reference loop, and what
lands in real TensorBoard event files and a real (offline) W&B run."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import deadweight
from deadweight.integrations.forward import (
    forward_to,
    forward_to_tensorboard,
    forward_to_wandb,
)
from tests.integrations._tensorboard import read_events


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(80, 60)  # 4860 elements: large
        self.norm = nn.LayerNorm(60)  # small: exact update statistics
        self.scale = nn.Parameter(torch.ones(1))  # tiny: its value is logged
        self.gains = nn.Parameter(torch.ones(3))  # tiny vector
        self.unused = nn.Parameter(torch.zeros(2))  # never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.big(x)) * self.scale
        return h[:, :3] * self.gains


class FakeWriter:
    def __init__(self) -> None:
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.texts: dict[str, str] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.setdefault(tag, []).append((step, value))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.texts[tag] = text


class FakeRun:
    """Records what a W&B run is asked to do (a stand-in for the unit tests; the real
    offline run is exercised once below)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.metrics: list[tuple[str, str | None]] = []

    def log(self, data: dict[str, Any]) -> None:
        self.rows.append(dict(data))

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.metrics.append((name, step_metric))


def train(
    steps: int,
    *,
    every: int = 5,
    targets: tuple[Any, ...] = (),
    attach_after: int = 0,
    max_params: int = 32,
    offset: int = 0,
) -> tuple[deadweight.Report, list[dict[str, tuple[float, float]]], Net]:
    """A plain loop; returns the report and, per step, each small parameter's update norm
    and its norm after the step (copied around every step: the slow reference)."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    w = deadweight.watch(model, opt, every=every)
    params = dict(model.named_parameters())
    updates: list[dict[str, tuple[float, float]]] = []
    x, y = torch.randn(16, 80), torch.randn(16, 3)
    for step in range(1, steps + 1):
        if step == attach_after + 1:
            for target in targets:
                forward_to(w, target, max_params=max_params, step_offset=offset)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        before = {n: p.detach().clone() for n, p in params.items() if p.numel() <= 4096}
        opt.step()
        updates.append(
            {
                n: ((params[n].detach() - b).norm().item(), params[n].detach().norm().item())
                for n, b in before.items()
            }
        )
    w.close()
    return w.report(), updates, model


def test_scalars_match_a_slow_reference() -> None:
    writer = FakeWriter()
    report, updates, model = train(20, targets=(writer,))
    s = writer.scalars
    # Watched steps: 1, 5, 10, 15, 20.
    assert [step for step, _ in s["deadweight/value/scale"]] == [1, 5, 10, 15, 20]
    assert s["deadweight/value/scale"][-1][1] == pytest.approx(model.scale.item(), rel=1e-6)
    assert s["deadweight/value/gains/2"][-1][1] == pytest.approx(model.gains[2].item(), rel=1e-6)
    # Mean update norm over each window (steps 11..15 for the record at 15) / param norm.
    windows = {1: (1, 1), 5: (2, 5), 10: (6, 10), 15: (11, 15), 20: (16, 20)}
    for name in ("norm.weight", "scale", "gains"):
        got = dict(s[f"deadweight/update_ratio/{name}"])
        assert sorted(got) == sorted(windows)
        for step, (a, b) in windows.items():
            mean = sum(u[name][0] for u in updates[a - 1 : b]) / (b - a + 1)
            norm = updates[step - 1][name][1]
            assert got[step] == pytest.approx(mean / norm, rel=1e-5), (name, step)
    assert "deadweight/grad_rms/norm.bias" in s
    assert "deadweight/grad_rms/unused" not in s  # no gradient: nothing to plot
    assert s["deadweight/summary/without_grad"][-1] == (20, 1.0)  # `unused`
    assert s["deadweight/summary/unmoved"][-1] == (20, 1.0)
    assert "deadweight/grad_rms/big.weight" not in s  # large: not tracked (big.bias is small)
    # At close: one count per severity and the table.
    assert s["deadweight/findings/error"] == [(20, float(report.counts()["error"]))]
    assert set(writer.texts) == {"deadweight/findings"}
    assert not report.subject["detector_errors"]


def test_never_learning_parameter_reaches_the_table() -> None:
    writer = FakeWriter()
    report, _, _ = train(60, every=10, targets=(writer,))
    assert report.by_code("DW301")
    table = writer.texts["deadweight/findings"]
    assert "DW301" in table and "unused" in table
    assert writer.scalars["deadweight/findings/error"][-1] == (60, 1.0)


def test_per_parameter_tags_are_bounded() -> None:
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(30)])  # 60 small parameters
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    writer = FakeWriter()
    with deadweight.watch(model, opt, every=1) as w:
        forward_to_tensorboard(w, writer, max_params=4)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    kinds = ("value", "grad_rms", "update_ratio")
    names = {tag.split("/")[2] for tag in writer.scalars if tag.split("/")[1] in kinds}
    assert 0 < len(names) <= 4


def test_late_listener_and_step_offset() -> None:
    """Attached after the optimizer was introduced: it learns the layout from the stats."""
    run = FakeRun()
    train(20, targets=(run,), attach_after=7, offset=1000)
    steps = [row["deadweight/step"] for row in run.rows]
    assert steps == [1010, 1015, 1020, 1020]  # three watched steps, then the findings
    assert ("deadweight/*", "deadweight/step") in run.metrics
    scalar_rows, findings = run.rows[:-1], run.rows[-1]
    assert all("deadweight/value/scale" in row for row in scalar_rows)
    assert all("deadweight/update_ratio/scale" in row for row in scalar_rows)
    assert {"deadweight/findings/error", "deadweight/findings/warning"} <= set(findings)
    assert "deadweight/findings" in findings


def test_forward_to_rejects_what_it_cannot_write_to() -> None:
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadweight.watch(model, opt) as w, pytest.raises(TypeError, match="SummaryWriter"):
        forward_to(w, object())


def test_tensorboard_event_files(tmp_path: Path) -> None:
    tensorboard = pytest.importorskip("torch.utils.tensorboard")
    writer = tensorboard.SummaryWriter(log_dir=str(tmp_path))
    train(60, every=10, targets=(writer,))
    writer.close()
    scalars, texts = read_events(tmp_path)
    assert [step for step, _ in scalars["deadweight/value/scale"]] == [1, 10, 20, 30, 40, 50, 60]
    for tag in ("grad_rms/norm.weight", "update_ratio/gains", "summary/unmoved"):
        assert f"deadweight/{tag}" in scalars
    assert scalars["deadweight/findings/error"] == [(60, 1.0)]
    assert "DW301" in texts["deadweight/findings/text_summary"]


def test_real_wandb_run_offline(tmp_path: Path, offline_wandb: Any) -> None:
    """One real run, offline and silent, to see the forwarder works with wandb's own
    `log`, `define_metric` and `Table` (about a second)."""
    started = time.monotonic()
    run = offline_wandb.init(mode="offline", dir=str(tmp_path))
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with deadweight.watch(model, opt, every=5) as w:
        forward_to_wandb(w, run)
        for _ in range(10):
            opt.zero_grad()
            model(torch.randn(4, 80)).sum().backward()
            opt.step()
    assert not w.report().subject["detector_errors"]  # no listener was dropped
    assert run.summary["deadweight/step"] == 10
    assert run.summary["deadweight/value/scale"] == pytest.approx(model.scale.item())
    run.finish()
    assert time.monotonic() - started < 30
    assert list(tmp_path.rglob("*.wandb"))


def test_importing_deadweight_imports_no_framework() -> None:
    code = (
        "import sys, deadweight, deadweight.integrations.forward; "
        "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', "
        "'tensorboard', 'tensorboardX', 'wandb') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_update_ratio_is_finite_for_zero_norm_parameters() -> None:
    """A parameter at exactly zero has no ratio (no division by zero)."""
    writer = FakeWriter()
    train(5, targets=(writer,))
    for tag, points in writer.scalars.items():
        assert all(math.isfinite(v) for _, v in points), tag
