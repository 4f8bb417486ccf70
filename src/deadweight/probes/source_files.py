"""Finding and reading the source files `deadweight lint` examines.

Directories are walked in sorted order, following symbolic links but never into a
directory that is already on the current path (a link loop), and each real file is
returned once however many links lead to it. A file that cannot be read (gone,
unreadable, not a regular file, too large, a link that leads nowhere or in a
circle) becomes a `SourceProblem` for that file; the others are unaffected.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LANGUAGES = {".py": "python", ".rs": "rust"}

# Directory names never entered while walking (an explicitly named path is always
# linted): version control, virtual environments, caches and build output, where
# third-party or generated code lives.
DEFAULT_EXCLUDES = frozenset({
    ".git", ".hg", ".svn", ".bzr", ".venv", "venv", ".tox", ".nox", "__pycache__",
    ".mypy_cache", ".ruff_cache", ".pytest_cache", "node_modules", "site-packages",
    "__pypackages__", "target", "build", "dist", "_build",
})  # fmt: skip

# Larger files are reported rather than parsed: generated sources of this size take
# seconds and gigabytes to parse, and hand-written model code is far smaller (the
# largest file under transformers/models is about 0.3 MB).
DEFAULT_MAX_BYTES = 10 * 1024 * 1024


@dataclass(frozen=True)
class Span:
    """A region of source text: 1-based lines, 1-based columns in characters, end exclusive."""

    line: int
    column: int
    end_line: int
    end_column: int


def character_column(line_text: str, byte_offset: int) -> int:
    """Parsers count UTF-8 bytes into the line; editors and SARIF count characters (1-based)."""
    if line_text.isascii():
        return byte_offset + 1
    return len(line_text.encode("utf-8")[:byte_offset].decode("utf-8", "replace")) + 1


@dataclass(frozen=True)
class SourceProblem:
    """A file that could not be linted (or only partly), and why."""

    path: str
    message: str
    line: int | None = None
    column: int | None = None

    def __str__(self) -> str:
        where = self.path
        if self.line is not None:
            where += f":{self.line}" + (f":{self.column}" if self.column else "")
        return f"{where}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.path, "line": self.line, "column": self.column,
                "message": self.message}  # fmt: skip


@dataclass(frozen=True)
class SourcePath:
    path: str  # as shown to the user: joined from the path they gave
    language: str


def discover(
    inputs: Iterable[str | os.PathLike[str]],
    *,
    excluded: Callable[[Path], bool] = lambda p: False,
) -> tuple[list[SourcePath], list[SourceProblem]]:
    """The Python and Rust files under `inputs`, and the inputs that led nowhere."""
    found: list[SourcePath] = []
    problems: list[SourceProblem] = []
    seen: set[tuple[int, int]] = set()
    for raw in inputs:
        text = os.path.normpath(os.fspath(raw))  # "./a.py" and "src/../a.py" read as "a.py"
        try:
            info = os.stat(text)
        except OSError as exc:
            problems.append(SourceProblem(text, _os_reason(exc, text)))
            continue
        if stat.S_ISDIR(info.st_mode):
            _walk(text, info, found, problems, seen, excluded)
            continue
        language = LANGUAGES.get(Path(text).suffix)
        if language is None:
            problems.append(SourceProblem(text, "not a Python (.py) or Rust (.rs) file"))
            continue
        if _first_time(info, seen):
            found.append(SourcePath(text, language))
    return found, problems


def _walk(
    root: str,
    info: os.stat_result,
    found: list[SourcePath],
    problems: list[SourceProblem],
    seen: set[tuple[int, int]],
    excluded: Callable[[Path], bool],
) -> None:
    # (directory, inodes of it and its ancestors): an ancestor reached again is a loop
    stack: list[tuple[str, frozenset[tuple[int, int]]]] = [
        (root, frozenset({(info.st_dev, info.st_ino)}))
    ]
    visited_dirs = {(info.st_dev, info.st_ino)}
    while stack:
        directory, ancestors = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            problems.append(SourceProblem(directory, _os_reason(exc, directory)))
            continue
        subdirs: list[tuple[str, frozenset[tuple[int, int]]]] = []
        for entry in entries:
            path = entry.path if directory != "." else entry.name
            try:
                target = os.stat(path)  # follows links
            except OSError as exc:
                if entry.is_symlink() or Path(entry.name).suffix in LANGUAGES:
                    problems.append(SourceProblem(path, _os_reason(exc, path)))
                continue
            key = (target.st_dev, target.st_ino)
            if stat.S_ISDIR(target.st_mode):
                if entry.name in DEFAULT_EXCLUDES or excluded(Path(path)):
                    continue
                if key in ancestors:
                    problems.append(SourceProblem(
                        path, "symbolic link loop: leads back to a directory above it; not linted"
                    ))  # fmt: skip
                    continue
                if key in visited_dirs:  # reached before through another link
                    continue
                visited_dirs.add(key)
                subdirs.append((path, ancestors | {key}))
                continue
            language = LANGUAGES.get(Path(entry.name).suffix)
            if language is None or excluded(Path(path)):
                continue
            if not stat.S_ISREG(target.st_mode):
                problems.append(SourceProblem(path, "not a regular file; not linted"))
                continue
            if _first_time(target, seen):
                found.append(SourcePath(path, language))
        stack.extend(reversed(subdirs))  # depth first, in name order


def _first_time(info: os.stat_result, seen: set[tuple[int, int]]) -> bool:
    key = (info.st_dev, info.st_ino)
    if key in seen:
        return False
    seen.add(key)
    return True


def read_bytes(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes | SourceProblem:
    """The file's bytes, or why they cannot be had."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            return SourceProblem(path, "not a regular file; not linted")
        if info.st_size > max_bytes:
            return SourceProblem(
                path,
                f"{info.st_size / 2**20:.1f} MiB is over the {max_bytes / 2**20:.0f} MiB limit "
                "for one source file; not linted (--max-file-size raises it)",
            )
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        return SourceProblem(path, _os_reason(exc, path))
    if len(data) > max_bytes:  # grew while we looked
        return SourceProblem(path, f"over the {max_bytes / 2**20:.0f} MiB limit; not linted")
    return data


def decode_utf8(path: str, data: bytes) -> str | SourceProblem:
    """UTF-8 text without a byte-order mark, or where the first invalid byte is."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        return SourceProblem(
            path,
            f"not valid UTF-8 (byte 0x{data[exc.start]:02x} at line {line}); not linted",
            line,
            column,
        )


def _os_reason(exc: OSError, path: str) -> str:
    if exc.errno == errno.ELOOP:
        return "symbolic link loop: the link leads back to itself; not linted"
    if exc.errno == errno.ENOENT and os.path.islink(path):
        return "broken symbolic link: its target does not exist; not linted"
    if exc.errno == errno.ENOENT:
        return "no such file or directory"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied; not linted"
    return f"cannot read: {exc.strerror or exc}; not linted"
