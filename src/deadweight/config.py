"""Project settings: `[tool.deadweight]` in pyproject.toml, or a deadweight.toml.

    [tool.deadweight]
    select = ["DW1", "DW5"]              # rule codes, code prefixes or names
    ignore = ["DW504"]
    fail-on = "error"                    # error, warning (the default), info or never
    exclude = ["third_party"]            # never linted when met while walking a directory
    inference-only = ["serve/**", "src/model.rs::generate*"]

    [tool.deadweight.per-file-ignores]
    "tests/**" = ["DW501"]

    [tool.deadweight.thresholds]         # deadweight.thresholds lists them, with defaults
    never-moved-steps = 200
    quantization-scheme = "int8-channel"

A deadweight.toml holds the same keys at its top level (`[thresholds]`,
`[per-file-ignores]`). The configuration of a directory is the nearest file, from
there upwards, that is a deadweight.toml or a pyproject.toml with a `[tool.deadweight]`
table; a deadweight.toml wins over a pyproject.toml in the same directory. Every
subcommand reads it (lint per linted file, the others from the working directory);
the Python API only when asked (`config=` or `deadweight.load_config()`).

Patterns are relative to the directory of the pyproject.toml. `*`, `?` and `[...]`
stay within one path component, a component `**` spans any number of them (elsewhere
`**` is a `*`); a pattern without `/` matches any file or directory of that name at any
depth, and a pattern that matches a directory covers everything below it. A pattern
that cannot be read (`[z-a]`, an unclosed `[`) is a problem of the table, like an
unknown key; each is compiled once and matched in time linear in the path's length
(`deadweight.path_globs`). An `inference-only` entry `PATH::FUNCTION`
marks only the matching functions (by name, or by qualified name such as
`Model.generate` or `Model::generate`) of the matching files.

Every problem in the table is collected and raised at once as a `ConfigError`; an
unknown key names the nearest known one.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import inspect
import os
import re
import reprlib
import stat
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ParamSpec, TypeVar

from deadweight.errors import ConfigError
from deadweight.path_globs import GlobError, GlobSet, PathGlob, compile_glob
from deadweight.thresholds import DEFAULT as DEFAULT_THRESHOLDS
from deadweight.thresholds import KEYS as THRESHOLD_KEYS
from deadweight.thresholds import Thresholds, current, did_you_mean, key_of, using

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

FILENAME = "pyproject.toml"
OWN_FILENAME = "deadweight.toml"
FAIL_ON_CHOICES = ("error", "warning", "info", "never")
DEFAULT_FAIL_ON = "warning"

# key -> what it holds, for the error message
KEYS: dict[str, str] = {
    "select": "a list of rule codes, code prefixes or names",
    "ignore": "a list of rule codes, code prefixes or names",
    "fail-on": "one of " + ", ".join(FAIL_ON_CHOICES),
    "thresholds": "a table of threshold = value (`deadweight config` lists them)",
    "exclude": "a list of path patterns",
    "per-file-ignores": "a table of path pattern = list of rule codes, code prefixes or names",
    "inference-only": "a list of path patterns, each optionally with ::FUNCTION",
}


@dataclass(frozen=True)
class Config:
    """Settings of one project; `root` is the directory its patterns are relative to."""

    root: Path
    path: Path | None = None
    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    per_file_ignores: tuple[tuple[str, tuple[str, ...]], ...] = ()
    inference_only: tuple[str, ...] = field(default=())
    fail_on: str = DEFAULT_FAIL_ON
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    # keys set by the file (`fail-on`, `thresholds.outlier-z`); the rest are defaults
    explicit: frozenset[str] = frozenset()
    own_file: bool = False  # a deadweight.toml (keys at the top level)
    # broken pyproject.toml files without [tool.deadweight] passed over on the way here
    notes: tuple[str, ...] = ()

    def source_of(self, key: str) -> str:
        """Where a key's value came from: the file (and table) that set it, or `default`."""
        if key in self.explicit and self.path is not None:
            table = "" if self.own_file else " [tool.deadweight]"
            return f"{self.path}{table}"
        return "default"

    def effective(self) -> dict[str, Any]:
        """Every key with its value, thresholds as `thresholds.KEY`, in a stable order."""
        values: dict[str, Any] = {
            "select": list(self.select),
            "ignore": list(self.ignore),
            "fail-on": self.fail_on,
            "exclude": list(self.exclude),
            "per-file-ignores": {p: list(r) for p, r in self.per_file_ignores},
            "inference-only": list(self.inference_only),
        }
        values.update({f"thresholds.{k}": v for k, v in self.thresholds.to_dict().items()})
        return values

    def relative(self, path: str | Path) -> str | None:
        """`path` relative to the root in POSIX form, or None when it lies outside."""
        parts = self._relative_parts(path)
        return None if parts is None else "/".join(parts)

    def _relative_parts(self, path: str | Path) -> tuple[str, ...] | None:
        # Symbolic links resolved, each directory once (see _resolved): resolving every
        # path of a deep tree whole cost a system call per component per file.
        real = _resolved(os.path.abspath(path), self._resolved_dirs)
        root = _resolved(os.path.abspath(self.root), self._resolved_dirs)
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            return None
        return tuple(Path(real[len(root) :].lstrip(os.sep)).parts)

    @functools.cached_property
    def _resolved_dirs(self) -> dict[str, str]:
        return {}  # directory -> its real path: see _resolved

    @functools.cached_property
    def _exclude_globs(self) -> GlobSet:
        return GlobSet.of(self.exclude)

    @functools.cached_property
    def _per_file_globs(self) -> tuple[tuple[PathGlob, tuple[str, ...]], ...]:
        return tuple((compile_glob(p), rules) for p, rules in self.per_file_ignores)

    def excludes(self, path: str | Path) -> bool:
        if not self.exclude:
            return False
        parts = self._relative_parts(path)
        return parts is not None and self._exclude_globs.matches(parts)

    def ignored_rules(self, path: str | Path) -> tuple[str, ...]:
        """Rule entries ignored for this file by `per-file-ignores`."""
        if not self.per_file_ignores:
            return ()
        parts = self._relative_parts(path)
        if parts is None:
            return ()
        return tuple(e for glob, rules in self._per_file_globs if glob.matches(parts)
                     for e in rules)  # fmt: skip

    def inference_only_match(self, path: str | Path, function: str | None) -> str | None:
        """The `inference-only` entry that covers this file (and function), if any."""
        rel = self.relative(path)
        if rel is None:
            return None
        for entry in self.inference_only:
            file_pattern, _, function_pattern = entry.partition("::")
            if not path_matches(file_pattern, rel):
                continue
            if not function_pattern:
                return entry
            if function and _function_matches(function_pattern, function):
                return entry
        return None


_RESOLVED_MAX = 100_000  # directories kept by one configuration before it starts over


def _resolved(path: str, known: dict[str, str]) -> str:
    """`path` (absolute, normalised) with every symbolic link resolved, as realpath does,
    but looking at each directory once: a directory's real path is cached, and a path's
    own last component is the only new one (a lint of a deep tree resolved every
    component of every path: 2100 folders deep took minutes). `known` holds the
    directories resolved so far."""
    chain: list[str] = []  # the components below the nearest directory already resolved
    head = path
    while head not in known:
        parent, name = os.path.split(head)
        if not name or parent == head:
            known[head] = head  # the root
            break
        chain.append(name)
        head = parent
    real = known[head]
    if len(known) > _RESOLVED_MAX:
        known.clear()
    for name in reversed(chain):
        here = os.path.join(real, name)
        real = os.path.realpath(here) if os.path.islink(here) else here
        head = os.path.join(head, name)
        if head != path:
            known[head] = real
    return real


def default(root: Path | None = None) -> Config:
    return Config(root=root or Path.cwd())


def find_pyproject(start: str | Path) -> Path | None:
    """The nearest pyproject.toml with a `[tool.deadweight]` table, from `start` upwards."""
    return _find(start, own_file=False)


def find_config_file(start: str | Path) -> Path | None:
    """The nearest deadweight.toml, or pyproject.toml with a `[tool.deadweight]` table."""
    return _find(start, own_file=True)


def _find(start: str | Path, *, own_file: bool, notes: list[str] | None = None) -> Path | None:
    here = Path(start).resolve()
    if not here.is_dir():
        here = here.parent
    for directory in (here, *here.parents):
        if own_file:
            own = directory / OWN_FILENAME
            if own.is_file():
                return own
            if os.path.lexists(own) and not own.is_dir():
                return own  # a FIFO, a socket, a dangling link: load() says so, never opens it
        candidate = directory / FILENAME
        if candidate.is_file():
            has_table, note = _has_table(candidate)
            if note and notes is not None:
                notes.append(note)
            if has_table:
                return candidate
    return None


def _has_table(path: Path) -> tuple[bool, str | None]:
    try:
        mtime_ns = path.stat().st_mtime_ns
    except OSError:
        return False, None  # gone since is_file(): nothing to read
    return _has_table_cached(path, mtime_ns)


@functools.lru_cache(maxsize=64)
def _has_table_cached(path: Path, mtime_ns: int) -> tuple[bool, str | None]:
    """Whether a pyproject.toml holds `[tool.deadweight]`, and a note when it cannot be
    parsed but is none of deadweight's business (so it is passed over, not an error)."""
    try:
        tool = _read_toml(path).get("tool")
    except ConfigError as exc:
        if _mentions_deadweight(path):
            return True, None  # let load() report the broken file instead of skipping it
        return False, f"{exc}; it has no [tool.deadweight], so deadweight ignores it"
    return isinstance(tool, dict) and "deadweight" in tool, None


# `[tool.deadweight]`, `[tool.deadweight.thresholds]`, `tool.deadweight.x = ` or, under
# `[tool]`, `deadweight = {...}` / `deadweight.x = `: how a TOML file can hold the table.
_TABLE_TEXT = re.compile(
    rb"""^[ \t]*(?:\[[ \t]*tool[ \t]*\.[ \t]*["']?deadweight\b|(?:tool[ \t]*\.[ \t]*)?"""
    rb"""["']?deadweight["']?[ \t]*[.=])""",
    re.MULTILINE,
)


def _mentions_deadweight(path: Path) -> bool:
    """Whether an unparsable pyproject.toml looks like it has a [tool.deadweight] table
    (a mere dependency on deadweight does not count)."""
    try:
        with open(path, "rb") as fh:
            return _TABLE_TEXT.search(fh.read()) is not None
    except OSError:
        return False


def for_path(start: str | Path) -> Config:
    """The configuration that governs `start`: its nearest configuration file, or defaults.
    `notes` of the result name the broken pyproject.toml files passed over."""
    notes: list[str] = []
    found = _find(start, own_file=True, notes=notes)
    cfg = load(found) if found else default()
    return dataclasses.replace(cfg, notes=tuple(notes)) if notes else cfg


def load(path: str | Path) -> Config:
    """Read a deadweight.toml, or `[tool.deadweight]` of a pyproject.toml (or any other
    .toml file); raises ConfigError listing every problem."""
    path = Path(path)
    if path.is_dir():
        found = find_config_file(path)
        if found is None:
            raise ConfigError(f"{path}: no {OWN_FILENAME} or {FILENAME} with [tool.deadweight]")
        path = found
    document = _read_toml(path)
    tool = document.get("tool")
    nested = isinstance(tool, dict) and "deadweight" in tool
    if path.name == FILENAME or (nested and path.name != OWN_FILENAME):
        if tool is not None and not isinstance(tool, dict):
            raise ConfigError(f"{path}: [tool] must be a table, got {_shown(tool)}")
        table = (tool or {}).get("deadweight", {})
        return from_table(table, root=path.resolve().parent, source=path)
    return from_table(document, root=path.resolve().parent, source=path, own_file=True)


def load_config(path: str | Path | None = None) -> Config:
    """The project configuration, for the Python API: the file at `path` (a
    deadweight.toml or pyproject.toml, or a directory to search from), else the
    nearest one from the working directory upwards, else the defaults.

    Pass the result as `config=` to `check`, `watch`, `inspect_checkpoints`, ...
    """
    if path is None:
        return for_path(Path.cwd())
    return load(path)


ConfigLike = Config | str | os.PathLike[str] | bool | None
Rules = Iterable[str] | str | None
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Settings:
    """What a project configuration contributes to one API call."""

    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    thresholds: Thresholds = DEFAULT_THRESHOLDS

    def rules(self, select: Rules, ignore: Rules) -> tuple[Rules, tuple[str, ...]]:
        """An explicit `select` replaces the configured one; `ignore` adds to it."""
        return (select if _entries(select) else self.select), (*self.ignore, *_entries(ignore))


def settings_for(
    config: ConfigLike, thresholds: Thresholds | Mapping[str, Any] | None = None
) -> Settings:
    """`config` is None or False (no file is read: the active thresholds apply), True
    (the nearest file from the working directory), a path or a Config; `thresholds` (a
    Thresholds, or a mapping of some keys) overrides the configured values."""
    cfg: Config | None
    if config is None or config is False:
        cfg = None
    elif config is True:
        cfg = load_config()
    elif isinstance(config, Config):
        cfg = config
    else:
        cfg = load(os.fspath(config))
    # Without a configuration, the thresholds already active (an enclosing `using()`, or
    # those the command line read) stay in force.
    if cfg is None:
        base = Settings(thresholds=current())
    else:
        base = Settings(cfg.select, cfg.ignore, cfg.thresholds)
    if thresholds is None:
        return base
    if isinstance(thresholds, Thresholds):
        return dataclasses.replace(base, thresholds=thresholds)
    return dataclasses.replace(base, thresholds=base.thresholds.updated(thresholds))


def resolve(
    config: ConfigLike, select: Rules = None, ignore: Rules = None, thresholds: Any = None
) -> tuple[Rules, tuple[str, ...], Thresholds]:
    """(select, ignore, thresholds) of an API call with these arguments."""
    settings = settings_for(config, thresholds)
    chosen, ignored = settings.rules(select, ignore)
    return chosen, ignored, settings.thresholds


def applies_settings(fn: Callable[P, R]) -> Callable[P, R]:
    """For the API functions that judge, with `select`, `ignore`, `config` and
    `thresholds` keywords: the configuration is resolved once, select/ignore merged,
    and the function runs with the thresholds active."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = signature.bind(*args, **kwargs)
        given = bound.arguments
        select, ignore, limits = resolve(
            given.get("config"), given.get("select"), given.get("ignore"),
            given.get("thresholds"),
        )  # fmt: skip
        given.update(select=select, ignore=ignore, config=None, thresholds=limits)
        with using(limits):
            return fn(*bound.args, **bound.kwargs)

    return wrapper


def _entries(rules: Iterable[str] | str | None) -> tuple[str, ...]:
    if rules is None:
        return ()
    return (rules,) if isinstance(rules, str) else tuple(rules)


def from_table(
    table: Any, *, root: Path, source: Path | None = None, own_file: bool = False
) -> Config:
    """Validate a `[tool.deadweight]` table, or a deadweight.toml (`own_file`), already
    parsed, and build the Config."""
    own = own_file
    name = "" if own else " [tool.deadweight]"
    where = f"{source}{name}" if source else "[tool.deadweight]"
    problems: list[str] = []
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
    for key in table:
        if key not in KEYS:
            hint = _did_you_mean(key, [*KEYS, *(f"thresholds.{k}" for k in THRESHOLD_KEYS)])
            if own and key == "tool":
                hint = (
                    f" ({OWN_FILENAME} holds the keys at its top level, without [tool.deadweight])"
                )
            problems.append(f"unknown key {_shown(key)}{hint}")

    def string_list(key: str) -> tuple[str, ...]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(f"{key} must be {KEYS[key]}, got {_shown(value)}")
            return ()
        return tuple(value)

    select = string_list("select")
    ignore = string_list("ignore")
    exclude = string_list("exclude")
    inference_only = string_list("inference-only")
    per_file: list[tuple[str, tuple[str, ...]]] = []
    raw = table.get("per-file-ignores", {})
    if not isinstance(raw, dict):
        problems.append(f"per-file-ignores must be {KEYS['per-file-ignores']}, got {_shown(raw)}")
    else:
        for pattern, rules in raw.items():
            if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
                problems.append(
                    f"per-file-ignores.{_shown(pattern)} must be a list of rule codes, "
                    f"got {_shown(rules)}"
                )
                continue
            per_file.append((pattern, tuple(rules)))
    for entry in (*select, *ignore, *(r for _, rules in per_file for r in rules)):
        problem = rule_entry_problem(entry)
        if problem:
            problems.append(problem)
    for entry in inference_only:
        if entry.partition("::")[0] == "":
            problems.append(
                f"inference-only entry {_shown(entry)} has no path pattern (use '**::NAME')"
            )
    for key, patterns in (
        ("exclude", exclude),
        ("per-file-ignores", [p for p, _ in per_file]),
        ("inference-only", [e.partition("::")[0] for e in inference_only]),
    ):
        for pattern in patterns:
            try:
                compile_glob(pattern)
            except GlobError as exc:
                problems.append(f"{key}: {exc}")
    fail_on = table.get("fail-on", DEFAULT_FAIL_ON)
    if fail_on not in FAIL_ON_CHOICES:
        problems.append(
            f"fail-on must be {KEYS['fail-on']}, got {_shown(fail_on)}"
            + _did_you_mean(_shown(fail_on).strip("'\""), FAIL_ON_CHOICES)
        )
        fail_on = DEFAULT_FAIL_ON
    limits = DEFAULT_THRESHOLDS
    raw_limits = table.get("thresholds", {})
    if not isinstance(raw_limits, dict):
        problems.append(f"thresholds must be {KEYS['thresholds']}, got {_shown(raw_limits)}")
        raw_limits = {}
    try:
        limits = DEFAULT_THRESHOLDS.updated(raw_limits, where="thresholds")
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    explicit = {k for k in table if k != "thresholds"}
    explicit |= {f"thresholds.{key_of(str(k).replace('-', '_'))}" for k in raw_limits}
    return Config(
        root=root,
        path=source,
        select=select,
        ignore=ignore,
        exclude=exclude,
        per_file_ignores=tuple(per_file),
        inference_only=inference_only,
        fail_on=fail_on,
        thresholds=limits,
        explicit=frozenset(explicit),
        own_file=own,
    )


def rule_entry_problem(entry: str) -> str | None:
    """Why a select/ignore entry names no rule, with the nearest code or name; None if fine."""
    from deadweight.registry import all_rules

    rules = all_rules()
    key = entry.strip()
    upper = key.upper()
    if upper.startswith("DW"):
        if any(r.code.startswith(upper) for r in rules):
            return None
        return f"unknown rule {_shown(entry)}{_did_you_mean(upper, [r.code for r in rules])}"
    if any(r.name == key for r in rules):
        return None
    return f"unknown rule {_shown(entry)}{_did_you_mean(key, [r.name for r in rules])}"


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    # difflib's cost grows with the word's length: no key or choice is longer than 64.
    return did_you_mean(word[:64], choices)


def _read_toml(path: Path) -> dict[str, Any]:
    """The parsed file; ConfigError naming it for anything that stops that."""
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise ConfigError(f"{path}: reading TOML on Python 3.10 needs `pip install tomli`")
    try:
        # Only a regular file is opened: a FIFO would block until someone writes to it.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"{path}: not a regular file")
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not valid TOML: not UTF-8 (byte {exc.start}: {exc.reason})"
        ) from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deeply to read") from None
    except ValueError as exc:  # such as an integer too long to convert
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = 80  # a value in a message: enough to recognise it
_SHOWN.maxlevel = 3


def _shown(value: Any) -> str:
    """repr() of a configured value, cut to a readable length and depth."""
    return _SHOWN.repr(value)


def path_matches(pattern: str, rel: str) -> bool:
    """Whether a POSIX path relative to the root, or a directory above it, matches `pattern`
    (see `deadweight.path_globs`); raises GlobError for a pattern that cannot be read."""
    return _compiled(pattern).matches(PurePosixPath(rel).parts)


@functools.lru_cache(maxsize=1024)
def _compiled(pattern: str) -> PathGlob:
    return compile_glob(pattern)


def _function_matches(pattern: str, function: str) -> bool:
    last = re.split(r"::|\.", function)[-1]
    return fnmatch.fnmatchcase(function, pattern) or fnmatch.fnmatchcase(last, pattern)
