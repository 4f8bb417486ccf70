"""One documentation page per rule, generated from the registry, plus an index.

The pages under docs/rules/ are this module's output (`deadweight rules --write-docs
docs/rules`), and `deadweight rules CODE` prints the same page in the terminal. A test
keeps the files in step with the registry and fails when a rule lacks a section.
"""

from __future__ import annotations

from pathlib import Path

from deadweight import thresholds
from deadweight.registry import DOC_SECTIONS, FAMILIES, Rule, all_rules

# What every rule's docstring must hold; the registry insists on the first four when a
# rule is declared, the docs test on all of them.
REQUIRED_SECTIONS = (*DOC_SECTIONS, "Evidence")
INDEX = "index.md"
THRESHOLDS = "thresholds.md"

_FOUND_BY = {
    "1": "`deadweight check`, `deadweight.check()`",
    "2": "`deadweight check`, `deadweight.check()` with the optimizer (DW207: also `watch`)",
    "3": "`deadweight run`, `deadweight report LOG`, `deadweight.watch()`",
    "4": "`deadweight inspect` / `diff` / `trend`, `deadweight.inspect_checkpoints()`, ...",
    "5": "`deadweight lint`, `deadweight.lint_paths()`",
}
_RANKS_NOTE = (
    "Under torch.distributed, a finding seen on some ranks only also carries `ranks` (where "
    "it was seen) and `world_size`."
)


def page_name(rule: Rule) -> str:
    return f"{rule.code}.md"


def missing_sections(rule: Rule) -> list[str]:
    """The required documentation sections a rule lacks or leaves empty."""
    sections = rule.sections()
    return [s for s in REQUIRED_SECTIONS if not sections.get(s, "").strip()]


def rule_page(rule: Rule) -> str:
    """The Markdown page of one rule."""
    sections = rule.sections()
    out = [
        f"# {rule.code} {rule.name}",
        "",
        f"**{rule.summary}**",
        "",
        f"- severity: {rule.severity.value}",
        f"- family: DW{rule.code[2]}xx, {rule.family}",
        f"- found by: {_FOUND_BY[rule.code[2]]}",
        "",
    ]
    for heading in DOC_SECTIONS:
        out += [f"## {heading}", "", sections.get(heading, "").strip(), ""]
    out += ["## Evidence", "", "Keys of `finding.evidence` (JSON: `evidence`):", ""]
    out += [sections.get("Evidence", "").strip(), ""]
    if rule.code[2] in "12":
        out += [_RANKS_NOTE, ""]
    out += ["## Thresholds", ""]
    limits = thresholds.for_rule(rule.code)
    if limits:
        out += [
            "Set in `[tool.deadweight.thresholds]` (pyproject.toml), `[thresholds]` "
            "(deadweight.toml) or `thresholds=` in Python:",
            "",
            "| key | default | what it sets | why this default |",
            "| --- | --- | --- | --- |",
        ]
        out += [f"| `{k}` | `{_toml(d)}` | {_cell(m)} | {_cell(w)} |" for k, d, m, w in limits]
    else:
        out.append("None: this rule has no configurable threshold.")
    out += ["", "## Turning it off", ""]
    out.append(
        f'`ignore = ["{rule.code}"]` in `[tool.deadweight]`, or `--ignore {rule.code}` '
        f"(or `--ignore {rule.name}`) on the command line, or `ignore=` in Python."
    )
    if rule.code.startswith("DW5"):
        comment = "//" if rule.code.startswith("DW51") else "#"
        out.append(
            f"One line: `{comment} deadweight: ignore[{rule.code}]`; one path: "
            "`[tool.deadweight.per-file-ignores]`."
        )
    out += ["", f"[All rules](index.md) · `deadweight rules {rule.code}` prints this page.", ""]
    return "\n".join(out)


def index_page() -> str:
    out = [
        "# Rules",
        "",
        "Every finding names its rule by code and name (`DW101 no-gradient`); each has a "
        "page here, and `deadweight rules CODE` prints it in the terminal. Codes are never "
        "reused. Configurable thresholds: [thresholds.md](thresholds.md).",
        "",
    ]
    rules = all_rules()
    for digit, family in FAMILIES.items():
        members = [r for r in rules if r.code[2] == digit]
        if not members:
            continue
        out += [
            f"## DW{digit}xx: {family}",
            "",
            "| code | name | severity | what it catches |",
            "| --- | --- | --- | --- |",
        ]
        out += [
            f"| [{r.code}]({page_name(r)}) | {r.name} | {r.severity.value} | {r.summary} |"
            for r in members
        ]
        out.append("")
    return "\n".join(out)


def thresholds_page() -> str:
    out = [
        "# Thresholds",
        "",
        "The numbers the rules judge by. Set any of them in `[tool.deadweight.thresholds]` "
        "of pyproject.toml (or `[thresholds]` of deadweight.toml), or pass "
        '`thresholds={"outlier-z": 6}` to `deadweight.check`, `watch`, '
        "`inspect_checkpoints`, ...; `deadweight config` shows the values in effect and "
        "where each came from.",
        "",
        "| key | default | rules | what it sets | why this default |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, f in thresholds.FIELDS.items():
        rules = ", ".join(f"[{c}]({c}.md)" for c in f.metadata["rules"])
        out.append(
            f"| `{thresholds.key_of(name)}` | `{_toml(f.default)}` | {rules} | "
            f"{_cell(f.metadata['meaning'])} | {_cell(f.metadata['why'])} |"
        )
    out.append("")
    return "\n".join(out)


def generated_docs() -> dict[str, str]:
    """File name -> content of everything under docs/rules/."""
    docs = {page_name(r): rule_page(r) for r in all_rules()}
    docs[INDEX] = index_page()
    docs[THRESHOLDS] = thresholds_page()
    return docs


def stale_docs(directory: str | Path) -> list[str]:
    """What differs between `directory` and the generated pages (empty when current)."""
    directory = Path(directory)
    expected = generated_docs()
    problems = []
    for name, text in expected.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_text(encoding="utf-8") != text:
            problems.append(f"{path}: differs from the registry")
    if directory.is_dir():
        problems += [
            f"{path}: no such rule any more"
            for path in sorted(directory.glob("*.md"))
            if path.name not in expected
        ]
    return problems


def write_docs(directory: str | Path) -> list[Path]:
    """Write every page (and remove pages of rules that are gone); the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    expected = generated_docs()
    for path in directory.glob("*.md"):
        if path.name not in expected:
            path.unlink()
    written = []
    for name, text in expected.items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


def _toml(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return f"{value:g}" if isinstance(value, float) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
