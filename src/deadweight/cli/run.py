"""`deadweight run -- python train.py ARGS`: watch an unmodified training script.

The command runs in a child process whose interpreter starts deadweight's global
optimizer hooks before the script's first line (see `deadweight.watching.run_in_script`). When
it ends, however it ends (exit, exception, Ctrl-C, kill), the report is rebuilt
from the event log and printed, and the script's own exit code is returned. A
SIGTERM sent to deadweight is passed on to the script at once.

The log never costs the user a file. `--log PATH` may name a new file or an earlier
run's own log (its first line is a deadweight start event); anything else (a directory,
a symbolic link, a FIFO, an empty or any other file, a file of the command) is refused
before the script starts. An earlier log is replaced only once the script steps an
optimizer: a script that fails to start (a typo in its name) or steps none leaves it as
it was. While the run lasts deadweight holds an exclusive lock on the log, so a second
run with the same log (two runs with the default, in one folder) is refused rather
than taking it over. Once this run has logged, the rank and pid logs beside it
(`STEM.rankN.EXT`, `STEM.pidN.EXT`, exactly) that are earlier runs' logs are removed;
those written by this run carry its `run_id`, and only those are listed after the report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from types import FrameType
from typing import Any

import deadweight
from deadweight.cli._common import add_html_option, add_report_options, emit
from deadweight.cli.report import load_log
from deadweight.errors import InputError
from deadweight.output_files import OutputFile, refusal
from deadweight.registry import Selection
from deadweight.report.display import safe_text
from deadweight.watching import run_status
from deadweight.watching.event_log import process_logs_beside, read_start
from deadweight.watching.run_in_script import ENV_CHECK, ENV_EVERY, ENV_FULL, ENV_LOG, ENV_RUN_ID

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, so no refusal
    fcntl = None  # type: ignore[assignment]

# Opening without waiting (should a FIFO appear at the path) and keeping the descriptor
# out of the script's process; both absent on Windows.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a link put at the log path is never followed

HELP = "run a training script with every optimizer it creates watched"
# A Ctrl-C at the terminal reaches the script itself (same foreground process group),
# and is not passed on: a second SIGINT could cut the script's own cleanup short. A
# SIGINT sent to deadweight alone (no terminal, or deadweight not in the foreground) is
# passed on after this many seconds if the script is still running.
FORWARD_SIGINT_AFTER = 1.0
STDERR_FD = 2
TOOL_ERROR = 2  # the exit code of a deadweight error, as for every command


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "run",
        help=HELP,
        description=HELP + ". Everything after `--` is the command, e.g. "
        "`deadweight run -- python train.py --lr 3e-4`. Exit code: the script's own when it "
        "is not 0; else 2 when deadweight could not start the command, or could not watch "
        "a process that trained (it says which and why); else 1 when a finding is at or "
        "above --fail-on, 0 when none is. With --format json the script's own "
        "output goes to stderr, so stdout holds only the report.",
    )
    parser.add_argument("--every", type=int, default=20, help="fuller statistics every N steps")
    parser.add_argument(
        "--log", default="deadweight-run.jsonl", help="event log (default: deadweight-run.jsonl)"
    )
    parser.add_argument(
        "--full", action="store_true", help="exact update norms of every parameter (copies them)"
    )
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="no step-0 check (deadweight.check on the first training batch, at the first "
        "optimizer step)",
    )
    add_report_options(parser)
    add_html_option(parser)
    parser.set_defaults(run=run)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command after --")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise InputError("no command given: deadweight run [OPTIONS] -- python train.py ARGS")
    if args.every < 1:
        raise InputError(f"--every must be at least 1, got {args.every}")
    try:  # a typo in --select must not cost a whole training run first
        Selection.of(args.select, args.ignore)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    log = os.path.abspath(args.log)
    if args.html:  # the log and the command's files are what the report is made from
        args.html_target = OutputFile.claim(
            args.html, "--html", inputs=[log, *(a for a in command if os.path.isfile(a))]
        )
    held = _claim_log(args.log, log)  # before the script starts: a refusal costs nothing
    # Where the script's processes say whether they were watched (watching/run_status.py):
    # a private folder, outside the user's, removed when the run ends.
    status = tempfile.mkdtemp(prefix="deadweight-run-")
    try:
        return _run_and_report(command, log, held, status, args)
    finally:
        os.close(held.fd)  # releases the lock
        shutil.rmtree(status, ignore_errors=True)


def _run_and_report(
    command: list[str], log: str, held: HeldLog, status: str, args: argparse.Namespace
) -> int:
    run_id = uuid.uuid4().hex
    env = dict(os.environ)
    env[run_status.ENV_STATUS] = status
    bootstrap = os.path.join(os.path.dirname(deadweight.__file__), "watching", "_bootstrap")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (bootstrap, env.get("PYTHONPATH")) if p)
    env[ENV_LOG] = log
    env[ENV_EVERY] = str(args.every)
    env[ENV_FULL] = "1" if args.full else "0"
    env[ENV_RUN_ID] = run_id
    env[ENV_CHECK] = "0" if args.no_check else "1"
    # With --format json, stdout is the report alone: a script's prints (and those of the
    # processes it starts) would make it unparseable, so they go to stderr.
    stdout = STDERR_FD if args.format == "json" else None
    try:
        child = subprocess.Popen(command, env=env, stdout=stdout)
    except OSError as exc:
        _nothing_logged(log, held)
        raise InputError(f"cannot run {command[0]!r}: {exc}") from None
    code = _wait(child)
    print(file=sys.stderr)
    empty = _nothing_logged(log, held)
    attach = run_status.summarise(run_status.read(status), log_written=not empty)
    kept = "" if held.created else f" (the earlier log {log} was left as it was)"
    for i, line in enumerate(attach.lines):
        tail = kept if empty and i == len(attach.lines) - 1 else ""
        print(safe_text(f"deadweight: {line}{tail}"), file=sys.stderr)
    unwatched = attach.unwatched
    if empty:
        return exit_code(code, 0, unwatched=unwatched)
    _remove_stale_process_logs(log, run_id)
    try:
        ((report, stats),) = load_log(log, args.select, args.ignore)
    except Exception as exc:  # an empty log (killed at once) or a deadweight bug
        print(safe_text(f"deadweight: no report: {exc}"), file=sys.stderr)
        return exit_code(code, 0, unwatched=True)
    for problem in report.subject.get("problems", []):
        print(safe_text(f"deadweight: note: {problem}"), file=sys.stderr)
    failed = emit(report, args, stats)
    print(safe_text(f"deadweight: event log {log}"), file=sys.stderr)
    others = _this_runs_process_logs(log, run_id)
    if others:
        print(
            safe_text(
                f"deadweight: {len(others)} other process(es) of the run wrote their own logs "
                f"(`deadweight report` shows each): {', '.join(others)}"
            ),
            file=sys.stderr,
        )
    return exit_code(code, failed, unwatched=unwatched)


def exit_code(script: int, findings: int, *, unwatched: bool = False) -> int:
    """`deadweight run`'s exit code: the script's own when it failed (a crash must not
    pass for a finding); else 2 when some process trained where deadweight could not
    watch it (a run it did not watch is never a clean result); else what the findings
    and --fail-on decide (0 or 1)."""
    if script != 0:
        return script
    return TOOL_ERROR if unwatched else findings


@dataclass(frozen=True)
class HeldLog:
    """The log this run holds locked: `fd`, whether this run created the file, and the
    size and modification time of the earlier log it claimed (to tell whether the script
    wrote to it)."""

    fd: int
    created: bool
    before: tuple[int, int] = (0, 0)


def _claim_log(shown: str, log: str) -> HeldLog:
    """Create the log, or claim an earlier run's own log, and lock it for this run.

    Raises InputError for anything that is not ours to write. Nothing is written: an
    earlier log is replaced by the script's own process once it steps an optimizer."""
    where = f"--log {shown}"
    if not shown or os.path.isdir(log) or shown.endswith(("/", os.sep)):
        problem = refusal(shown) or "is a directory; give the path of a file"
        raise InputError(
            f"{where}: {problem}"
            + (f", e.g. --log {os.path.join(shown, 'deadweight-run.jsonl')}" if shown else "")
        )
    try:
        os.makedirs(os.path.dirname(log), exist_ok=True)
    except OSError as exc:
        raise InputError(f"{where}: cannot create its folder: {exc.strerror or exc}") from None
    why = refusal(log)
    if why is not None:
        raise InputError(f"{where}: {why}; choose another --log")
    try:  # a new file: nobody else's
        fd = os.open(log, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o666)
    except FileExistsError:
        fd = _take_over(where, log)
        earlier = os.fstat(fd)
        return HeldLog(fd, created=False, before=(earlier.st_size, earlier.st_mtime_ns))
    except OSError as exc:
        raise InputError(f"{where}: cannot create it: {exc.strerror or exc}") from None
    if not _lock(fd):  # created this instant by another run that locked it first
        os.close(fd)
        raise InputError(f"{where}: is the event log of another deadweight run that is "
                         "still running; choose another --log")  # fmt: skip
    return HeldLog(fd, created=True)


def _take_over(where: str, log: str) -> int:
    """An existing file at the log path: ours to claim only if it is an earlier run's log.
    It is locked, not emptied."""
    try:
        held = os.open(log, os.O_RDWR | _NONBLOCK | _NOFOLLOW | _CLOEXEC)
    except OSError as exc:  # a link swapped in since the check (ELOOP), a path through a file
        raise InputError(f"{where}: cannot open it: {exc.strerror or exc}") from None
    try:
        mine = os.fstat(held)
        if not stat.S_ISREG(mine.st_mode):
            raise InputError(f"{where}: exists and is not a regular file; choose another --log")
        if not _lock(held):
            other = read_start(log) or {}
            pid = other.get("pid")
            by = f" (its script: pid {pid})" if isinstance(pid, int) else ""
            raise InputError(f"{where}: is the event log of another deadweight run that is "
                             f"still running{by}; choose another --log")  # fmt: skip
        start = read_start(log)
        same = os.stat(log)
        if start is None or (same.st_dev, same.st_ino) != (mine.st_dev, mine.st_ino):
            empty = " (it is empty)" if mine.st_size == 0 else ""
            raise InputError(
                f"{where}: exists and is not a deadweight event log{empty}; deadweight run "
                "replaces only its own logs: choose another --log or remove the file"
            )
    except BaseException:
        os.close(held)
        raise
    return held


def _lock(fd: int) -> bool:
    """An exclusive lock for as long as `fd` is open; False when another process holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without locks: nothing to refuse on
        return True
    return True


def _nothing_logged(log: str, held: HeldLog) -> bool:
    """Whether the script wrote nothing to the log (it stepped no optimizer, or never
    started); then the file this run created is removed, and an earlier run's log it
    claimed is left as it was (the script's process empties it when it first steps)."""
    mine = os.fstat(held.fd)
    if not held.created:
        return (mine.st_size, mine.st_mtime_ns) == held.before
    if mine.st_size:
        return False
    with contextlib.suppress(OSError):
        now = os.lstat(log)
        if (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            os.remove(log)
    return True


def _remove_stale_process_logs(log: str, run_id: str) -> None:
    """Earlier runs' rank and pid logs beside the log, once this run has logged: they
    must not pass for this run's.

    Only files named exactly so and holding a deadweight log of another run are removed,
    and none that a live run holds (another run's main log can have such a name)."""
    for path in process_logs_beside(log):
        start = read_start(path)
        if start is None or start.get("run_id") == run_id:
            continue  # not a deadweight log, or this run's own
        try:
            fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
        except OSError:
            continue
        try:
            if _lock(fd):
                os.remove(path)
        except OSError:
            pass
        finally:
            os.close(fd)


def _this_runs_process_logs(log: str, run_id: str) -> list[str]:
    """Logs of torchrun ranks (LOG.rankN.jsonl) and of nested scripts (LOG.pidN.jsonl)
    written by this run."""
    return [
        path
        for path in process_logs_beside(log)
        if (read_start(path) or {}).get("run_id") == run_id
    ]


def _wait(child: subprocess.Popen[bytes]) -> int:
    interrupted_at: list[float] = []

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        interrupted_at.append(time.monotonic())

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        # A scheduler or `kill` that stops deadweight alone must not leave the script
        # running without it: pass it on, then report once the script has ended.
        with contextlib.suppress(OSError):
            child.send_signal(signal.SIGTERM)

    terminal_reaches_child = _in_terminal_foreground()
    previous = signal.signal(signal.SIGINT, on_sigint)
    previous_term = signal.signal(signal.SIGTERM, on_sigterm)
    forwarded = False
    try:
        while True:
            try:
                code = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if (
                    interrupted_at
                    and not forwarded
                    and not terminal_reaches_child
                    and time.monotonic() - interrupted_at[0] > FORWARD_SIGINT_AFTER
                ):
                    child.send_signal(signal.SIGINT)
                    forwarded = True
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.signal(signal.SIGTERM, previous_term)
    # Like a shell: a script killed by signal N exits with 128 + N.
    return 128 - code if code < 0 else code


def _in_terminal_foreground() -> bool:
    """Whether a Ctrl-C typed at the terminal reaches this process group (and the child)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError, AttributeError):  # no terminal: stdin is a pipe or closed
        return False
