"""`deadweight run -- python train.py ARGS`: watch an unmodified training script.

The command runs in a child process whose interpreter starts deadweight's global
optimizer hooks before the script's first line (see `deadweight.zero_code`). When
it ends, however it ends (exit, exception, Ctrl-C, kill), the report is rebuilt
from the event log and printed, and the script's own exit code is returned. A
SIGTERM sent to deadweight is passed on to the script at once.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from types import FrameType
from typing import Any

import deadweight
from deadweight.cli._common import add_html_option, add_report_options, emit
from deadweight.cli.report import load_log
from deadweight.errors import InputError
from deadweight.registry import Selection
from deadweight.zero_code import ENV_EVERY, ENV_FULL, ENV_LOG

HELP = "run a training script with every optimizer it creates watched"
# A Ctrl-C at the terminal reaches the script itself (same foreground process group),
# and is not passed on: a second SIGINT could cut the script's own cleanup short. A
# SIGINT sent to deadweight alone (no terminal, or deadweight not in the foreground) is
# passed on after this many seconds if the script is still running.
FORWARD_SIGINT_AFTER = 1.0


def add_parser(sub: Any) -> None:
    parser = sub.add_parser(
        "run",
        help=HELP,
        description=HELP + ". Everything after `--` is the command, e.g. "
        "`deadweight run -- python train.py --lr 3e-4`.",
    )
    parser.add_argument("--every", type=int, default=20, help="fuller statistics every N steps")
    parser.add_argument(
        "--log", default="deadweight-run.jsonl", help="event log (default: deadweight-run.jsonl)"
    )
    parser.add_argument(
        "--full", action="store_true", help="exact update norms of every parameter (copies them)"
    )
    add_report_options(parser)
    add_html_option(parser)
    parser.set_defaults(run=run, fail_on="never")
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
    for stale in [log, *_other_logs(log)]:  # an earlier run's logs must not pass for this one's
        with contextlib.suppress(FileNotFoundError):
            os.remove(stale)
    env = dict(os.environ)
    bootstrap = os.path.join(os.path.dirname(deadweight.__file__), "_bootstrap")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (bootstrap, env.get("PYTHONPATH")) if p)
    env[ENV_LOG] = log
    env[ENV_EVERY] = str(args.every)
    env[ENV_FULL] = "1" if args.full else "0"
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        raise InputError(f"cannot run {command[0]!r}: {exc}") from None
    code = _wait(child)
    print(file=sys.stderr)
    if not os.path.exists(log):
        print(
            "deadweight: the command stepped no optimizer, so there is nothing to report",
            file=sys.stderr,
        )
        return code
    try:
        ((report, stats),) = load_log(log, args.select, args.ignore)
    except Exception as exc:  # an empty log (killed at once) or a deadweight bug
        print(f"deadweight: no report: {exc}", file=sys.stderr)
        return code
    for problem in report.subject.get("problems", []):
        print(f"deadweight: note: {problem}", file=sys.stderr)
    failed = emit(report, args, stats)
    print(f"deadweight: event log {log}", file=sys.stderr)
    others = _other_logs(log)
    if others:
        print(
            f"deadweight: {len(others)} other process(es) of the run wrote their own logs "
            f"(`deadweight report` shows each): {', '.join(others)}",
            file=sys.stderr,
        )
    return code if code != 0 else failed


def _other_logs(log: str) -> list[str]:
    """Logs of torchrun ranks (LOG.rankN.jsonl) and of nested scripts (LOG.pidN.jsonl)."""
    stem, ext = os.path.splitext(log)
    found = glob.glob(f"{glob.escape(stem)}.rank*{ext}") + glob.glob(
        f"{glob.escape(stem)}.pid*{ext}"
    )
    return sorted(found)


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
