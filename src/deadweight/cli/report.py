"""`deadweight report INPUT...`: rebuild the report of a watch log, or turn saved results
(watch logs, `check`/`inspect`/`diff`/`trend --format json` output) into one HTML page
with `-o report.html`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections import Counter
from typing import TYPE_CHECKING, Any

from deadweight.cli._common import add_report_options, emit
from deadweight.errors import InputError
from deadweight.findings import Finding, Location, Severity
from deadweight.output_files import OutputFile
from deadweight.registry import Selection
from deadweight.report import SCHEMA_VERSION, Report
from deadweight.report.display import safe_text
from deadweight.report.text import render_plain
from deadweight.watching.event_log import iter_runs, parse_line, read_log
from deadweight.watching.watch_report import report_from_stats
from deadweight.watching.watch_stats import WatchStats

if TYPE_CHECKING:  # report.html imports numpy: loaded when a page is made
    from deadweight.report.html import Section

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
    _require_file(path)
    try:
        contents = read_log(path)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
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
            Selection.of(select, ignore)
        except ValueError as exc:  # a bad --select / --ignore entry
            raise InputError(str(exc)) from None
        try:
            report = report_from_stats(stats, select=select, ignore=ignore, log=path)
        except Exception as exc:
            # The events passed the reader's checks yet a rule could not judge them (a
            # combination no run writes): this file is an error, the other inputs go on.
            raise InputError(
                f"{path}: its events could not be judged ({type(exc).__name__}: {exc}); "
                "the log is damaged, or this is a deadweight bug worth reporting"
            ) from None
        out.append((report, stats))
    if contents.rejected.get("step") and not any(stats.steps for _, stats in out):
        # Every step record was damaged: "no findings" would pass a run nobody checked.
        raise InputError(
            f"{path}: none of its {contents.rejected['step']} step events could be read "
            f"({'; '.join(contents.problems)})"
        )
    return out


def _require_file(path: str) -> None:
    # A FIFO would block the reader, a directory cannot be read: only regular files.
    if not os.path.exists(path):
        raise InputError(f"no such file: {path}")
    if not os.path.isfile(path):
        raise InputError(f"{path} is not a regular file")


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
    # One note per problem: the statistics note an unknown optimizer once per event.
    seen = Counter(stats.problems)
    stats.problems = [p if seen[p] == 1 else f"{p} ({seen[p]} times)" for p in seen]
    return stats


def report_from_dict(
    data: Any, select: Any = None, ignore: Any = None, *, source: str = "saved report"
) -> Report:
    """A Report saved with `--format json`, read back (unknown keys are ignored).

    Raises InputError naming `source` and every value of the wrong type."""
    problems = saved_report_problems(data)
    if problems:
        shown = "; ".join(problems[:_MAX_PROBLEMS])
        more = len(problems) - _MAX_PROBLEMS
        raise InputError(
            f"{source} is not a valid deadweight report: {shown}"
            + (f"; and {more} more" if more > 0 else "")
        )
    findings = []
    for item in data["findings"]:
        location = item.get("location")
        findings.append(
            Finding(
                code=item["code"],
                name=item.get("name", ""),
                severity=Severity.parse(item.get("severity", "info")),
                message=item.get("message", ""),
                params=tuple(item.get("params") or ()),
                location=Location(**{k: location.get(k) for k in _LOCATION_KEYS})
                if isinstance(location, dict)
                else None,
                evidence=item.get("evidence") or {},
                fix=item.get("fix", ""),
            )
        )
    try:
        selection = Selection.of(select, ignore)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    return Report.of(data["kind"], selection.filter(findings), data.get("subject") or {})


_LOCATION_KEYS = ("file", "line", "function", "module", "column", "end_line", "end_column")
_MAX_PROBLEMS = 5  # a report with thousands of bad findings: the first few say enough
_SEVERITIES = tuple(s.value for s in Severity)


def _is_int(v: Any) -> bool:
    return type(v) is int


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# subject key -> (what it must be, check): the keys the text and HTML renderers read.
_SUBJECT_KEYS: dict[str, tuple[str, Any]] = {
    "optimizers": ("a list of strings", _is_str_list),
    "loss": ("a number or null", lambda v: v is None or type(v) in (int, float)),
    "detector_errors": (
        "a list of objects",
        lambda v: isinstance(v, list) and all(isinstance(e, dict) for e in v),
    ),
    "problems": ("a list of strings", _is_str_list),
    "checkpoints": ("a list", lambda v: isinstance(v, list)),
    "tensors": (
        "an object of lists of objects",
        lambda v: (
            isinstance(v, dict)
            and all(isinstance(r, list) and all(isinstance(x, dict) for x in r) for r in v.values())
        ),
    ),
    "quantization": (
        "an object of objects of objects",
        lambda v: (
            isinstance(v, dict)
            and all(
                isinstance(t, dict) and all(isinstance(q, dict) for q in t.values())
                for t in v.values()
            )
        ),
    ),
    "top_movers": (
        "a list of objects with a name and a relative_change",
        lambda v: (
            isinstance(v, list)
            and all(
                isinstance(m, dict)
                and isinstance(m.get("name"), str)
                # null: an infinite change (a tensor that was all zeros), as JSON writes it
                and "relative_change" in m
                and (m["relative_change"] is None or type(m["relative_change"]) in (int, float))
                for m in v
            )
        ),
    ),
    "values": (
        "an object of lists of numbers",
        lambda v: (
            isinstance(v, dict)
            and all(
                isinstance(y, list) and all(x is None or type(x) in (int, float) for x in y)
                for y in v.values()
            )
        ),
    ),
}
_FINDING_TEXT = ("code", "name", "message", "fix")


def saved_report_problems(data: Any) -> list[str]:
    """What in a `--format json` report has the wrong type, every problem at once."""
    if not isinstance(data, dict):
        return [f"it is a JSON {type(data).__name__}, not an object"]
    problems = []
    if not isinstance(data.get("kind"), str):
        problems.append("'kind' must be a string")
    findings = data.get("findings")
    if not isinstance(findings, list):
        problems.append("'findings' must be a list")
        findings = []
    subject = data.get("subject")
    if subject is not None and not isinstance(subject, dict):
        problems.append("'subject' must be an object")
    elif subject:
        for key, (what, ok) in _SUBJECT_KEYS.items():
            if key in subject and subject[key] is not None and not ok(subject[key]):
                problems.append(f"subject {key!r} must be {what}")
    for k, item in enumerate(findings):
        where = f"finding {k + 1}"
        if not isinstance(item, dict):
            problems.append(f"{where} is not an object")
            continue
        if not isinstance(item.get("code"), str):
            problems.append(f"{where} has no 'code' string")
        for key in _FINDING_TEXT[1:]:
            if key in item and not isinstance(item[key], str):
                problems.append(f"{where}: {key!r} must be a string")
        if item.get("severity", "info") not in _SEVERITIES:
            problems.append(f"{where}: 'severity' must be one of {', '.join(_SEVERITIES)}")
        if item.get("params") is not None and not _is_str_list(item["params"]):
            problems.append(f"{where}: 'params' must be a list of strings")
        if item.get("evidence") is not None and not isinstance(item["evidence"], dict):
            problems.append(f"{where}: 'evidence' must be an object")
        location = item.get("location")
        if location is not None and not isinstance(location, dict):
            problems.append(f"{where}: 'location' must be an object or null")
        elif location:
            for key in _LOCATION_KEYS:
                value = location.get(key)
                text = key in ("file", "function", "module")
                if value is not None and not (isinstance(value, str) if text else _is_int(value)):
                    kind = "a string" if text else "an integer"
                    problems.append(f"{where}: location {key!r} must be {kind} or null")
    return problems


def classify(path: str) -> tuple[str, Any]:
    """("report", dict) for saved JSON output, ("log", None) for a watch event log.

    Raises InputError saying what the file is not."""
    _require_file(path)
    try:
        if os.path.getsize(path) == 0:
            raise InputError(f"{path} is empty")
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(4096)
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    first = next((line for line in head.splitlines() if line.strip()), "")
    try:
        event = parse_line(first)
    except ValueError:  # not JSON, too deep, or cut off at 4096 characters
        event = None
    if isinstance(event, dict) and "event" in event:
        return "log", None
    try:
        with open(path, encoding="utf-8") as f:
            data = parse_line(f.read())
    except (ValueError, OSError) as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        raise InputError(
            f"{path} is neither a watch event log nor deadweight's JSON output ({exc})"
        ) from None
    if isinstance(data, dict) and "findings" in data and "kind" in data:
        return "report", data
    raise InputError(f"{path} is JSON but not deadweight's output (no 'kind' and 'findings')")


def _shown(value: Any) -> str:
    return safe_text(repr(value)[:40]) if value is not None else "missing"


def _saved_section(path: str, data: dict[str, Any], select: Any, ignore: Any) -> Section:
    from deadweight.report.html import Section

    version = data.get("schema_version")
    notes_here = []
    if type(version) is not int:
        notes_here.append(
            f"its schema_version is {_shown(version)}, not a number; read as version "
            f"{SCHEMA_VERSION}, what it can"
        )
    elif version > SCHEMA_VERSION:
        notes_here.append(
            f"report schema version {version} is newer than this deadweight reads "
            f"({SCHEMA_VERSION}); upgrade deadweight. Reading what it can."
        )
    report = report_from_dict(data, select, ignore, source=path)
    return Section(path, report, None, notes_here)


def load_sections(
    paths: list[str], select: Any = None, ignore: Any = None
) -> tuple[list[Section], list[str], int]:
    """Every readable input as HTML sections, a note for each problem met, and how many
    inputs could not be read at all."""
    from deadweight.report.html import Section

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
                sections.append(_saved_section(path, data, select, ignore))
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
    try:  # a bad --select / --ignore is one error, not one per input
        Selection.of(args.select, args.ignore)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if args.output is not None:
        from deadweight.report.html import require_plotly, write_html

        require_plotly()  # before reading anything: a missing extra is the first thing to say
        target = OutputFile.claim(args.output, "-o", inputs=args.inputs)
        sections, notes, skipped = load_sections(args.inputs, args.select, args.ignore)
        sections, failed_here = _renderable(sections, notes)
        skipped += failed_here
        for note in [*notes, *(f"{s.label}: {n}" for s in sections for n in s.notes)]:
            print(safe_text(f"deadweight: note: {note}"), file=sys.stderr)
        if not sections:
            raise InputError("nothing to report: no input could be read")
        write_html(target, sections, notes)
        print(f"deadweight: wrote {args.output}", file=sys.stderr)
        fail_on = None if args.fail_on == "never" else Severity.parse(args.fail_on)
        failed = any(s.report.failed(fail_on) for s in sections)
        return 2 if skipped else int(failed)
    code = 0
    for path in args.inputs:
        # One bad input is an error of its own: the others are still reported.
        try:
            report = _text_input(path, args)
        except InputError as exc:
            print(safe_text(f"deadweight: error: {exc}"), file=sys.stderr)
            code = 2
            continue
        code = max(code, emit(report, args))
    return code


def _text_input(path: str, args: argparse.Namespace) -> Report:
    kind, data = ("log", None) if not os.path.isfile(path) else _classify_for_text(path)
    if kind == "log":
        report = report_from_log(path, args.select, args.ignore)
        for problem in report.subject.get("problems", []):
            print(safe_text(f"deadweight: note: {path}: {problem}"), file=sys.stderr)
        return report
    report = report_from_dict(data, args.select, args.ignore, source=path)
    if args.format == "text":
        # The findings' own fields are checked by type already: what may not render is
        # the free-form subject, which a report with a few findings exercises as well.
        sample = dataclasses.replace(report, findings=report.findings[:3])
        _check_renders(path, lambda: render_plain(sample))
    return report


def _check_renders(path: str, render: Any) -> None:
    """Render a saved report once before it is printed: its subject is free-form JSON
    that only the renderers read, and a value of a type they do not expect must make
    this file an error, not end the command with a traceback."""
    try:
        render()
    except Exception as exc:  # any renderer failure on hostile input; the type is named
        raise InputError(
            f"{path}: its report cannot be rendered ({type(exc).__name__}: {exc}); "
            "a value in it has a type deadweight does not write"
        ) from None


def _renderable(sections: list[Section], notes: list[str]) -> tuple[list[Section], int]:
    """The sections of saved reports that render as HTML on their own (see _check_renders)."""
    from deadweight.report.html import render_html

    kept, failed = [], 0
    for section in sections:
        if section.stats is None:
            try:
                _check_renders(section.label, lambda s=section: render_html([s]))
            except InputError as exc:
                notes.append(f"{exc}; skipped")
                failed += 1
                continue
        kept.append(section)
    return kept, failed


def _classify_for_text(path: str) -> tuple[str, Any]:
    # An empty file keeps its old message ("holds no watch events") from the log reader.
    try:
        return classify(path)
    except InputError:
        return "log", None
