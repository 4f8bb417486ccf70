"""Options and output shared by the subcommands that produce a Report."""

from __future__ import annotations

import argparse

from rich.console import Console

from deadweight.findings import Severity
from deadweight.probes.watch_stats import WatchStats
from deadweight.report import Report
from deadweight.report.text import render

FAIL_ON_CHOICES = ("error", "warning", "info", "never")


def add_report_options(
    parser: argparse.ArgumentParser, formats: tuple[str, ...] = ("text", "json")
) -> None:
    parser.add_argument(
        "--format", choices=formats, default="text", help="output format (default: text)"
    )
    parser.add_argument(
        "--fail-on",
        choices=FAIL_ON_CHOICES,
        default="warning",
        help="exit with 1 when a finding at or above this severity is found (default: warning)",
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
        help="skip these rules: codes, code prefixes or names, comma-separated",
    )


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


def emit(
    report: Report,
    args: argparse.Namespace,
    stats: WatchStats | None = None,
    *,
    html_report: Report | None = None,
) -> int:
    """Print the report and write --html (of `html_report` when the printed one is
    trimmed for the terminal); the exit code --fail-on asks for."""
    if getattr(args, "html", None):
        from deadweight.report.html import Section, write_html

        full = html_report or report
        label = str(full.subject.get("log") or getattr(args, "target", None) or full.kind)
        notes = list(stats.problems) if stats is not None else []
        write_html(args.html, [Section(label, full, stats, notes)])
    if args.format == "json":
        print(report.to_json())
    else:
        render(report, Console())
    fail_on = None if args.fail_on == "never" else Severity.parse(args.fail_on)
    return 1 if report.failed(fail_on) else 0
