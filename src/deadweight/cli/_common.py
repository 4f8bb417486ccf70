"""Options and output shared by the subcommands that produce a Report, and the project
configuration every subcommand reads."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from rich.console import Console

from deadweight import config as config_module
from deadweight.config import Config, Settings
from deadweight.errors import InputError
from deadweight.findings import Severity
from deadweight.output_files import OutputFile
from deadweight.report import Report
from deadweight.report.text import render
from deadweight.watching.watch_stats import WatchStats

FAIL_ON_CHOICES = config_module.FAIL_ON_CHOICES


def add_report_options(
    parser: argparse.ArgumentParser, formats: tuple[str, ...] = ("text", "json")
) -> None:
    parser.add_argument(
        "--format", choices=formats, default="text", help="output format (default: text)"
    )
    parser.add_argument(
        "--fail-on",
        choices=FAIL_ON_CHOICES,
        default=None,
        help="exit with 1 when a finding at or above this severity is found "
        "(default: fail-on of the configuration, else warning)",
    )
    parser.add_argument(
        "--select",
        action="append",
        metavar="RULES",
        help="only these rules: codes, code prefixes or names, comma-separated",
    )
    parser.add_argument(
        "--ignore",
        action="append",
        metavar="RULES",
        help="skip these rules: codes, code prefixes or names, comma-separated "
        "(added to the configured ignore)",
    )
    add_config_options(parser)


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE",
        help="read the configuration from this deadweight.toml or pyproject.toml instead of "
        "the nearest one",
    )  # fmt: skip
    parser.add_argument(
        "--isolated", action="store_true",
        help="read no configuration file (defaults only)",
    )  # fmt: skip


def project_config(args: argparse.Namespace, start: str | Path | None = None) -> Config:
    """The configuration `args` ask for: --isolated, --config FILE, or the nearest file
    from `start` (default: the working directory) upwards."""
    if getattr(args, "isolated", False):
        return config_module.default()
    if getattr(args, "config", None):
        return config_module.load(args.config)
    return config_module.for_path(start or Path.cwd())


def apply_config(args: argparse.Namespace) -> Config:
    """Fill what the command line left unset from the configuration: fail-on, and
    select / ignore (--select replaces the configured select, --ignore adds to it).
    `deadweight lint` merges select / ignore per file itself (`merges_rules=False`)."""
    cfg = project_config(args)
    if hasattr(args, "fail_on") and args.fail_on is None:
        args.fail_on = cfg.fail_on
    if hasattr(args, "select") and getattr(args, "merges_rules", True):
        select, ignore = Settings(cfg.select, cfg.ignore).rules(args.select, args.ignore)
        args.select = list(select) if select else None
        args.ignore = list(ignore) or None
    return cfg


def add_html_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--html",
        metavar="REPORT.html",
        type=_html_path,
        help="also write the report as one self-contained HTML page with plots "
        "(needs deadweight[html])",
    )


def _html_path(path: str) -> str:
    # Checked when the arguments are parsed, before a check or a training run starts.
    from deadweight.report.html import MISSING_EXTRA, plotly_available

    if not plotly_available():
        raise argparse.ArgumentTypeError(MISSING_EXTRA)
    return path


def claim_html(args: argparse.Namespace, inputs: list[str], reads: tuple[str, ...] = ()) -> None:
    """Check --html before anything runs: it must not be one of `inputs` (nor a file of
    a kind in `reads` inside an input folder), a link, a FIFO, a directory or empty."""
    if getattr(args, "html", None) is not None:
        args.html_target = OutputFile.claim(args.html, "--html", inputs=inputs, reads=reads)


def emit(
    report: Report,
    args: argparse.Namespace,
    stats: WatchStats | None = None,
    *,
    html_report: Report | None = None,
) -> int:
    """Print the report and write --html (of `html_report` when the printed one is
    trimmed for the terminal); the exit code --fail-on asks for."""
    if getattr(args, "html", None) is not None:
        from deadweight.report.html import Section, write_html

        target = getattr(args, "html_target", None) or OutputFile.claim(args.html, "--html")
        full = html_report or report
        label = str(full.subject.get("log") or getattr(args, "target", None) or full.kind)
        notes = list(stats.problems) if stats is not None else []
        write_html(target, [Section(label, full, stats, notes)])
    if sys.stdout is None or sys.stdout.closed:
        raise InputError(
            "standard output was closed by the code under check (sys.stdout.close()), so "
            "the report cannot be printed"
        )
    if args.format == "json":
        print(report.to_json())
    else:
        render(report, Console())
    fail_on = None if args.fail_on == "never" else Severity.parse(args.fail_on)
    return 1 if report.failed(fail_on) else 0


@contextlib.contextmanager
def script_output_to_stderr(active: bool = True) -> Iterator[None]:
    """While the user's code runs, what it prints goes to stderr, so that a report on
    stdout (--format json) is the report alone. Both `sys.stdout` and file descriptor 1
    are redirected: a C extension or a subprocess writes to the descriptor."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = _point_stdout_at_stderr()
    # The user's code gets its own stream onto stderr: its sys.stdout.close() then closes
    # that copy, not the stderr deadweight reports on.
    copy = _stderr_copy()
    try:
        with contextlib.redirect_stdout(copy or sys.stderr):
            yield
    finally:
        if copy is not None:
            with contextlib.suppress(OSError, ValueError):
                copy.close()
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _stderr_copy() -> TextIO | None:
    """A line-buffered text stream on a copy of stderr's descriptor; None where stderr
    has none (captured in-process)."""
    try:
        fd = os.dup(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None
    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
    return os.fdopen(fd, "w", buffering=1, encoding=encoding, errors="backslashreplace")


def _point_stdout_at_stderr() -> int | None:
    """Descriptor 1 made a copy of descriptor 2; a copy of the old 1 to restore it with,
    or None where stdout is no descriptor 1 (captured in-process, closed)."""
    try:
        if sys.stdout.fileno() != 1:
            return None
        saved = os.dup(1)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        return None
    return saved
