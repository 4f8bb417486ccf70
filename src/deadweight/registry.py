"""The one rule registry.

Every rule is declared once, with `@rule(...)` on the function that judges: code,
readable name, default severity, a one-line summary, the kind of measurement it
consumes, and its documentation (the function's docstring, with the headings
What it does / Why is this bad / Example / Fix). Rule modules live in
each capability's `rules` package (`RULE_PACKAGES`) and are discovered there, so
adding a rule needs no edit anywhere else.

Code families (codes are never reused or renumbered once published; retired codes
go into `RETIRED_CODES`):

    DW1xx  gradient flow, found by `deadweight.check`
    DW2xx  optimizer set-up
    DW3xx  training dynamics, found by `deadweight.watch`
    DW4xx  checkpoints, found by `deadweight inspect/diff/trend`
    DW5xx  model source, found by `deadweight lint`
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from deadweight.findings import Finding, Location, Severity

FAMILIES: dict[str, str] = {
    "1": "gradient flow (check)",
    "2": "optimizer set-up",
    "3": "training dynamics (watch)",
    "4": "checkpoints (inspect, diff, trend)",
    "5": "model source (lint)",
}

# Codes that were published and later withdrawn. They stay reserved forever so a
# user's `--ignore` written against an old version never silently means something new.
RETIRED_CODES: frozenset[str] = frozenset()

DOC_SECTIONS = ("What it does", "Why is this bad", "Example", "Fix")

_CODE = re.compile(r"^DW[1-5]\d\d$")
_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")

Judge = Callable[[Any], Iterable[Finding]]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    severity: Severity
    summary: str
    consumes: type
    doc: str
    judge: Judge
    # Figures of the report its findings are drawn on, beyond what their evidence
    # carries (`loss-plateau`: the loss curve marks where it stopped falling).
    plots: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        return FAMILIES[self.code[2]]

    @property
    def source(self) -> str:
        """The file that declares and judges this rule, from the repository's root
        (`src/deadweight/watching/rules/dynamics.py`)."""
        return "src/" + self.judge.__module__.replace(".", "/") + ".py"

    def sections(self) -> dict[str, str]:
        """The documentation split by its `## Heading` lines."""
        return _split_sections(self.doc)

    def finding(
        self,
        message: str,
        *,
        params: Sequence[str] = (),
        location: Location | None = None,
        evidence: dict[str, Any] | None = None,
        fix: str | None = None,
        severity: Severity | None = None,
    ) -> Finding:
        """A finding of this rule; severity and fix default to the rule's own."""
        return Finding(
            code=self.code,
            name=self.name,
            severity=severity or self.severity,
            message=message,
            params=tuple(params),
            location=location,
            evidence=evidence or {},
            fix=fix
            if fix is not None
            else " ".join(self.sections().get("Fix", "").split("\n\n")[0].split()),
        )


_RULES: dict[str, Rule] = {}
_loaded = False


def rule(
    *,
    code: str,
    name: str,
    severity: Severity,
    summary: str,
    consumes: type,
    plots: tuple[str, ...] = (),
) -> Callable[[Judge], Judge]:
    """Declare a rule. The decorated function turns one measurement into findings;
    `plots` names the report's figures its findings are drawn on (the report picks
    them from this, never from the rule's code)."""

    def register(judge: Judge) -> Judge:
        doc = inspect.cleandoc(judge.__doc__ or "")
        problems = []
        if not _CODE.match(code):
            problems.append(f"code {code!r} is not of the form DW[1-5]NN")
        if code in RETIRED_CODES:
            problems.append(f"code {code} is retired and may not be reused")
        if code in _RULES:
            problems.append(f"code {code} is already taken by {_RULES[code].name}")
        if not _NAME.match(name):
            problems.append(f"name {name!r} is not kebab-case")
        if any(r.name == name for r in _RULES.values()):
            problems.append(f"name {name!r} is already taken")
        missing = [s for s in DOC_SECTIONS if s not in _split_sections(doc)]
        if missing:
            problems.append(f"documentation lacks the section(s): {', '.join(missing)}")
        if problems:
            raise ValueError(f"cannot register rule {code} {name}: " + "; ".join(problems))
        _RULES[code] = Rule(code, name, severity, summary, consumes, doc, judge, plots)
        return judge

    return register


# Each capability keeps its rules in a `rules` package of its own; every module in
# one is imported, so a new rule file needs no edit elsewhere.
RULE_PACKAGES = (
    "deadweight.checking.rules",
    "deadweight.watching.rules",
    "deadweight.checkpoints.rules",
    "deadweight.linting.rules",
    "deadweight.distributed.rules",
)


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in RULE_PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{name}.{info.name}")


def all_rules() -> list[Rule]:
    _load()
    return sorted(_RULES.values(), key=lambda r: r.code)


def rules_consuming(kind: type) -> list[Rule]:
    return [r for r in all_rules() if r.consumes is kind]


def get_rule(code_or_name: str) -> Rule:
    """Look a rule up by code (`DW101`, any case) or name (`no-gradient`)."""
    _load()
    key = code_or_name.strip()
    found = _RULES.get(key.upper()) or next((r for r in _RULES.values() if r.name == key), None)
    if found is None:
        raise KeyError(f"no rule {code_or_name!r}; `deadweight rules` lists them")
    return found


@dataclass(frozen=True)
class Selection:
    """Which findings to keep, from `--select` / `--ignore` lists.

    Each entry is a code (`DW101`), a code prefix (`DW1`, `DW10`) or a rule name
    (`no-gradient`). An empty `select` keeps everything not ignored.
    """

    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, select: Iterable[str] | str | None = None, ignore: Iterable[str] | str | None = None
    ) -> Selection:
        sel, ign = _normalise(select or ()), _normalise(ignore or ())
        _load()
        unknown = [e for e in (*sel, *ign) if not _matches_any_rule(e)]
        if unknown:
            raise ValueError(
                f"unknown rule code or name: {', '.join(unknown)}; `deadweight rules` lists them"
            )
        return cls(sel, ign)

    def keeps(self, finding: Finding) -> bool:
        if self.select and not any(
            _entry_matches(e, finding.code, finding.name) for e in self.select
        ):
            return False
        return not any(_entry_matches(e, finding.code, finding.name) for e in self.ignore)

    def filter(self, findings: Iterable[Finding]) -> Iterator[Finding]:
        return (f for f in findings if self.keeps(f))


def _normalise(entries: Iterable[str] | str) -> tuple[str, ...]:
    if isinstance(entries, str):  # select="DW101" means one entry, not five characters
        entries = [entries]
    out: list[str] = []
    for entry in entries:
        out.extend(part.strip() for part in entry.split(",") if part.strip())
    return tuple(e.upper() if e.upper().startswith("DW") else e for e in out)


def _entry_matches(entry: str, code: str, name: str) -> bool:
    return code.startswith(entry) if entry.startswith("DW") else entry == name


def _matches_any_rule(entry: str) -> bool:
    return any(_entry_matches(entry, r.code, r.name) for r in _RULES.values())


def _split_sections(doc: str) -> dict[str, str]:
    sections: dict[str, str] = {}
    current: str | None = None
    lines: list[str] = []
    for line in doc.splitlines():
        if line.startswith("## "):
            if current is not None:
                sections[current] = "\n".join(lines).strip()
            current, lines = line[3:].strip(), []
        elif current is not None:
            lines.append(line)
    if current is not None:
        sections[current] = "\n".join(lines).strip()
    return sections
