"""The HTML report in a real browser: Debian's Chromium driven by playwright, offline.

In CI (.ci/run installs Chromium) a missing browser fails the tests; elsewhere they are
skipped with the reason."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import deadweight
from deadweight.cli import main
from tests.report.hostile import save_hostile
from tests.report.html_inputs import (
    DRIFT_STEPS,
    LAST,
    VALUES,
    checkpoint_reports,
    incident_checkpoints,
    loss_log,
)

# The switches that keep Chromium from talking to anything on its own.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: .ci/run installs it (apt-get install chromium, pip .[test])")
    pytest.skip(reason)


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        _missing("no chromium on PATH")
    assert path is not None
    return path


@pytest.fixture(scope="module")
def browser_context() -> Iterator[Any]:
    executable = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed")
    with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
        context = p.chromium.launch_persistent_context(
            profile,
            executable_path=executable,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1280, "height": 900},
        )
        try:
            yield context
        finally:
            context.close()


class Opened:
    def __init__(self, page: Any, requests: list[str], errors: list[str]) -> None:
        self.page, self.requests, self.errors = page, requests, errors


def open_offline(context: Any, path: Path) -> Opened:
    """Open a file with every request recorded and all but the file itself refused."""
    url = path.resolve().as_uri()
    requests: list[str] = []
    errors: list[str] = []

    def route(r: Any) -> None:
        requests.append(r.request.url)
        if r.request.url == url:
            r.continue_()
        else:
            r.abort()

    page = context.new_page()
    page.route("**/*", route)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    page.goto(url, wait_until="load")
    return Opened(page, requests, errors)


@pytest.fixture(scope="module")
def report_page(tmp_path_factory: pytest.TempPathFactory, drift_jsonl: Path) -> Path:
    d = tmp_path_factory.mktemp("browser")
    log = drift_jsonl
    paths = incident_checkpoints(d)
    saved = checkpoint_reports(paths)
    files = [str(log), str(loss_log(d / "fused.jsonl"))]
    for kind, report in saved.items():
        (d / f"{kind}.json").write_text(report.to_json())
        files.append(str(d / f"{kind}.json"))
    out = d / "report.html"
    assert main(["report", *files, "-o", str(out)]) == 1
    return out


PLOTS = """
() => Array.from(document.querySelectorAll('div.js-plotly-plot')).map(gd => ({
  id: gd.id,
  title: (gd.layout.title && gd.layout.title.text) || '',
  traces: gd.data.length,
  points: gd.data.reduce((n, t) => n + ((t.y && t.y.length) || 0), 0),
  svg: gd.querySelectorAll('svg.main-svg').length,
  width: gd.getBoundingClientRect().width,
  height: gd.getBoundingClientRect().height,
  drawn: gd.querySelectorAll('path.js-line, g.point, path.point').length,
}))
"""


def test_report_opens_offline_with_every_plot_drawn(browser_context, report_page, tmp_path):
    opened = open_offline(browser_context, report_page)
    page = opened.page
    try:
        assert opened.errors == []
        # Only the page itself was loaded: nothing left the machine, nothing was refused.
        assert opened.requests == [report_page.resolve().as_uri()]
        plots = page.evaluate(PLOTS)
        ids = {p["id"] for p in plots}
        expected_ids = set(
            page.evaluate(
                "Array.from(document.querySelectorAll('[data-plot]'), d => d.dataset.plot)"
            )
        )
        assert ids == expected_ids and len(ids) >= 6
        for plot in plots:
            assert plot["traces"] > 0 and plot["points"] > 0, plot
            assert plot["svg"] > 0 and plot["width"] > 100 and plot["height"] > 100, plot
            assert plot["drawn"] > 0, plot  # lines or bars were actually drawn
        titles = " | ".join(p["title"] for p in plots)
        for needle in ("DW402", "DW307", LAST, "effective bits", "top movers", "single-element"):
            assert needle in titles
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 50_000
    finally:
        page.close()


def test_the_32_layer_scalars_with_the_outlier_highlighted(browser_context, report_page):
    opened = open_offline(browser_context, report_page)
    page = opened.page
    try:
        bars = page.evaluate(
            """() => Array.from(document.querySelectorAll('div.js-plotly-plot'))
                 .filter(gd => gd.layout.title.text.startsWith('DW402'))
                 .map(gd => ({y: gd.data[0].y, x: gd.data[0].x, colour: gd.data[0].marker.color,
                              drawn: gd.querySelectorAll('g.point').length}))"""
        )
        (chart,) = bars
        assert chart["x"] == [str(i) for i in range(32)]
        assert len(chart["y"]) == 32 and chart["drawn"] == 32
        assert chart["y"][31] == pytest.approx(56.25)
        assert max(chart["y"][:31]) < 1.3
        red = [i for i, c in enumerate(chart["colour"]) if c == "#c62828"]
        assert red == [31]
        # The drift: the trend of the same scalar over the saves, and the watched run's
        # trajectory with the optimizer reset marked.
        trend = page.evaluate(
            """() => Array.from(document.querySelectorAll('div.js-plotly-plot'))
                 .filter(gd => gd.id.endsWith('-trend'))
                 .map(gd => gd.data.map(t => ({name: t.name, y: t.y})))[0]"""
        )
        (series,) = [t for t in trend if t["name"] == "layers.31.layer_scalar"]
        assert series["y"] == pytest.approx(VALUES)
        trajectory = page.evaluate(
            f"""() => {{
                const gd = Array.from(document.querySelectorAll('div.js-plotly-plot'))
                  .find(gd => gd.layout.title.text === '{LAST}');
                return {{names: gd.data.map(t => t.name), shapes: (gd.layout.shapes || []).map(s => s.x0),
                         first: gd.data[0].y[0], last: gd.data[0].y[gd.data[0].y.length - 1]}};
            }}"""
        )
        assert "optimizer-state reset" in trajectory["names"]
        assert any(n.startswith("measured drift") for n in trajectory["names"])
        assert any(n.startswith("predicted") for n in trajectory["names"])
        # The one reset (Adam's state emptied after DRIFT_STEPS), marked on both panels.
        assert trajectory["shapes"] == [DRIFT_STEPS + 1] * 2
        assert abs(trajectory["last"] - trajectory["first"]) > 0.3  # it really drifted
    finally:
        page.close()


def test_filters_change_the_table_and_links_lead_to_evidence(browser_context, report_page):
    opened = open_offline(browser_context, report_page)
    page = opened.page
    try:
        visible = "() => Array.from(document.querySelectorAll('#findings-table tbody tr')).filter(r => r.offsetParent !== null).map(r => r.dataset.code)"
        everything = page.evaluate(visible)
        assert len(everything) >= 5
        page.select_option("#filter-rule", "DW402")
        only = page.evaluate(visible)
        assert only == ["DW402"] * everything.count("DW402") and len(only) < len(everything)
        assert page.inner_text("#shown") == f"{len(only)} of {len(everything)} shown"
        page.select_option("#filter-rule", "")
        page.select_option("#filter-severity", "info")
        infos = page.evaluate(visible)
        assert len(infos) < len(everything)
        page.select_option("#filter-severity", "")
        assert page.evaluate(visible) == everything
        # The DW402 row's evidence link scrolls to the bar chart; its rule link to the docs.
        row = page.locator('#findings-table tr[data-code="DW402"]')
        target = row.locator("a", has_text="plot").get_attribute("href")
        assert target and page.locator(f"div.js-plotly-plot{target}").count() == 1
        row.locator("a", has_text="plot").click()
        assert page.evaluate("location.hash") == target
        row.locator("a", has_text="DW402").click()
        assert page.evaluate("location.hash") == "#rule-DW402"
        assert "checkpoint-layer-outlier" in page.inner_text("#rule-DW402")
        assert opened.errors == []
    finally:
        page.close()


def test_loss_curve_with_the_plateau_and_the_missing_loss_note(browser_context, report_page):
    opened = open_offline(browser_context, report_page)
    page = opened.page
    try:
        curves = page.evaluate(
            """() => Array.from(document.querySelectorAll('div.js-plotly-plot'))
                 .filter(gd => gd.id.endsWith('-loss'))
                 .map(gd => ({id: gd.id, traces: gd.data.map(t => ({name: t.name, n: t.y.length})),
                              shapes: (gd.layout.shapes || []).length,
                              drawn: gd.querySelectorAll('path.js-line').length}))"""
        )
        (curve,) = curves  # the fused log has the loss, the drift log does not
        assert curve["id"] == "s1-loss"
        names = {t["name"]: t["n"] for t in curve["traces"]}
        assert names["loss"] == 1000
        assert any(n.startswith("plateau from step") for n in names)
        assert curve["shapes"] == 1 and curve["drawn"] >= 3  # shaded, three lines drawn
        note = page.locator('#s0 [data-note="no-loss"]')
        assert note.count() == 1 and note.is_visible()
        assert opened.errors == []
    finally:
        page.close()


def test_names_that_are_markup_stay_text_in_the_drawn_plots(browser_context, tmp_path):
    """A tensor named `<a href=...>` or `<b>z</b>` (issue 20, row 7): plotly draws its
    mini-HTML in titles, tick labels and legends; drawn, the name is text, no link."""
    saves = [
        save_hostile(tmp_path / "step-100.safetensors", 1.0, extra="removed"),
        save_hostile(tmp_path / "step-200.safetensors", 1.5, extra="added"),
    ]
    files = []
    for kind, report in {
        "inspect": deadweight.inspect_checkpoints([saves[1]], scheme="int4"),
        "diff": deadweight.diff_checkpoints(*saves),
        "trend": deadweight.trend_checkpoints(saves),
    }.items():
        (tmp_path / f"{kind}.json").write_text(report.to_json())
        files.append(str(tmp_path / f"{kind}.json"))
    out = tmp_path / "hostile.html"
    assert main(["report", *files, "-o", str(out)]) == 1
    opened = open_offline(browser_context, out)
    page = opened.page
    try:
        assert opened.errors == []
        drawn = page.evaluate(
            """() => ({
              plots: document.querySelectorAll('div.js-plotly-plot').length,
              links: Array.from(document.querySelectorAll('a'))
                .map(a => a.getAttribute('href') || a.getAttribute('xlink:href') || '')
                .filter(h => h.includes('evil')),
              bold: Array.from(document.querySelectorAll('svg b, svg tspan'))
                .filter(t => t.textContent === 'z' && t.style.fontWeight).length,
              text: Array.from(document.querySelectorAll('svg text'))
                .map(t => t.textContent).join('\\n'),
            })"""
        )
        assert drawn["plots"] >= 4
        assert drawn["links"] == [] and drawn["bold"] == 0
        # readable: the name drawn as it is spelled
        assert "<b>z</b>" in drawn["text"]
        assert '<a href="https://evil.example/x">y</a>' in drawn["text"]
    finally:
        page.close()
