"""`deadweight run`'s step-0 check (watching/step_zero.py) against `deadweight.check` on the
same model and batch, side by side, in-process through the zero-code watch itself.

Where the loss comes out of the model's forward the step-0 check is `check` with the
same loss: the same findings. Where it is computed outside, the check replays the
forward with a stand-in loss and keeps what holds for any loss computed from the
output: the same DW101/DW102/DW2xx, and the DW104/DW105 the graph's structure proves.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight.demos import fused_rmsnorm, layer_scalar_drift
from deadweight.watching.step_monitor import MonitorConfig
from deadweight.watching.step_zero import locate
from deadweight.watching.watcher import GlobalWatch, report_from_stats
from tests.e2e import seeded

STEPS = 3


def zero_code(loop: Callable[[], None]) -> deadweight.Report:
    """The report `deadweight run` would print for `loop` (its watch, in-process)."""
    gc.collect()  # other tests' optimizers, still alive, would make it name by class
    watch = GlobalWatch(config=MonitorConfig(every=1), log=None, argv=[], check=True)
    try:
        loop()
    finally:
        watch.close()
    return report_from_stats(watch.stats)


def facts(findings: Any) -> set[tuple[str, tuple[str, ...], str | None]]:
    """What must agree: the rule, its parameters and where it points."""
    return {
        (f.code, tuple(sorted(f.params)), str(f.location) if f.location else None) for f in findings
    }


def step0(report: deadweight.Report) -> list[deadweight.Finding]:
    return [f for f in report.findings if f.phase == "step 0"]


# -- where the loss is found --------------------------------------------------------


def test_the_loss_is_found_in_the_output_and_behind_scalings_of_it() -> None:
    w = torch.ones(3, requires_grad=True)
    loss = (w * 2).sum()
    out = {"logits": w * 3, "loss": loss}
    assert locate(loss, out) == (("loss",), True)
    assert locate(loss / 4, out) == (("loss",), True)  # gradient accumulation
    assert locate(loss.float() * 1024.0, out) == (("loss",), True)  # a scaler's scale
    assert locate(loss, (out["logits"], loss)) == ((1,), True)


def test_a_loss_computed_from_the_output_points_at_the_tensor_it_came_from() -> None:
    w = torch.ones(3, 4, requires_grad=True)
    logits = w * 3
    loss = F.cross_entropy(logits, torch.tensor([0, 1, 2]))
    assert locate(loss, (logits,)) == ((0,), False)
    other = (torch.ones(2, requires_grad=True) * 2).sum()
    assert locate(other, (logits,)) is None  # from another forward altogether


# -- side by side with deadweight.check --------------------------------------------


def _in_model_loss_run(model: nn.Module, batches: list[torch.Tensor]) -> tuple[Any, Any]:
    opt = torch.optim.AdamW(seeded.decay_groups(model), lr=1e-3)
    first = batches[0]
    checked = deadweight.check(model, lambda: model(input_ids=first, labels=first).loss, opt)

    def loop() -> None:
        for ids in batches:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    return checked, zero_code(loop)


def test_a_scalar_before_the_final_norm_gives_the_same_findings_as_check() -> None:
    model = seeded.tiny_llama()
    name = seeded.scalar_before_final_norm(model)
    checked, report = _in_model_loss_run(model, seeded.batches(STEPS))
    assert report.subject["step0"]["mode"] == "replayed"
    assert facts(step0(report)) == facts(checked.findings)
    codes = {f.code for f in step0(report)}
    assert {"DW104", "DW203", "DW204"} <= codes
    assert all(name in f.params for f in step0(report) if f.code in ("DW104", "DW204"))


def test_frozen_embeddings_under_reentrant_checkpointing_give_the_same_findings() -> None:
    """The classic cut: reentrant checkpointing of layers whose input needs no gradient
    (the embedding is frozen) leaves every checkpointed layer without one."""
    model = seeded.tiny_llama()
    for layer in model.model.layers:  # reentrant, as transformers' own option once was
        forward = layer.forward

        def checkpointed(hidden: torch.Tensor, *args: Any, _f: Any = forward, **kwargs: Any) -> Any:
            run = functools.partial(_f, **kwargs)  # reentrant checkpoint takes no kwargs
            return torch.utils.checkpoint.checkpoint(run, hidden, *args, use_reentrant=True)

        layer.forward = checkpointed
    model.model.embed_tokens.requires_grad_(False)
    checked, report = _in_model_loss_run(model, seeded.batches(STEPS))
    assert report.subject["step0"]["mode"] == "replayed"
    assert facts(step0(report)) == facts(checked.findings)
    cut = [f for f in step0(report) if f.code == "DW101"]
    assert cut and all(p.startswith("model.layers.") for f in cut for p in f.params)


def _seed_side_by_side(setup: Any) -> tuple[deadweight.Report, deadweight.Report]:
    """`check` with a seed's own loss, then its training loop under the zero-code watch
    (the seeds' `loss()` draws the same first batch both times)."""
    checked = deadweight.check(setup.model, setup.loss, setup.optimizer)

    def loop() -> None:
        for _ in range(STEPS):
            setup.loss().backward()
            setup.optimizer.step()
            setup.optimizer.zero_grad()

    return checked, zero_code(loop)


def test_the_fused_kernel_seed_gives_check_s_cut_with_a_stand_in_loss() -> None:
    """Seed 1, whose loss (`F.mse_loss(model(x), y)`) is outside the model: the same cut,
    at the same line, as `check` with the real loss."""
    checked, report = _seed_side_by_side(fused_rmsnorm.make(False))
    assert report.subject["step0"]["mode"] == "structure-only"
    structural = [f for f in checked.findings if f.code.startswith(("DW101", "DW102", "DW2"))]
    assert facts(step0(report)) == facts(structural)
    (cut,) = [f for f in step0(report) if f.code == "DW102"]
    assert cut.location is not None and cut.location.function == "fused_rms_norm"


def test_the_drifting_scalar_seed_is_proven_by_structure_with_a_stand_in_loss() -> None:
    checked, report = _seed_side_by_side(layer_scalar_drift.make())
    assert report.subject["step0"]["mode"] == "structure-only"
    found = {f.code: f for f in step0(report)}
    expected = {f.code: f for f in checked.findings}
    assert "DW104" in found and set(found["DW104"].params) == set(expected["DW104"].params)
    assert "by construction" in found["DW104"].message
    assert {c for c in expected if c.startswith("DW2")} <= set(found)


def test_a_parameter_used_only_by_the_loss_outside_the_model_is_not_called_cut_off() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    temperature = nn.Parameter(torch.ones(1))
    model.register_parameter("temperature", temperature)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))

    def loop() -> None:
        for _ in range(STEPS):
            F.cross_entropy(model(x) / temperature, y).backward()
            opt.step()
            opt.zero_grad()

    report = zero_code(loop)
    assert report.subject["step0"]["mode"] == "structure-only"
    assert not [f for f in step0(report) if "temperature" in f.params]


def test_a_healthy_run_adds_nothing_and_no_check_means_no_step_0() -> None:
    model = seeded.tiny_llama()
    checked, report = _in_model_loss_run(model, seeded.batches(STEPS))
    assert checked.findings == () and step0(report) == []
    watch = GlobalWatch(config=MonitorConfig(every=1), log=None, argv=[], check=False)
    try:
        model(input_ids=seeded.batches(1)[0], labels=seeded.batches(1)[0]).loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.0).step()
    finally:
        watch.close()
    assert "step0" not in report_from_stats(watch.stats).subject


@pytest.mark.parametrize("where", ["eval forward first", "no backward seen"])
def test_what_cannot_be_replayed_is_said_not_guessed(where: str) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loop() -> None:
        with torch.no_grad():
            model(torch.randn(2, 4))  # an evaluation forward is never the one replayed
        if where == "no backward seen":  # gradients set by hand: nothing to replay
            for p in model.parameters():
                p.grad = torch.ones_like(p)
        else:
            model(torch.randn(2, 4)).sum().backward()
        opt.step()

    report = zero_code(loop)
    mode = report.subject["step0"]["mode"]
    assert mode == ("unavailable" if where == "no backward seen" else "structure-only")
    assert step0(report) == []


def test_a_drift_the_step_0_check_predicted_says_so() -> None:
    """Seed 2 under the zero-code watch: DW104 at step 0 (by the graph's structure),
    then DW302 while training, which names the prediction."""
    setup = layer_scalar_drift.make_watchable()
    report = zero_code(lambda: layer_scalar_drift.train(setup, 400, every=400))
    (cancelled,) = [f for f in step0(report) if f.code == "DW104"]
    (drift,) = report.by_code("DW302")
    assert drift.params == cancelled.params
    assert drift.evidence["predicted_at_step_0"] == "DW104"
    assert "Predicted at step 0 (DW104" in drift.message


# -- the log, and what shows the findings ---------------------------------------------


def _cut_model_run(tmp_path: Any) -> tuple[str, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    model[0].register_forward_hook(lambda _m, _i, out: out.detach())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = str(tmp_path / "run.jsonl")
    watch = GlobalWatch(config=MonitorConfig(every=1), log=log, argv=[], check=True)
    try:
        for _ in range(STEPS):
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        watch.close()
    return log, model


def test_the_log_keeps_the_step_0_findings_for_deadweight_report(tmp_path: Any) -> None:
    from deadweight.cli.report import load_log

    log, _ = _cut_model_run(tmp_path)
    ((report, _stats),) = load_log(log)
    first = step0(report)
    assert {f.code for f in first} == {"DW101", "DW102"}
    assert all(set(f.params) == {"0.weight", "0.bias"} for f in first)
    (cut,) = [f for f in first if f.code == "DW102"]
    assert cut.location is not None and __file__.endswith(str(cut.location.file))
    text = str(report)
    assert text.index("At step 0") < text.index("DW102") < text.index("While training")
    assert report.to_dict()["findings"][0]["phase"] == "step 0"


def test_html_and_notebook_show_step_0_in_its_own_section(tmp_path: Any) -> None:
    pytest.importorskip("plotly")
    from deadweight.cli.report import load_log
    from deadweight.report.html import Section, render_html

    log, _ = _cut_model_run(tmp_path)
    ((report, stats),) = load_log(log)
    page = render_html([Section("run.jsonl", report, stats)])
    section = page[page.index('class="step0"') :]
    assert "At step 0" in section and "DW102" in section[: section.index("While training")]
    assert "run.jsonl · step 0" in page
    notebook = report._repr_html_()
    assert notebook.index("At step 0") < notebook.index("DW102") < notebook.index("While training")


def test_a_forged_step_0_finding_is_left_out_and_said(tmp_path: Any) -> None:
    import json

    from deadweight.cli.report import load_log

    log, _ = _cut_model_run(tmp_path)
    lines = Path(log).read_text().splitlines()
    events = [json.loads(line) for line in lines]
    (check,) = [e for e in events if e["event"] == "check"]
    check["findings"].append({"code": "DW101", "name": "no-gradient", "severity": "fatal"})
    check["findings"].append({"code": ["not", "text"]})
    with open(log, "w") as fh:
        fh.write("\n".join(json.dumps(e) for e in events) + "\n")
    ((report, _),) = load_log(log)
    assert {f.code for f in step0(report)} == {"DW101", "DW102"}  # the two real ones
    assert sum("step-0 finding was left out" in p for p in report.subject["problems"]) == 2


def test_the_check_s_own_backward_is_neither_a_loss_nor_a_backward_of_the_script() -> None:
    model = seeded.tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gc.collect()
    watch = GlobalWatch(config=MonitorConfig(every=1), log=None, argv=[], check=True)
    try:
        for ids in seeded.batches(STEPS):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        watch.close()
    assert watch.stats.step0_mode == "replayed"
    assert watch.backwards == STEPS
    assert len(watch.stats.loss_values) == STEPS
