"""Every file deadweight writes for the user: `-o`, `--output`, `--html`, `--write-docs`
pages and `deadweight run --log`.

One set of refusals for all of them, checked when the command starts (before a check or a
training run costs anything) and again when the file is written: an empty path, a
directory, a symbolic link (nothing is written through a link), anything but a regular
file (a FIFO would block the writer), and an input of the same command (`report r.jsonl
-o r.jsonl` would destroy the log it reads).

A file is written whole or not at all: into a temporary file in the same folder, renamed
over the path only once complete, so a failure half-way (an error while rendering, a full
disk, an interrupt) leaves an existing file as it was. The event log is the one output
written in place, line by line, so that a killed run keeps what it logged: see
`open_log`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from deadweight.errors import InputError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


def refusal(path: str) -> str | None:
    """Why `path` may not be written as an output, whatever the command; None if it may."""
    if not path:
        return "an empty path names no file"
    if path.endswith(("/", os.sep)) or (os.path.isdir(path) and not os.path.islink(path)):
        return "is a directory; give the path of a file"
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(path))
        return None if os.path.isdir(folder) else f"its folder {folder} does not exist"
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if stat.S_ISLNK(mode):
        return (
            "is a symbolic link; deadweight writes nothing through a link (give the path "
            "of the file itself)"
        )
    if not stat.S_ISREG(mode):
        return f"exists and is not a regular file ({_kind(mode)})"
    return None


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False


def _inside(path: str, folder: str) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real != root and os.path.commonpath([real, root]) == root


@dataclass(frozen=True)
class OutputFile:
    """A file to write, refused at once when it may not be written.

    `inputs` are the paths the command reads; an output that is one of them is refused,
    and so is one inside an input folder with a name in `reads` (suffixes, or whole
    names: the kind of file the command reads there)."""

    path: str
    option: str  # how the user named it, for messages: "--html", "-o"
    inputs: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()

    @classmethod
    def claim(
        cls, path: str, option: str, *, inputs: Iterable[str] = (), reads: Iterable[str] = ()
    ) -> OutputFile:
        target = cls(os.fspath(path), option, tuple(map(os.fspath, inputs)), tuple(reads))
        target.check()
        return target

    def check(self) -> None:
        """Raises InputError when the path may not be written now."""
        why = refusal(self.path) or self._input_refusal()
        if why is not None:
            raise InputError(f"{self.option} {self.path}: {why}")

    def _input_refusal(self) -> str | None:
        if not os.path.exists(self.path) and not self.reads:
            return None
        for given in self.inputs:
            if _same_file(self.path, given) or (
                os.path.isdir(given)
                and self.path.endswith(self.reads)
                and _inside(self.path, given)
            ):
                return (
                    "is an input of this command; writing the output there would replace "
                    "what it reads (choose another path)"
                )
        return None

    def write_text(self, text: str) -> None:
        """Write `text` (UTF-8; a code point UTF-8 cannot hold, a lone surrogate, as an
        escape) whole, or leave what is at the path as it was."""
        self.check()  # again: what is at the path may have changed since the claim
        try:
            write_whole(self.path, text.encode("utf-8", "backslashreplace"))
        except OSError as exc:
            raise InputError(
                f"{self.option} {self.path}: cannot write it ({exc.strerror or exc}); "
                "nothing there was changed"
            ) from None


def write_whole(path: str, data: bytes) -> None:
    """`data` at `path` through a temporary file in the same folder, renamed into place
    once complete; an existing file keeps its permissions. Raises OSError."""
    folder, name = os.path.split(os.path.abspath(path))
    try:
        mode: int | None = stat.S_IMODE(os.lstat(path).st_mode)
    except FileNotFoundError:
        mode = None
    temporary = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
    fd = os.open(temporary, flags, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        if mode is not None:
            os.chmod(temporary, mode)  # the umask narrowed what os.open was asked for
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def open_log(path: str, *, append: bool = False) -> int:
    """The event log at `path` opened for writing in place, emptied (or, with `append`,
    kept and written at its end), as a descriptor.

    The same refusals as every output, on the opened file itself: the final component is
    never followed if it is a link, a FIFO is opened without waiting and refused, as is
    anything but a regular file. Raises OSError (ELOOP for a link) or InputError."""
    why = refusal(path)
    if why is not None:
        raise InputError(f"event log {path}: {why}")
    flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | _CLOEXEC | _NONBLOCK
    fd = os.open(path, flags | (os.O_APPEND if append else 0), 0o666)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"event log {path}: exists and is not a regular file ({_kind(mode)})")
        os.set_blocking(fd, True)
        if not append:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd
