"""Checkpoint forensics on the two seed incidents (DW401-DW405)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

import deadweight
from deadweight.demos import fused_rmsnorm
from tests.watching.rules.test_dynamics import INCIDENT

LAYERS = 32
WIDTH = 64


def _save(model: torch.nn.Module, path) -> str:
    save_file(
        {n: p.detach().clone().contiguous() for n, p in model.state_dict().items()}, str(path)
    )
    return str(path)


@pytest.mark.parametrize("diff", [False, True], ids=["fused", "differentiable"])
def test_seed1_diff_names_w1_and_g(tmp_path, diff: bool) -> None:
    setup = fused_rmsnorm.make(diff)
    before = _save(setup.model, tmp_path / "step-0.safetensors")
    fused_rmsnorm.train(setup, 200)
    after = _save(setup.model, tmp_path / "step-200.safetensors")
    report = deadweight.diff_checkpoints(before, after)
    found = report.by_code("DW401")
    if diff:
        assert not found, str(report)
        return
    (finding,) = found
    assert set(finding.params) == {"l1.weight", "norm.weight"}  # w1 and g; w2 learned
    assert report.subject["relative_change"]["l2.weight"] > 0
    assert report.subject["top_movers"][0]["name"] == "l2.weight"


def _incident_checkpoint(path, last: float, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, value in enumerate([*INCIDENT[:-1], last]):
        tensors[f"layers.{i}.layer_scalar"] = torch.tensor([value])
        # weights in [-2, 2], as in the write-up's quantization table
        tensors[f"layers.{i}.mlp.weight"] = torch.rand(WIDTH, WIDTH, generator=gen) * 4 - 2
    save_file(tensors, str(path))
    return str(path)


def test_seed2_inspect_outlier_and_quantization(tmp_path) -> None:
    path = _incident_checkpoint(tmp_path / "model.safetensors", 56.25)
    report = deadweight.inspect_checkpoints([path], scheme="int4")
    (outlier,) = report.by_code("DW402")
    assert outlier.params == ("layers.31.layer_scalar",)
    assert outlier.evidence["value"] == pytest.approx(56.25)
    joint = [f for f in report.by_code("DW403") if f.evidence.get("quantized_with")]
    assert [f.params for f in joint] == [("layers.31.layer_scalar",)], str(report)
    ev = joint[0].evidence
    assert ev["quantized_with"] == "layers.31.mlp.weight"
    assert ev["effective_bits"] == pytest.approx(4 - math.log2(56.25 / 2), abs=0.1)  # -0.8
    assert ev["zero_fraction"] > 0.9  # the weights collapse to zero
    assert joint[0].severity is deadweight.Severity.WARNING


def test_seed2_healthy_checkpoint_is_quiet(tmp_path) -> None:
    path = _incident_checkpoint(tmp_path / "model.safetensors", 1.2)
    report = deadweight.inspect_checkpoints([path], scheme="int4")
    assert not report.by_code("DW402") and not report.by_code("DW403"), str(report)


def test_seed2_trend_drift_rate(tmp_path) -> None:
    steps = [0, 10_000, 20_000, 35_000, 53_000]
    values = [1.0, 4.2, 9.8, 21.5, 56.25]
    paths = [
        _incident_checkpoint(tmp_path / f"step-{s}.safetensors", v)
        for s, v in zip(steps, values, strict=True)
    ]
    report = deadweight.trend_checkpoints(list(reversed(paths)))  # ordered by step, not by argument
    (drift,) = report.by_code("DW405")
    assert drift.params == ("layers.31.layer_scalar",)
    assert drift.evidence["rate_per_step"] == pytest.approx((56.25 - 1.0) / 53_000)
    assert drift.evidence["steps"] == steps


def test_a_pickled_module_is_an_error_not_an_empty_report(tmp_path) -> None:
    path = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), path)  # the whole module, not its state_dict
    report = deadweight.inspect_checkpoints([str(path)], unsafe_pickle=True)
    assert not report.subject["checkpoints"]
    (error,) = report.subject["errors"]
    assert str(path) in error and "state_dict" in error
