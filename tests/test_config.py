"""`[tool.deadweight]`: found in the nearest pyproject.toml, validated all at once, and applied
by `deadweight lint` (select, ignore, exclude, per-file-ignores, inference-only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import deadweight
from deadweight import config
from deadweight.config import Config, path_matches
from deadweight.errors import ConfigError
from tests.linting.helpers import write

CHECKPOINTED = (
    "import torch\n\ndef f(block, x):\n    return torch.utils.checkpoint.checkpoint(block, x)\n"
)
DECAY = "def groups(ps):\n    no_decay = [p for p in ps if p.ndim < 2]\n    return no_decay\n"


def pyproject(directory: Path, body: str) -> Path:
    path = directory / "pyproject.toml"
    path.write_text('[project]\nname = "x"\n\n[tool.deadweight]\n' + body)
    return path


def test_load_reads_every_key(tmp_path: Path) -> None:
    path = pyproject(tmp_path, """
select = ["DW5"]
ignore = ["reentrant-checkpoint"]
exclude = ["vendor"]
inference-only = ["serve/**", "src/model.rs::generate*"]

[tool.deadweight.per-file-ignores]
"tests/**" = ["DW501", "DW502"]
""")  # fmt: skip
    cfg = config.load(path)
    assert cfg.root == tmp_path.resolve() and cfg.path == path
    assert cfg.select == ("DW5",) and cfg.ignore == ("reentrant-checkpoint",)
    assert cfg.exclude == ("vendor",)
    assert cfg.per_file_ignores == (("tests/**", ("DW501", "DW502")),)
    assert cfg.ignored_rules(tmp_path / "tests" / "unit" / "test_x.py") == ("DW501", "DW502")
    assert cfg.ignored_rules(tmp_path / "src" / "x.py") == ()
    assert cfg.inference_only_match(tmp_path / "serve" / "app.py", None) == "serve/**"
    assert cfg.inference_only_match(tmp_path / "src" / "model.rs", "Model::generate_step")
    assert cfg.inference_only_match(tmp_path / "src" / "model.rs", "Model::forward") is None
    assert cfg.excludes(tmp_path / "a" / "vendor" / "b.py")


def test_every_problem_is_reported_at_once_with_the_nearest_key(tmp_path: Path) -> None:
    path = pyproject(tmp_path, """
selct = ["DW501"]
per_file_ignores = {}
ignore = "DW501"
select = ["DW599", "forward-gradient-cutt"]
inference-only = ["::generate"]
""")  # fmt: skip
    with pytest.raises(ConfigError) as info:
        config.load(path)
    message = str(info.value)
    assert str(path) in message
    assert "unknown key 'selct' (did you mean 'select'?)" in message
    assert "unknown key 'per_file_ignores' (did you mean 'per-file-ignores'?)" in message
    assert "ignore must be a list" in message
    assert "unknown rule 'DW599'" in message
    assert "unknown rule 'forward-gradient-cutt' (did you mean 'forward-gradient-cut'?)" in message
    assert "has no path pattern" in message


def test_broken_toml_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text("[tool.deadweight\nselect = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(path)


def test_nearest_pyproject_with_a_deadweight_table(tmp_path: Path) -> None:
    outer = pyproject(tmp_path, 'ignore = ["DW504"]\n')
    inner = tmp_path / "pkg"
    inner.mkdir()
    (inner / "pyproject.toml").write_text('[project]\nname = "inner"\n')  # no [tool.deadweight]
    deep = inner / "src" / "m.py"
    deep.parent.mkdir()
    deep.write_text("")
    assert config.find_pyproject(deep) == outer
    assert config.for_path(deep).ignore == ("DW504",)
    assert config.find_pyproject(Path("/")) is None or config.find_pyproject(Path("/")) != outer


@pytest.mark.parametrize(
    "pattern,path,expected",
    [
        ("tests/**", "tests/a/b.py", True),
        ("tests/**", "src/tests.py", False),
        ("tests", "src/tests/x.py", True),  # no slash: a component at any depth
        ("*.rs", "src/model.rs", True),
        ("src/*.py", "src/a/b.py", True),  # the directory src/a does not match, but...
        ("src/*.py", "src/b.py", True),
        ("src/*/b.py", "src/a/b.py", True),
        ("src/*.py", "lib/b.py", False),
        ("**/gen_*.py", "a/b/gen_x.py", True),
        ("serve", "serve/app.py", True),
        ("./serve/", "serve/app.py", True),
    ],
)
def test_path_patterns(pattern: str, path: str, expected: bool) -> None:
    if (pattern, path) == ("src/*.py", "src/a/b.py"):
        expected = False  # `*` stays within one component
    assert path_matches(pattern, path) is expected


def test_lint_applies_the_nearest_configuration(tmp_path: Path) -> None:
    pyproject(tmp_path, """
ignore = ["DW502"]
exclude = ["generated"]

[tool.deadweight.per-file-ignores]
"legacy/*.py" = ["reentrant-checkpoint"]
""")  # fmt: skip
    write(tmp_path, CHECKPOINTED, "src/a.py")
    write(tmp_path, DECAY, "src/b.py")
    write(tmp_path, CHECKPOINTED, "legacy/c.py")
    write(tmp_path, CHECKPOINTED, "generated/d.py")
    report = deadweight.lint_paths([tmp_path])
    assert [(Path(f.location.file).name, f.code) for f in report.findings] == [("a.py", "DW504")]
    assert report.subject["files"] == 3  # generated/ was never entered
    assert report.subject["config"] == [str(tmp_path / "pyproject.toml")]
    # --select on the command line replaces the configured select; --ignore adds to it
    again = deadweight.lint_paths([tmp_path], select=["DW502"])
    assert [f.code for f in again.findings] == []  # still ignored by the configuration
    isolated = deadweight.lint_paths([tmp_path], config=None)
    assert sorted(f.code for f in isolated.findings) == ["DW502", "DW504", "DW504", "DW504"]


def test_config_object_and_explicit_path(tmp_path: Path) -> None:
    path = pyproject(tmp_path, 'select = ["DW502"]\n')
    write(tmp_path, CHECKPOINTED + DECAY, "m.py")
    assert [f.code for f in deadweight.lint_paths([tmp_path], config=path).findings] == ["DW502"]
    own = Config(root=tmp_path, ignore=("DW5",))
    assert deadweight.lint_paths([tmp_path], config=own).findings == ()


# --- one configuration for every subcommand: deadweight.toml, fail-on, thresholds ------


def test_deadweight_toml_holds_the_keys_at_top_level_and_wins_in_its_directory(
    tmp_path: Path,
) -> None:
    pyproject(tmp_path, 'ignore = ["DW504"]\n')
    own = tmp_path / "deadweight.toml"
    own.write_text('ignore = ["DW502"]\nfail-on = "error"\n\n[thresholds]\noutlier-z = 7.5\n')
    cfg = config.for_path(tmp_path / "src" / "m.py")
    assert cfg.path == own and cfg.own_file
    assert cfg.ignore == ("DW502",) and cfg.fail_on == "error"
    assert cfg.thresholds.outlier_z == 7.5
    assert cfg.source_of("thresholds.outlier-z") == str(own)
    assert cfg.source_of("thresholds.never-moved-steps") == "default"
    own.unlink()  # without it, the pyproject.toml governs
    assert config.for_path(tmp_path).ignore == ("DW504",)


def test_fail_on_and_thresholds_are_read_and_their_sources_named(tmp_path: Path) -> None:
    path = pyproject(tmp_path, """
fail-on = "info"

[tool.deadweight.thresholds]
never-moved-steps = 200
quantization-scheme = "int8-channel"
""")  # fmt: skip
    cfg = config.load(path)
    assert cfg.fail_on == "info"
    assert cfg.thresholds.never_moved_steps == 200
    assert cfg.thresholds.quantization_scheme == "int8-channel"
    assert cfg.thresholds.outlier_z == 5.0  # untouched keys keep their defaults
    assert cfg.source_of("fail-on") == f"{path} [tool.deadweight]"
    assert cfg.source_of("select") == "default"
    effective = cfg.effective()
    assert effective["thresholds.never-moved-steps"] == 200 and effective["fail-on"] == "info"
    assert config.default().fail_on == "warning"


def test_threshold_and_fail_on_problems_are_all_reported_with_the_nearest_key(
    tmp_path: Path,
) -> None:
    path = pyproject(tmp_path, """
fail-on = "warnings"
thresold = 1

[tool.deadweight.thresholds]
outlier_zz = 3
never-moved-steps = 2.5
noise-floor-ulps = -1
quantization-scheme = "int3-bogus"
""")  # fmt: skip
    with pytest.raises(ConfigError) as info:
        config.load(path)
    message = str(info.value)
    assert "fail-on must be one of error, warning, info, never, got 'warnings'" in message
    assert "(did you mean 'warning'?)" in message
    assert "unknown key 'thresold' (did you mean 'thresholds'?)" in message
    assert "unknown key 'outlier_zz' (did you mean 'outlier-z'?)" in message
    assert "never-moved-steps must be a whole number, got 2.5" in message
    assert "noise-floor-ulps must be positive, got -1" in message
    assert "quantization-scheme is not a quantization scheme" in message


def test_a_tool_table_in_deadweight_toml_is_explained(tmp_path: Path) -> None:
    own = tmp_path / "deadweight.toml"
    own.write_text('[tool.deadweight]\nignore = ["DW504"]\n')
    with pytest.raises(ConfigError, match="holds the keys at its top level"):
        config.load(own)


def test_the_api_reads_a_configuration_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pyproject(tmp_path, 'ignore = ["DW107"]\n[tool.deadweight.thresholds]\noutlier-z = 9\n')
    monkeypatch.chdir(tmp_path)
    # not asked: nothing read, the active thresholds apply
    select, ignore, limits = config.resolve(None, None, ["DW101"])
    assert not select and ignore == ("DW101",) and limits.outlier_z == 5.0
    # asked: True finds the nearest file; select replaces, ignore adds, thresholds override
    select, ignore, limits = config.resolve(True, ["DW1"], ["DW101"], {"never-moved-steps": 7})
    assert list(select or ()) == ["DW1"] and ignore == ("DW107", "DW101")
    assert (limits.outlier_z, limits.never_moved_steps) == (9, 7)
    assert deadweight.load_config().ignore == ("DW107",)
    assert deadweight.load_config(tmp_path / "pyproject.toml").thresholds.outlier_z == 9
    with pytest.raises(ConfigError, match="unknown key 'outlier-zz'"):
        config.resolve(True, thresholds={"outlier-zz": 1})


# -- unreadable files (issue 20): one ConfigError naming the file, never a traceback ----

DEEP = "x = " + "[" * 200_000 + "]" * 200_000 + "\n"


@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (DEEP, "not valid TOML: nested too deeply to read"),
        ("x = " + "7" * 5000 + "\n", "not valid TOML: Exceeds the limit"),
        (b"select = ['\xff\xfe']\n", "not valid TOML: not UTF-8 (byte 11"),
        ("select = [\n", "not valid TOML: "),
    ],
    ids=["nested-200k-deep", "5000-digit-integer", "not-utf8", "cut-off"],
)
def test_an_unparsable_deadweight_toml_is_a_config_error_naming_it(
    tmp_path: Path, body: str | bytes, problem: str
) -> None:
    path = tmp_path / "deadweight.toml"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    with pytest.raises(ConfigError) as info:
        config.for_path(tmp_path)
    assert str(info.value).startswith(f"{path}: {problem}")


def test_a_broken_pyproject_without_our_table_is_passed_over_with_a_note(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["deadweight"]\n' + DEEP)
    cfg = config.for_path(tmp_path)
    assert cfg.path is None and cfg.select == ()
    (note,) = cfg.notes
    assert note.startswith(f"{tmp_path / 'pyproject.toml'}: not valid TOML: nested too deeply")
    assert note.endswith("it has no [tool.deadweight], so deadweight ignores it")


def test_a_broken_pyproject_with_our_table_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text('[tool.deadweight]\nselect = ["DW5"\n')
    with pytest.raises(ConfigError, match=f"^{path}: not valid TOML"):
        config.for_path(tmp_path)


@pytest.mark.parametrize("tool", ["5", '"deadweight"', '["deadweight"]'])
def test_a_tool_key_that_is_not_a_table_is_not_a_crash(tmp_path: Path, tool: str) -> None:
    path = tmp_path / "pyproject.toml"
    path.write_text(f"tool = {tool}\n")
    assert config.for_path(tmp_path).path is None  # not ours: defaults
    with pytest.raises(ConfigError, match=r"\[tool\] must be a table"):
        config.load(path)


def test_values_in_messages_are_cut_to_a_readable_length(tmp_path: Path) -> None:
    (tmp_path / "deadweight.toml").write_text(f'fail-on = "{"x" * 100_000}"\n')
    with pytest.raises(ConfigError) as info:
        config.for_path(tmp_path)
    assert "fail-on must be" in str(info.value) and len(str(info.value)) < 500


def test_a_deadweight_toml_that_is_not_a_regular_file_is_never_opened(tmp_path: Path) -> None:
    import subprocess
    import sys

    os.mkfifo(tmp_path / "deadweight.toml")
    (tmp_path / "other.toml").symlink_to(tmp_path / "missing.toml")
    script = (
        "import sys; from deadweight import config\n"
        "for target in sys.argv[1:]:\n"
        "    try:\n"
        "        config.load(target) if target.endswith('.toml') else config.for_path(target)\n"
        "    except config.ConfigError as exc:\n"
        "        print(exc)\n"
    )
    targets = [str(tmp_path), str(tmp_path / "deadweight.toml"), str(tmp_path / "other.toml")]
    # A timeout, not a hang, if a FIFO is ever opened: nothing writes to it.
    result = subprocess.run(
        [sys.executable, "-c", script, *targets], capture_output=True, text=True, timeout=120
    )
    assert result.stdout.splitlines() == [
        f"{tmp_path / 'deadweight.toml'}: not a regular file",
        f"{tmp_path / 'deadweight.toml'}: not a regular file",
        f"{tmp_path / 'other.toml'}: cannot read: No such file or directory",
    ], result.stderr
