"""`deadweight rules [CODE]`: list the rules, or print one rule's page; write or check
the generated pages under docs/rules/."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, ClassVar

from rich.console import Console, ConsoleOptions, RenderResult
from rich.markdown import Markdown, MarkdownElement, TableElement
from rich.table import Table

from deadweight import rule_docs, thresholds
from deadweight.cli._console import print_whole
from deadweight.errors import InputError
from deadweight.registry import all_rules, get_rule

HELP = "list the rules, or explain one (by code or name)"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("rules", help=HELP, description=HELP + ".")
    parser.add_argument("rule", nargs="?", metavar="CODE", help="a rule code or name, e.g. DW101")
    parser.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    docs = parser.add_mutually_exclusive_group()
    docs.add_argument(
        "--write-docs", metavar="DIR", help="write one Markdown page per rule and an index to DIR"
    )
    docs.add_argument(
        "--check-docs", metavar="DIR",
        help="exit with 1 when the pages in DIR differ from the registry (for CI)",
    )  # fmt: skip
    parser.set_defaults(run=run, reads_config=False)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.write_docs:
        written = rule_docs.write_docs(args.write_docs)
        print(f"{len(written)} page(s) written to {args.write_docs}", file=sys.stderr)
        return 0
    if args.check_docs:
        problems = rule_docs.stale_docs(args.check_docs)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(
                f"deadweight: regenerate with `deadweight rules --write-docs {args.check_docs}`",
                file=sys.stderr,
            )
        return 1 if problems else 0
    if args.rule:
        try:
            found = get_rule(args.rule)
        except KeyError as exc:
            raise InputError(exc.args[0]) from None
        if args.format == "json":
            print(json.dumps(_rule_dict(found), indent=2))
        elif args.format == "markdown":
            print(rule_docs.rule_page(found))
        else:
            console.print(RulePage(rule_docs.rule_page(found)))
        return 0
    if args.format == "json":
        print(json.dumps([_rule_dict(r) for r in all_rules()], indent=2))
        return 0
    if args.format == "markdown":
        print(markdown_table())
        return 0
    table = Table(box=None, header_style="bold")
    for column in ("code", "name", "severity"):  # whole, so they can be pasted
        table.add_column(column, no_wrap=True)
    table.add_column("summary")
    for r in all_rules():
        table.add_row(r.code, r.name, r.severity.value, r.summary)
    print_whole(table)
    return 0


class _KeyedTable(TableElement):
    """A Markdown table whose first column (a threshold key) is never wrapped or cut:
    the other columns wrap around it, and the key can be pasted into a configuration."""

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for part in super().__rich_console__(console, options):
            if isinstance(part, Table) and part.columns:
                part.columns[0].no_wrap = True
            yield part


class RulePage(Markdown):
    """A rule's page in the terminal, its thresholds' keys whole at any width."""

    elements: ClassVar[dict[str, type[MarkdownElement]]] = {
        **Markdown.elements,
        "table_open": _KeyedTable,
    }


def markdown_table() -> str:
    """The rule table of the README, generated from the registry."""
    lines = ["| code | name | severity | what it catches |", "| --- | --- | --- | --- |"]
    lines += [f"| {r.code} | {r.name} | {r.severity.value} | {r.summary} |" for r in all_rules()]
    return "\n".join(lines)


def _rule_dict(r: Any) -> dict[str, Any]:
    return {
        "code": r.code,
        "name": r.name,
        "severity": r.severity.value,
        "family": r.family,
        "summary": r.summary,
        "source": r.source,
        "doc": r.doc,
        "thresholds": {key: default for key, default, _, _ in thresholds.for_rule(r.code)},
    }
