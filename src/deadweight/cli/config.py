"""`deadweight config [PATH]`: the configuration in effect, and where each value came from."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from deadweight.cli._common import add_config_options, project_config
from deadweight.cli._console import print_whole
from deadweight.config import Config
from deadweight.report.display import plain, safe_text

HELP = "print the configuration in effect and where each value came from"
DESCRIPTION = (
    HELP + ": the nearest deadweight.toml, or pyproject.toml with [tool.deadweight], from "
    "PATH (default: the working directory) upwards, or --config FILE. Exit code 2 when the "
    "file has an error, which is then named with every problem in it."
)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("config", help=HELP, description=DESCRIPTION)
    parser.add_argument(
        "path", nargs="?", default=None, metavar="PATH",
        help="the file or directory whose configuration to show (lint reads it per file)",
    )  # fmt: skip
    parser.add_argument("--format", choices=("text", "json", "toml"), default="text")
    add_config_options(parser)
    parser.set_defaults(run=run, reads_config=False)


def run(args: argparse.Namespace) -> int:
    cfg = project_config(args, Path(args.path) if args.path else None)
    print_config_notes(cfg)
    if args.format == "json":
        print(json.dumps(as_dict(cfg), indent=2))
    elif args.format == "toml":
        print(as_toml(cfg))
    else:
        console = Console(highlight=False)
        # Paths and values are the project's text (a cloned repository's pyproject.toml):
        # shown as text, never read as rich markup.
        where = cfg.path or "none found; defaults"
        console.print(Text.assemble(("configuration:", "bold"), " ", plain(where)), soft_wrap=True)
        table = Table("key", "value", "from", box=None, header_style="bold")
        for key, value in cfg.effective().items():
            table.add_row(plain(key), plain(_toml_value(value)), plain(_short(cfg.source_of(key))))
        print_whole(table, highlight=False)
    return 0


def print_config_notes(cfg: Config) -> None:
    """One line per broken pyproject.toml passed over (it is not deadweight's)."""
    for note in cfg.notes:
        print(safe_text(f"deadweight: note: {note}"), file=sys.stderr)


def as_dict(cfg: Config) -> dict[str, Any]:
    return {
        "file": str(cfg.path) if cfg.path else None,
        "values": {
            key: {"value": value, "source": cfg.source_of(key)}
            for key, value in cfg.effective().items()
        },
    }


def as_toml(cfg: Config) -> str:
    """The effective configuration as a `[tool.deadweight]` table to paste into pyproject.toml."""
    plain: list[str] = ["[tool.deadweight]"]
    tables: dict[str, list[str]] = {"per-file-ignores": [], "thresholds": []}
    for key, value in cfg.effective().items():
        if key == "per-file-ignores":
            tables[key] += [f"{json.dumps(p)} = {_toml_value(r)}" for p, r in value.items()]
        elif key.startswith("thresholds."):
            tables["thresholds"].append(f"{key.split('.', 1)[1]} = {_toml_value(value)}")
        else:
            plain.append(f"{key} = {_toml_value(value)}")
    for name, lines in tables.items():
        if lines:
            plain += ["", f"[tool.deadweight.{name}]", *lines]
    return "\n".join(plain)


def _short(source: str) -> str:
    """A file source relative to the working directory, when it is below it."""
    path, sep, table = source.partition(" [")
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve())) + sep + table
    except ValueError:
        return source


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, list)):
        return json.dumps(value)  # strings and lists of strings read the same in TOML
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
        )
    return repr(value)
