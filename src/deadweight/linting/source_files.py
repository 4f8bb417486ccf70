"""Finding and reading the source files `deadweight lint` examines.

Directories are walked in sorted order, following symbolic links but never into a
directory that is already on the current path (a link loop), and each real file is
returned once however many links lead to it. A file that cannot be read (gone,
unreadable, not a regular file, too large, a link that leads nowhere or in a
circle) becomes a `SourceProblem` for that file; the others are unaffected. Only
regular files are read, decided on the opened file itself: a FIFO or a device, even
one swapped in after the directory was listed, is never waited on.
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

# Parsing takes memory per token, not per byte, and bytes alone do not bound it: ast.parse
# (CPython 3.11) peaked at 350-450 bytes per token on hand-written model code, 500 on a
# list of integers (a 2 MiB table took 1 GB) and up to 920 on a file of one-name
# statements; tree-sitter at about 240 on Rust. A file with more tokens than this
# (`count_tokens`) is reported instead of parsed: at most about 2.6 GiB, while a 10 MiB
# file of ordinary code (0.22-0.27 tokens per byte) still fits.
MAX_TOKENS = 3_000_000

# Byte classes for count_tokens: "a" a word byte (letters, digits, _, and every byte of a
# UTF-8 sequence, so a non-ASCII name is one word), " " white space, "." anything else
# (an operator, a bracket, a quote; a newline ends a statement, which costs as a token).
_WORD = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_" + bytes(range(128, 256))
_TOKEN_CLASSES = bytes(
    ord("a") if b in _WORD else ord(" ") if b in b" \t\r\f\v" else ord(".") for b in range(256)
)


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
                # A path too long to open is named whatever it is: a folder there may
                # hold sources (it was skipped without a word).
                if (
                    entry.is_symlink()
                    or Path(entry.name).suffix in LANGUAGES
                    or exc.errno == errno.ENAMETOOLONG
                ):
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
        # Opened without waiting (a FIFO's open blocks until a writer comes), then
        # checked on the open file: what the path named a moment ago does not count.
        with open(path, "rb", opener=_open_nonblocking) as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                return SourceProblem(path, "not a regular file; not linted")
            if info.st_size > max_bytes:
                return SourceProblem(
                    path,
                    f"{info.st_size / 2**20:.1f} MiB is over the {max_bytes / 2**20:.0f} MiB "
                    "limit for one source file; not linted (--max-file-size raises it)",
                )
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        return SourceProblem(path, _os_reason(exc, path))
    if len(data) > max_bytes:  # grew while we looked
        return SourceProblem(path, f"over the {max_bytes / 2**20:.0f} MiB limit; not linted")
    return data


def _open_nonblocking(path: str, flags: int) -> int:
    # O_NONBLOCK changes nothing for reading a regular file.
    return os.open(path, flags | getattr(os, "O_NONBLOCK", 0))


def count_tokens(data: bytes) -> int:
    """An upper estimate of the tokens of Python or Rust source, at memory speed (about
    50 MB/s): every operator byte, every word and every newline counts, so a string or a
    comment counts as many as the words and marks in it, and `**` counts two."""
    classes = data.translate(_TOKEN_CLASSES)
    return (
        classes.count(b".") + classes.count(b" a") + classes.count(b".a") + classes.startswith(b"a")
    )


def too_many_tokens(path: str, data: bytes) -> SourceProblem | None:
    """Why a file is not parsed when its syntax tree would take gigabytes (`MAX_TOKENS`)."""
    if len(data) <= MAX_TOKENS:  # a token takes at least a byte: no need to count
        return None
    tokens = count_tokens(data)
    if tokens <= MAX_TOKENS:
        return None
    return SourceProblem(
        path,
        f"about {tokens / 1e6:.1f} million tokens, over the {MAX_TOKENS / 1e6:.0f} million "
        "that one file may have: parsing it would take gigabytes of memory; not linted",
    )


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
    if exc.errno == errno.ENAMETOOLONG:
        return (
            f"the path is {len(os.fsencode(path))} bytes, longer than the system opens "
            "(PATH_MAX); nothing there or below is linted"
        )
    return f"cannot read: {exc.strerror or exc}; not linted"
