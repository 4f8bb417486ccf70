"""SARIF 2.1.0, the format GitHub code scanning (and most editors' problem viewers) read.

Rule metadata comes from the registry: the summary is the short description, the
"What it does" section the full description, the whole documentation the help.
Paths are written relative to `root` (the current directory by default: run from the
repository root for code scanning) under the base id `%SRCROOT%`. Each result has a
`partialFingerprints` entry computed from the rule, file, function and message (not
the line number), so an alert keeps its identity when code above it moves. Files that
could not be linted become tool execution notifications.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import quote

from deadweight._version import __version__
from deadweight.findings import Finding, Severity
from deadweight.registry import Rule, all_rules
from deadweight.report import Report

SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
VERSION = "2.1.0"
INFORMATION_URI = "https://pypi.org/project/deadweight/"
SRCROOT = "%SRCROOT%"
FINGERPRINT = "deadweight/v1"

LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def to_sarif(report: Report, root: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The report as a SARIF log (a JSON-ready dict)."""
    base = Path(root or Path.cwd()).resolve()
    rules = _rules_for(report)
    index = {r.code: k for k, r in enumerate(rules)}
    seen: Counter[str] = Counter()
    results = [_result(f, index, base, seen) for f in report.findings]
    errors = report.subject.get("errors") or []
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": "deadweight",
                "version": __version__,
                "semanticVersion": __version__,
                "informationUri": INFORMATION_URI,
                "rules": [_rule(r) for r in rules],
            }
        },
        "originalUriBaseIds": {SRCROOT: {"uri": base.as_uri() + "/"}},
        "columnKind": "unicodeCodePoints",
        "results": results,
        "invocations": [
            {
                "executionSuccessful": bool(report.subject.get("files", 1)) or not errors,
                "toolExecutionNotifications": [_notification(e, base) for e in errors],
            }
        ],
    }
    return {"$schema": SCHEMA, "version": VERSION, "runs": [run]}


def render_sarif(report: Report, root: str | os.PathLike[str] | None = None) -> str:
    return json.dumps(to_sarif(report, root), indent=2)


def _rules_for(report: Report) -> list[Rule]:
    families = {f.code[2] for f in report.findings}
    if report.kind == "lint":
        families.add("5")
    return [r for r in all_rules() if r.code[2] in families]


def _rule(r: Rule) -> dict[str, Any]:
    sections = r.sections()
    what = " ".join(sections.get("What it does", r.summary).split())
    return {
        "id": r.code,
        "name": r.name,
        "shortDescription": {"text": r.summary},
        "fullDescription": {"text": what},
        "help": {"text": r.doc, "markdown": r.doc},
        "defaultConfiguration": {"level": LEVEL[r.severity]},
        "properties": {
            "tags": ["deadweight", r.family],
            "precision": "high",
            "problem.severity": LEVEL[r.severity]
            if r.severity is not Severity.INFO
            else "recommendation",
        },
    }


def _uri(path: str, base: Path) -> dict[str, str]:
    absolute = Path(path).resolve()
    try:
        relative = absolute.relative_to(base)
    except ValueError:
        return {"uri": absolute.as_uri()}
    return {"uri": quote(relative.as_posix()), "uriBaseId": SRCROOT}


def _result(f: Finding, index: dict[str, int], base: Path, seen: Counter[str]) -> dict[str, Any]:
    result: dict[str, Any] = {
        "ruleId": f.code,
        "level": LEVEL[f.severity],
        "message": {"text": f.message + (f" Fix: {f.fix}" if f.fix else "")},
    }
    if f.code in index:
        result["ruleIndex"] = index[f.code]
    loc = f.location
    if loc is not None and loc.file:
        region: dict[str, int] = {}
        if loc.line:
            region["startLine"] = loc.line
            if loc.column:
                region["startColumn"] = loc.column
            if loc.end_line:
                region["endLine"] = loc.end_line
            if loc.end_column:
                region["endColumn"] = loc.end_column
        physical: dict[str, Any] = {"artifactLocation": _uri(loc.file, base)}
        if region:
            physical["region"] = region
        location: dict[str, Any] = {"physicalLocation": physical}
        if loc.function:
            location["logicalLocations"] = [
                {"fullyQualifiedName": loc.function, "kind": "function"}
            ]
        result["locations"] = [location]
        key = "\0".join(
            [f.code, physical["artifactLocation"]["uri"], loc.function or "", f.message]
        )
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
        seen[digest] += 1
        result["partialFingerprints"] = {FINGERPRINT: f"{digest}:{seen[digest]}"}
    return result


def _notification(error: dict[str, Any], base: Path) -> dict[str, Any]:
    note: dict[str, Any] = {"level": "error", "message": {"text": error.get("message", "")}}
    if error.get("file"):
        physical: dict[str, Any] = {"artifactLocation": _uri(error["file"], base)}
        if error.get("line"):
            physical["region"] = {"startLine": error["line"]}
            if error.get("column"):
                physical["region"]["startColumn"] = error["column"]
        note["locations"] = [{"physicalLocation": physical}]
    return note
