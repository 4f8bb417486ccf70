"""Names are data in every renderer: a tensor, parameter or file named like rich markup,
plotly's mini-HTML or a terminal escape sequence is shown as text, styles nothing, links
nowhere, reaches no terminal raw and crashes nothing. End to end in subprocesses."""

from __future__ import annotations

import html
import json
import math
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deadweight.report import html as html_report
from deadweight.report.text import render_plain
from tests.cli_runner import deadweight_cli
from tests.linting.helpers import CUT
from tests.report.hostile import (
    CLEAR,
    HOSTILE,
    OSC,
    SGR,
    SHOWN,
    figures,
    hostile_report,
    save_hostile,
    strings,
)

PLAIN = {**os.environ, "COLUMNS": "250", "NO_COLOR": "1"}
PLAIN.pop("FORCE_COLOR", None)
# Colour forced: what a terminal gets, styles and links included.
COLOUR = {**PLAIN, "FORCE_COLOR": "1", "TERM": "xterm-256color"}
COLOUR.pop("NO_COLOR")


def dw(*args: str | Path, env: dict[str, str] = PLAIN) -> subprocess.CompletedProcess[str]:
    return deadweight_cli(*args, env=env)


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("hostile")
    return [
        save_hostile(d / "step-100.safetensors", 1.0, extra="removed"),
        save_hostile(d / "step-200.safetensors", 1.5, extra="added"),
    ]


def _assert_terminal_safe(result: subprocess.CompletedProcess[str], names: list[str]) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    for stream in (result.stdout, result.stderr):
        assert OSC not in stream and CLEAR not in stream
    plain = SGR.sub("", result.stdout)
    assert "\x1b" not in plain, "an escape sequence other than colours reached stdout"
    for name in names:
        assert SHOWN[name] in plain, f"{name!r} not shown as text"


# -- the helper --------------------------------------------------------------------------


def test_safe_text_shows_control_characters_as_escapes():
    from deadweight.report.display import safe_text

    assert safe_text("\x1b]52;c;aGk=\x07") == r"\x1b]52;c;aGk=\x07"
    assert safe_text("a\nb\tc\x00\x7f\x9b") == r"a\nb\tc\x00\x7f\x9b"
    assert safe_text("a\nb", keep_newlines=True) == "a\nb"
    # bidi overrides reorder what a terminal shows (Trojan Source), line separators break it
    assert safe_text("x\u202ey\u2028") == r"x\u202ey\u2028"
    # ordinary text, non-ASCII and backslashes (Windows paths) are left alone
    text = r"C:\runs\ckpt.0.weight λ ‖θ‖ [bold] <b>"
    assert safe_text(text) == text


# -- terminal ------------------------------------------------------------------------------


@pytest.mark.parametrize("env", [PLAIN, COLOUR], ids=["plain", "colour"])
def test_inspect_table_shows_names_as_text(saves, env):
    result = dw("inspect", saves[0], env=env)
    assert result.returncode == 1, result.stderr  # DW402 on every group, no error
    _assert_terminal_safe(result, HOSTILE)
    assert "evil.example" not in SGR.sub("", result.stdout).replace(
        "[link=https://evil.example]x[/link]", ""
    ).replace('<a href="https://evil.example/x">y</a>', ""), "a name became a link"


def test_diff_and_trend_tables_show_names_as_text(saves):
    diff = dw("diff", *saves, env=COLOUR)
    assert diff.returncode in (0, 1), diff.stderr
    _assert_terminal_safe(diff, HOSTILE)
    plain = SGR.sub("", diff.stdout)
    for name in HOSTILE:  # the added and removed lists
        assert f"{SHOWN[name]}.added" in plain and f"{SHOWN[name]}.removed" in plain
    trend = dw("trend", *saves, env=COLOUR)
    assert trend.returncode in (0, 1), trend.stderr
    _assert_terminal_safe(trend, HOSTILE)


def test_saved_report_text_escapes_every_field(tmp_path):
    saved = tmp_path / "saved.json"
    saved.write_text(hostile_report().to_json())
    result = dw("report", saved, env=COLOUR)
    assert result.returncode == 1, result.stderr
    _assert_terminal_safe(result, HOSTILE)


def test_render_plain_of_a_report_has_no_control_characters():
    text = render_plain(hostile_report(), width=400)
    assert "\x1b" not in text and "\x07" not in text
    assert SHOWN["\x1b[2J"] in text and "[link=https://evil.example]x[/link]" in text


def test_lint_of_a_hostile_file_name(tmp_path):
    # A file name cannot hold "/", so the closing tags go.
    name = "[bold]x[link=https:evil]y<b>z\x1b[2J\x1b]52;c;aGk=\x07.py"
    src = tmp_path / "src"
    src.mkdir()
    (src / name).write_text("def (:\n")  # unreadable: reported as an error, on stderr
    (src / f"ok{name}").write_text(CUT)
    shown = name.replace("\x1b", r"\x1b").replace("\x07", r"\x07")
    result = dw("lint", src, "--isolated", env=COLOUR)
    assert "Traceback" not in result.stderr, result.stderr
    for stream in (result.stdout, result.stderr):
        assert OSC not in stream and CLEAR not in stream
        assert "\x1b" not in SGR.sub("", stream)
    assert shown in result.stderr  # the unreadable file
    assert shown in SGR.sub("", result.stdout)  # the diagnostic of the other one
    sarif = dw("lint", src, "--isolated", "--format", "sarif")
    assert "\x1b" not in sarif.stdout  # json escapes control characters
    json.loads(sarif.stdout)


def test_config_table_shows_values_as_text(tmp_path):
    project = tmp_path / "[red]proj"
    project.mkdir()
    (project / "deadweight.toml").write_text(
        'inference-only = ["model.py::[link=https://evil.example]x[/link]\\u001b[2J"]\n'
    )
    result = dw("config", project, env=COLOUR)
    assert result.returncode == 0, result.stderr
    plain = SGR.sub("", result.stdout)
    assert OSC not in result.stdout and CLEAR not in result.stdout
    assert "[red]proj" in plain and "[link=https://evil.example]x[/link]" in plain


def test_config_error_shows_a_pattern_as_text(tmp_path):
    # Not a path pattern deadweight can read (its `[` classes are never closed): the
    # error names it, as text.
    (tmp_path / "deadweight.toml").write_text(
        '[per-file-ignores]\n"[link=https://evil.example]x[/link]\\u001b[2J" = ["DW501"]\n'
    )
    result = dw("config", tmp_path, env=COLOUR)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert OSC not in result.stderr and CLEAR not in result.stderr
    assert r"\x1b[2J" in result.stderr and "never closed" in result.stderr


# -- JSON --------------------------------------------------------------------------------


def test_json_keeps_names_exact_and_escapes_control_characters(saves):
    result = dw("inspect", saves[0], "--format", "json")
    assert "\x1b" not in result.stdout and "\x07" not in result.stdout
    data = json.loads(result.stdout)
    names = {row["name"] for rows in data["subject"]["tensors"].values() for row in rows}
    assert set(HOSTILE) <= names  # data, not display: exactly the names of the file


# -- HTML ----------------------------------------------------------------------------------


class _Links(HTMLParser):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))


def _assert_page_safe(page: str) -> None:
    tags = _Links(page).tags
    # (a slug of a name in a div id is fine: `s0-p-_a_href__https_evil_x__y__a_`)
    assert not [t for t in tags if re.search("https:/*evil", json.dumps(t))], "a name is markup"
    assert "<b>z</b>" not in page, "a name became bold"  # plotly's JSON writes < as \u003c
    assert "\x1b" not in page and "\x07" not in page
    texts = [s for fig in figures(page) for s in strings(fig)]
    assert texts, "no figure in the page"
    for text in texts:
        # plotly draws <a>, <b>, <span style> and friends as markup: never from a name
        assert "<a" not in text and "<b>" not in text and "\x1b" not in text, text


@pytest.fixture(scope="module")
def pages(saves, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    pytest.importorskip("plotly", reason="the HTML report needs deadweight[html]")
    d = tmp_path_factory.mktemp("pages")
    out = {}
    for command, args in (
        ("inspect", [saves[1], "--scheme", "int4"]),
        ("diff", saves),
        ("trend", saves),
    ):
        page = d / f"{command}.html"
        # JSON on stdout: the HTML page alone is under test here, not the tables
        result = dw(command, *args, "--format", "json", "--html", page)
        assert result.returncode in (0, 1), result.stderr
        out[command] = page.read_text()
    saved = d / "saved.json"
    saved.write_text(hostile_report().to_json())
    assert dw("report", saved, "-o", d / "saved.html").returncode == 1
    out["saved"] = (d / "saved.html").read_text()
    return out


@pytest.mark.parametrize("kind", ["inspect", "diff", "trend", "saved"])
def test_html_plots_show_names_as_text(pages, kind):
    page = pages[kind]
    _assert_page_safe(page)
    texts = "\n".join(s for fig in figures(page) for s in strings(fig))
    # readable: plotly shows &lt; as <, so the figure holds the name html-escaped
    assert html.escape('<a href="https://evil.example/x">y</a>', quote=False) in texts
    assert html.escape("<b>z</b>", quote=False) in texts


def test_inspect_page_plots_the_outlier_layers(pages):
    """DW402's bars of the layers of each group: the hostile templates included."""
    titles = [
        fig[1]["title"]["text"]
        for fig in figures(pages["inspect"])
        if fig[1].get("title", {}).get("text", "").startswith("DW402")
    ]
    assert len(titles) == len(HOSTILE)
    assert any(html.escape("<b>z</b>", quote=False) in t for t in titles)


def test_homologous_values_need_no_regex(tmp_path):
    """Names of literal `{}`s: the template once made a regex of 25 `\\d+` in a row, which
    never finished on an all-digit name (row 2 of issue 20). In a subprocess, so a
    regression cannot hang the suite."""
    code = (
        "from deadweight.report.html import _homologous\n"
        "rows = [{'name': '{}' * 24 + f'.{i}.s', 'analysed': True, 'numel': 1, 'min': 1.0}"
        " for i in range(4)]\n"
        "rows.append({'name': '1' * 40, 'analysed': True, 'numel': 1, 'min': 2.0})\n"
        "values = _homologous(rows, '{}' * 24 + '.{}.s', 'value')\n"
        "assert sorted(values) == [r['name'] for r in rows[:4]], values\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_homologous_values_match_the_rule_grouping():
    rows = [
        {"name": n, "analysed": True, "numel": 1, "min": float(k)}
        for k, n in enumerate(["h.0.g", "h.1.g", "h.12.g", "h.x.g", "h.1.2.g", "hh.0.g"])
    ]
    assert html_report._homologous(rows, "h.{}.g", "value") == {
        "h.0.g": 0.0, "h.1.g": 1.0, "h.12.g": 2.0,
    }  # fmt: skip


def test_watch_log_plots_show_parameter_names_as_text(tmp_path):
    """A parameter named like plotly markup, from a real watched run: its trajectory's
    title and the findings table show it as text."""
    pytest.importorskip("plotly", reason="the HTML report needs deadweight[html]")
    import torch

    import deadweight
    from deadweight.cli import main

    link, bold = '<a href="https:evil/x">y</a>', "<b>z</b>"  # a parameter name has no "."

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for name in (link, bold, "\x1b[2J"):
                self.register_parameter(name, torch.nn.Parameter(torch.ones(4)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * getattr(self, bold)).sum()  # the other two never get a gradient

    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    log = tmp_path / "run.jsonl"
    with deadweight.watch(model, optimizer, every=1, log=log):
        for _ in range(60):  # DW301 judges after 50 steps
            optimizer.zero_grad()
            model(torch.randn(4)).backward()
            optimizer.step()
    out = tmp_path / "run.html"
    assert main(["report", str(log), "-o", str(out)]) == 1
    page = out.read_text()
    _assert_page_safe(page)
    titles = [fig[1]["title"]["text"] for fig in figures(page)]
    assert html.escape(link, quote=False) in titles and r"\x1b[2J" in titles


# -- names no encoding can write, names with absurd numbers (issue 33, cases 6 and 13) ----


def _save_raw_safetensors(path: Path, tensors: dict[str, list[float]]) -> None:
    """A safetensors file whose header names tensors as JSON allows (`\\ud800`, a lone
    surrogate, that no UTF encoding can write): written by hand, as no library would."""
    import struct

    header, data = {}, b""
    for name, values in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)],
                        "data_offsets": [len(data), len(data) + len(raw)]}  # fmt: skip
        data += raw
    text = json.dumps(header).encode()  # ensure_ascii: the surrogate stays an escape
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


SURROGATE = "a\ud800.w"


@pytest.fixture(scope="module")
def surrogates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("surrogates")
    _save_raw_safetensors(d / "n.safetensors", {SURROGATE: [math.nan, 1, 2], "b.w": [1, 1]})
    _save_raw_safetensors(d / "m.safetensors", {SURROGATE: [0, 1, 2], "b.w": [1, 1]})
    saved = dw("inspect", d / "n.safetensors", "--format", "json")
    (d / "saved.json").write_text(saved.stdout)
    return d


@pytest.mark.parametrize(
    "args",
    [["inspect", "n.safetensors"], ["diff", "n.safetensors", "m.safetensors"],
     ["report", "saved.json"], ["trend", "n.safetensors", "m.safetensors"]],
    ids=["inspect", "diff", "report", "trend"],
)  # fmt: skip
def test_a_lone_surrogate_in_a_name_is_shown_escaped(surrogates, args):
    result = deadweight_cli(*args, env=PLAIN, cwd=surrogates)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode in (0, 1), result.stderr
    if args[0] != "trend":  # trend lists single-element tensors only
        assert r"a\ud800.w" in result.stdout


@pytest.mark.parametrize(
    "args",
    [["inspect", "n.safetensors", "--html"], ["report", "saved.json", "-o"]],
    ids=["inspect", "report"],
)
def test_a_lone_surrogate_in_a_name_reaches_the_page_escaped(surrogates, args, tmp_path):
    pytest.importorskip("plotly", reason="the HTML report needs deadweight[html]")
    page = tmp_path / "page.html"
    page.write_text("an earlier report")
    result = deadweight_cli(*args, page, env=PLAIN, cwd=surrogates)
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.returncode == 1, result.stderr
    text = page.read_text(encoding="utf-8")
    assert r"a\ud800.w" in text and "an earlier report" not in text


def test_a_layer_index_of_5000_digits_is_a_name(tmp_path):
    big = "9" * 5000
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({f"a.{big}.w": torch.tensor([math.nan, 1.0]), "a.1.w": torch.ones(2)}, a)
    save_file({f"a.{big}.w": torch.tensor([math.nan, 1.0]), "a.1.w": torch.ones(2)}, b)
    inspect = dw("inspect", a)
    # The whole file is read: its NaN is found (it was refused as unreadable).
    assert inspect.returncode == 1 and "Traceback" not in inspect.stderr, inspect.stderr[-2000:]
    assert "could not be read" not in inspect.stdout
    diff = dw("diff", a, b)  # DW401 lists both names (compress_names raised on this one)
    assert diff.returncode == 1 and "Traceback" not in diff.stderr, diff.stderr[-2000:]
    assert big[:50] in diff.stdout.replace("\n", "").replace("│", "").replace(" ", "")


def test_safe_text_escapes_lone_surrogates():
    from deadweight.report.display import safe_text

    assert safe_text("a\ud800b\udfff") == r"a\ud800b\udfff"
    assert safe_text("a\U0001f600") == "a\U0001f600"  # a real astral character stays
