"""`deadweight report LOG.jsonl`: rebuild the watch report from an event log."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from typing import Any

from deadweight.cli._common import add_report_options, emit
from deadweight.errors import InputError
from deadweight.probes.event_log import iter_runs, read_log
from deadweight.probes.watch_stats import WatchStats
from deadweight.report import Report
from deadweight.watcher import report_from_stats

HELP = "rebuild the report of a watched run from its event log (also of a killed run)"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("report", help=HELP, description=HELP + ".")
    parser.add_argument("log", metavar="LOG.jsonl", help="an event log written by watch or run")
    add_report_options(parser)
    parser.set_defaults(run=run)


def report_from_log(path: str, select: Any = None, ignore: Any = None) -> Report:
    if not os.path.isfile(path):
        raise InputError(f"no such file: {path}")
    contents = read_log(path)
    runs = list(iter_runs(contents.events))
    if not runs:
        raise InputError(
            f"{path} holds no watch events"
            + (f" ({'; '.join(contents.problems)})" if contents.problems else "")
        )
    problems = list(contents.problems)
    if len(runs) > 1:
        problems.append(f"{path} holds {len(runs)} runs; reporting the last one")
    stats = _stats(runs[-1], problems)
    try:
        return report_from_stats(stats, select=select, ignore=ignore, log=path)
    except ValueError as exc:  # a bad --select / --ignore entry
        raise InputError(str(exc)) from None


def _stats(events: list[dict[str, Any]], problems: list[str]) -> WatchStats:
    """Like `stats_from_events`, but an event that does not fit (a damaged line, or the
    layout of a newer schema) is skipped with a note instead of ending the report."""
    stats = WatchStats(problems=list(problems))
    unreadable: Counter[tuple[str, str]] = Counter()
    for event in events:
        try:
            stats.apply(event)
        except Exception as exc:
            unreadable[(str(event.get("event")), f"{type(exc).__name__}: {exc}")] += 1
    for (kind, error), count in unreadable.items():
        stats.problems.append(f"{count} {kind!r} event(s) could not be read ({error}); skipped")
    return stats


def run(args: argparse.Namespace) -> int:
    report = report_from_log(args.log, args.select, args.ignore)
    for problem in report.subject.get("problems", []):
        print(f"deadweight: note: {problem}", file=sys.stderr)
    return emit(report, args)
