"""`deadweight report INPUT...`: rebuild the report of a watch log, or turn saved results
(watch logs, `check`/`inspect`/`diff`/`trend --format json` output) into one HTML page
with `-o report.html`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from typing import Any

from deadweight.cli._common import add_report_options, emit
from deadweight.errors import InputError
from deadweight.findings import Finding, Location, Severity
from deadweight.probes.event_log import iter_runs, read_log
from deadweight.probes.watch_stats import WatchStats
from deadweight.registry import Selection
from deadweight.report import SCHEMA_VERSION, Report
from deadweight.report.html import Section
from deadweight.watcher import report_from_stats

HELP = (
    "rebuild the report of a watched run from its event log (also of a killed run), or "
    "write saved results as one HTML page with -o"
)


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("report", help=HELP, description=HELP + ".")
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="an event log written by watch or run (JSONL), or the --format json output "
        "of check, inspect, diff or trend",
    )
    parser.add_argument(
        "-o",
        "--output",
        metavar="REPORT.html",
        help="write one self-contained HTML report of every input (needs deadweight[html])",
    )
    add_report_options(parser)
    parser.set_defaults(run=run)


def report_from_log(path: str, select: Any = None, ignore: Any = None) -> Report:
    return load_log(path, select, ignore)[-1][0]


def load_log(
    path: str, select: Any = None, ignore: Any = None, *, every_run: bool = False
) -> list[tuple[Report, WatchStats]]:
    """The report and statistics of the log's last run, or of each run with `every_run`."""
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
        problems.append(
            f"{path} holds {len(runs)} runs; "
            + ("each is reported on its own" if every_run else "reporting the last one")
        )
    out = []
    for events in runs if every_run else runs[-1:]:
        stats = _stats(events, problems)
        try:
            report = report_from_stats(stats, select=select, ignore=ignore, log=path)
        except ValueError as exc:  # a bad --select / --ignore entry
            raise InputError(str(exc)) from None
        out.append((report, stats))
    return out


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


def report_from_dict(data: dict[str, Any], select: Any = None, ignore: Any = None) -> Report:
    """A Report saved with `--format json`, read back (unknown keys are ignored)."""
    findings = []
    for item in data.get("findings") or []:
        location = item.get("location")
        findings.append(
            Finding(
                code=str(item["code"]),
                name=str(item.get("name", "")),
                severity=Severity.parse(item.get("severity", "info")),
                message=str(item.get("message", "")),
                params=tuple(item.get("params") or ()),
                location=Location(**{k: location.get(k) for k in _LOCATION_KEYS})
                if isinstance(location, dict)
                else None,
                evidence=item.get("evidence") or {},
                fix=str(item.get("fix", "")),
            )
        )
    try:
        selection = Selection.of(select, ignore)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return Report.of(
        str(data.get("kind", "?")), selection.filter(findings), data.get("subject") or {}
    )


_LOCATION_KEYS = ("file", "line", "function", "module", "column", "end_line", "end_column")


def classify(path: str) -> tuple[str, Any]:
    """("report", dict) for saved JSON output, ("log", None) for a watch event log.

    Raises InputError saying what the file is not."""
    if not os.path.isfile(path):
        raise InputError(f"no such file: {path}")
    if os.path.getsize(path) == 0:
        raise InputError(f"{path} is empty")
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(4096)
    first = next((line for line in head.splitlines() if line.strip()), "")
    try:
        event = json.loads(first)
    except json.JSONDecodeError:
        event = None
    if isinstance(event, dict) and "event" in event:
        return "log", None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(
            f"{path} is neither a watch event log nor deadweight's JSON output ({exc})"
        ) from None
    if isinstance(data, dict) and "findings" in data and "kind" in data:
        return "report", data
    raise InputError(f"{path} is JSON but not deadweight's output (no 'kind' and 'findings')")


def load_sections(
    paths: list[str], select: Any = None, ignore: Any = None
) -> tuple[list[Section], list[str], int]:
    """Every readable input as HTML sections, a note for each problem met, and how many
    inputs could not be read at all."""
    sections: list[Section] = []
    notes: list[str] = []
    skipped = 0
    for path in paths:
        try:
            kind, data = classify(path)
            if kind == "log":
                runs = load_log(path, select, ignore, every_run=True)
                for k, (report, stats) in enumerate(runs):
                    label = path if len(runs) == 1 else f"{path} run {k + 1} of {len(runs)}"
                    notes_here = (
                        list(stats.problems)
                        if k == 0
                        else [p for p in stats.problems if p not in runs[0][1].problems]
                    )
                    sections.append(Section(label, report, stats, notes_here))
            else:
                version = data.get("schema_version")
                notes_here = []
                if not isinstance(version, int) or version > SCHEMA_VERSION:
                    notes_here.append(
                        f"report schema version {version} is newer than this deadweight reads "
                        f"({SCHEMA_VERSION}); upgrade deadweight. Reading what it can."
                    )
                try:
                    report = report_from_dict(data, select, ignore)
                except (KeyError, TypeError, ValueError) as exc:
                    raise InputError(f"{path}: a finding could not be read ({exc})") from None
                sections.append(Section(path, report, None, notes_here))
        except InputError as exc:
            notes.append(f"{exc}; skipped")
            skipped += 1
    origins = {
        (s.stats.start.get("pid"), s.stats.start.get("time"))
        for s in sections
        if s.stats is not None
    }
    if len(origins) > 1:
        notes.append(
            f"the inputs come from {len(origins)} different runs; each is shown on its own "
            "and nothing is merged"
        )
    return sections, notes, skipped


def run(args: argparse.Namespace) -> int:
    if args.output:
        from deadweight.report.html import require_plotly, write_html

        require_plotly()  # before reading anything: a missing extra is the first thing to say
        sections, notes, skipped = load_sections(args.inputs, args.select, args.ignore)
        for note in [*notes, *(f"{s.label}: {n}" for s in sections for n in s.notes)]:
            print(f"deadweight: note: {note}", file=sys.stderr)
        if not sections:
            raise InputError("nothing to report: no input could be read")
        write_html(args.output, sections, notes)
        print(f"deadweight: wrote {args.output}", file=sys.stderr)
        fail_on = None if args.fail_on == "never" else Severity.parse(args.fail_on)
        failed = any(s.report.failed(fail_on) for s in sections)
        return 2 if skipped else int(failed)
    code = 0
    for path in args.inputs:
        kind, data = ("log", None) if not os.path.isfile(path) else _classify_for_text(path)
        if kind == "log":
            report = report_from_log(path, args.select, args.ignore)
            for problem in report.subject.get("problems", []):
                print(f"deadweight: note: {problem}", file=sys.stderr)
        else:
            assert data is not None
            report = report_from_dict(data, args.select, args.ignore)
        code = max(code, emit(report, args))
    return code


def _classify_for_text(path: str) -> tuple[str, Any]:
    # An empty file keeps its old message ("holds no watch events") from the log reader.
    try:
        return classify(path)
    except InputError:
        return "log", None
