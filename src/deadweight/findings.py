"""What deadweight reports: one `Finding` type for every check, watch, scan and lint."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class Severity(str, enum.Enum):
    """How bad a finding is. Ordered: info < warning < error."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @classmethod
    def parse(cls, value: str | Severity) -> Severity:
        if isinstance(value, Severity):
            return value
        try:
            return cls(value.lower())
        except ValueError:
            choices = ", ".join(s.value for s in cls)
            raise ValueError(f"unknown severity {value!r}; choose one of {choices}") from None


_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}


@dataclass(frozen=True)
class Location:
    """Where a finding points: the user's source line and/or the module path in the model.

    `column` (1-based, in characters) and the end of the region (`end_line`, and
    `end_column` one past the last character) are set by `deadweight lint`, whose
    findings point into source text.
    """

    file: str | None = None
    line: int | None = None
    function: str | None = None
    module: str | None = None
    column: int | None = None
    end_line: int | None = None
    end_column: int | None = None

    def __str__(self) -> str:
        parts = []
        if self.file:
            position = f":{self.line}" if self.line else ""
            if self.line and self.column:
                position += f":{self.column}"
            parts.append(self.file + position)
        if self.function:
            parts.append(f"in {self.function}")
        if self.module is not None:
            parts.append(f"(module {self.module or '<root>'})")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "file": self.file,
            "line": self.line,
            "function": self.function,
            "module": self.module,
        }
        if self.column is not None:  # only source-text findings have a region
            out.update(column=self.column, end_line=self.end_line, end_column=self.end_column)
        return out


@dataclass(frozen=True)
class Finding:
    """One problem, in terms a user can act on.

    `params` are full names as in `model.named_parameters()`; `evidence` holds the
    numbers behind the verdict (JSON-serialisable); `fix` says what to do about it.
    """

    code: str
    name: str
    severity: Severity
    message: str
    params: tuple[str, ...] = ()
    location: Location | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "name": self.name,
            "severity": self.severity.value,
            "message": self.message,
            "params": list(self.params),
            "location": self.location.to_dict() if self.location else None,
            "evidence": dict(self.evidence),
            "fix": self.fix,
        }
