"""`deadweight report` sees untrusted files: whatever a watch log or a saved report holds,
the command exits 0, 1 or 2 without a traceback, and the other inputs are still reported.

The inputs are mutations of a real log written by `deadweight.watch` and of its real
`--format json` report: fields of the wrong type, removed or duplicated, lines cut,
repeated, or replaced by random JSON, so that most examples get past the JSON parser
and reach the statistics, the rules and the renderers.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deadweight
from deadweight import bounded_json, cli
from deadweight.cli import main
from deadweight.cli.report import classify, load_sections, report_from_dict
from deadweight.demos import fused_rmsnorm
from deadweight.errors import InputError
from deadweight.report.text import render_plain
from deadweight.watching.event_log import read_log
from tests.cli_runner import measured_cli
from tests.fuzzing import FUZZ, examples, fuzz

pytestmark = fuzz

# The HTML page builds plotly figures (about 0.2 s an input): a tenth of the examples.
FUZZ_HTML = settings(FUZZ, max_examples=max(10, examples() // 10))


def _real_log() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.jsonl"
        setup = fused_rmsnorm.make(False, seed=1)
        with deadweight.watch(setup.model, setup.optimizer, log=path, every=10):
            fused_rmsnorm.train(setup, 60)  # past DW301's 50 steps
        return path.read_text()


LOG = _real_log()
EVENTS = [json.loads(line) for line in LOG.splitlines()]
with tempfile.TemporaryDirectory() as _tmp:
    (Path(_tmp) / "run.jsonl").write_text(LOG)
    with contextlib.redirect_stdout(io.StringIO()) as _out:
        assert main(["report", str(Path(_tmp) / "run.jsonl"), "--format", "json"]) == 1
    SAVED = json.loads(_out.getvalue())

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=70),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place inside a JSON value (dict keys, list indices), the value itself first."""
    out = [prefix]
    if isinstance(value, dict):
        for key, inner in value.items():
            out += _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value[:6]):  # the first few entries of long arrays
            out += _paths(inner, (*prefix, index))
    return out


@st.composite
def _mutated(draw: st.DrawFn, value: Any) -> Any:
    """A deep copy of `value` with a few places replaced by random JSON, or removed."""
    value = copy.deepcopy(value)
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        places = [p for p in _paths(value) if p]
        if not places:
            break
        place = draw(st.sampled_from(places))
        parent = value
        for key in place[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[place[-1]]
        else:
            parent[place[-1]] = draw(_json)
    return value


@st.composite
def _mutated_log(draw: st.DrawFn) -> str:
    events = copy.deepcopy(EVENTS)
    lines: list[str] = []
    chosen = set(draw(st.lists(st.integers(0, len(events) - 1), min_size=1, max_size=4)))
    for k, event in enumerate(events):
        line = json.dumps(draw(_mutated(event)) if k in chosen else event)
        action = draw(st.sampled_from(["keep"] * 8 + ["drop", "twice", "cut", "random"]))
        if action == "drop":
            continue
        if action == "random":
            line = json.dumps(draw(_json))
        if action == "cut":
            line = line[: draw(st.integers(0, len(line)))]
        lines += [line, line] if action == "twice" else [line]
    text = "\n".join(lines)
    return text if draw(st.booleans()) else text + "\n"


@pytest.fixture(autouse=True, scope="module")
def _one_parser() -> Any:
    # Building the argument parser of every subcommand costs more than reading a small
    # log: build it once for the module (parse_args does not change it).
    parser = cli.build_parser()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "build_parser", lambda: parser)
        yield


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _good_log(tmp: Path) -> Path:
    good = tmp / "good.jsonl"
    good.write_text(LOG)
    return good


def _reported(argv_inputs: list[str]) -> tuple[int, str, str]:
    """`deadweight report INPUTS --format json` in-process (JSON: no terminal rendering,
    which costs more than everything else here); the good log must be in the output."""
    code, out, err = _run(["report", *argv_inputs, "--format", "json"])
    assert code in (0, 1, 2), err
    assert "Traceback" not in err
    assert '"steps": 60' in out  # the good log is reported whatever the other holds
    return code, out, err


@FUZZ
@given(_mutated_log())
def test_a_mutated_log_reads_or_is_an_error(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.jsonl"
        path.write_text(text)
        contents = read_log(path)
        assert all(isinstance(e, dict) and "event" in e for e in contents.events)
        code, out, err = _reported([str(path), str(_good_log(Path(tmp)))])
        if code == 2:
            assert f"deadweight: error: {path}" in err
        else:
            decoder = json.JSONDecoder()  # two strict JSON documents, one per input
            first, end = decoder.raw_decode(out)
            assert first["subject"]["log"] == str(path)
            decoder.raw_decode(out[end:].lstrip())


@FUZZ
@given(_mutated(SAVED))
def test_a_mutated_saved_report_renders_or_is_an_error_naming_it(data: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.json"
        path.write_text(json.dumps(data))
        try:
            report = report_from_dict(data, source=str(path))
        except InputError as exc:
            assert str(exc).startswith(f"{path} is not a valid deadweight report: ")
        else:
            render_plain(report)  # the types the text renderer reads are checked
            report.to_json()
        _reported([str(path), str(_good_log(Path(tmp)))])


@FUZZ
@given(st.binary(max_size=300) | _json.map(lambda v: json.dumps(v).encode()))
def test_random_bytes_are_a_log_a_report_or_an_error(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.json"
        path.write_bytes(data)
        try:
            classify(str(path))
        except InputError as exc:
            assert str(path) in str(exc)
        sections, _, skipped = load_sections([str(path), str(_good_log(Path(tmp)))])
        assert sections[-1].label.endswith("good.jsonl") and skipped in (0, 1)
        _reported([str(path), str(_good_log(Path(tmp)))])


@FUZZ_HTML
@given(st.one_of(_mutated(SAVED), _mutated_log()))
def test_the_html_page_of_mutated_inputs_is_written_or_an_error(data: Any) -> None:
    pytest.importorskip("plotly")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("fuzz.jsonl" if isinstance(data, str) else "fuzz.json")
        path.write_text(data if isinstance(data, str) else json.dumps(data))
        page = Path(tmp) / "report.html"
        code, _, err = _run(["report", str(path), str(_good_log(Path(tmp))), "-o", str(page)])
        assert code in (0, 1, 2), err
        assert "Traceback" not in err
        assert page.exists()  # the good log makes a page whatever the other input holds


def _escaped_quotes(prefix: str, count: int) -> str:
    """An unterminated string of `count` escaped quotes followed by 40 brackets: what made
    the depth check restart at every quote (issue 33, case 8)."""
    return prefix + '\\"' * count + "[" * 40


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("40k.jsonl", _escaped_quotes('{"event": "', 20_000) + "\n"),
        ("300k.jsonl", _escaped_quotes('{"event": "', 150_000) + "\n"),
        # not a log: report's input classification parses the whole file
        ("300k.json", _escaped_quotes('{"kind": "', 150_000)),
    ],
    ids=["40k-log", "300k-log", "300k-json"],
)
def test_a_line_that_made_the_reader_quadratic(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    for args in ([path], [path, "-o", tmp_path / "page.html"]):
        run = measured_cli("report", *args)
        assert run.result.returncode == 2, run.result.stderr
        assert "Traceback" not in run.result.stderr and name in run.result.stderr
        assert run.within_bounds, (run.seconds, run.peak_mb)


@pytest.mark.parametrize(
    "text",
    ["[" * 100_000, '"' * 100_001, '"\\' * 50_000, "[]" * 50_000, '{"a": ["]", {"b": "\\"["}]}'],
    ids=["brackets", "quotes", "escapes", "pairs", "mixed"],
)
def test_nesting_is_measured_outside_strings_in_one_pass(text: str) -> None:
    # The reference: a character-by-character scan that tracks strings and escapes.
    level = deepest = opened = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            in_string, escaped = (True, False) if escaped else (c != '"', c == "\\")
        elif c == '"':
            in_string = True
        elif c in "[{":
            level += 1
            opened += 1
            deepest = max(deepest, level)
        elif c in "]}":
            level -= 1
    assert not bounded_json.deeper_than(text, deepest)
    assert bounded_json.deeper_than(text, deepest - 1)
    assert bounded_json.containers(text) == opened
