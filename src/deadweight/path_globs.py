"""Path patterns of the configuration (`exclude`, `per-file-ignores`, `inference-only`),
compiled once and matched in time linear in the path's length.

`*`, `?` and `[...]` stay within one path component; a component that is exactly `**`
spans any number of them (elsewhere `**` is a `*`, as in .gitignore); a pattern without
`/` matches a component at any depth; and a pattern that matches a directory covers
everything below it.

A pattern is matched component by component: each component's part of the pattern is
a regex without nested repetition (every `*` after the first is an atomic, first-match
search, which is exact for a single component, as fnmatch's translation is), and the
`**` components are simulated as a set of positions in the pattern, one step per
component of the path. (A translation into one regex with a `(?:.*/)?` per `**`
backtracked: twelve of them against a path 20 folders deep never finished.) An invalid
pattern (`[z-a]`, an unclosed `[`) is a `GlobError` when the configuration is read,
never an `re.error` in the middle of a lint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

GLOBSTAR = "**"  # a whole component: any number of components


class GlobError(ValueError):
    """A pattern that cannot be read; the message says what is wrong and where."""


def _class(segment: str, start: int, pattern: str) -> tuple[str, int]:
    """The regex of the `[...]` class opening at `start`, and the index after it."""
    i = start + 1
    negate = i < len(segment) and segment[i] in "!^"
    i += negate
    members: list[str] = []
    first = True
    while i < len(segment) and (segment[i] != "]" or first):
        first = False
        low = segment[i]
        if i + 2 < len(segment) and segment[i + 1] == "-" and segment[i + 2] != "]":
            high = segment[i + 2]
            if low > high:
                raise GlobError(
                    f"pattern {pattern!r}: the range {low}-{high} in {segment[start:]!r} is "
                    "reversed (write the lower character first)"
                )
            members.append(f"{re.escape(low)}-{re.escape(high)}")
            i += 3
        else:
            members.append(re.escape(low))
            i += 1
    if i >= len(segment):
        raise GlobError(
            f"pattern {pattern!r}: the '[' at {segment[start:]!r} opens a character class "
            "that is never closed (a ']' right after '[' or '[!' is a member; write [[] for "
            "a literal '[')"
        )
    return f"[{'^' if negate else ''}{''.join(members)}]", i + 1


def _component_regex(segment: str, pattern: str) -> re.Pattern[str]:
    """One component's pattern as a regex that matches in time linear in the component."""
    chunks: list[list[str]] = [[]]  # the pieces between stars
    i = 0
    while i < len(segment):
        c = segment[i]
        if c == "*":
            if chunks[-1] or len(chunks) == 1:
                chunks.append([])
            i += 1
        elif c == "?":
            chunks[-1].append(".")
            i += 1
        elif c == "[":
            regex, i = _class(segment, i, pattern)
            chunks[-1].append(regex)
        else:
            chunks[-1].append(re.escape(c))
            i += 1
    if len(chunks) == 1:
        return re.compile("".join(chunks[0]), re.DOTALL)
    head, *middle, tail = ("".join(chunk) for chunk in chunks)
    # Each middle piece at its first place: a later one could only leave less to the rest.
    body = "".join(f"(?>.*?{piece})" for piece in middle if piece)
    return re.compile(f"{head}{body}.*{tail}", re.DOTALL)


@dataclass(frozen=True)
class PathGlob:
    """One compiled pattern. `segments` holds GLOBSTAR or a component's regex; `literals`
    the component a segment matches when it matches exactly one (no wildcard), else None."""

    pattern: str
    segments: tuple[str | re.Pattern[str], ...]
    literals: tuple[str | None, ...]

    def matches(self, parts: Sequence[str]) -> bool:
        """Whether the path of these components, or a directory above it, matches."""
        segments = self.segments
        end = len(segments)
        states = self._closed({0})
        for part in parts:
            following: set[int] = set()
            for j in states:
                if j == end:
                    continue
                segment = segments[j]
                if segment is GLOBSTAR:
                    following.add(j)
                elif segment.fullmatch(part):  # type: ignore[union-attr]
                    following.add(j + 1)
            states = self._closed(following)
            if end in states:
                return True  # this directory (or the file itself) matches
            if not states:
                return False
        return False

    def _closed(self, states: set[int]) -> set[int]:
        """`states` with every GLOBSTAR skipped as matching no component."""
        closed = set(states)
        for j in states:
            while j < len(self.segments) and self.segments[j] is GLOBSTAR:
                j += 1
                closed.add(j)
        return closed


def compile_glob(pattern: str) -> PathGlob:
    """`pattern` compiled; raises GlobError when it cannot be read."""
    text = pattern.strip().removeprefix("./").rstrip("/")
    pieces = text.split("/") if "/" in text else [GLOBSTAR, text]
    if pieces[-1] == GLOBSTAR and len(pieces) > 1:
        pieces[-1] = "*"  # `dir/**`: everything below dir, which `dir/*` covers already
    segments: list[str | re.Pattern[str]] = []
    literals: list[str | None] = []
    for piece in pieces:
        if piece == GLOBSTAR:
            if not segments or segments[-1] is not GLOBSTAR:
                segments.append(GLOBSTAR)
                literals.append(None)
        else:
            segments.append(_component_regex(piece, pattern))
            literals.append(None if _WILDCARD.search(piece) else piece)
    return PathGlob(pattern, tuple(segments), tuple(literals))


_WILDCARD = re.compile(r"[*?\[]")


@dataclass(frozen=True)
class GlobSet:
    """Many patterns matched together (`exclude`): names without a wildcard are looked up
    in a set, patterns anchored by a first component are tried only on paths that start
    with it, so thousands of patterns cost little more than a few."""

    names: frozenset[str] = frozenset()
    # Patterns of one component with wildcards, at any depth (`*.pyi`): one regex of all.
    any_depth: re.Pattern[str] | None = None
    by_first: dict[str, tuple[PathGlob, ...]] = field(default_factory=dict)
    others: tuple[PathGlob, ...] = ()

    @classmethod
    def of(cls, patterns: Iterable[str]) -> GlobSet:
        names: set[str] = set()
        components: list[str] = []
        by_first: dict[str, list[PathGlob]] = {}
        others: list[PathGlob] = []
        for pattern in patterns:
            glob = compile_glob(pattern)
            if glob.segments[0] is GLOBSTAR and len(glob.segments) == 2:
                if glob.literals[1] is not None:
                    names.add(glob.literals[1])  # a bare name: a component at any depth
                else:
                    components.append(glob.segments[1].pattern)  # type: ignore[union-attr]
            elif glob.literals[0] is not None:
                by_first.setdefault(glob.literals[0], []).append(glob)
            else:
                others.append(glob)
        any_depth = (
            re.compile("|".join(f"(?:{c})" for c in components), re.DOTALL) if components else None
        )
        return cls(
            frozenset(names),
            any_depth,
            {k: tuple(v) for k, v in by_first.items()},
            tuple(others),
        )

    def matches(self, parts: Sequence[str]) -> bool:
        if not parts:
            return False
        if self.names and not self.names.isdisjoint(parts):
            return True
        if self.any_depth is not None and any(map(self.any_depth.fullmatch, parts)):
            return True
        candidates = (*self.by_first.get(parts[0], ()), *self.others)
        return any(glob.matches(parts) for glob in candidates)
