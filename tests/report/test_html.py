"""The HTML report without a browser: inputs of every kind, --html on each command, bad
input, a missing plotly, and the downsampling of long series."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

import deadweight
from deadweight.cli import main
from deadweight.demos import fused_rmsnorm
from deadweight.report import html as html_report
from tests.report.html_inputs import LAST, checkpoint_reports, dw, figure, incident_checkpoints

pytest.importorskip("plotly", reason="the HTML report needs deadweight[html]")


class _Page(HTMLParser):
    """Ids, links, table rows and plot divs of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.rows: list[dict[str, str]] = []
        self.plots: list[str] = []
        self.scripts_with_src: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "a" and "href" in a:
            self.links.append(a["href"])
        if tag == "tr" and "data-code" in a:
            self.rows.append(a)
        if tag == "div" and "data-plot" in a:
            self.plots.append(a["data-plot"])
        if tag in ("script", "link", "img") and (a.get("src") or a.get("href")):
            self.scripts_with_src.append(a.get("src") or a.get("href") or "")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory, drift_jsonl: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("inputs")
    log = drift_jsonl
    paths = incident_checkpoints(d)
    saved = checkpoint_reports(paths)
    out = {"log": log, "checkpoints": d}
    for kind, report in saved.items():
        out[kind] = d / f"{kind}.json"
        out[kind].write_text(report.to_json())
    return out


def _report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["report", *args])
    return code, capsys.readouterr().err


def test_one_page_from_every_kind_of_input(capsys, inputs, tmp_path):
    out = tmp_path / "report.html"
    files = [str(inputs[k]) for k in ("log", "inspect", "diff", "trend")]
    code, err = _report(capsys, *files, "-o", str(out))
    assert code == 1, err  # findings, and no input problem
    text = out.read_text()
    page = _Page(text)
    # Offline: no external script, stylesheet or image; plotly.js is inlined.
    assert page.scripts_with_src == []
    assert not re.search(r"<script[^>]+src=", text)
    # Every finding of every input is a row, with its rule's docs and evidence in the page.
    expected = [json.loads(inputs[k].read_text())["findings"] for k in ("inspect", "diff", "trend")]
    codes = {f["code"] for findings in expected for f in findings} | {"DW302", "DW303", "DW307"}
    assert {r["data-code"] for r in page.rows} == codes
    assert len(page.rows) == sum(map(len, expected)) + 3
    for code in codes:
        assert f"rule-{code}" in page.ids and f"#rule-{code}" in page.links
    plot_links = [link[1:] for link in page.links if not link.startswith("#rule-")]
    assert plot_links and all(target in page.plots for target in plot_links)
    # The plots the inputs call for.
    assert any(p.endswith(f"-p-{LAST.replace('.', '_')}") for p in page.plots)  # trajectory
    assert sum(p.endswith("-layers") for p in page.plots) == 2  # DW307 (watch), DW402 (inspect)
    assert any("-bits-" in p for p in page.plots)
    assert any(p.endswith("-movers") for p in page.plots)
    assert any(p.endswith("-trend") for p in page.plots)
    # The summary: counts, inputs, versions; and the log's missing loss is said, not drawn.
    assert f"deadweight {deadweight.__version__}" in text and "report schema 1" in text
    assert "there is no loss curve" in text


def test_text_stays_the_default_for_saved_json(capsys, inputs):
    code = main(["report", str(inputs["inspect"])])
    out = capsys.readouterr().out
    assert code == 1
    assert "DW402" in out and "layers.31.layer_scalar" in out
    assert "<html" not in out


def test_html_option_on_each_command(inputs, tmp_path):
    ckpts = sorted(str(p) for p in inputs["checkpoints"].glob("step-*.safetensors"))
    first, last = str(inputs["checkpoints"] / "step-0.safetensors"), ckpts[-1]
    runs = {
        "inspect": ["inspect", last, "--scheme", "int4"],
        "diff": ["diff", first, last],
        "trend": ["trend", str(inputs["checkpoints"])],
        "check": ["check", str(tmp_path / "model.py")],
    }
    (tmp_path / "model.py").write_text(
        "from deadweight.demos import fused_rmsnorm as f\n"
        "def make():\n    s = f.make(False)\n    return s.model, s.loss, s.optimizer\n"
    )
    for kind, args in runs.items():
        out = tmp_path / f"{kind}.html"
        plain = dw(*args)
        result = dw(*args, "--html", str(out))
        assert result.returncode == plain.returncode, result.stderr
        assert result.stdout == plain.stdout  # the terminal report is unchanged
        page = _Page(out.read_text())
        assert page.rows, kind  # each of these inputs has findings
        if kind != "check":  # check measures no series to plot
            assert page.plots, kind


def test_html_option_on_run(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "from deadweight.demos import fused_rmsnorm as f\n"
        "s = f.make(False, seed=1)\nf.train(s, 60)\n"
    )
    out, log = tmp_path / "run.html", tmp_path / "run.jsonl"
    result = dw("run", "--every", "10", "--log", str(log), "--html", str(out), "--",
                "python", str(script))  # fmt: skip
    assert result.returncode == 1, result.stderr  # the script exits 0; DW301 is an error
    page = _Page(out.read_text())
    assert {r["data-code"] for r in page.rows} >= {"DW301"}
    assert any("-p-l1_weight" in p for p in page.plots)  # the parameter that never moved


def test_missing_plotly_names_the_extra(tmp_path, inputs):
    blocker = tmp_path / "blocker" / "plotly"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('plotly is not installed')\n")
    env = {"PYTHONPATH": str(blocker.parent)}
    for args in (
        ["report", str(inputs["log"]), "-o", str(tmp_path / "r.html")],
        ["trend", str(inputs["checkpoints"]), "--html", str(tmp_path / "t.html")],
    ):
        result = dw(*args, env=env)
        assert result.returncode == 2, result.stderr
        assert "deadweight[html]" in result.stderr
        assert not list(tmp_path.glob("*.html"))


# -- bad input -------------------------------------------------------------------------------


def test_truncated_log_line_is_noted_and_the_rest_reported(capsys, inputs, tmp_path):
    lines = inputs["log"].read_text().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:-3]) + lines[-3][: len(lines[-3]) // 2])
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(cut), "-o", str(out))
    assert code == 1, err
    assert f"line {len(lines) - 2} is cut off" in err
    text = out.read_text()
    assert "Read with problems" in text and "is cut off" in text
    assert "DW302" in {r["data-code"] for r in _Page(text).rows}


def test_newer_schema_is_noted(capsys, inputs, tmp_path):
    events = [json.loads(line) for line in inputs["log"].read_text().splitlines()]
    events[0]["schema_version"] = 99
    newer = tmp_path / "newer.jsonl"
    newer.write_text("".join(json.dumps(e) + "\n" for e in events))
    saved = json.loads(inputs["inspect"].read_text())
    saved["schema_version"] = 99
    newer_json = tmp_path / "newer.json"
    newer_json.write_text(json.dumps(saved))
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(newer), str(newer_json), "-o", str(out))
    assert code == 1, err
    assert "log schema version 99 is newer" in err
    assert "report schema version 99 is newer" in err
    rows = {r["data-code"] for r in _Page(out.read_text()).rows}
    assert {"DW302", "DW402"} <= rows


def test_empty_file_is_skipped_and_the_others_reported(capsys, inputs, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(empty), str(inputs["trend"]), "-o", str(out))
    assert code == 2  # an input could not be read
    assert f"{empty} is empty; skipped" in err
    text = out.read_text()
    assert "is empty; skipped" in text and "DW405" in text
    # Nothing readable at all: an error, and no page.
    alone = tmp_path / "alone.html"
    code, err = _report(capsys, str(empty), "-o", str(alone))
    assert code == 2 and "nothing to report" in err and not alone.exists()


def test_not_a_deadweight_file_is_skipped(capsys, inputs, tmp_path):
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(other), str(inputs["diff"]), "-o", str(out))
    assert code == 2 and "not deadweight's output" in err
    assert any(p.endswith("-movers") for p in _Page(out.read_text()).plots)


def test_mixed_runs_are_shown_apart(capsys, inputs, tmp_path):
    other = tmp_path / "other.jsonl"
    setup = fused_rmsnorm.make(False, seed=1)
    with deadweight.watch(setup.model, setup.optimizer, log=other, every=10):
        fused_rmsnorm.train(setup, 60)
    both = tmp_path / "both.jsonl"  # two runs appended to one log
    both.write_text(inputs["log"].read_text() + other.read_text())
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(both), "-o", str(out))
    assert code == 1, err
    assert "holds 2 runs; each is reported on its own" in err
    assert "the inputs come from 2 different runs" in err
    text = out.read_text()
    assert "run 1 of 2" in text and "run 2 of 2" in text
    rows = {r["data-code"] for r in _Page(text).rows}
    assert {"DW302", "DW301"} <= rows  # each run's own findings
    # Text output of the same log still reports the last run only.
    main(["report", str(both)])
    assert "DW302" not in capsys.readouterr().out


# -- downsampling ----------------------------------------------------------------------------


def test_downsample_keeps_extremes_and_flagged_steps():
    rng = np.random.default_rng(0)
    n = 100_000
    steps = np.arange(1, n + 1) * 20
    y = rng.standard_normal(n).cumsum()
    y[777] = np.nan
    # Two steps with a record, one between two records (a reset at step 50,001).
    flagged = [int(steps[12_345]), int(steps[99_998]), int(steps[2_500]) + 1]
    idx = html_report.downsample(y, steps, flagged)
    assert len(idx) <= html_report.MAX_POINTS + 2 + 2 * len(flagged)
    assert np.all(np.diff(idx) > 0)
    kept = set(idx.tolist())
    assert {0, n - 1, 12_345, 99_998, 2_500, 2_501} <= kept
    assert int(np.nanargmax(y)) in kept and int(np.nanargmin(y)) in kept
    # Slow reference: every bucket's own lowest and highest point is kept.
    edges = np.linspace(0, n, html_report.MAX_POINTS // 2 + 1).astype(int)
    for lo, hi in itertools.pairwise(edges):
        chunk = y[lo:hi]
        assert lo + int(np.nanargmin(chunk)) in kept and lo + int(np.nanargmax(chunk)) in kept
    short = html_report.downsample(y[:50], steps[:50])
    assert short.tolist() == list(range(50))


def test_saved_watch_report_still_shows_the_layer_bars(capsys, inputs, tmp_path):
    main(["report", str(inputs["log"]), "--format", "json"])
    saved = tmp_path / "watch.json"
    saved.write_text(capsys.readouterr().out)
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(saved), "-o", str(out))
    assert code == 1, err
    page = _Page(out.read_text())
    assert [p for p in page.plots if p.endswith("-layers")] == ["s0-f2-layers"]  # DW307
    assert not any("-p-" in p for p in page.plots)  # no per-step data in a saved report


def test_text_from_a_saved_report_is_escaped(capsys, inputs, tmp_path):
    saved = json.loads(inputs["diff"].read_text())
    hostile = '"><script>alert(1)</script>'
    saved["findings"][0].update(code="DW9" + hostile, message=hostile, params=[hostile])
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(saved))
    out = tmp_path / "r.html"
    code, err = _report(capsys, str(path), "-o", str(out))
    assert code == 1, err
    text = out.read_text()
    assert "<script>alert(1)" not in text
    assert "not known to this version" in text  # the unknown code's docs entry


def test_layer_outlier_by_rms_is_plotted(tmp_path):
    """DW402 on matrices compares RMS (its evidence says "RMS"): the bars of every layer,
    each the tensor's RMS."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.w": torch.randn(8, 8, generator=gen) * (50 if i == 3 else 1)
               for i in range(6)}  # fmt: skip
    path = tmp_path / "rms.safetensors"
    save_file(tensors, str(path))
    report = deadweight.inspect_checkpoints([str(path)])
    (finding,) = report.by_code("DW402")
    assert finding.evidence["statistic"] == "RMS"
    page = html_report.render_html([html_report.Section("rms", report)])
    (div,) = re.findall(r'data-plot="(s0-f\d+-layers)"', page)
    (bars,) = figure(page, div)["data"]
    assert bars["x"] == [str(i) for i in range(6)]
    # RMS from the rows' mean and std; a sample std (n - 1) is off by at most √(64/63), 0.8%
    rms = [float(t.square().mean().sqrt()) for t in tensors.values()]
    assert bars["y"] == pytest.approx(rms, rel=0.02)
    assert bars["marker"]["color"][3] == "#c62828"


def test_layer_bars_saved_without_their_values_come_from_the_tensor_table(tmp_path):
    """DW402's bars are the values its evidence carries; a report saved before it carried
    them draws the same bars from the saved tensor table."""
    import torch
    from safetensors.torch import save_file

    tensors = {f"layers.{i}.s": torch.tensor([1.0 + 0.01 * i]) for i in range(5)}
    tensors["layers.5.s"] = torch.tensor([40.0])
    path = tmp_path / "scalars.safetensors"
    save_file(tensors, str(path))
    report = deadweight.inspect_checkpoints([str(path)])
    (finding,) = report.by_code("DW402")
    assert finding.evidence["values"] == {n: float(v) for n, v in tensors.items()}
    older = {k: v for k, v in finding.evidence.items() if k != "values"}
    saved = dataclasses.replace(report, findings=(dataclasses.replace(finding, evidence=older),))
    bars = []
    for shown in (report, saved):
        page = html_report.render_html([html_report.Section("s", shown)])
        (div,) = re.findall(r'data-plot="(s0-f\d+-layers)"', page)
        bars.append(figure(page, div)["data"])
    assert bars[0] == bars[1] and bars[0][0]["y"][5] == 40.0


def test_a_clean_report_has_no_empty_rules_section():
    subject = {"model": "Net", "parameters": 2}
    clean = deadweight.Report.of("check", [], subject)
    page = html_report.render_html([html_report.Section("clean", clean)])
    assert "no findings" in page
    assert 'id="rules"' not in page and "<h2>Rules</h2>" not in page
    finding = deadweight.Finding(
        code="DW101", name="no-gradient", severity=deadweight.Severity.ERROR, message="none"
    )
    found = deadweight.Report.of("check", [finding], subject)
    page = html_report.render_html([html_report.Section("found", found)])
    (rules,) = re.findall(r'<section id="rules">.*?</section>', page, re.S)
    assert '<div class="rule" id="rule-DW101">' in rules
