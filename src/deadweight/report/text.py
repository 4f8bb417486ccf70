"""Terminal rendering with rich."""

from __future__ import annotations

import io
import re
import sys
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from deadweight.findings import Finding, Severity
from deadweight.homologous import MAX_INDEX_DIGITS
from deadweight.report.display import safe_text

if TYPE_CHECKING:  # report/__init__.py imports this module lazily
    from deadweight.report import Report

_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
_MAX_NAMES = 8
_MAX_NESTED = 2  # per-parameter evidence shown in the terminal; JSON has it all
# Items of a list shown in the terminal (the first ones and the last): a trend over 10,000
# saves put every value and step in its finding, 1,800 lines of them.
_MAX_ITEMS = 8
PLAIN_WIDTH = 100  # columns of `str(report)` outside a notebook
# Findings drawn as panels in the terminal; the rest are counted by code on one line. Rich
# draws a panel in about 2.5 ms: 10,000 of them took 25-50 s, and nobody reads them there.
MAX_PANELS = 200


def render(report: Report, console: Console | None = None) -> None:
    # In a notebook rich draws HTML at the notebook's width (JUPYTER_COLUMNS, else 115
    # columns); a kernel rich does not recognise would get 80 columns of plain text.
    console = console or Console(force_jupyter=True if in_notebook() else None)
    console.print(_header(report))
    panels = 0
    notes = report.subject.get("notes")
    if isinstance(notes, list):
        for note in notes:
            console.print(Text(safe_text(f"note: {note}")))
    for title, findings in sections(report):
        if title is not None:  # the note in it is safe_text already
            console.print(Text(safe_text(title, keep_newlines=True), style="bold"))
        unshown: Counter[str] = Counter()
        for finding in findings:
            if finding.location is not None and finding.location.column is not None:
                # source findings print like compiler diagnostics so editors can jump to them
                console.print(diagnostic_line(finding), soft_wrap=True)
            elif panels < MAX_PANELS:
                console.print(_finding_panel(finding))
                panels += 1
            else:
                unshown[finding.code] += 1
        if unshown:
            counts = ", ".join(f"{code} x{n}" for code, n in sorted(unshown.items()))
            console.print(Text(
                safe_text(f"… and {unshown.total()} more finding(s) not drawn here ({counts}); "
                          "--format json lists every one"), style="bold"))  # fmt: skip
    console.print(_footer(report))


def sections(report: Report) -> list[tuple[str | None, list[Finding]]]:
    """The findings in the order shown, under a title where a watch report has the
    step-0 check of `deadweight run`: first what that check found, then what the watch
    saw while training. One untitled section otherwise."""
    step0 = report.subject.get("step0") if report.kind == "watch" else None
    if not isinstance(step0, dict):
        return [(None, list(report.findings))]
    first = [f for f in report.findings if f.phase == "step 0"]
    later = [f for f in report.findings if f.phase != "step 0"]
    how = {
        "replayed": "deadweight.check on the first training batch",
        "structure-only": "deadweight.check on the first training batch, with a stand-in loss",
        "from-backward": "what the script's first backward proves",
    }.get(str(step0.get("mode")), "not run")
    title = f"At step 0 ({how}): {len(first) or 'no'} finding{'s' if len(first) != 1 else ''}"
    note = step0.get("note")
    if isinstance(note, str) and note:
        title += f"\n  note: {safe_text(note)}"  # its own line breaks shown as \\n
    return [(title, first), (f"While training: {len(later) or 'no'} finding"
                             f"{'s' if len(later) != 1 else ''}", later)]  # fmt: skip


def diagnostic_line(finding: Finding) -> Text:
    """`path:line:col: DW501 forward-gradient-cut: message`, one line.

    Every part is shown as text (`safe_text`): a file name or a saved report can hold
    markup or escape sequences."""
    loc = finding.location
    assert loc is not None
    text = Text(safe_text(f"{loc.file}:{loc.line}:{loc.column}: "), style="bold")
    text.append(safe_text(finding.code), style=_STYLE[finding.severity])
    text.append(safe_text(f" {finding.name}: {finding.message}"))
    return text


def render_plain(report: Report, width: int | None = None) -> str:
    """The report as text: `width` columns, by default 100, in a notebook its width."""
    notebook = in_notebook()
    if width is None:
        width = Console(file=io.StringIO(), force_jupyter=True).width if notebook else PLAIN_WIDTH
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=width,
        no_color=True,
        highlight=False,
        # A console that thinks it is in Jupyter displays what it prints itself and
        # leaves its file empty; a notebook's FORCE_COLOR would add escape codes.
        force_jupyter=False,
        force_terminal=False if notebook else None,
    )
    render(report, console)
    return buffer.getvalue()


def in_notebook() -> bool:
    """Whether this process is a notebook's kernel: as rich detects Jupyter (also Colab,
    Databricks), or any running ipykernel (VS Code, Spyder's console)."""
    if Console(file=io.StringIO()).is_jupyter:
        return True
    # Looked up, never imported: outside a kernel, ipykernel is not loaded.
    kernelapp = sys.modules.get("ipykernel.kernelapp")
    app = getattr(kernelapp, "IPKernelApp", None)
    try:
        return app is not None and bool(app.initialized())
    except Exception:  # a version without traitlets' singleton API
        return False


def _header(report: Report) -> Text:
    return Text(safe_text(" · ".join(header_parts(report))), style="bold")


def header_parts(report: Report) -> list[str]:
    """`deadweight check`, the model, its parameters, ...: the report's summary line."""
    subject = report.subject
    parts = [f"deadweight {report.kind}"]
    if "model" in subject:
        parts.append(f"{subject['model']}")
    if "files" in subject:
        parts.append(f"{subject['files']} file{'s' if subject['files'] != 1 else ''}")
    if "steps" in subject:
        parts.append(f"{subject['steps']} steps")
    if subject.get("optimizers"):
        parts.append("optimizers " + ", ".join(subject["optimizers"]))
    if "parameters" in subject:
        trainable = subject.get("trainable")
        parts.append(
            f"{subject['parameters']} parameters"
            + (f" ({trainable} trainable)" if trainable is not None else "")
        )
    if subject.get("complete") is False:
        parts.append("log ends without an end record (the run was killed or is still going)")
    elif subject.get("end") and subject["end"] not in ("closed", "exited"):
        parts.append(f"run {subject['end']}")
    if subject.get("loss") is not None:
        parts.append(f"loss {subject['loss']:.6g}")
    if subject.get("optimizer"):
        parts.append(f"optimizer {subject['optimizer']}")
    if subject.get("names_note"):  # diff matched names across torch.compile's `_orig_mod.`, ...
        parts.append(str(subject["names_note"]))
    return parts


def _finding_panel(finding: Finding) -> Panel:
    style = _STYLE[finding.severity]
    table = Table.grid(padding=(0, 1))
    table.add_column(style="dim", no_wrap=True)
    table.add_column()
    table.add_row("", _folding(finding.message, keep_newlines=True))
    if finding.location and str(finding.location):
        table.add_row("where", _folding(str(finding.location)))
    if finding.params:
        table.add_row("params", _folding(compress_names(finding.params)))
    evidence = _evidence_line(finding)
    if evidence:
        table.add_row("evidence", _folding(evidence))
    if finding.fix:
        table.add_row("fix", _folding(finding.fix, keep_newlines=True))
    title = Text.assemble(
        (finding.severity.value, style), safe_text(f" {finding.code} {finding.name}")
    )
    return Panel(Group(table), title=title, title_align="left", border_style=style)


def _folding(text: str, *, keep_newlines: bool = False) -> Text:
    # Long paths have no spaces to wrap at: fold them rather than cut them off. A Text is
    # never read as markup; safe_text shows the control characters of a name.
    return Text(safe_text(text, keep_newlines=keep_newlines), overflow="fold")


def _evidence_line(finding: Finding) -> str:
    items = []
    for key, value in finding.evidence.items():
        if key in ("explained_by",) or value is None or value == [] or value == {}:
            continue
        items.append(f"{key}={_short(value)}")
    return ", ".join(items)


def _short(value: object, depth: int = 0) -> str:
    """Numbers to 3 significant digits; a long dict of per-parameter entries is cut."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        items = list(value.items())
        limit = _MAX_NESTED if depth == 0 else len(items)
        shown = ", ".join(f"{k}: {_short(v, depth + 1)}" for k, v in items[:limit])
        more = f", … {len(items) - limit} more in --format json" if len(items) > limit else ""
        return "{" + shown + more + "}"
    if isinstance(value, (list, tuple)):
        if len(value) > _MAX_ITEMS:
            head = [_short(v, depth + 1) for v in value[: _MAX_ITEMS - 2]]
            tail = _short(value[-1], depth + 1)
            return f"[{', '.join(head)}, …, {tail}] ({len(value)} in all)"
        return "[" + ", ".join(_short(v, depth + 1) for v in value) + "]"
    return str(value)


def _footer(report: Report) -> Text:
    prefix = "".join(safe_text(n) + "\n" for n in detector_notes(report))
    unread = unreadable_inputs(report)
    # "no findings" next to an input that was never read would pass for a clean result.
    missed = f"{unread} input{'s' if unread != 1 else ''} could not be read" if unread else ""
    if not report.findings:
        return Text(prefix + (missed or "no findings"), style="bold red" if unread else "green")
    text = ", ".join(part for _, part in count_parts(report)) + (f"; {missed}" if missed else "")
    return Text(prefix + text, style="bold red" if not report.ok or unread else "bold")


def unreadable_inputs(report: Report) -> int:
    """How many inputs (files, paths) a checkpoint or lint report could not read: its
    `subject["errors"]` (lint: one or more per file)."""
    errors = report.subject.get("errors")
    if not isinstance(errors, list):
        return 0
    return len({e.get("file") if isinstance(e, dict) else str(e) for e in errors})


def count_parts(report: Report) -> list[tuple[Severity, str]]:
    """`2 errors`, `1 warning`, `3 info`: each severity found, the gravest first."""
    counts = report.counts()
    parts = [
        (sev, f"{n} {sev.value}{'s' if n != 1 and sev is not Severity.INFO else ''}")
        for sev in Severity
        if (n := counts[sev.value])
    ]
    return parts[::-1]


def detector_notes(report: Report) -> list[str]:
    """One line per detector the watch disabled after an error inside deadweight."""
    return [
        f"deadweight disabled its {e.get('detector')} detector at step {e.get('step')}: "
        f"{e.get('message')}"
        for e in report.subject.get("detector_errors") or []
    ]


# A layer index, as homologous.layer_key reads one (a longer number is part of a name).
_NUMBER = re.compile(
    rf"(?<=\.)[0-9]{{1,{MAX_INDEX_DIGITS}}}(?=\.)|^[0-9]{{1,{MAX_INDEX_DIGITS}}}(?=\.)"
)


def compress_names(names: tuple[str, ...] | list[str], limit: int = _MAX_NAMES) -> str:
    """`h.0.ln.weight, h.1.ln.weight, ...` -> `h.{0-11}.ln.weight`; long lists are cut."""
    patterns: dict[str, list[int]] = defaultdict(list)
    singles: list[str] = []
    for name in names:
        numbers = _NUMBER.findall(name)
        if len(numbers) == 1:
            patterns[_NUMBER.sub("{}", name)].append(int(numbers[0]))
        else:
            singles.append(name)
    shown: list[str] = []
    for pattern, numbers in patterns.items():
        if len(numbers) == 1:
            shown.append(pattern.replace("{}", str(numbers[0])))
        else:
            shown.append(pattern.replace("{}", "{" + _ranges(sorted(numbers)) + "}"))
    shown.extend(singles)
    if len(shown) > limit:
        return ", ".join(shown[:limit]) + f" … and {len(shown) - limit} more ({len(names)} in all)"
    return ", ".join(shown)


def _ranges(numbers: list[int]) -> str:
    spans: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(spans)
