"""Reporters render: a `Report` holds findings; text (rich), JSON and a notebook's HTML
are views of it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deadweight._version import __version__
from deadweight.findings import Finding, Severity

# Bumped on any incompatible change to the JSON layout; additions keep the number.
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Report:
    """Findings of one run of a deadweight command, plus what was examined."""

    kind: str  # "check", later "watch", "inspect", "lint", ...
    findings: tuple[Finding, ...]
    subject: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, kind: str, findings: Iterable[Finding], subject: dict[str, Any]) -> Report:
        ordered = sorted(findings, key=lambda f: (-f.severity.rank, f.code))
        return cls(kind, tuple(ordered), subject)

    @property
    def ok(self) -> bool:
        """True when nothing at warning level or above was found."""
        return not self.failed(Severity.WARNING)

    def failed(self, fail_on: Severity | str | None) -> bool:
        """Whether any finding is at or above `fail_on` (None never fails)."""
        if fail_on is None:
            return False
        threshold = Severity.parse(fail_on).rank
        return any(f.severity.rank >= threshold for f in self.findings)

    def counts(self) -> dict[str, int]:
        return {s.value: sum(1 for f in self.findings if f.severity is s) for s in Severity}

    def by_code(self, code: str) -> list[Finding]:
        return [f for f in self.findings if f.code == code]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "deadweight", "version": __version__},
            "kind": self.kind,
            "subject": self.subject,
            "summary": self.counts(),
            "ok": self.ok,
            "findings": [f.to_dict() for f in self.findings],
        }

    def to_json(self, indent: int | None = 2) -> str:
        """Strict JSON: NaN and Infinity (a tensor that blew up) become null, since jq and
        JavaScript reject them."""
        try:
            return json.dumps(self.to_dict(), indent=indent, default=str, allow_nan=False)
        except ValueError:
            return json.dumps(_finite(self.to_dict()), indent=indent, default=str)

    def __str__(self) -> str:
        from deadweight.report.text import render_plain

        return render_plain(self)

    def _repr_html_(self) -> str:
        """How Jupyter shows a report: a findings table (no plotly, no script)."""
        from deadweight.report.notebook import report_html

        return report_html(self)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
