"""What `deadweight inspect`, `diff` and `trend` share: options, progress, tables, exit codes.

Each command reads only, writes nothing next to the checkpoints, and keeps going past
a file it cannot read: that file's error is printed and the exit code is 2, the others
are still reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from deadweight.cli._common import add_html_option, add_report_options, claim_html, emit
from deadweight.cli._console import print_whole
from deadweight.report import Report
from deadweight.report.display import plain, safe_text

_TABLE_ROWS = 60  # per checkpoint in the terminal; --format json has every tensor


def add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--unsafe-pickle",
        action="store_true",
        help="allow torch checkpoints that need arbitrary code to load: runs the pickle of "
        "each file the safe loader refuses, and names each such file in a warning",
    )
    add_report_options(parser)
    add_html_option(parser)


# What the checkpoint commands read inside a folder they are given: --html is refused there
# under such a name (a DCP directory's shards, a sharded index and its shards).
READS = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".npz", ".json", ".distcp", ".metadata")


def claim_checkpoint_html(args: argparse.Namespace, inputs: list[str]) -> None:
    claim_html(args, inputs, READS)


def expand(inputs: list[str]) -> tuple[list[str], list[str]]:
    """The checkpoints the inputs name, and an error for each input that names none; one
    input that cannot even be expanded is that input's error, the others still count."""
    from deadweight.checkpoints.readers import find_checkpoints
    from deadweight.checkpoints.readers.base import PASS_THROUGH, reading_error

    paths: list[str] = []
    seen: set[str] = set()
    errors: list[str] = []
    for raw in inputs:
        try:
            found, failed = find_checkpoints([raw])
        except PASS_THROUGH:
            raise
        except BaseException as exc:
            found, failed = [], [reading_error(raw, exc)]
        paths.extend(p for p in found if p not in seen)
        seen.update(found)
        errors.extend(str(e) for e in failed)
    return paths, errors


# Subject keys the generic text header would print raw: the optimizer summary as a dict
# repr, and trend's list of steps as "[0, 100, ...] steps". Their tables show them instead;
# --format json keeps them.
_HEADER_CLASHES = ("optimizer", "steps")


def finish(
    report: Report, args: argparse.Namespace, errors: list[str], *tables: Table | None
) -> int:
    # Each once, on one line: a file named twice (a glob and its path) is one error.
    every = [*errors, *report.subject.get("errors", [])]
    unique = list(dict.fromkeys(" ".join(e.splitlines()) for e in every))
    if args.format == "text":
        for table in tables:
            if table is not None:
                print_whole(table)
        subject = {k: v for k, v in report.subject.items() if k not in _HEADER_CLASHES}
        subject["errors"] = unique  # the footer counts the inputs not read, named or not found
        code = emit(dataclasses.replace(report, subject=subject), args, html_report=report)
    else:
        code = emit(report, args)
    # The readers' notes: each file whose pickle --unsafe-pickle ran, each tensor not measured.
    for warning in report.subject.get("warnings", []):
        print(f"deadweight: warning: {warning}", file=sys.stderr)
    for error in unique:
        print(f"deadweight: error: {error}", file=sys.stderr)
    return 2 if unique else code


class progress_bar:
    """A progress bar on stderr for long scans, only when stderr is a terminal."""

    def __enter__(self) -> Any:
        if not sys.stderr.isatty():
            self._bar = None
            return None
        self._bar = Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), console=Console(stderr=True), transient=True,
        )  # fmt: skip
        self._bar.start()
        task = self._bar.add_task("reading", total=None)
        bar = self._bar

        def advance(name: str, nbytes: int) -> None:
            # the description is rich markup: a file name is shown as text
            bar.update(task, advance=nbytes, description=escape(safe_text(name[-40:])))

        return advance

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def tensor_table(report: Report) -> Table | None:
    tensors = report.subject.get("tensors") or {}
    if not tensors:
        return None
    table = Table(title="tensors", header_style="bold", pad_edge=False)
    table.add_column("name", overflow="fold", min_width=24)
    for column in ("shape", "dtype", "min", "max", "mean", "std", "zeros", "nan/inf"):
        table.add_column(column, justify="left" if column == "dtype" else "right", no_wrap=True)
    for path, rows in tensors.items():
        if len(tensors) > 1:
            table.add_row(plain(path, "bold"))
        for row in rows[:_TABLE_ROWS]:
            if row["analysed"]:
                numbers = [f"{row[k]:.3g}" for k in ("min", "max", "mean", "std")]
                counts = [str(row["zeros"]), str(row["nonfinite"])]
            else:
                numbers, counts = ["·"] * 4, ["·", "·"]
            table.add_row(
                plain(row["name"]),
                plain("×".join(map(str, row["shape"])) or "scalar"),
                plain(row["dtype"]),
                *numbers,
                *counts,
            )
        if len(rows) > _TABLE_ROWS:
            table.add_row(f"… {len(rows) - _TABLE_ROWS} more (--format json lists all)")
    return table


def diff_table(report: Report) -> Table | None:
    s = report.subject
    table = Table(title=f"top movers of {s['compared']} compared tensors", header_style="bold")
    table.add_column("name")
    table.add_column("relative change", justify="right")
    table.add_column("max |change|", justify="right")
    for row in s["top_movers"]:
        table.add_row(
            plain(row["name"]), f"{row['relative_change']:.3g}", f"{row['max_abs_change']:.3g}"
        )
    for key in ("added", "removed"):
        if s[key]:
            table.add_row(
                _labelled(key, ", ".join(s[key][:10]) + (" …" if len(s[key]) > 10 else ""))
            )
    for row in s["reshaped"]:
        table.add_row(_labelled("reshaped", f"{row['name']} {row['a']} -> {row['b']}"))
    for row in s.get("retyped", []):
        table.add_row(_labelled("retyped", f"{row['name']} {row['a']} -> {row['b']}"))
    if s.get("not_compared"):
        table.add_row(_labelled("not compared", f"(int/bool): {_listing(s['not_compared'])}", ""))
    return table


def _labelled(label: str, names: str, sep: str = ":") -> Text:
    """`label: names`, the label bold, the names (data from the files) shown as text."""
    return Text.assemble((label, "bold"), f"{sep} ", plain(names))


def _listing(names: list[str], n: int = 10) -> str:
    return ", ".join(names[:n]) + (f" … ({len(names) - n} more)" if len(names) > n else "")


def optimizer_table(report: Report) -> Table | None:
    """The optimizer state saved beside the weights (torch checkpoints), one row per group."""
    optimizers = report.subject.get("optimizer") or {}
    if not optimizers:
        return None
    table = Table(title="optimizer state", header_style="bold", pad_edge=False)
    for column in ("checkpoint", "key", "step", "params", "moments", "group", "lr",
                   "weight decay", "betas", "eps"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("checkpoint", "key") else "right")
    for path, summary in optimizers.items():
        head: list[str | Text] = [
            plain(path),
            plain(summary.get("key", "")),
            _number(summary.get("step")),
            plain(summary.get("params_with_state", "")),
            plain(", ".join(map(str, summary.get("moments") or [])) or "none"),
        ]
        groups = summary.get("param_groups") or [{}]
        for k, group in enumerate(groups):
            betas = group.get("betas")
            table.add_row(
                *(head if k == 0 else [""] * len(head)),
                str(k),
                _number(group.get("lr")),
                _number(group.get("weight_decay")),
                ", ".join(_number(b) for b in betas) if betas else "·",
                _number(group.get("eps")),
            )
    return table


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else "·"


def trend_table(report: Report) -> Table | None:
    """Each single-element tensor over the series: first, last, lowest and highest value."""
    s = report.subject
    if not s.get("values"):
        return None
    known = [step for step in s["steps"] if step is not None]
    span = f", steps {min(known)}..{max(known)}" if known else ""
    table = Table(
        title=f"single-element tensors over {len(s['checkpoints'])} checkpoints{span}",
        header_style="bold",
        pad_edge=False,
    )
    table.add_column("name", overflow="fold", min_width=24)
    for column in ("saves", "first", "last", "min", "max"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, values in list(s["values"].items())[:_TABLE_ROWS]:
        seen = [v for v in values if v is not None]
        if not seen:
            continue
        table.add_row(
            plain(name),
            str(len(seen)),
            *(f"{v:.4g}" for v in (seen[0], seen[-1], min(seen), max(seen))),
        )
    if len(s["values"]) > _TABLE_ROWS:
        table.add_row(f"… {len(s['values']) - _TABLE_ROWS} more (--format json lists all)")
    return table
