"""`deadweight trend CKPT...`: single-element tensors across a series of checkpoints,
ordered by the step in their names (DW405 monotone drift)."""

from __future__ import annotations

import argparse
from typing import Any

from deadweight.cli._checkpoints import (
    add_checkpoint_options,
    claim_checkpoint_html,
    expand,
    finish,
    trend_table,
)
from deadweight.errors import InputError

HELP = "single-element tensors across a series of checkpoints (a directory or glob works)"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("trend", help=HELP, description=HELP + ".")
    parser.add_argument("paths", nargs="+", metavar="CKPT", help="files, directories or globs")
    add_checkpoint_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deadweight.checkpoints import api as forensics  # torch: only when it runs

    claim_checkpoint_html(args, args.paths)
    paths, errors = expand(args.paths)
    if not paths and errors:
        raise InputError("; ".join(errors))
    try:
        report = forensics.trend_checkpoints(
            paths, unsafe_pickle=args.unsafe_pickle, select=args.select, ignore=args.ignore
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return finish(report, args, errors, trend_table(report))
