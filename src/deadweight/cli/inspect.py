"""`deadweight inspect CKPT...`: per-tensor statistics, layer outliers (DW402),
quantization risk (DW403) and NaN/Inf (DW404) of checkpoints."""

from __future__ import annotations

import argparse
from typing import Any

from deadweight.cli._checkpoints import (
    add_checkpoint_options,
    claim_checkpoint_html,
    expand,
    finish,
    optimizer_table,
    progress_bar,
    tensor_table,
)
from deadweight.errors import InputError
from deadweight.thresholds import DEFAULT as DEFAULT_THRESHOLDS

HELP = "per-tensor statistics, layer outliers, quantization risk and NaN/Inf of checkpoints"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("inspect", help=HELP, description=HELP + ".")
    parser.add_argument("paths", nargs="+", metavar="CKPT", help="files, directories or globs")
    parser.add_argument(
        "--scheme",
        default="default",
        help="quantization scheme for DW403: int4, int8-channel, int4-group128, "
        "int8-tensor-asym, ... or 'none' (default: quantization-scheme of the configuration, "
        f"else {DEFAULT_THRESHOLDS.quantization_scheme})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="threads reducing tensors (default: every core this process may use)",
    )
    add_checkpoint_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deadweight.checkpoints import api as forensics  # torch: only when it runs

    claim_checkpoint_html(args, args.paths)
    paths, errors = expand(args.paths)
    if not paths and errors:
        raise InputError("; ".join(errors))
    scheme = args.scheme  # "default": the configured quantization-scheme
    try:
        with progress_bar() as progress:
            report = forensics.inspect_checkpoints(
                paths, scheme=scheme, unsafe_pickle=args.unsafe_pickle, select=args.select,
                ignore=args.ignore, progress=progress, threads=args.threads,
            )  # fmt: skip
    except ValueError as exc:  # a bad --scheme, --threads, --select or --ignore
        raise InputError(str(exc)) from None
    return finish(report, args, errors, tensor_table(report), optimizer_table(report))
