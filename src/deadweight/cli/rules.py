"""`deadweight rules [CODE]`: list the rules, or explain one."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markdown import Markdown
from rich.table import Table

from deadweight.errors import InputError
from deadweight.registry import all_rules, get_rule

HELP = "list the rules, or explain one (by code or name)"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("rules", help=HELP, description=HELP + ".")
    parser.add_argument("rule", nargs="?", metavar="CODE", help="a rule code or name, e.g. DW101")
    parser.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.rule:
        try:
            found = get_rule(args.rule)
        except KeyError as exc:
            raise InputError(exc.args[0]) from None
        if args.format == "json":
            print(json.dumps(_rule_dict(found), indent=2))
        else:
            console.print(
                f"[bold]{found.code} {found.name}[/] ({found.severity.value}, {found.family})"
            )
            console.print(found.summary)
            console.print(Markdown(found.doc))
        return 0
    if args.format == "json":
        print(json.dumps([_rule_dict(r) for r in all_rules()], indent=2))
        return 0
    if args.format == "markdown":
        print(markdown_table())
        return 0
    table = Table("code", "name", "severity", "summary", box=None, header_style="bold")
    for r in all_rules():
        table.add_row(r.code, r.name, r.severity.value, r.summary)
    console.print(table)
    return 0


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
        "doc": r.doc,
    }
