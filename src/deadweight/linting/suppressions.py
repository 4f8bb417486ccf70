"""Inline suppressions: `# deadweight: ignore[DW501]` (Python), `// deadweight: ignore[DW511]` (Rust).

A comment suppresses the listed rules (codes, code prefixes or names, comma-separated)
for findings that start or end on its line; a bare `deadweight: ignore` suppresses
every rule there.
"""

from __future__ import annotations

import re

# line -> the entries it suppresses; an empty set means every rule
Suppressions = dict[int, frozenset[str]]

MARKER = "deadweight:"
_COMMENT = re.compile(r"deadweight:\s*ignore\b(?:\[([^\]]*)\])?")


def parse_comment(comment: str) -> frozenset[str] | None:
    """The entries a comment suppresses (empty: all), or None when it suppresses nothing."""
    match = _COMMENT.search(comment)
    if match is None:
        return None
    if match.group(1) is None:
        return frozenset()
    entries = (e.strip() for e in match.group(1).split(","))
    return frozenset(e.upper() if e.upper().startswith("DW") else e for e in entries if e)


def add(table: Suppressions, line: int, comment: str) -> None:
    entries = parse_comment(comment)
    if entries is None:
        return
    if line in table and (not table[line] or not entries):
        table[line] = frozenset()
    else:
        table[line] = table.get(line, frozenset()) | entries


def suppresses(entries: frozenset[str], code: str, name: str) -> bool:
    if not entries:
        return True
    return any(code.startswith(e) if e.startswith("DW") else e == name for e in entries)
