"""Project settings from `[tool.deadweight]` in the nearest pyproject.toml.

    [tool.deadweight]
    select = ["DW5"]                     # rule codes, code prefixes or names
    ignore = ["DW504"]
    exclude = ["third_party"]            # never linted when met while walking a directory
    inference-only = ["serve/**", "src/model.rs::generate*"]

    [tool.deadweight.per-file-ignores]
    "tests/**" = ["DW501"]

Patterns are relative to the directory of the pyproject.toml. `*` and `?` stay
within one path component, `**` spans any number of them; a pattern without `/`
matches any file or directory of that name at any depth, and a pattern that matches
a directory covers everything below it. An `inference-only` entry `PATH::FUNCTION`
marks only the matching functions (by name, or by qualified name such as
`Model.generate` or `Model::generate`) of the matching files.

Every problem in the table is collected and raised at once as a `ConfigError`; an
unknown key names the nearest known one.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from deadweight.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

FILENAME = "pyproject.toml"

# key -> what it holds, for the error message
KEYS: dict[str, str] = {
    "select": "a list of rule codes, code prefixes or names",
    "ignore": "a list of rule codes, code prefixes or names",
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

    def relative(self, path: str | Path) -> str | None:
        """`path` relative to the root in POSIX form, or None when it lies outside."""
        try:
            return Path(path).resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return None

    def excludes(self, path: str | Path) -> bool:
        rel = self.relative(path)
        return rel is not None and any(path_matches(p, rel) for p in self.exclude)

    def ignored_rules(self, path: str | Path) -> tuple[str, ...]:
        """Rule entries ignored for this file by `per-file-ignores`."""
        rel = self.relative(path)
        if rel is None:
            return ()
        return tuple(e for pattern, rules in self.per_file_ignores if path_matches(pattern, rel)
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


def default(root: Path | None = None) -> Config:
    return Config(root=root or Path.cwd())


def find_pyproject(start: str | Path) -> Path | None:
    """The nearest pyproject.toml with a `[tool.deadweight]` table, from `start` upwards."""
    here = Path(start).resolve()
    if not here.is_dir():
        here = here.parent
    for directory in (here, *here.parents):
        candidate = directory / FILENAME
        if candidate.is_file() and _has_table(candidate):
            return candidate
    return None


def _has_table(path: Path) -> bool:
    return _has_table_cached(path, path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _has_table_cached(path: Path, mtime_ns: int) -> bool:
    try:
        return "deadweight" in _read_toml(path).get("tool", {})
    except ConfigError:
        return True  # let load() report the broken file instead of skipping past it


def for_path(start: str | Path) -> Config:
    """The configuration that governs `start`: its nearest `[tool.deadweight]`, or defaults."""
    found = find_pyproject(start)
    return load(found) if found else default()


def load(path: str | Path) -> Config:
    """Read `[tool.deadweight]` from a pyproject.toml; raises ConfigError listing every problem."""
    path = Path(path)
    table = _read_toml(path).get("tool", {}).get("deadweight", {})
    return from_table(table, root=path.resolve().parent, source=path)


def from_table(table: Any, *, root: Path, source: Path | None = None) -> Config:
    """Validate a `[tool.deadweight]` table (already parsed) and build the Config."""
    where = f"{source} [tool.deadweight]" if source else "[tool.deadweight]"
    problems: list[str] = []
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {type(table).__name__}")
    for key in table:
        if key not in KEYS:
            problems.append(f"unknown key {key!r}{_did_you_mean(key, KEYS)}")

    def string_list(key: str) -> tuple[str, ...]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(f"{key} must be {KEYS[key]}, got {value!r}")
            return ()
        return tuple(value)

    select = string_list("select")
    ignore = string_list("ignore")
    exclude = string_list("exclude")
    inference_only = string_list("inference-only")
    per_file: list[tuple[str, tuple[str, ...]]] = []
    raw = table.get("per-file-ignores", {})
    if not isinstance(raw, dict):
        problems.append(f"per-file-ignores must be {KEYS['per-file-ignores']}, got {raw!r}")
    else:
        for pattern, rules in raw.items():
            if not isinstance(rules, list) or not all(isinstance(r, str) for r in rules):
                problems.append(
                    f"per-file-ignores.{pattern!r} must be a list of rule codes, got {rules!r}"
                )
                continue
            per_file.append((pattern, tuple(rules)))
    for entry in (*select, *ignore, *(r for _, rules in per_file for r in rules)):
        problem = rule_entry_problem(entry)
        if problem:
            problems.append(problem)
    for entry in inference_only:
        if entry.partition("::")[0] == "":
            problems.append(f"inference-only entry {entry!r} has no path pattern (use '**::NAME')")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return Config(
        root=root,
        path=source,
        select=select,
        ignore=ignore,
        exclude=exclude,
        per_file_ignores=tuple(per_file),
        inference_only=inference_only,
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
        return f"unknown rule {entry!r}{_did_you_mean(upper, [r.code for r in rules])}"
    if any(r.name == key for r in rules):
        return None
    return f"unknown rule {entry!r}{_did_you_mean(key, [r.name for r in rules])}"


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _read_toml(path: Path) -> dict[str, Any]:
    if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
        raise ConfigError(
            f"{path}: reading pyproject.toml on Python 3.10 needs `pip install tomli`"
        )
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None


def path_matches(pattern: str, rel: str) -> bool:
    """Whether a POSIX path relative to the root, or a directory above it, matches `pattern`."""
    pattern = pattern.strip().removeprefix("./").rstrip("/")
    parts = PurePosixPath(rel).parts
    if "/" not in pattern:
        regex = _glob_regex(pattern)
        return any(regex.fullmatch(part) for part in parts)
    regex = _glob_regex(pattern)
    return any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1))


@functools.lru_cache(maxsize=512)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    out: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append(f"[{body}]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out))


def _function_matches(pattern: str, function: str) -> bool:
    last = re.split(r"::|\.", function)[-1]
    return fnmatch.fnmatchcase(function, pattern) or fnmatch.fnmatchcase(last, pattern)
