"""One documentation page per rule, generated from the registry, plus an index.

The pages under docs/rules/ are this module's output (`deadweight rules --write-docs
docs/rules`), and `deadweight rules CODE` prints the same page in the terminal. A test
keeps the files in step with the registry and fails when a rule lacks a section.
"""

from __future__ import annotations

import re
from pathlib import Path

from deadweight import thresholds
from deadweight.errors import InputError
from deadweight.output_files import OutputFile
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
        f"- source: [`{rule.source}`](../../{rule.source}) (`{rule.judge.__name__}`)",
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


# A rule page's name: only a file so named can be a page of a rule that is gone.
_RULE_PAGE = re.compile(r"DW[0-9]{3}\.md")


def generated_here(path: Path) -> bool:
    """Whether the file at `path` is a page this module wrote (now or in an earlier
    version): a regular file that opens with its page's own heading and, for a rule
    page, ends with the line that names the command printing it. Anything else there
    is the user's, and is never replaced or removed."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open(encoding="utf-8") as fh:
            head = fh.read(200)
    except (OSError, UnicodeDecodeError):
        return False
    if path.name == INDEX:
        return head.startswith("# Rules\n")
    if path.name == THRESHOLDS:
        return head.startswith("# Thresholds\n")
    code = path.name.removesuffix(".md")
    if not (_RULE_PAGE.fullmatch(path.name) and head.startswith(f"# {code} ")):
        return False
    tail = path.read_bytes()[-400:].decode("utf-8", "replace")
    return f"`deadweight rules {code}` prints this page." in tail


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
            for path in sorted(directory.glob("DW*.md"))
            if path.name not in expected and generated_here(path)
        ]
    return problems


def write_docs(directory: str | Path) -> list[Path]:
    """Write every page, and remove the pages of rules that are gone; the paths written.

    Only pages this module wrote are replaced or removed (`generated_here`): a file of
    the user's under one of the names (a README.md, an index.md of their own) makes it
    refuse, before anything is written, and files under other names are never touched.
    Each page is written whole, through a temporary file."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"--write-docs {directory}: cannot create it ({exc.strerror or exc})"
        ) from None
    expected = generated_docs()
    targets = {name: OutputFile.claim(str(directory / name), "--write-docs") for name in expected}
    foreign = [
        str(directory / name)
        for name in expected
        if (directory / name).exists() and not generated_here(directory / name)
    ]
    if foreign:
        raise InputError(
            f"--write-docs {directory}: {', '.join(foreign[:5])}"
            + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            + " would be replaced but deadweight did not write them; nothing was written "
            "(write the pages into a folder of their own)"
        )
    gone = [
        path
        for path in sorted(directory.glob("DW*.md"))
        if path.name not in expected and generated_here(path)
    ]
    written = []
    for name, text in expected.items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            targets[name].write_text(text)
            written.append(path)
    for path in gone:
        path.unlink()
    return written


def _toml(value: object) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    return f"{value:g}" if isinstance(value, float) else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
