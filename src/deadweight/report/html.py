"""One self-contained HTML file: summary, a filterable findings table, evidence plots.

The plots are plotly figures with plotly.js inlined once in the page, so the file
opens offline and can be mailed around. plotly is an optional dependency
(`pip install 'deadweight[html]'`); the rest of deadweight never imports it.

The renderer only draws what it is given: `Section`s, each a `Report` plus, for a
watch log, the per-step `WatchStats` behind it. Long series are downsampled to at
most `MAX_POINTS` per trace (each bucket keeps its lowest and highest point) and
every flagged step (a reset, a first non-finite value, the step an outlier began)
is kept.
"""

from __future__ import annotations

import html
import itertools
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deadweight._version import __version__
from deadweight.errors import InputError
from deadweight.findings import Finding, Severity
from deadweight.homologous import layer_key
from deadweight.output_files import OutputFile
from deadweight.registry import get_rule
from deadweight.report import SCHEMA_VERSION, Report, loss_curve, markdown
from deadweight.report.display import html_text, plotly_text
from deadweight.report.text import sections as sections_of
from deadweight.watching.watch_stats import LOG_SCHEMA_VERSION, WatchStats
from deadweight.wording import name_list

# 2000 points per trace: a 1000-pixel-wide plot shows no more, and 60 such plots
# stay well under a second of plotly layout in the browser.
MAX_POINTS = 2000
# Parameters with a trajectory plot each; the rest are named in a note. A finding
# that flags hundreds of parameters (a frozen model) would otherwise make the page slow.
MAX_TRAJECTORIES = 60
MAX_BARS = 400  # bars in one effective-bits chart (the lowest first)
# A finding's evidence shown in the table: a few screens of JSON; per-layer values of a
# 400-layer model would otherwise fill the page (the plots hold those).
MAX_EVIDENCE_CHARS = 4000
MISSING_EXTRA = "the HTML report needs plotly: pip install 'deadweight[html]'"

_SEVERITY_COLOUR = {"error": "#c62828", "warning": "#ef6c00", "info": "#1565c0"}


@dataclass
class Section:
    """One input of the report: a check, a watch run, or a checkpoint scan."""

    label: str  # the file (and run) it came from
    report: Report
    stats: WatchStats | None = None  # per-step data, for a watch log
    notes: list[str] = field(default_factory=list)  # problems met reading it


def plotly_available() -> bool:
    try:
        import plotly  # noqa: F401
    except ImportError:
        return False
    return True


def require_plotly() -> Any:
    try:
        import plotly  # noqa: F401
        import plotly.graph_objects as go
    except ImportError:
        raise InputError(MISSING_EXTRA) from None
    return go


def write_html(
    path: str | OutputFile, sections: Sequence[Section], notes: Sequence[str] = ()
) -> None:
    """The page, written whole or not at all (an existing file is replaced only once the
    page is complete); raises InputError for a path no output may be written to."""
    target = path if isinstance(path, OutputFile) else OutputFile.claim(path, "HTML report")
    target.write_text(render_html(sections, notes))


def render_html(sections: Sequence[Section], notes: Sequence[str] = ()) -> str:
    go = require_plotly()
    from plotly.offline import get_plotlyjs

    page = _Page(go)
    body: list[str] = [_summary(sections, notes)]
    rows: list[str] = []
    codes: set[str] = set()
    step0: list[str] = []
    for index, section in enumerate(sections):
        plots = page.section_plots(index, section)
        for finding in section.report.findings:
            codes.add(finding.code)
            label = section.label + (" · step 0" if finding.phase == "step 0" else "")
            rows.append(_finding_row(finding, label, plots.anchor_for(finding)))
        step0.append(_step0_section(section))
        body.append(plots.html)
    body.insert(1, _findings_table(rows, codes) + "".join(step0))
    body.append(_rule_docs(codes))
    return _PAGE.format(
        title=html_text("deadweight report: " + ", ".join(s.label for s in sections)),
        style=_STYLE,
        plotly=get_plotlyjs(),
        body="\n".join(body),
        script=_FILTER_SCRIPT,
    )


# -- summary and table ---------------------------------------------------------------------


def _summary(sections: Sequence[Section], notes: Sequence[str]) -> str:
    total = {s.value: 0 for s in Severity}
    for section in sections:
        for sev, n in section.report.counts().items():
            total[sev] += n
    counts = " ".join(
        f'<span class="count sev-{sev}" data-count="{sev}">{n} {sev}</span>'
        for sev, n in reversed(list(total.items()))
    )
    items = []
    for section in sections:
        c = section.report.counts()
        found = ", ".join(f"{n} {sev}" for sev, n in reversed(list(c.items())) if n) or "clean"
        items.append(
            f"<li><b>{html_text(section.label)}</b> — {html_text(section.report.kind)}"
            f"{html_text(_subject_line(section))}: {found}</li>"
        )
    problems = [*notes, *(f"{s.label}: {n}" for s in sections for n in s.notes)]
    problem_html = (
        '<div class="problems"><b>Read with problems</b><ul>'
        + "".join(f"<li>{html_text(p)}</li>" for p in problems)
        + "</ul></div>"
        if problems
        else ""
    )
    return (
        '<section id="summary"><h1>deadweight report</h1>'
        f'<p class="counts">{counts}</p><ul class="inputs">{"".join(items)}</ul>'
        f"{problem_html}"
        f'<p class="meta">deadweight {html.escape(__version__)} · report schema '
        f"{SCHEMA_VERSION} · watch log schema {LOG_SCHEMA_VERSION}</p></section>"
    )


def _subject_line(section: Section) -> str:
    s = section.report.subject
    parts = []
    if section.stats is not None:
        parts.append(f"{section.stats.steps} steps, {len(section.stats.params)} parameters")
        if not section.stats.complete:
            parts.append("no end record (killed or still running)")
    elif "parameters" in s:
        parts.append(f"{s['parameters']} parameters")
    if section.report.kind == "check":
        for key, label in (("model", "model"), ("optimizer", "optimizer"), ("loss", "loss")):
            value = s.get(key)
            if isinstance(value, float):
                parts.append(f"{label} {value:.4g}")
            elif value is not None:
                parts.append(f"{label} {value}")
    if s.get("checkpoints"):
        parts.append(", ".join(map(str, s["checkpoints"])))
    if section.report.kind == "diff":
        parts.append(f"{s.get('a')} → {s.get('b')}, {s.get('compared')} tensors compared")
        if s.get("names_note"):
            parts.append(str(s["names_note"]))
    if s.get("scheme"):
        parts.append(f"scheme {s['scheme']}")
    return f" ({'; '.join(parts)})" if parts else ""


def _finding_row(finding: Finding, label: str, anchor: str | None) -> str:
    sev = finding.severity.value
    params = ", ".join(finding.params[:6]) + (
        f" … {len(finding.params) - 6} more" if len(finding.params) > 6 else ""
    )
    evidence = f'<a href="#{anchor}">plot</a>' if anchor else ""
    if finding.evidence:
        evidence += (
            f"<details><summary>data</summary><pre>{_evidence_text(finding)}</pre></details>"
        )
    evidence = evidence or "—"
    code = html_text(finding.code)  # a saved report is text from elsewhere
    return (
        f'<tr data-severity="{sev}" data-code="{code}">'
        f'<td class="sev-{sev}">{sev}</td>'
        f'<td><a href="#rule-{code}">{code}</a> {html_text(finding.name)}</td>'
        f"<td>{html_text(finding.message, keep_newlines=True)}</td><td>{html_text(params)}</td>"
        f"<td>{html_text(label)}</td><td>{evidence}</td></tr>"
    )


def _step0_section(section: Section) -> str:
    """A watch's step-0 check (`deadweight run`): what it found, next to what the watch
    saw while training; empty for any other report."""
    titled = [(t, f) for t, f in sections_of(section.report) if t is not None]
    if not titled:
        return ""
    (title, first), (later_title, _) = titled[0], titled[-1]
    head, _, note = title.partition("\n  note: ")
    rows = "".join(_finding_row(f, section.label + " · step 0", None) for f in first)
    table = (
        '<table class="step0-table"><thead><tr><th>severity</th><th>rule</th><th>message</th>'
        "<th>parameters</th><th>input</th><th>evidence</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
        if rows
        else ""
    )
    return (
        f'<section class="step0"><h2>{html_text(section.label)}: {html_text(head)}</h2>'
        + (f'<p class="note">{html_text(note)}</p>' if note else "")
        + f"{table}<p>{html_text(later_title)} (in the table above)</p></section>"
    )


def _evidence_text(finding: Finding) -> str:
    """A finding's evidence as escaped JSON, cut at `MAX_EVIDENCE_CHARS`."""
    text = json.dumps(finding.evidence, indent=1, default=str, allow_nan=True)
    if len(text) > MAX_EVIDENCE_CHARS:
        text = text[:MAX_EVIDENCE_CHARS] + f"\n… ({len(text) - MAX_EVIDENCE_CHARS} more characters)"
    return html.escape(text)


def _findings_table(rows: list[str], codes: set[str]) -> str:
    sev_options = "".join(f'<option value="{s.value}">{s.value}</option>' for s in Severity)
    code_options = "".join(
        f'<option value="{html_text(c)}">{html_text(c)}</option>' for c in sorted(codes)
    )
    body = "".join(rows) or '<tr class="empty"><td colspan="6">no findings</td></tr>'
    return (
        '<section id="findings"><h2>Findings</h2><div class="filters">'
        '<label>severity <select id="filter-severity"><option value="">all</option>'
        f"{sev_options}</select></label> "
        '<label>rule <select id="filter-rule"><option value="">all</option>'
        f'{code_options}</select></label> <span id="shown"></span></div>'
        '<table id="findings-table"><thead><tr><th>severity</th><th>rule</th><th>message</th>'
        "<th>parameters</th><th>input</th><th>evidence</th></tr></thead>"
        f"<tbody>{body}</tbody></table></section>"
    )


def _rule_docs(codes: Iterable[str]) -> str:
    """The pages of the rules found; nothing at all (not an empty heading) when none was."""
    found = sorted(codes)
    if not found:
        return ""
    parts = ['<section id="rules"><h2>Rules</h2>']
    for raw in found:
        code = html_text(raw)
        try:
            rule = get_rule(raw)
        except (KeyError, ValueError):  # a saved report from a newer deadweight
            parts.append(f'<div id="rule-{code}"><h3>{code}</h3><p>not known to this version')
            parts.append("</p></div>")
            continue
        parts.append(
            f'<div class="rule" id="rule-{code}"><h3>{code} {html.escape(rule.name)}</h3>'
            f"<p>{html.escape(rule.summary)}</p>"
        )
        for heading, text in rule.sections().items():
            parts.append(f"<h4>{html.escape(heading)}</h4>{markdown.to_html(text.strip())}")
        parts.append("</div>")
    parts.append("</section>")
    return "".join(parts)


# -- plots ---------------------------------------------------------------------------------


@dataclass
class _Plots:
    html: str = ""
    by_finding: dict[int, str] = field(default_factory=dict)  # id(finding) -> div id
    by_param: dict[str, str] = field(default_factory=dict)

    def anchor_for(self, finding: Finding) -> str | None:
        if id(finding) in self.by_finding:
            return self.by_finding[id(finding)]
        for name in finding.params:
            if name in self.by_param:
                return self.by_param[name]
        return None


class _Page:
    def __init__(self, go: Any) -> None:
        self.go = go
        self.count = 0

    def figure_html(self, figure: Any, div_id: str, title: str, height: int = 360) -> str:
        import plotly.io as pio

        # plotly reads its own mini-HTML in every string it draws (a tensor named
        # `<a href=...>` would be a live link): the title, like every name, as text.
        figure.update_layout(
            title=plotly_text(title),
            height=height,
            margin={"l": 60, "r": 20, "t": 50, "b": 40},
            template="none",
        )
        self.count += 1
        return (
            f'<div class="plot" data-plot="{div_id}">'
            + pio.to_html(
                figure,
                full_html=False,
                include_plotlyjs=False,
                div_id=div_id,
                config={"displaylogo": False, "responsive": True},
            )
            + "</div>"
        )

    def section_plots(self, index: int, section: Section) -> _Plots:
        plots = _Plots()
        parts: list[str] = []
        kind = section.report.kind
        prefix = f"s{index}"
        parts.extend(self._sibling_values(prefix, section.report, plots))
        if section.stats is not None:
            parts.extend(self._watch(prefix, section, plots))
        if kind == "inspect":
            parts.extend(self._inspect(prefix, section.report, plots))
        if kind == "diff":
            parts.extend(self._diff(prefix, section.report, plots))
        if kind == "trend":
            parts.extend(self._trend(prefix, section.report, plots))
        parts.extend(self._per_parameter(prefix, section.report, plots))
        if not parts:
            parts.append("<p>No per-step or per-tensor data in this input to plot.</p>")
        title = f"{html_text(section.label)} ({html_text(kind)})"
        plots.html = (
            f'<section class="input" id="{prefix}"><h2>{title}</h2>{"".join(parts)}</section>'
        )
        return plots

    # -- watch logs ------------------------------------------------------------------------

    def _watch(self, prefix: str, section: Section, plots: _Plots) -> list[str]:
        stats = section.stats
        assert stats is not None
        findings = section.report.findings
        out: list[str] = [self._loss(prefix, stats, findings, plots)]
        flagged_names: list[str] = []
        for finding in findings:
            for name in finding.params:
                if name in stats.params and name not in flagged_names:
                    flagged_names.append(name)
        reset_steps = sorted({r.step for r in stats.resets})
        # A finding that measured a drift (DW302) draws it on the parameter's trajectory.
        drift = {
            name: f
            for f in findings
            for name in f.params
            if isinstance(f.evidence.get("drift_per_step"), (int, float))
        }
        # Steps a finding points at (where an outlier began) survive the downsampling.
        marked: dict[str, set[int]] = {}
        for f in findings:
            since = f.evidence.get("since_step")
            if isinstance(since, int):
                for name in f.params:
                    marked.setdefault(name, set()).add(since)
        for name in flagged_names[:MAX_TRAJECTORIES]:
            div = f"{prefix}-p-{_slug(name)}"
            keep = set(reset_steps) | marked.get(name, set())
            out.append(self._trajectory(div, stats, name, keep, reset_steps, drift.get(name)))
            plots.by_param[name] = div
        rest = flagged_names[MAX_TRAJECTORIES:]
        if rest:
            out.append(
                f'<p class="note">{len(rest)} more flagged parameters have no plot here '
                f"(the first {MAX_TRAJECTORIES} do): {html_text(', '.join(rest[:50]))}"
                f"{' …' if len(rest) > 50 else ''}</p>"
            )
        return out

    def _loss(
        self, prefix: str, stats: WatchStats, findings: Sequence[Finding], plots: _Plots
    ) -> str:
        """The loss per step; its plateau marked for the findings of a rule that declares
        the `loss-plateau` plot (DW301: parameters that never moved)."""
        if not stats.loss_recorded:
            return (
                '<p class="note" data-note="no-loss">The loss was not recorded in this run '
                "(the loop did not call <code>Watch.log_loss</code>, or the log was written "
                "before deadweight recorded it): there is no loss curve to draw.</p>"
            )
        curve = loss_curve.per_step(stats.loss_steps, stats.loss_values)
        notes = []
        if curve.averaged_steps:
            notes.append(
                f"{curve.averaged_steps} steps have several losses (gradient accumulation, "
                "or several backward calls per step): their mean is drawn."
            )
        if curve.nonfinite:
            notes.append(f"{curve.nonfinite} loss values were NaN or infinite and are left out.")
        if not len(curve.steps):
            return "".join(f'<p class="note">{html_text(n)}</p>' for n in notes)
        never_moved = [f for f in findings if "loss-plateau" in _declared_plots(f)]
        codes = "/".join(sorted({f.code for f in never_moved}))
        plateau = loss_curve.find_plateau(curve) if never_moved else None
        reset_steps = sorted({r.step for r in stats.resets})
        keep = set(reset_steps) | ({plateau.start_step} if plateau else set())
        x, y = curve.steps, curve.values
        idx = downsample(y, x, keep)
        go = self.go
        figure = go.Figure()
        figure.add_trace(
            go.Scatter(x=x[idx], y=_json_floats(y[idx]), name="loss", mode="lines",
                       line={"color": "#90a4ae"})
        )  # fmt: skip
        window = loss_curve.smoothing_window(len(y))
        if window > 1:
            smoothed = loss_curve.smooth(y, window)
            figure.add_trace(
                go.Scatter(x=x[idx], y=_json_floats(smoothed[idx]), mode="lines",
                           name=f"smoothed ({window} steps)", line={"color": "#1565c0"})
            )  # fmt: skip
        title = "loss per step"
        if plateau is not None:
            names = [n for f in never_moved for n in f.params]
            label = f"plateau from step {plateau.start_step} ({codes}: {len(names)} never moved)"
            figure.add_vrect(
                x0=plateau.start_step, x1=plateau.end_step, fillcolor="#c62828",
                opacity=0.08, line_width=0,
            )  # fmt: skip
            figure.add_trace(
                go.Scatter(
                    x=[plateau.start_step, plateau.end_step],
                    y=[plateau.level, plateau.level],
                    name=label,
                    mode="lines+markers",
                    line={"color": "#c62828", "dash": "dash"},
                    hovertext=[f"final level {plateau.level:.4g} ± {plateau.tolerance:.2g}"] * 2,
                )
            )
            title += f": {label}"
            notes.append(
                f"The loss stays within {plateau.tolerance:.3g} of its final level "
                f"{plateau.level:.4g} from step {plateau.start_step} on, while "
                f"{name_list(names)} never moved."
            )
        elif never_moved:
            notes.append(f"Parameters never moved ({codes}), yet the loss shows no plateau.")
        for step in reset_steps:
            figure.add_vline(x=step, line={"color": "#8e24aa", "dash": "dot"})
        figure.update_xaxes(title="optimizer step")
        div = f"{prefix}-loss"
        return self.figure_html(figure, div, title) + "".join(
            f'<p class="note">{html_text(n)}</p>' for n in notes
        )

    def _sibling_values(self, prefix: str, report: Report, plots: _Plots) -> list[str]:
        """Bars of the per-layer values a finding carries (DW307 of a watch, live or saved)."""
        out = []
        for k, finding in enumerate(report.findings):
            values = finding.evidence.get("values")
            if isinstance(values, dict) and len(values) > 1:
                div = f"{prefix}-f{k}-layers"
                title = (
                    f"{finding.code}: {finding.evidence.get('template', 'siblings')} "
                    f"({finding.evidence.get('statistic', 'value')})"
                )
                out.append(self._layer_bars(div, title, values, set(finding.params)))
                plots.by_finding[id(finding)] = div
        return out

    def _trajectory(
        self,
        div: str,
        stats: WatchStats,
        name: str,
        keep: set[int],
        reset_steps: list[int],
        drift: Finding | None,
    ) -> str:
        from plotly.subplots import make_subplots

        track = stats.params[name]
        s = track.series
        steps = np.asarray(s.steps, dtype=np.int64)
        keep_steps = keep | set(track.nonfinite.values())
        has_values = bool(s.value) and len(s.value) == len(s.steps)
        if has_values:
            primary = np.array([_first(v) for v in s.value], dtype=np.float64)
            primary_label = "value" if track.numel == 1 else "first element"
        else:
            primary = _floats(s.param_norm)
            primary_label = "‖θ‖"
        figure = make_subplots(
            rows=2,
            cols=1,
            shared_xaxes=True,
            vertical_spacing=0.08,
            subplot_titles=(f"{primary_label} per step", "update size against gradient size"),
        )
        go = self.go
        idx = downsample(primary, steps, keep_steps)
        figure.add_trace(
            go.Scatter(
                x=steps[idx], y=_json_floats(primary[idx]), name=primary_label, mode="lines"
            ),
            row=1,
            col=1,
        )
        if drift is not None and len(steps):
            # A drift is measured as a norm; a plotted element drifts 1/√numel of it.
            per_norm = 1.0 if not has_values else 1.0 / math.sqrt(max(1, track.numel))
            self._drift_lines(figure, drift, steps, primary, per_norm)
        self._update_panel(figure, s.update_norm, s.grad_rms, steps, keep_steps)
        for step in reset_steps:
            figure.add_vline(x=step, line={"color": "#8e24aa", "dash": "dot"})
        if reset_steps:
            figure.add_trace(
                go.Scatter(
                    x=reset_steps,
                    y=[None] * len(reset_steps),
                    name="optimizer-state reset",
                    mode="markers",
                    marker={"color": "#8e24aa"},
                ),
                row=1,
                col=1,
            )
        return self.figure_html(figure, div, name, height=480)

    def _drift_lines(
        self,
        figure: Any,
        finding: Finding,
        steps: np.ndarray,
        primary: np.ndarray,
        per_norm: float,
    ) -> None:
        """The measured drift (`drift_per_step` of the finding's evidence) as a straight
        line from the first value, and the drift its rule predicts
        (`predicted_drift_per_step`, its assumption in `predicted_by`) where it has one: a
        finding saved before DW302 carried a prediction draws only the measured line."""
        ev = finding.evidence
        rate = float(ev["drift_per_step"]) * per_norm
        first = ev.get("first_value")
        start = float(first) if isinstance(first, (int, float)) else float(primary[0])
        last = ev.get("last_value")
        if not isinstance(last, (int, float)):
            last = float(primary[-1])  # a plotted element of a larger parameter
        sign = -1.0 if last < start else 1.0
        ends = np.array([steps[0], steps[-1]], dtype=np.float64)
        code = plotly_text(finding.code)  # evidence and code are text from a file: escaped
        lines = [(rate, f"measured drift {rate:.3g}/step ({code})", {"dash": "dash"})]
        predicted = ev.get("predicted_drift_per_step")
        if isinstance(predicted, (int, float)) and math.isfinite(predicted):
            per_step = float(predicted) * per_norm
            label = f"predicted {per_step:.3g}/step"
            if ev.get("predicted_by"):
                label += f": {plotly_text(ev['predicted_by'])}"
            lines.append((per_step, label, {"dash": "dot", "color": "#2e7d32"}))
        for per_step, label, line in lines:
            figure.add_trace(
                self.go.Scatter(
                    x=ends,
                    y=start + sign * per_step * (ends - ends[0]),
                    name=label,
                    mode="lines",
                    line=line,
                ),
                row=1,
                col=1,
            )

    def _update_panel(
        self,
        figure: Any,
        update_norm: Sequence[float | None],
        grad_rms: Sequence[float | None],
        steps: np.ndarray,
        keep_steps: set[int],
    ) -> None:
        """The lower panel: the update's size against the gradient's, on a log axis
        unless one of them is 0 at every record."""
        measured = []
        for label, series in (("‖update‖", update_norm), ("grad RMS", grad_rms)):
            y = _floats(series)
            if np.isfinite(y).any():  # update norms exist only where a copy was taken
                measured.append((label, y))
        # A log axis hides zeros; when nothing is above 0 (a parameter that never got a
        # gradient), the axis is linear and the zeros are drawn.
        log_axis = any((y > 0).any() for _, y in measured)
        zeros = [label for label, y in measured if not (y > 0).any()]
        for label, y in measured:
            if log_axis and label in zeros:
                continue
            if log_axis:
                y = np.where(y > 0, y, math.nan)
            pick = downsample(y, steps, keep_steps)
            figure.add_trace(
                self.go.Scatter(x=steps[pick], y=_json_floats(y[pick]), name=label, mode="lines"),
                row=2,
                col=1,
            )
        if log_axis:
            figure.update_yaxes(type="log", row=2, col=1)
        if zeros:
            figure.layout.annotations[
                1
            ].text = f"update size against gradient size ({' and '.join(zeros)}: 0 at every record)"
        elif log_axis:
            figure.layout.annotations[1].text = "update size against gradient size (log)"

    def _per_parameter(self, prefix: str, report: Report, plots: _Plots) -> list[str]:
        """Bars of the gradient norms a finding measured per parameter (check's DW103 to
        DW105 evidence: `params: {name: {grad_norm, param_norm, ...}}`), on a log axis."""
        out = []
        for k, finding in enumerate(report.findings):
            per = finding.evidence.get("params")
            if not isinstance(per, dict) or id(finding) in plots.by_finding:
                continue
            rows = [
                (str(name), float(v["grad_norm"]), v.get("param_norm"))
                for name, v in per.items()
                if isinstance(v, dict)
                and isinstance(v.get("grad_norm"), (int, float))
                and math.isfinite(v["grad_norm"])
            ][:MAX_BARS]
            if not rows:
                continue
            div = f"{prefix}-f{k}-grads"
            # A log axis drops zeros (an exactly-zero gradient, DW103): linear then.
            log_axis = all(g > 0 for _, g, _ in rows)
            figure = self.go.Figure(
                self.go.Bar(
                    y=[plotly_text(n) for n, _, _ in rows],
                    x=[g for _, g, _ in rows],
                    orientation="h",
                    marker={"color": _SEVERITY_COLOUR[finding.severity.value]},
                    text=[f"{g:.2g}" for _, g, _ in rows],
                    textposition="outside",
                    hovertext=[plotly_text(f"‖θ‖ {pn}") for _, _, pn in rows],
                    name="‖grad‖",
                )
            )
            figure.update_yaxes(autorange="reversed", automargin=True)
            figure.update_xaxes(title="gradient norm", type="log" if log_axis else "linear")
            title = f"{finding.code} {finding.name}: gradient norm per parameter"
            out.append(self.figure_html(figure, div, title, height=_bar_height(len(rows))))
            plots.by_finding[id(finding)] = div
        return out

    def _layer_bars(self, div: str, title: str, values: dict[str, Any], flagged: set[str]) -> str:
        names = sorted(values, key=_natural)
        colours = ["#c62828" if n in flagged else "#90a4ae" for n in names]
        ys = [v if isinstance(v, (int, float)) and math.isfinite(v) else None for v in
              (values[n] for n in names)]  # fmt: skip
        labels = [plotly_text(_layer_label(n)) for n in names]
        figure = self.go.Figure(
            self.go.Bar(
                x=labels,
                y=ys,
                marker={"color": colours},
                text=[
                    f"{v:.4g}" if n in flagged and v is not None else ""
                    for n, v in zip(names, ys, strict=True)
                ],
                textposition="outside",
                hovertext=[plotly_text(n) for n in names],
            )
        )
        figure.update_xaxes(type="category", title="layer")
        return self.figure_html(figure, div, title)

    # -- checkpoints -----------------------------------------------------------------------

    def _inspect(self, prefix: str, report: Report, plots: _Plots) -> list[str]:
        out: list[str] = []
        tensors = report.subject.get("tensors") or {}
        for k, finding in enumerate(report.findings):
            # A layer outlier saved before its evidence carried the `values` of every
            # layer (`_sibling_values` draws those): the values from the tensor table.
            ev = finding.evidence
            if "values" in ev or not {"checkpoint", "template", "statistic"} <= ev.keys():
                continue
            rows = tensors.get(ev.get("checkpoint")) or []
            values = _homologous(rows, str(ev.get("template", "")), str(ev.get("statistic")))
            if len(values) > 1:
                div = f"{prefix}-f{k}-layers"
                title = f"{finding.code}: {ev.get('template')} ({ev.get('statistic')})"
                out.append(self._layer_bars(div, title, values, set(finding.params)))
                plots.by_finding[id(finding)] = div
        # Findings that judged a tensor's quantization (DW403) are marked on its chart.
        quantized = [f for f in report.findings if "effective_bits" in f.evidence]
        quant = report.subject.get("quantization") or {}
        for c, (path, per_tensor) in enumerate(quant.items()):
            bits = sorted(
                (
                    (name, q["effective_bits"])
                    for name, q in per_tensor.items()
                    if isinstance(q.get("effective_bits"), (int, float))
                    and math.isfinite(q["effective_bits"])
                ),
                key=lambda item: item[1],
            )
            if not bits:
                continue
            shown = bits[:MAX_BARS]
            flagged = {
                f"{n} with {f.evidence['quantized_with']}"
                if f.evidence.get("quantized_with")
                else n
                for f in quantized
                for n in f.params
            }
            div = f"{prefix}-bits-{c}"
            figure = self.go.Figure(
                self.go.Bar(
                    y=[plotly_text(n) for n, _ in shown],
                    x=[b for _, b in shown],
                    orientation="h",
                    marker={"color": ["#c62828" if n in flagged else "#90a4ae" for n, _ in shown]},
                )
            )
            figure.update_yaxes(autorange="reversed", automargin=True)
            figure.update_xaxes(title="effective bits of the bulk")
            title = f"effective bits per tensor under {report.subject.get('scheme')}: {path}"
            if len(bits) > MAX_BARS:
                title += f" (lowest {MAX_BARS} of {len(bits)})"
            out.append(self.figure_html(figure, div, title, height=_bar_height(len(shown))))
            for f in quantized:
                if f.evidence.get("checkpoint") == path:
                    plots.by_finding.setdefault(id(f), div)
        return out

    def _diff(self, prefix: str, report: Report, plots: _Plots) -> list[str]:
        movers = report.subject.get("top_movers") or []
        out: list[str] = []
        if movers:
            div = f"{prefix}-movers"
            figure = self.go.Figure(
                self.go.Bar(
                    y=[plotly_text(m["name"]) for m in movers],
                    x=[m["relative_change"] for m in movers],
                    orientation="h",
                    marker={"color": "#1565c0"},
                )
            )
            figure.update_yaxes(autorange="reversed", automargin=True)
            figure.update_xaxes(title="relative change ‖b − a‖ / ‖a‖")
            title = f"top movers: {report.subject.get('a')} → {report.subject.get('b')}"
            out.append(self.figure_html(figure, div, title))
            for f in report.findings:
                plots.by_finding[id(f)] = div
        return out

    def _trend(self, prefix: str, report: Report, plots: _Plots) -> list[str]:
        s = report.subject
        steps = s.get("steps") or []
        values = s.get("values") or {}
        flagged = {n for f in report.findings for n in f.params}
        names = [n for n in values if n in flagged] or list(values)
        out: list[str] = []
        if not names:
            return out
        x = [st if st is not None else i for i, st in enumerate(steps)]
        figure = self.go.Figure()
        for name in names[:MAX_TRAJECTORIES]:
            figure.add_trace(
                self.go.Scatter(x=x, y=values[name], name=plotly_text(name), mode="lines+markers")
            )
        figure.update_xaxes(title="step (from the file names)")
        div = f"{prefix}-trend"
        out.append(self.figure_html(figure, div, "single-element tensors over the checkpoints"))
        for f in report.findings:
            plots.by_finding[id(f)] = div
        return out


def _declared_plots(finding: Finding) -> tuple[str, ...]:
    """The figures the finding's rule declares it is drawn on; none for a code this
    version does not know (a report saved by a newer one)."""
    try:
        return get_rule(finding.code).plots
    except (KeyError, ValueError):
        return ()


def downsample(y: np.ndarray, steps: np.ndarray, keep_steps: Iterable[int] = ()) -> np.ndarray:
    """Indices of at most about `MAX_POINTS` points: each bucket's lowest and highest,
    the first and last, and for every step in `keep_steps` the records at and before it
    (`steps` ascending)."""
    n = len(y)
    if n <= MAX_POINTS:
        return np.arange(n)
    buckets = MAX_POINTS // 2
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    finite = np.where(np.isfinite(y), y, np.nan)
    keep = [0, n - 1]
    for lo, hi in itertools.pairwise(edges):
        chunk = finite[lo:hi]
        if hi <= lo or np.isnan(chunk).all():
            keep.append(int(lo))
            continue
        keep.append(int(lo + np.nanargmin(chunk)))
        keep.append(int(lo + np.nanargmax(chunk)))
    wanted = np.fromiter(keep_steps, dtype=np.int64)
    if len(wanted):
        # The record at a flagged step, or the two around it when it fell between records.
        at = np.searchsorted(steps, wanted)
        keep.extend(np.clip(at, 0, n - 1).tolist())
        keep.extend(np.clip(at - 1, 0, n - 1).tolist())
    return np.unique(np.asarray(keep, dtype=np.int64))


def _homologous(rows: list[dict[str, Any]], template: str, statistic: str) -> dict[str, float]:
    """The rows of the layers `template` stands for, by the key the rule grouped them by:
    no regex made of a name (a name of literal `{}`s once made one that never finished)."""
    if "{}" not in template:
        return {}
    out = {}
    for row in rows:
        key = layer_key(str(row.get("name")))
        if key is None or key[0] != template or not row.get("analysed"):
            continue
        value = _statistic(row, statistic)
        if value is not None:
            out[row["name"]] = value
    return out


def _statistic(row: dict[str, Any], statistic: str) -> float | None:
    if statistic == "value":
        return row.get("min") if row.get("numel") == 1 else None
    if statistic.lower() == "rms":  # DW402 writes "RMS"
        mean, std = row.get("mean"), row.get("std")
        if isinstance(mean, (int, float)) and isinstance(std, (int, float)):
            return math.sqrt(mean * mean + std * std)
        return None
    value = row.get(statistic)
    return float(value) if isinstance(value, (int, float)) else None


def _floats(values: Sequence[float | None]) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)


def _json_floats(values: np.ndarray) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in values]


def _first(values: Sequence[float | None]) -> float:
    return math.nan if not values or values[0] is None else float(values[0])


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)


_DIGITS = re.compile(r"([0-9]+)")


def _natural(name: str) -> list[Any]:
    # A run of digits orders as its number (its length without leading zeros, then its
    # digits): never converted, so a name's 5000-digit run costs nothing.
    return [(len(p.lstrip("0")), p.lstrip("0")) if i % 2 else p
            for i, p in enumerate(_DIGITS.split(name))]  # fmt: skip


def _layer_label(name: str) -> str:
    numbers = _DIGITS.findall(name)
    return numbers[0] if len(numbers) == 1 else name


def _bar_height(bars: int) -> int:
    return max(360, min(12000, 80 + 16 * bars))


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{style}</style>
<script>{plotly}</script>
</head><body>
{body}
<script>{script}</script>
</body></html>
"""

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; max-width: 1200px; color: #222; }
table { border-collapse: collapse; width: 100%; font-size: 14px; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 6px; text-align: left; vertical-align: top; }
.sev-error { color: #c62828; font-weight: bold; } .sev-warning { color: #ef6c00; font-weight: bold; }
.sev-info { color: #1565c0; } .count { margin-right: 1em; font-size: 18px; }
.problems { background: #fff3e0; padding: 0.5em 1em; border-left: 4px solid #ef6c00; }
.note { color: #555; font-style: italic; } .meta { color: #777; font-size: 13px; }
pre { white-space: pre-wrap; background: #f6f8fa; padding: 0.5em; }
code { background: #f6f8fa; } pre code { background: none; }
.plot { margin: 1em 0; } .filters { margin: 0.5em 0; }
"""

# The table filter: hide rows whose severity or rule does not match the two selects.
_FILTER_SCRIPT = """
(function () {
  var sev = document.getElementById('filter-severity');
  var rule = document.getElementById('filter-rule');
  var shown = document.getElementById('shown');
  function apply() {
    var rows = document.querySelectorAll('#findings-table tbody tr[data-code]');
    var n = 0;
    rows.forEach(function (row) {
      var ok = (!sev.value || row.dataset.severity === sev.value) &&
               (!rule.value || row.dataset.code === rule.value);
      row.style.display = ok ? '' : 'none';
      if (ok) { n += 1; }
    });
    shown.textContent = n + ' of ' + rows.length + ' shown';
  }
  sev.addEventListener('change', apply);
  rule.addEventListener('change', apply);
  apply();
})();
"""
