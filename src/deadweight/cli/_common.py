"""Options and output shared by the subcommands that produce a Report."""

from __future__ import annotations

import argparse

from rich.console import Console

from deadweight.findings import Severity
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


def emit(report: Report, args: argparse.Namespace) -> int:
    if args.format == "json":
        print(report.to_json())
    else:
        render(report, Console())
    fail_on = None if args.fail_on == "never" else Severity.parse(args.fail_on)
    return 1 if report.failed(fail_on) else 0
