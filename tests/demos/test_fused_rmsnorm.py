"""Seed incident 1: the facts of the candle write-up, reproduced in PyTorch, and caught."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

import deadweight
from deadweight.demos import fused_rmsnorm
from tests.conftest import marker_line

EXAMPLE = Path(__file__).parents[2] / "examples" / "fused_rmsnorm_no_grad.py"


@pytest.fixture(scope="module")
def runs():
    out = {}
    for diff in (False, True):
        setup = fused_rmsnorm.make(diff)
        report = deadweight.check(setup.model, setup.loss, setup.optimizer)
        out[diff] = (report, fused_rmsnorm.train(setup))
    return out


def test_both_paths_start_from_the_same_weights_and_loss(runs):
    a, b = fused_rmsnorm.make(False), fused_rmsnorm.make(True)
    for (na, pa), (nb, pb) in zip(
        a.model.named_parameters(), b.model.named_parameters(), strict=True
    ):
        assert na == nb and torch.equal(pa, pb)
    assert runs[False][1].losses[0] == runs[True][1].losses[0]


def test_fused_path_grads_present(runs):
    assert runs[False][1].grads_present == {"w1": False, "g": False, "w2": True}
    assert runs[True][1].grads_present == {"w1": True, "g": True, "w2": True}


def test_fused_path_plateaus_while_diff_keeps_learning(runs):
    fused, diff = runs[False][1].losses, runs[True][1].losses
    assert fused[250] < fused[0]  # it does learn at first: w2 moves
    # ...then a plateau: no progress from step 250 to 1000 (the seed's 0.00075 x4)
    assert fused[1000] == pytest.approx(fused[250], rel=2e-3)
    # the differentiable path keeps going down, well below the plateau
    assert diff[250] > diff[500] > diff[750] > diff[1000]
    assert diff[1000] < fused[1000] / 10


def test_w1_and_g_never_move_on_the_fused_path(runs):
    fused, diff = runs[False][1].max_change, runs[True][1].max_change
    assert fused["w1"] == 0.0 and fused["g"] == 0.0  # "w1 max |change| after 1000 steps: 0"
    assert fused["w2"] > 0
    assert diff["w1"] > 0 and diff["g"] > 0


def test_check_reports_the_fused_kernel(runs):
    report = runs[False][0]
    (dw101,) = report.by_code("DW101")
    (dw102,) = report.by_code("DW102")
    assert set(dw101.params) == {"l1.weight", "norm.weight"}  # w1 and g
    assert set(dw102.params) == {"l1.weight", "norm.weight"}
    assert dw102.evidence["kind"] == "no-grad"
    assert dw102.location.file.endswith("fused_rmsnorm.py")
    assert dw102.location.function == "fused_rms_norm"
    assert dw102.location.line == marker_line(fused_rmsnorm.fused_rms_norm, "the fused kernel")
    assert "RMSNorm.forward" in dw102.evidence["called_from"]
    assert "DW102" in dw101.message and "SGD" in dw101.message


def test_check_is_clean_on_the_diff_path(runs):
    report = runs[True][0]
    assert not report.by_code("DW101") and not report.by_code("DW102")
    assert report.ok  # nothing above info (l1 feeding RMSNorm is scale-invariant: info)


def test_example_script_runs(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE)])
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    assert "grads present: w1 False g False w2 True" in out
    assert "DW102" in out
