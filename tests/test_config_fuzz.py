"""The configuration loader reads files anyone can put in a checkout: whatever a
deadweight.toml or pyproject.toml holds, it returns a Config or raises one ConfigError
naming the file, and the CLI exits 0, 1 or 2 with no traceback.

Inputs: random TOML-ish text built from TOML's own pieces (headers, keys, brackets,
quotes), and valid TOML that puts values of every type under deadweight's keys.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deadweight import config
from deadweight.cli import main
from deadweight.errors import ConfigError
from deadweight.path_globs import compile_glob
from deadweight.thresholds import KEYS as THRESHOLD_KEYS
from tests.cli_runner import deadweight_cli, measured_cli
from tests.fuzzing import FUZZ, fuzz

pytestmark = fuzz

_PIECES = [
    "[tool.deadweight]", "[tool.deadweight.thresholds]", "[tool.deadweight.per-file-ignores]",
    "[thresholds]", "[tool]", "[[tool.deadweight]]", "select", "ignore", "fail-on", "exclude",
    "inference-only", "per-file-ignores", "thresholds", "tool", "deadweight", *THRESHOLD_KEYS,
    " = ", "=", "[", "]", "{", "}", ",", ".", '"', "'", '"""', "\n", " ", "#", "1", "-1",
    "1e999", "nan", "inf", "true", "1979-05-27", '"DW5"', '"warning"', "\\u0000", "\\",
    "\xff", "é", "0x1F",
]  # fmt: skip
_tomlish = st.lists(st.sampled_from(_PIECES) | st.text(max_size=4), max_size=40).map("".join)

_scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["DW5", "DW501", "never-moved", "warning", "never", "**", "a::b"]),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["a", "DW5", *THRESHOLD_KEYS[:4]]), inner, max_size=3)
    ),
    max_leaves=8,
)
_keys = st.sampled_from([*config.KEYS, *THRESHOLD_KEYS, "tool", "selct"]) | st.text(max_size=6)


def _toml(value: Any) -> str:
    """A TOML value (inline), written by hand: tomllib only reads."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(value), repr(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"


def _loads_or_config_error(directory: Path, name: str) -> None:
    path = directory / name
    try:
        cfg = config.for_path(directory)
    except ConfigError as exc:
        assert str(exc).startswith((f"{path}: ", f"{path} [tool.deadweight]: ")), exc
    else:
        cfg.effective()
        assert cfg.path in (None, path)
    code, err = _cli(directory)
    assert code in (0, 2) and "Traceback" not in err, err
    if code == 2:
        assert err.startswith(f"deadweight: error: {path}") and err.count("\n") == 1, err


def _cli(directory: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(directory)  # contextlib.chdir is Python 3.11+
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["config", "--format", "json"])
    finally:
        os.chdir(here)
    return code, err.getvalue()


@FUZZ
@given(_tomlish, st.sampled_from(["deadweight.toml", "pyproject.toml"]))
def test_tomlish_text_loads_or_is_one_config_error(text: str, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_text(text, encoding="utf-8", errors="surrogateescape")
        _loads_or_config_error(Path(tmp), name)


@FUZZ
@given(st.binary(max_size=200), st.sampled_from(["deadweight.toml", "pyproject.toml"]))
def test_random_bytes_load_or_are_one_config_error(data: bytes, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_bytes(data)
        _loads_or_config_error(Path(tmp), name)


@FUZZ
@given(st.dictionaries(_keys, _values, max_size=5), st.booleans())
def test_valid_toml_with_wrong_types_is_one_config_error(table: dict, own_file: bool) -> None:
    body = "".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in table.items())
    name = "deadweight.toml" if own_file else "pyproject.toml"
    text = body if own_file else "[tool.deadweight]\n" + body
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / name).write_text(text)
        _loads_or_config_error(Path(tmp), name)


# -- path patterns (issue 33, case 9) --------------------------------------------------------

_GLOB_PIECES = ["a", "b", "*", "?", "/", "**", "**/", "[", "]", "!", "-", "[a-b]", "[!a]"]


@FUZZ
@given(st.lists(st.sampled_from(_GLOB_PIECES), max_size=10).map("".join))
def test_any_pattern_compiles_or_is_one_config_error(pattern: str) -> None:
    for key in ("exclude", "per-file-ignores", "inference-only"):
        value = (
            f"{{{json.dumps(pattern)} = []}}"
            if key == "per-file-ignores"
            else f"[{json.dumps(pattern)}]"
        )
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "deadweight.toml").write_text(f"{key} = {value}\n")
            _loads_or_config_error(Path(tmp), "deadweight.toml")


def _reference(pattern: str, parts: tuple[str, ...]) -> bool:
    """What a pattern of `a`, `b`, `*`, `?`, `/` and `**` means, by exhaustive search:
    fnmatch within a component, `**` as any number of components, and a match of any
    leading part of the path (a directory above the file)."""
    import fnmatch

    text = pattern.strip().removeprefix("./").rstrip("/")
    segments = text.split("/") if "/" in text else ["**", text]
    if segments[-1] == "**" and len(segments) > 1:
        segments[-1] = "*"

    def whole(i: int, j: int, n: int) -> bool:
        if i == len(segments):
            return j == n
        if segments[i] == "**":
            return any(whole(i + 1, k, n) for k in range(j, n + 1))
        return j < n and fnmatch.fnmatchcase(parts[j], segments[i]) and whole(i + 1, j + 1, n)

    return any(whole(0, 0, n) for n in range(1, len(parts) + 1))


@FUZZ
@given(
    st.lists(st.sampled_from(["a", "b", "*", "?", "/", "**", "**/"]), max_size=8).map("".join),
    st.lists(st.text("ab", min_size=1, max_size=3), min_size=1, max_size=5),
)
def test_patterns_match_as_the_exhaustive_reference(pattern: str, parts: list[str]) -> None:
    assert compile_glob(pattern).matches(tuple(parts)) is _reference(pattern, tuple(parts))


@pytest.mark.parametrize("key", ["exclude", "per-file-ignores", "inference-only"])
@pytest.mark.parametrize("pattern", ["[z-a]", "[!]", "src/[x"])
def test_a_pattern_that_cannot_be_read_is_a_config_error(
    tmp_path: Path, key: str, pattern: str
) -> None:
    """`[z-a]` and `[!]` ended lint with an re.error traceback; `deadweight config`
    accepted them."""
    value = (
        f"{{{json.dumps(pattern)} = []}}"
        if key == "per-file-ignores"
        else f"[{json.dumps(pattern)}]"
    )
    (tmp_path / "deadweight.toml").write_text(f"{key} = {value}\n")
    (tmp_path / "a.py").write_text("x = 1\n")
    for command in (["config"], ["lint", "."]):
        result = deadweight_cli(*command, cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1 and f"pattern {pattern!r}" in result.stderr


@pytest.mark.parametrize(
    ("patterns", "tree"),
    [
        # twelve `**/` against a file 20 folders deep: never finished
        (["**/" * 12 + "nomatch"], {"/".join(["d"] * 20) + "/a.py": 1}),
        # 5000 patterns on 100 files: 17 s (the regex cache held 512)
        ([f"x{i}/*.py" for i in range(2500)] + [f"*/y{i}/*" for i in range(2500)],
         {f"src/f{i}.py": 1 for i in range(100)}),
    ],
    ids=["globstars", "5000-patterns"],
)  # fmt: skip
def test_patterns_are_matched_in_bounded_time(
    tmp_path: Path, patterns: list[str], tree: dict
) -> None:
    (tmp_path / "deadweight.toml").write_text(f"exclude = {json.dumps(patterns)}\n")
    for name in tree:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    run = measured_cli("lint", ".", cwd=tmp_path)
    assert run.result.returncode == 0, run.result.stderr
    assert run.within_bounds, (run.seconds, run.peak_mb)
