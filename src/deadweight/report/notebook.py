"""What a notebook shows for a `Report` or a `Watch`: a self-contained HTML fragment.

A summary line with the counts, then one table row per finding (severity, rule,
message and fix, parameters, location). No script, no stylesheet (front ends that
sanitise output, such as JupyterLab for an untrusted notebook or GitHub's viewer, drop
`<style>` and would leave the page unstyled), no external resource: inline styles only,
so it looks the same wherever the notebook is opened, plotly or not.

Every string from the report is escaped (`html_text`): tensor names, messages and
locations are data from the user's model, a checkpoint or a saved report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from deadweight.findings import Finding, Severity
from deadweight.report.display import html_text
from deadweight.report.text import (
    compress_names,
    count_parts,
    detector_notes,
    header_parts,
    sections,
)

if TYPE_CHECKING:  # report/__init__.py imports this module lazily
    from deadweight.report import Report

# The HTML report's colours (html._SEVERITY_COLOUR; a test keeps them equal). Not
# imported: that module loads numpy and the watch probes, a notebook showing a saved
# report needs neither.
SEVERITY_COLOUR = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}
# A cell's text past this many characters is cut: a frozen model's finding names
# hundreds of parameters, a name can be a kilobyte long. JSON keeps them all.
MAX_CELL_CHARS = 400
MAX_PARAM_NAMES = 8  # distinct names (or `h.{0-11}.w` patterns) listed in a row

_TABLE = "border-collapse:collapse;margin:0.3em 0;font-size:13px;text-align:left"
_CELL = "border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top"
_TEXT = _CELL + ";white-space:pre-wrap;word-break:break-word"
_MUTED = "color:#666"
_TITLE = "margin-top:0.4em;white-space:pre-wrap"  # a section of a watch's findings


def report_html(report: Report, *, status: str | None = None) -> str:
    """The report as an HTML fragment; `status` (a watch's "running, 12 steps") goes in
    the summary line after the report's kind."""
    parts = header_parts(report)
    if status:
        parts.insert(1, status)
    counts = _counts(report)
    notes = "".join(
        f'<div style="{_MUTED}">{html_text(note)}</div>' for note in detector_notes(report)
    )
    table = "".join(
        (
            f'<div style="margin-top:0.4em;white-space:pre-wrap"><b>{html_text(title, keep_newlines=True)}</b></div>'
            if title
            else ""
        )
        + (_table(tuple(findings)) if findings else "")
        for title, findings in sections(report)
    )
    return (
        '<div class="deadweight-report">'
        f"<div><b>{html_text(' · '.join(parts))}</b>: {counts}</div>{notes}{table}</div>"
    )


def watch_html(build: Callable[[], Report], *, steps: int, running: bool) -> str:
    """A watch: its report so far (`build()`, `Watch.report`) with the steps taken.
    Never raises: a notebook shows whatever comes back, an exception as a traceback
    where the user asked for a report."""
    state = "running" if running else "closed"
    try:
        report = build()
        subject = dict(report.subject)
        # A live watch has no end record yet: that is not the killed run the text says.
        subject.pop("complete", None)
        as_of = subject.pop("steps", None)
        status = f"{state}, {steps} step{'s' if steps != 1 else ''}"
        if isinstance(as_of, int) and as_of != steps:
            status += f" (findings as of step {as_of})"
        return report_html(dataclasses.replace(report, subject=subject), status=status)
    except Exception as exc:
        message = (
            f"deadweight watch ({state}, {steps} steps): no report: {type(exc).__name__}: {exc}"
        )
        return f'<div class="deadweight-report">{html_text(_cut(message))}</div>'


def _counts(report: Report) -> str:
    if not report.findings:
        return '<span style="color:#2e7d32">no findings</span>'
    return ", ".join(
        f'<span style="{_severity_style(sev)}">{html_text(text)}</span>'
        for sev, text in count_parts(report)
    )


def _table(findings: tuple[Finding, ...]) -> str:
    head = "".join(
        f'<th style="{_CELL}">{h}</th>'
        for h in ("severity", "rule", "message", "parameters", "location")
    )
    rows = "".join(_row(f) for f in findings)
    return f'<table style="{_TABLE}"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'


def _row(finding: Finding) -> str:
    sev = finding.severity
    message = html_text(_cut(finding.message), keep_newlines=True)
    if finding.fix:
        fix = html_text(_cut(finding.fix), keep_newlines=True)
        message += f'<div style="{_MUTED}">fix: {fix}</div>'
    params = compress_names(finding.params, MAX_PARAM_NAMES) if finding.params else ""
    location = str(finding.location) if finding.location is not None else ""
    return (
        f'<tr data-severity="{html_text(sev.value)}" data-code="{html_text(finding.code)}">'
        f'<td style="{_CELL};{_severity_style(sev)}">{html_text(sev.value)}</td>'
        f'<td style="{_CELL};white-space:nowrap"><code>{html_text(finding.code)}</code> '
        f"{html_text(finding.name)}</td>"
        f'<td style="{_TEXT}">{message}</td>'
        f'<td style="{_TEXT}">{html_text(_cut(params))}</td>'
        f'<td style="{_TEXT}">{html_text(_cut(location))}</td></tr>'
    )


def _severity_style(sev: Severity) -> str:
    weight = "" if sev is Severity.INFO else ";font-weight:bold"
    return f"color:{SEVERITY_COLOUR[sev.value]}{weight}"


def _cut(text: str, limit: int = MAX_CELL_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f" … ({len(text) - limit} more characters)"
