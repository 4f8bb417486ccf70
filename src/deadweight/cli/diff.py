"""`deadweight diff A B`: tensors bitwise unchanged between two checkpoints (DW401),
the top movers, and tensors added, removed or reshaped."""

from __future__ import annotations

import argparse
from typing import Any

from deadweight.cli._checkpoints import (
    add_checkpoint_options,
    claim_checkpoint_html,
    diff_table,
    finish,
)
from deadweight.errors import InputError

HELP = "what changed between two checkpoints of one run"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("diff", help=HELP, description=HELP + ".")
    parser.add_argument("a", metavar="A")
    parser.add_argument("b", metavar="B")
    parser.add_argument("--top", type=int, default=10, help="how many top movers to show")
    add_checkpoint_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deadweight.checkpoints import api as forensics  # torch: only when it runs

    claim_checkpoint_html(args, [args.a, args.b])
    try:
        report = forensics.diff_checkpoints(
            args.a, args.b, unsafe_pickle=args.unsafe_pickle, select=args.select,
            ignore=args.ignore, top=args.top,
        )  # fmt: skip
    except ValueError as exc:  # a bad --select or --ignore
        raise InputError(str(exc)) from None
    if report.subject["errors"] and not report.subject["compared"]:
        raise InputError("; ".join(report.subject["errors"]))
    return finish(report, args, [], diff_table(report))
