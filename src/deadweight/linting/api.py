"""`deadweight lint` as a library: find the code behind silent gradient bugs before a run.

    report = deadweight.lint_paths(["src/", "train.py"])
    report.findings        # DW5xx findings, each located at file:line:column
    report.subject["errors"]   # files that could not be linted, and why

Python files are read with the `ast` module, Rust files with tree-sitter (the `rust`
extra). Settings come from `[tool.deadweight]` of the nearest pyproject.toml
(`deadweight.config`); inline `# deadweight: ignore[DW501]` /
`// deadweight: ignore[DW511]` comments silence single lines. A file that cannot be
read or parsed, or is too large to parse (more bytes than `max_file_size`, or more
tokens than `source_files.MAX_TOKENS`, which bounds the memory parsing takes), is
listed in `subject["errors"]` and the others are still linted.
"""

from __future__ import annotations

import io
import os
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deadweight import config as config_module
from deadweight.config import Config
from deadweight.findings import Finding
from deadweight.linting import source_files, suppressions
from deadweight.linting.python_facts import PythonRunFacts, PythonSourceFacts
from deadweight.linting.source_files import DEFAULT_MAX_BYTES, SourcePath, SourceProblem
from deadweight.registry import Selection, rules_consuming
from deadweight.report import Report

Rules = Iterable[str] | str | None
AUTO = "auto"


@dataclass
class _Tally:
    files: int = 0
    languages: dict[str, int] = field(default_factory=lambda: {"python": 0, "rust": 0})
    suppressed: int = 0
    inference_only: int = 0
    problems: list[SourceProblem] = field(default_factory=list)
    rust_unparsed: list[str] = field(default_factory=list)


def lint_paths(
    paths: Sequence[str | os.PathLike[str]],
    *,
    select: Rules = None,
    ignore: Rules = None,
    config: Config | str | os.PathLike[str] | None = AUTO,
    max_file_size: int = DEFAULT_MAX_BYTES,
) -> Report:
    """Lint Python and Rust files, and directories of them, for DW5xx findings.

    `select` replaces the configuration's `select` and `ignore` adds to its `ignore`.
    `config` is "auto" (the nearest pyproject.toml with `[tool.deadweight]` above each
    path), a path to a pyproject.toml, a `Config`, or None for the defaults. Raises
    `ConfigError` for a malformed configuration and ValueError for an unknown rule.
    """
    Selection.of(select, ignore)  # unknown codes fail before any file is read
    tally = _Tally()
    findings: list[Finding] = []
    used_configs: set[str] = set()
    seen: set[str] = set()
    # Files whose facts a rule across files needs (DW502: a decay rule in train.py and
    # the scalar parameter model.py creates), with the configuration each was linted under.
    across: list[tuple[PythonSourceFacts, Config]] = []
    imports: dict[str, tuple[str, ...]] = {}  # every Python file linted -> what it imports
    for raw in paths:
        cfg = _config_for(raw, config)
        if cfg.path is not None:
            used_configs.add(str(cfg.path))
        found, problems = source_files.discover([raw], excluded=cfg.excludes)
        tally.problems.extend(problems)
        for item in found:
            real = os.path.realpath(item.path)
            if real in seen:
                continue
            seen.add(real)
            findings.extend(
                _lint_file(item, cfg, select, ignore, max_file_size, tally, across, imports)
            )
    findings.extend(_judge_across(across, imports, select, ignore, tally))
    if tally.rust_unparsed:
        from deadweight.linting.source_rust import INSTALL_HINT

        count = len(tally.rust_unparsed)
        tally.problems.append(SourceProblem(
            tally.rust_unparsed[0],
            f"{count} Rust file{'s' if count != 1 else ''} not linted: linting Rust needs the "
            f"'rust' extra: {INSTALL_HINT}",
        ))  # fmt: skip
    findings.sort(key=_position)
    subject: dict[str, Any] = {
        "paths": [os.fspath(p) for p in paths],
        "files": tally.files,
        "languages": tally.languages,
        "suppressed": tally.suppressed,
        "inference_only": tally.inference_only,
        "config": sorted(used_configs),
        "errors": [p.to_dict() for p in tally.problems],
    }
    return Report("lint", tuple(findings), subject)


def _position(f: Finding) -> tuple[str, int, int, str]:
    loc = f.location
    return (loc.file or "", loc.line or 0, loc.column or 0, f.code) if loc else ("", 0, 0, f.code)


def _config_for(raw: str | os.PathLike[str], config: Any) -> Config:
    if isinstance(config, Config):
        return config
    if config is None:
        return config_module.default()
    if isinstance(config, str) and config == AUTO:
        return _nearest(os.fspath(raw))
    return config_module.load(config)


_CACHE: dict[tuple[str, int], Config] = {}


def _nearest(path: str) -> Config:
    found = config_module.find_config_file(path)
    if found is None:
        return config_module.default()
    key = (str(found), found.stat().st_mtime_ns)  # an edited file is read again
    if key not in _CACHE:
        _CACHE[key] = config_module.load(found)
    return _CACHE[key]


def _lint_file(
    item: SourcePath,
    cfg: Config,
    select: Rules,
    ignore: Rules,
    max_file_size: int,
    tally: _Tally,
    across: list[tuple[PythonSourceFacts, Config]],
    imports: dict[str, tuple[str, ...]],
) -> list[Finding]:
    data = source_files.read_bytes(item.path, max_file_size)
    if isinstance(data, SourceProblem):
        tally.problems.append(data)
        return []
    too_big = source_files.too_many_tokens(item.path, data)
    if too_big is not None:  # what --max-file-size lets in may still be gigabytes to parse
        tally.problems.append(too_big)
        return []
    facts: Any
    if item.language == "python":
        text = _decode_python(item.path, data)
        if isinstance(text, SourceProblem):
            tally.problems.append(text)
            return []
        from deadweight.linting.source_python import probe_python

        try:
            facts = probe_python(text, item.path)
        except SyntaxError as exc:
            tally.problems.append(SourceProblem(
                item.path, f"syntax error: {exc.msg}; not linted", exc.lineno, exc.offset
            ))  # fmt: skip
            return []
        except ValueError as exc:  # NUL bytes (Python < 3.12 raises ValueError)
            tally.problems.append(SourceProblem(item.path, f"cannot be parsed: {exc}; not linted"))
            return []
        except (RecursionError, MemoryError):
            tally.problems.append(SourceProblem(
                item.path, "too deeply nested to analyse; not linted"
            ))  # fmt: skip
            return []
    else:
        text = source_files.decode_utf8(item.path, data)
        if isinstance(text, SourceProblem):
            tally.problems.append(text)
            return []
        from deadweight.linting.source_rust import MissingParser, probe_rust

        try:
            facts = probe_rust(data, item.path)
        except MissingParser:
            tally.rust_unparsed.append(item.path)
            return []
        except RecursionError:
            tally.problems.append(SourceProblem(item.path, "too deeply nested to analyse"))
            return []
        for span in facts.parse_errors[:1]:
            tally.problems.append(SourceProblem(
                item.path,
                f"does not parse as Rust here ({len(facts.parse_errors)} place(s)); "
                "the rest of the file was linted",
                span.line, span.column,
            ))  # fmt: skip
    tally.files += 1
    tally.languages[item.language] += 1
    if isinstance(facts, PythonSourceFacts):
        imports[facts.path] = facts.imports
        if facts.rank_decay or facts.scalar_parameters:
            across.append((facts, cfg))
    found = [f for r in rules_consuming(type(facts)) for f in r.judge(facts)]
    return _kept(found, item.path, facts.suppressions, cfg, select, ignore, tally)


def _judge_across(
    across: list[tuple[PythonSourceFacts, Config]],
    imports: dict[str, tuple[str, ...]],
    select: Rules,
    ignore: Rules,
    tally: _Tally,
) -> list[Finding]:
    """The rules that read the Python files of the run together; each finding is then
    kept or dropped by the settings and comments of the file it is in."""
    if not across:
        return []
    from deadweight.linting.import_graph import in_sight

    wanted = [facts.path for facts, _ in across if facts.rank_decay]
    run = PythonRunFacts(tuple(facts for facts, _ in across), in_sight(imports, wanted))
    by_path = {facts.path: (facts, cfg) for facts, cfg in across}
    kept: list[Finding] = []
    for r in rules_consuming(PythonRunFacts):
        for finding in r.judge(run):
            path = finding.location.file if finding.location else None
            if path not in by_path:
                continue
            facts, cfg = by_path[path]
            kept += _kept([finding], path, facts.suppressions, cfg, select, ignore, tally)
    return kept


def _kept(
    found: list[Finding],
    path: str,
    table: suppressions.Suppressions,
    cfg: Config,
    select: Rules,
    ignore: Rules,
    tally: _Tally,
) -> list[Finding]:
    """What survives the selection, the inline suppressions and `inference-only`."""
    kept: list[Finding] = []
    selection = _selection(
        tuple(_entries(select)) or cfg.select,
        (*cfg.ignore, *_entries(ignore), *cfg.ignored_rules(path)),
    )
    for finding in found:
        if not selection.keeps(finding):
            continue
        if _suppressed(finding, table):
            tally.suppressed += 1
            continue
        loc = finding.location
        if cfg.inference_only and cfg.inference_only_match(path, loc.function if loc else None):
            tally.inference_only += 1
            continue
        kept.append(finding)
    return kept


_SELECTIONS: dict[tuple[tuple[str, ...], tuple[str, ...]], Selection] = {}


def _selection(select: tuple[str, ...], ignore: tuple[str, ...]) -> Selection:
    key = (select, ignore)
    if key not in _SELECTIONS:
        _SELECTIONS[key] = Selection.of(select, ignore)
    return _SELECTIONS[key]


def _entries(rules: Rules) -> list[str]:
    if rules is None:
        return []
    return [rules] if isinstance(rules, str) else list(rules)


def _suppressed(finding: Finding, table: suppressions.Suppressions) -> bool:
    loc = finding.location
    if loc is None or loc.line is None or not table:
        return False
    for line in {loc.line, loc.end_line or loc.line}:
        entries = table.get(line)
        if entries is not None and suppressions.suppresses(entries, finding.code, finding.name):
            return True
    return False


def _decode_python(path: str, data: bytes) -> str | SourceProblem:
    """Text per PEP 263: UTF-8 unless a coding declaration in the first two lines says
    otherwise."""
    head = data[:512]
    if b"coding" in head:
        try:
            encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        except SyntaxError as exc:
            return SourceProblem(path, f"bad encoding declaration: {exc}; not linted")
        if encoding not in ("utf-8", "utf-8-sig"):
            try:
                return data.decode(encoding)
            except (UnicodeDecodeError, LookupError) as exc:
                return SourceProblem(path, f"not valid {encoding}: {exc}; not linted")
    return source_files.decode_utf8(path, data)
