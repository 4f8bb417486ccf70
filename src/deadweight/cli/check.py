"""`deadweight check FILE.py[:FUNC]`: import the user's file, build the model, check it."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from deadweight.cli._common import (
    add_html_option,
    add_report_options,
    claim_html,
    emit,
    script_output_to_stderr,
)
from deadweight.errors import InputError, LossFnError

HELP = "check a model: every trainable parameter gets a gradient, and where the graph is cut"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("check", help=HELP, description=HELP + ".")
    parser.add_argument(
        "target",
        metavar="FILE.py[:FUNC]",
        help="a Python file and the function in it (default: make) that returns "
        "(model, loss_fn) or (model, loss_fn, optimizer)",
    )
    add_report_options(parser)
    add_html_option(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deadweight.checking.api import check  # torch: only when a check runs

    path, func_name = parse_target(args.target)
    claim_html(args, [path])  # before the user's code runs: a refusal costs nothing
    # The file's own prints (at import, in the factory, in the forward or the loss) must
    # not mix with a JSON report on stdout.
    with script_output_to_stderr(args.format == "json"):
        made = call_factory(path, func_name)
        try:
            report = check(*made, select=args.select, ignore=args.ignore)
        except ValueError as exc:  # a bad --select / --ignore entry
            raise InputError(str(exc)) from None
    return emit(report, args)


def parse_target(target: str) -> tuple[str, str]:
    path, sep, func = target.rpartition(":")
    if not sep or not func.isidentifier() or not path:
        path, func = target, "make"
    if not os.path.isfile(path):
        raise InputError(f"no such file: {path}")
    return path, func


def call_factory(path: str, func_name: str) -> tuple[Any, ...]:
    module = import_file(path)
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise InputError(
            f"{path} has no function {func_name!r}; it should return (model, loss_fn) or "
            "(model, loss_fn, optimizer)"
        )
    try:
        made = factory()
    except Exception as exc:
        raise LossFnError(f"{path}:{func_name}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise InputError(
            f"{path}:{func_name}() must return (model, loss_fn) or (model, loss_fn, optimizer), "
            f"got {type(made).__name__}"
            + (f" of length {len(made)}" if isinstance(made, tuple) else "")
        )
    return made


def import_file(path: str) -> Any:
    path = os.path.abspath(path)
    name = "_deadweight_target_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise InputError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    # Let the file import its neighbours, as `python FILE.py` would.
    sys.path.insert(0, os.path.dirname(path))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise LossFnError(f"importing {path} raised {type(exc).__name__}: {exc}") from exc
    return module
