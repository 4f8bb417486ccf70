"""What a notebook shows: `Report` and `Watch` as HTML tables, and the text report in a
kernel. The last test runs a real notebook in an ipykernel kernel of this interpreter."""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import rich.console
import torch
from torch import nn

import deadweight
from deadweight.findings import Finding, Location, Severity
from deadweight.report import Report
from deadweight.report import html as html_report
from deadweight.report.notebook import SEVERITY_COLOUR, report_html
from deadweight.report.text import render_plain
from tests.report.hostile import HOSTILE, SGR, SHOWN, hostile_report

IMG = "<img src=x onerror=alert(1)>"
# Everything the fragment may contain: no script, link, image or event handler.
TAGS = {"div", "b", "span", "code", "table", "thead", "tbody", "tr", "th", "td"}
ATTRIBUTES = {"class", "style", "data-severity", "data-code"}


class _Parsed(HTMLParser):
    """The tags, attributes, text and table rows of a fragment."""

    def __init__(self, fragment: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.attributes: list[tuple[str, str | None]] = []
        self.rows: list[dict[str, str | None]] = []
        self.text: list[str] = []
        self.feed(fragment)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        self.attributes.extend(attrs)
        if tag == "tr" and attrs:
            self.rows.append(dict(attrs))

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _assert_inert(fragment: str) -> _Parsed:
    parsed = _Parsed(fragment)
    assert parsed.tags <= TAGS, parsed.tags - TAGS
    assert {name for name, _ in parsed.attributes} <= ATTRIBUTES
    styles = " ".join(v or "" for k, v in parsed.attributes if k == "style")
    assert "url(" not in styles and "expression(" not in styles
    assert "<script" not in fragment.lower() and "\x1b" not in fragment
    return parsed


def _report(*severities: Severity) -> Report:
    findings = [
        Finding(
            f"DW10{i}",
            f"rule-{i}",
            s,
            f"message {i}",
            params=(f"layer{i}.weight",),
            location=Location(file="train.py", line=10 + i, function="Net.forward"),
            fix=f"fix {i}",
        )
        for i, s in enumerate(severities)
    ]
    return Report.of("check", findings, {"model": "Net", "parameters": 3, "trainable": 3})


def test_one_row_per_finding_gravest_first():
    report = _report(Severity.INFO, Severity.ERROR, Severity.WARNING, Severity.WARNING)
    fragment = report._repr_html_()
    parsed = _assert_inert(fragment)
    rows = [(r["data-severity"], r["data-code"]) for r in parsed.rows]
    assert rows == [
        ("error", "DW101"),
        ("warning", "DW102"),
        ("warning", "DW103"),
        ("info", "DW100"),
    ]
    text = "".join(parsed.text)
    assert (
        "deadweight check · Net · 3 parameters (3 trainable): 1 error, 2 warnings, 1 info" in text
    )
    for i in range(4):
        assert f"message {i}" in text and f"fix: fix {i}" in text
        assert f"layer{i}.weight" in text and f"train.py:{10 + i} in Net.forward" in text
    assert f'color:{SEVERITY_COLOUR["error"]};font-weight:bold">error</td>' in fragment


def test_empty_report_says_so_without_a_table():
    fragment = report_html(_report())
    parsed = _assert_inert(fragment)
    assert "table" not in parsed.tags
    assert "".join(parsed.text).endswith("no findings")


def test_hostile_names_and_messages_render_inert():
    parsed = _assert_inert(report_html(hostile_report()))
    text = "".join(parsed.text)
    for name in HOSTILE:  # shown as the text it is, control characters as escapes
        assert SHOWN[name] in text
    assert "<a" not in "".join(str(a) for a in parsed.attributes)


def test_a_real_model_with_a_hostile_parameter_name():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    model.register_parameter(IMG, nn.Parameter(torch.ones(3)))  # trainable, never used
    x = torch.randn(4, 3)
    report = deadweight.check(model, lambda: model(x).pow(2).mean())
    fragment = report._repr_html_()
    assert report.by_code("DW101") and IMG in report.by_code("DW101")[0].params
    parsed = _assert_inert(fragment)
    assert "img" not in parsed.tags and "onerror" not in {k for k, _ in parsed.attributes}
    assert "&lt;img src=x onerror=alert(1)&gt;" in fragment and IMG in "".join(parsed.text)


def test_long_parameter_lists_and_names_are_cut():
    names = tuple(f"block{i}.attn{i}.weight" for i in range(300))  # no shared pattern
    long_name = "x" * 5000
    report = Report.of(
        "check",
        [
            Finding("DW101", "no-gradient", Severity.ERROR, "many", params=names),
            Finding("DW101", "no-gradient", Severity.ERROR, "one", params=(long_name,)),
        ],
        {},
    )
    fragment = report_html(report)
    assert "and 292 more (300 in all)" in fragment and "block299" not in fragment
    assert "(4600 more characters)" in fragment and long_name not in fragment


def test_colours_are_the_html_reports():
    assert SEVERITY_COLOUR == html_report._SEVERITY_COLOUR


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.first(x).detach())


def _train(steps: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 4)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_watch_mid_run_and_closed():
    torch.manual_seed(0)
    model = _Detached()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = deadweight.watch(model, opt, every=10, thresholds={"never_moved_steps": 20})
    try:
        _train(25, model, opt)
        running = _assert_inert(w._repr_html_())
        text = "".join(running.text)
        # The report is as of the last watched step (every 10), the step count is live.
        assert "deadweight watch · running, 25 steps (findings as of step 20)" in text
        assert "log ends without an end record" not in text
        assert {r["data-code"] for r in running.rows} == {"DW301"}
        assert "first.weight" in text
    finally:
        w.close()
    closed = "".join(_assert_inert(w._repr_html_()).text)
    assert "deadweight watch · closed, 25 steps" in closed and "DW301" in closed


def test_watch_whose_report_fails_shows_a_message(monkeypatch):
    model = _Detached()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with deadweight.watch(model, opt) as w:
        _train(2, model, opt)

        def broken(**_: object) -> Report:
            raise RuntimeError(f"stats gone {IMG}")

        monkeypatch.setattr(w, "report", broken)
        fragment = w._repr_html_()
    parsed = _assert_inert(fragment)
    assert "".join(parsed.text) == (
        f"deadweight watch (running, 2 steps): no report: RuntimeError: stats gone {IMG}"
    )


def test_text_report_in_a_notebook_is_plain_and_as_wide_as_the_notebook(monkeypatch):
    # What rich sees in Jupyter: without force_jupyter=False it would display the report
    # itself and `str(report)` would be empty.
    monkeypatch.setattr(rich.console, "_is_jupyter", lambda: True)
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.delenv("JUPYTER_COLUMNS", raising=False)
    report = _report(Severity.ERROR)
    text = str(report)
    assert "DW100" in text and "1 error" in text and not SGR.search(text)
    assert max(len(line) for line in text.splitlines()) == rich.console.JUPYTER_DEFAULT_COLUMNS
    monkeypatch.setenv("JUPYTER_COLUMNS", "150")
    assert max(len(line) for line in str(report).splitlines()) == 150
    assert max(len(line) for line in render_plain(report, width=90).splitlines()) == 90


def test_text_report_outside_a_notebook_is_unchanged(monkeypatch):
    monkeypatch.setattr(rich.console, "_is_jupyter", lambda: False)
    assert max(len(line) for line in str(_report(Severity.ERROR)).splitlines()) == 100


# -- a real notebook ----------------------------------------------------------------------

CELLS = [
    """
import torch
from torch import nn
import deadweight

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.first(x).detach())  # the bug: first never learns

torch.manual_seed(0)
model, x = Net(), torch.randn(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
report = deadweight.check(model, lambda: model(x).pow(2).mean(), opt)
report
""",
    "print(report)",
    """
w = deadweight.watch(model, opt, every=10, thresholds={"never_moved_steps": 20})
for _ in range(25):
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
w
""",
    "w.close()\nw",
]


def _kernel_of_this_interpreter(root: Path) -> None:
    """A `python3` kernelspec that starts this interpreter (whatever `python` is on
    PATH, which the installed spec runs), found first through JUPYTER_PATH."""
    from ipykernel.kernelspec import write_kernel_spec

    write_kernel_spec(root / "kernels" / "python3")


@pytest.mark.e2e
def test_a_notebook_shows_report_and_watch_as_html(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    _kernel_of_this_interpreter(tmp_path / "jupyter")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    assert spec.argv[0] == sys.executable

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.strip()) for c in CELLS])
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()

    outputs = [cell.outputs for cell in nb.cells]
    flat = [o for cell in outputs for o in cell]
    assert not [o for o in flat if o.output_type == "error"]
    check_html, watch_html, closed_html = (
        next(o.data["text/html"] for o in cell if "text/html" in o.get("data", {}))
        for cell in (outputs[0], outputs[2], outputs[3])
    )
    assert re.findall(r'data-code="(DW\d+)"', check_html) == ["DW101", "DW102"]
    assert "first.weight" in check_html and "<script" not in check_html
    assert (
        "deadweight watch · running, 25 steps" in watch_html and 'data-code="DW301"' in watch_html
    )
    assert "deadweight watch · closed, 25 steps" in closed_html
    printed = "".join(o.text for o in outputs[1] if o.output_type == "stream")
    assert "DW101 no-gradient" in printed and "\x1b" not in printed
    assert max(len(line) for line in printed.splitlines()) <= rich.console.JUPYTER_DEFAULT_COLUMNS
