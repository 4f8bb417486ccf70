"""The loss curve and its plateau, the predicted drift of DW302, and a saved `check` result
in the HTML report (without a browser: the figures are read from the page)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from deadweight.cli import main
from deadweight.registry import get_rule
from deadweight.report import Report, loss_curve
from deadweight.report import html as html_report
from deadweight.watching.watch_stats import WatchStats
from tests.report.html_inputs import LAST, dw, figure, loss_log

pytest.importorskip("plotly", reason="the HTML report needs deadweight[html]")


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["report", *args])
    return code, capsys.readouterr().err


def _slow_plateau_start(steps: list[int], values: list[float]) -> int | None:
    """The plateau's definition, spelled out point by point."""
    n = len(values)
    window = max(1, round(n * loss_curve.SMOOTH_SHARE))
    half = window // 2
    smoothed = []
    for i in range(n):
        part = values[max(0, i - half) : min(n, i + window - half)]
        smoothed.append(sum(part) / len(part))
    tail = values[-max(window, math.ceil(n * loss_curve.TAIL_SHARE)) :]
    level = sum(tail) / len(tail)
    std = math.sqrt(sum((v - level) ** 2 for v in tail) / len(tail))
    tolerance = max(loss_curve.PLATEAU_FALL * abs(level), 4 * std / math.sqrt(window))
    start = 0
    for i in range(n):
        if abs(smoothed[i] - level) > tolerance:
            start = i + 1
    if start >= n or steps[-1] - steps[start] < loss_curve.MIN_PLATEAU_SHARE * (
        steps[-1] - steps[0]
    ):
        return None
    return steps[start]


# -- the loss curve ------------------------------------------------------------------------------


def test_first_incident_loss_curve_with_its_plateau(capsys, tmp_path):
    log = loss_log(tmp_path / "fused.jsonl")
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(log), "-o", str(out))
    assert code == 1, err  # DW301: w1 and g never moved
    text = out.read_text()
    loss = figure(text, "s0-loss")
    traces = {t["name"]: t for t in loss["data"]}
    curve = traces["loss"]
    assert curve["x"] == list(range(1, 1001)) and len(curve["y"]) == 1000
    (label,) = [n for n in traces if n.startswith("plateau from step")]
    assert "DW301: 2 never moved" in label
    start = int(label.split()[3])
    # The same start from the definition spelled out slowly, on the logged losses.
    events = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [s for e in events if e["event"] == "loss" for s in e["steps"]]
    values = [v for e in events if e["event"] == "loss" for v in e["values"]]
    assert _slow_plateau_start(steps, values) == start
    # The loss really is flat from there: within 1% of where it ends, having fallen 15x.
    at_start, last = values[start - 1], values[-1]
    assert abs(at_start - last) <= 0.011 * last and values[0] > 10 * last
    assert traces[label]["x"] == [start, 1000]
    (shaded,) = loss["layout"]["shapes"]
    assert (shaded["x0"], shaded["x1"]) == (start, 1000)
    assert "never moved" in text and 'data-note="no-loss"' not in text


def test_a_healthy_run_has_a_curve_and_no_plateau(capsys, tmp_path):
    log = loss_log(tmp_path / "healthy.jsonl", diff=True, steps=300)
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(log), "-o", str(out))
    assert code == 0, err
    names = [t["name"] for t in figure(out.read_text(), "s0-loss")["data"]]
    assert "loss" in names and not any(n.startswith("plateau") for n in names)


def test_a_log_without_loss_says_so_and_draws_no_curve(capsys, tmp_path, drift_jsonl):
    drift = drift_jsonl  # logs no loss
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(drift), "-o", str(out))
    assert code == 1, err
    text = out.read_text()
    assert 'data-note="no-loss"' in text and "The loss was not recorded" in text
    assert "s0-loss" not in text


def test_a_bad_loss_event_is_noted_and_the_rest_reported(capsys, tmp_path):
    lines = loss_log(tmp_path / "fused.jsonl", steps=100).read_text().splitlines()
    broken = [json.loads(line) for line in lines]
    first = next(e for e in broken if e["event"] == "loss")
    first["values"] = first["values"][:-1]  # one value short
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(e) + "\n" for e in broken))
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(bad), "-o", str(out))
    assert code == 1, err
    assert "1 'loss' event(s) could not be read" in err
    text = out.read_text()
    x = figure(text, "s0-loss")["data"][0]["x"]
    assert len(x) == 100 - len(first["steps"]) and "DW301" in text


def test_run_records_the_loss_without_code(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from deadweight.demos import fused_rmsnorm as f\n"
        "s = f.make(False, seed=1)\nf.train(s, 300)\n"
    )
    out = tmp_path / "run.html"
    result = dw("run", "--every", "10", "--log", str(tmp_path / "run.jsonl"), "--html", str(out),
                "--", "python", str(script))  # fmt: skip
    assert result.returncode == 1, result.stderr  # the script exits 0; its findings are errors
    names = [t["name"] for t in figure(out.read_text(), "s0-loss")["data"]]
    # f.train runs one more backward than steps, for the last loss: 301 losses.
    (curve,) = [t for t in figure(out.read_text(), "s0-loss")["data"] if t["name"] == "loss"]
    assert curve["x"] == list(range(1, 302))
    assert any(n.startswith("plateau from step") for n in names)


def test_long_loss_series_is_downsampled_keeping_the_plateau_start():
    n = 100_000
    rng = np.random.default_rng(0)
    steps = np.arange(1, n + 1)
    values = np.where(steps < 30_001, 3.0 - 2.0 * steps / 30_000, 1.0)
    values = values * (1 + 0.02 * rng.standard_normal(n))
    stats = WatchStats(loss_steps=steps.tolist(), loss_values=values.tolist())
    finding = get_rule("DW301").finding("never moved", params=["l1.weight"])
    section = html_report.Section("big.jsonl", Report.of("watch", [finding], {}), stats)
    text = html_report.render_html([section])
    data = {t["name"]: t for t in figure(text, "s0-loss")["data"]}
    (label,) = [k for k in data if k.startswith("plateau from step")]
    start = int(label.split()[3])
    assert 29_000 < start < 32_000
    x = data["loss"]["x"]
    assert len(x) <= html_report.MAX_POINTS + 6
    assert start in x and x[0] == 1 and x[-1] == n


def test_the_plateau_is_drawn_for_the_rules_that_declare_it():
    """The loss plot marks a plateau for a rule that declares the `loss-plateau` figure
    (DW301), whatever its code; another rule's finding on the same curve marks none."""
    steps = np.arange(1, 2001)
    stats = WatchStats(
        loss_steps=steps.tolist(), loss_values=np.where(steps < 500, 2.0, 1.0).tolist()
    )
    assert get_rule("DW301").plots == ("loss-plateau",)
    for code, marked in (("DW301", True), ("DW310", False)):
        finding = get_rule(code).finding("found", params=["l1.weight"])
        section = html_report.Section("run.jsonl", Report.of("watch", [finding], {}), stats)
        names = [t["name"] for t in figure(html_report.render_html([section]), "s0-loss")["data"]]
        assert any(n.startswith("plateau from step") for n in names) is marked, code


# -- the plateau's definition --------------------------------------------------------------------


def test_per_step_means_against_a_slow_reference():
    steps = [3, 1, 1, 2, 3, 3, 4]
    values = [1.0, 2.0, 4.0, None, 5.0, float("nan"), 7.0]
    curve = loss_curve.per_step(steps, values)
    assert curve.steps.tolist() == [1, 3, 4]
    assert curve.values.tolist() == [3.0, 3.0, 7.0]
    assert (curve.averaged_steps, curve.nonfinite) == (2, 2)


def test_smoothing_against_a_slow_reference():
    y = np.random.default_rng(1).standard_normal(37)
    for window in (1, 2, 5, 36, 50):
        got = loss_curve.smooth(y, window)
        half = window // 2
        for i in range(len(y)):
            part = y[max(0, i - half) : min(len(y), i + window - half)]
            assert got[i] == pytest.approx(part.mean())


@pytest.mark.parametrize("seed", range(5))
def test_a_noisy_plateau_starts_where_the_fall_ends(seed):
    rng = np.random.default_rng(seed)
    steps = np.arange(1, 5001)
    clean = np.where(steps <= 1000, 2.0 - steps / 1000, 1.0)
    noisy = clean * (1 + 0.05 * rng.standard_normal(len(steps)))
    plateau = loss_curve.find_plateau(loss_curve.per_step(steps.tolist(), noisy.tolist()))
    assert plateau is not None and 900 <= plateau.start_step <= 1100
    assert plateau.end_step == 5000


@pytest.mark.parametrize(
    "values",
    [
        np.arange(1, 5001) ** -0.05,  # a language model's loss, still falling
        np.linspace(1.0, 2.0, 5000),  # rising
        np.linspace(2.0, 1.0, 5000),  # falling to the end
    ],
    ids=["power-law", "rising", "falling"],
)
def test_no_plateau_while_the_loss_moves(values):
    steps = list(range(1, len(values) + 1))
    assert loss_curve.find_plateau(loss_curve.per_step(steps, values.tolist())) is None


def test_a_flat_loss_is_a_plateau_from_the_start_and_a_short_one_is_none():
    flat = loss_curve.per_step(list(range(1, 101)), [1.0] * 100)
    plateau = loss_curve.find_plateau(flat)
    assert plateau is not None and plateau.start_step == 1
    few = loss_curve.per_step(list(range(1, loss_curve.MIN_RECORDS)), [1.0] * 19)
    assert loss_curve.find_plateau(few) is None


# -- DW302: the measured drift next to the predicted one -----------------------------------------


def test_drift_plot_shows_the_predicted_rate(capsys, tmp_path, drift_jsonl):
    log = drift_jsonl
    saved = tmp_path / "watch.json"
    main(["report", str(log), "--format", "json"])
    saved.write_text(capsys.readouterr().out)
    (finding,) = [f for f in json.loads(saved.read_text())["findings"] if f["code"] == "DW302"]
    ev = finding["evidence"]
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(log), "-o", str(out))
    assert code == 1, err
    div = f"s0-p-{LAST.replace('.', '_')}"
    traces = {t["name"]: t for t in figure(out.read_text(), div)["data"]}
    (predicted,) = [t for n, t in traces.items() if n.startswith("predicted")]
    (measured,) = [t for n, t in traces.items() if n.startswith("measured drift")]
    # Adam on noise: steps of mean_update_lr * lr, (2p - 1) of them net one way.
    rate = ev["mean_update_lr"] * ev["mean_lr"] * (2 * ev["same_sign_fraction"] - 1)
    (x0, x1), (y0, y1) = predicted["x"], predicted["y"]
    assert abs(y1 - y0) / (x1 - x0) == pytest.approx(rate, rel=1e-6)
    assert y0 == pytest.approx(ev["first_value"])
    # The scalar falls; both lines go its way, and the prediction is within 30% of it.
    (m0, m1) = measured["y"]
    assert y1 < y0 and m1 < m0
    assert abs(y1 - y0) == pytest.approx(abs(m1 - m0), rel=0.3)


def test_a_drift_saved_without_its_prediction_draws_only_the_measured_line(drift_jsonl):
    """The prediction is DW302's number (its evidence), not the page's: evidence written
    before it carried one draws the measured drift alone, and nothing the page works out."""
    from deadweight.cli.report import load_log

    ((report, stats),) = load_log(drift_jsonl)
    (finding,) = report.by_code("DW302")
    assert finding.evidence["predicted_drift_per_step"] > 0
    older = {k: v for k, v in finding.evidence.items() if not k.startswith("predicted_")}
    findings = [
        dataclasses.replace(f, evidence=older) if f is finding else f for f in report.findings
    ]
    saved = dataclasses.replace(report, findings=tuple(findings))
    page = html_report.render_html([html_report.Section("old", saved, stats)])
    names = [t["name"] for t in figure(page, f"s0-p-{LAST.replace('.', '_')}")["data"]]
    assert any(n.startswith("measured drift") for n in names)
    assert not any(n.startswith("predicted") for n in names)


# -- a saved check ---------------------------------------------------------------------------------


def test_saved_check_shows_its_evidence(tmp_path):
    factory = tmp_path / "model.py"
    factory.write_text(
        "from deadweight.demos import layer_scalar_drift as d\n"
        "def make():\n    s = d.make_watchable()\n    return s.model, s.loss, s.optimizer\n"
    )
    saved = tmp_path / "check.json"
    result = dw("check", f"{factory}:make", "--format", "json")
    assert result.returncode == 1, result.stderr
    saved.write_text(result.stdout)
    out = tmp_path / "r.html"
    result = dw("report", str(saved), "-o", str(out))
    assert result.returncode == 1, result.stderr
    text = out.read_text()
    findings = json.loads(saved.read_text())["findings"]
    codes = {f["code"] for f in findings}
    assert {"DW104", "DW203", "DW204"} <= codes
    # Every finding's evidence is in the table, and the measured gradients are plotted.
    assert text.count("<details><summary>data</summary>") == len(findings)
    assert "expected_step" in text and "noise_rms" in text
    (dw104,) = [f for f in findings if f["code"] == "DW104"]
    bars = figure(text, f"s0-f{findings.index(dw104)}-grads")["data"][0]
    assert bars["y"] == [LAST]
    assert bars["x"] == [pytest.approx(dw104["evidence"]["params"][LAST]["grad_norm"])]
    assert "model ScalarStack" in text and "optimizer AdamW" in text


# -- bad input, with the loss --------------------------------------------------------------------


def test_a_log_cut_inside_a_loss_event_keeps_the_complete_ones(capsys, tmp_path):
    lines = loss_log(tmp_path / "fused.jsonl", steps=200).read_text().splitlines(keepends=True)
    last_loss = max(i for i, line in enumerate(lines) if '"event":"loss"' in line)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:last_loss]) + lines[last_loss][:40])  # killed mid-write
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(cut), "-o", str(out))
    assert code == 1, err
    assert f"line {last_loss + 1} is cut off" in err
    kept = [json.loads(line) for line in lines[:last_loss] if '"event":"loss"' in line]
    x = figure(out.read_text(), "s0-loss")["data"][0]["x"]
    assert x == [s for e in kept for s in e["steps"]]
    assert "is cut off" in out.read_text()


def test_logs_of_two_runs_are_shown_apart(capsys, tmp_path):
    first = loss_log(tmp_path / "a.jsonl", steps=100)
    second = loss_log(tmp_path / "b.jsonl", diff=True, steps=100)
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(first), str(second), "-o", str(out))
    assert code == 1, err
    assert "the inputs come from 2 different runs" in err
    text = out.read_text()
    assert figure(text, "s0-loss")["data"][0]["y"] != figure(text, "s1-loss")["data"][0]["y"]
    assert "nothing is merged" in text
