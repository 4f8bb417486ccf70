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

    @classmethod
    def from_dict(cls, data: Any) -> Location | None:
        """A location as `to_dict` wrote it; fields of the wrong type are left out."""
        if not isinstance(data, dict):
            return None

        def text(key: str) -> str | None:
            value = data.get(key)
            return value if isinstance(value, str) else None

        def number(key: str) -> int | None:
            value = data.get(key)
            return value if type(value) is int and value >= 0 else None

        return cls(
            file=text("file"),
            line=number("line"),
            function=text("function"),
            module=text("module"),
            column=number("column"),
            end_line=number("end_line"),
            end_column=number("end_column"),
        )

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
    # When, for a watch: "step 0" for what its step-0 check found (`deadweight run`),
    # None for what the watch saw while training.
    phase: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "code": self.code,
            "name": self.name,
            "severity": self.severity.value,
            "message": self.message,
            "params": list(self.params),
            "location": self.location.to_dict() if self.location else None,
            "evidence": dict(self.evidence),
            "fix": self.fix,
        }
        if self.phase is not None:
            out["phase"] = self.phase
        return out

    @classmethod
    def from_dict(cls, data: Any, *, phase: str | None = None) -> Finding:
        """A finding as `to_dict` wrote it, read back from a log: every field is checked
        (a log is untrusted input); ValueError says what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("a finding is not a table")
        texts = {k: data.get(k) for k in ("code", "name", "message", "fix")}
        for key in ("code", "name", "message"):
            if not isinstance(texts[key], str) or not texts[key]:
                raise ValueError(f"a finding's {key} is not text")
        params = data.get("params", [])
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise ValueError("a finding's params are not a list of names")
        evidence = data.get("evidence", {})
        if not isinstance(evidence, dict):
            raise ValueError("a finding's evidence is not a table")
        return cls(
            code=texts["code"],  # type: ignore[arg-type]
            name=texts["name"],  # type: ignore[arg-type]
            severity=Severity.parse(str(data.get("severity", ""))),
            message=texts["message"],  # type: ignore[arg-type]
            params=tuple(params),
            location=Location.from_dict(data.get("location")),
            evidence=evidence,
            fix=texts["fix"] if isinstance(texts["fix"], str) else "",
            phase=phase,
        )
