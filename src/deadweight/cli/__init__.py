"""The `deadweight` command line: one small module per subcommand."""

from __future__ import annotations

import argparse
import contextlib
import enum
import gc
import os
import sys
import sysconfig
import traceback
from collections.abc import Sequence

from deadweight._version import __version__
from deadweight.cli import check as check_cmd
from deadweight.cli import config as config_cmd
from deadweight.cli import demo as demo_cmd
from deadweight.cli import diff as diff_cmd
from deadweight.cli import inspect as inspect_cmd
from deadweight.cli import lint as lint_cmd
from deadweight.cli import report as report_cmd
from deadweight.cli import rules as rules_cmd
from deadweight.cli import run as run_cmd
from deadweight.cli import trend as trend_cmd
from deadweight.cli._common import apply_config
from deadweight.cli.config import print_config_notes
from deadweight.errors import DeadweightError
from deadweight.report.display import safe_text
from deadweight.thresholds import using

SUBCOMMANDS = (
    demo_cmd, check_cmd, run_cmd, report_cmd, inspect_cmd, diff_cmd, trend_cmd, lint_cmd,
    rules_cmd, config_cmd,
)  # fmt: skip


class ExitCode(enum.IntEnum):
    OK = 0
    FINDINGS = 1  # something at or above --fail-on was found
    # bad arguments or input, deadweight could not run the check, or anything it did not
    # expect: never 1, which CI reads as findings
    USAGE = 2


# Set to 1 to have an unexpected error's whole traceback (for a bug report).
TRACEBACK_ENV = "DEADWEIGHT_TRACEBACK"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deadweight",
        description="Catch silent PyTorch training bugs: parameters that never learn, "
        "or only pretend to.",
    )
    parser.add_argument("--version", action="version", version=f"deadweight {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def _escape_what_cannot_be_printed() -> None:
    """A character the terminal's encoding cannot write (a lone surrogate from a
    checkpoint's name, anything but ASCII under PYTHONIOENCODING=ascii) is printed as an
    escape (`\\ud800`) instead of ending the command with a traceback."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            with contextlib.suppress(ValueError, OSError):  # closed, or not a text file
                reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    _escape_what_cannot_be_printed()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return ExitCode.USAGE
    # What the imports made (torch alone: hundreds of thousands of objects) lives until
    # exit: frozen, the cyclic collector never walks it again. Measured here on a 2.15 GB
    # `deadweight inspect`: its first full collection took 70 ms, and the command 1.56-1.70 s
    # frozen against 1.84-2.01 s not.
    gc.freeze()
    try:
        # Every subcommand but `rules` and `config` judges by the project configuration.
        limits = None
        if getattr(args, "reads_config", True):
            cfg = apply_config(args)
            print_config_notes(cfg)
            limits = cfg.thresholds
        with using(limits):
            return int(args.run(args))
    except DeadweightError as exc:
        cause = exc.__cause__
        if cause is not None and not isinstance(cause, DeadweightError):
            # The user's own code failed: their traceback is what they need to see.
            traceback.print_exception(type(cause), cause, cause.__traceback__, file=sys.stderr)
        print(safe_text(f"deadweight: error: {exc}"), file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        print("deadweight: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        # deadweight itself never exits inside a command: the user's code called sys.exit
        # (in the file `check` imports, its factory or its loss function).
        _say(f"deadweight: error: the code under check called sys.exit({exc.code!r}){_where(exc)}; "
             "the command did not finish and nothing was reported")  # fmt: skip
        return ExitCode.USAGE
    except BaseException as exc:  # anything else: one line saying what and where, exit 2
        if os.environ.get(TRACEBACK_ENV) == "1":
            with contextlib.suppress(Exception):
                traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        _say(f"deadweight: error: {_unexpected(exc)}")
        return ExitCode.USAGE


def _innermost(exc: BaseException) -> traceback.FrameSummary | None:
    frames = traceback.extract_tb(exc.__traceback__)
    return frames[-1] if frames else None


def _where(exc: BaseException) -> str:
    frame = _innermost(exc)
    if frame is None:
        return ""
    name = frame.filename
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(name)
        name = relative if not relative.startswith("..") else name
    return f" (at {name}:{frame.lineno} in {frame.name})"


def _unexpected(exc: BaseException) -> str:
    """What went wrong, and whose code it was in: deadweight's own (a bug), a library's,
    or the user's (the file `check` imports, its loss function)."""
    what = f"{type(exc).__name__}{': ' if str(exc) else ''}{' '.join(str(exc).split())[:300]}"
    frame = _innermost(exc)
    where = os.path.abspath(frame.filename) if frame is not None else ""
    if where.startswith(_PACKAGE + os.sep):
        return (
            f"internal error, {what}{_where(exc)}: a deadweight bug; please report it with "
            f"the traceback that {TRACEBACK_ENV}=1 prints"
        )
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    if frame is None or where.startswith(tuple(p + os.sep for p in installed)) or where[:1] == "<":
        return f"unexpected {what}{_where(exc)}; nothing was reported"
    return f"the code under check raised {what}{_where(exc)}; nothing was reported"


def _say(text: str) -> None:
    """One line on stderr, however the code under check left sys.stderr."""
    line = safe_text(text) + "\n"
    for stream in (sys.stderr, sys.__stderr__):
        try:
            if stream is not None and not stream.closed:
                stream.write(line)
                stream.flush()
                return
        except (OSError, ValueError):
            continue
    with contextlib.suppress(OSError):
        os.write(2, line.encode("utf-8", "backslashreplace"))
