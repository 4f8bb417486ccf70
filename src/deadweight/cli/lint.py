"""`deadweight lint PATH...`: the code behind silent gradient bugs, before a run starts."""

from __future__ import annotations

import argparse
import io
import sys
from typing import Any

from rich.console import Console

from deadweight.cli._common import add_report_options
from deadweight.errors import InputError
from deadweight.findings import Severity
from deadweight.linting.api import AUTO, lint_paths
from deadweight.linting.source_files import MAX_TOKENS
from deadweight.output_files import OutputFile
from deadweight.report import Report
from deadweight.report.display import safe_text
from deadweight.report.sarif import render_sarif
from deadweight.report.text import render

HELP = "find the code behind silent gradient bugs in Python (PyTorch) and Rust (candle) sources"
DESCRIPTION = (
    HELP + ". Settings come from the nearest deadweight.toml or [tool.deadweight] in "
    "pyproject.toml, per linted file; "
    "'# deadweight: ignore[DW501]' (Python) or '// deadweight: ignore[DW511]' (Rust) "
    "silences one line. Exit codes: 0 nothing at or above --fail-on, 1 something, "
    "2 bad arguments or configuration, or some input could not be linted (each is named "
    "on stderr with the reason; all the others are still linted and reported)."
)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("lint", help=HELP, description=DESCRIPTION)
    parser.add_argument(
        "paths", nargs="*", default=["."], metavar="PATH",
        help="Python (.py) and Rust (.rs) files, or directories to search (default: .)",
    )  # fmt: skip
    add_report_options(parser, formats=("text", "json", "sarif"))
    parser.add_argument(
        "--output", "-o", metavar="FILE", help="write the report to FILE instead of stdout"
    )
    parser.add_argument(
        "--max-file-size", type=float, default=10.0, metavar="MIB",
        help="larger files are reported instead of parsed (default: 10); so is a file of "
        f"more than {MAX_TOKENS / 1e6:.0f} million tokens, whatever its size, as parsing it "
        "would take gigabytes",
    )  # fmt: skip
    # select / ignore are merged with each file's own nearest configuration, in lint_paths
    parser.set_defaults(run=run, merges_rules=False)


def run(args: argparse.Namespace) -> int:
    if args.max_file_size <= 0:
        raise InputError("--max-file-size must be positive")
    config = None if args.isolated else (args.config or AUTO)
    target = (
        None
        if args.output is None
        else OutputFile.claim(args.output, "-o", inputs=args.paths, reads=(".py", ".rs"))
    )
    try:
        report = lint_paths(
            args.paths,
            select=args.select,
            ignore=args.ignore,
            config=config,
            max_file_size=int(args.max_file_size * 2**20),
        )
    except ValueError as exc:  # an unknown rule in --select / --ignore
        raise InputError(str(exc)) from None
    _write(report, args, target)
    errors = report.subject["errors"]
    for error in errors:
        where = error["file"] + "".join(
            f":{error[k]}" for k in ("line", "column") if error.get(k) is not None
        )
        print(safe_text(f"{where}: error: {error['message']}"), file=sys.stderr)
    if errors:  # a result that left inputs out must not pass for a clean one
        return 2
    if report.subject["files"] == 0:
        print("deadweight: warning: no Python (.py) or Rust (.rs) files found", file=sys.stderr)
    fail_on = None if args.fail_on == "never" else Severity.parse(args.fail_on)
    return 1 if report.failed(fail_on) else 0


def _write(report: Report, args: argparse.Namespace, target: OutputFile | None) -> None:
    if args.format == "sarif":
        text = render_sarif(report)
    elif args.format == "json":
        text = report.to_json()
    else:
        text = None
    if target is not None:
        if text is None:
            page = io.StringIO()
            render(report, Console(file=page, no_color=True, highlight=False, width=200))
            text = page.getvalue().removesuffix("\n")
        target.write_text(text + "\n")
    elif text is not None:
        print(text)
    else:
        render(report, Console(highlight=False))
