"""The small, safe subset of Markdown the rule docs are written in, as HTML.

Paragraphs, fenced code blocks, inline code, and bullet and numbered lists; nothing
else. There is no raw HTML passthrough: every character of the input is escaped, so a
doc (or anything else put through it) holding `<script>` comes out as text. Each line
is matched once by an anchored pattern without nested repetition, and code spans are
paired through an index, so the time is linear in the input's size.
"""

from __future__ import annotations

import bisect
import html
import re
from collections import defaultdict

_FENCE = re.compile(r"( *)(`{3,})[^`]*")  # an info string holds no backtick
# At any indentation: a nested item is shown as one more item of its list (the docs
# use no indented code blocks, only fences).
_BULLET = re.compile(r" *[-*+](?: +|$)")
_NUMBERED = re.compile(r" *\d{1,9}[.)](?: +|$)")
_TICKS = re.compile(r"`+")


def to_html(text: str) -> str:
    """`text` in Markdown as an HTML fragment; all of it escaped."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    blocks: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif _FENCE.fullmatch(line):
            i = _fenced(lines, i, blocks)
        elif _list_marker(line):
            i = _list(lines, i, blocks)
        else:
            i = _paragraph(lines, i, blocks)
    return "\n".join(blocks)


def _list_marker(line: str) -> re.Match[str] | None:
    return _BULLET.match(line) or _NUMBERED.match(line)


def _starts_block(line: str) -> bool:
    return bool(_FENCE.fullmatch(line) or _list_marker(line))


def _fenced(lines: list[str], i: int, blocks: list[str]) -> int:
    opening = _FENCE.fullmatch(lines[i])
    assert opening is not None
    indent, ticks = len(opening.group(1)), len(opening.group(2))
    closing = re.compile(rf" *`{{{ticks},}} *")
    body: list[str] = []
    i += 1
    # An unclosed fence runs to the end of the text, as in CommonMark.
    while i < len(lines) and not closing.fullmatch(lines[i]):
        line = lines[i]
        body.append(line[min(indent, len(line) - len(line.lstrip(" "))) :])
        i += 1
    code = html.escape("\n".join(body))
    blocks.append(f"<pre><code>{code}</code></pre>")
    return i + 1


def _list(lines: list[str], i: int, blocks: list[str]) -> int:
    ordered = _BULLET.match(lines[i]) is None
    marker = _NUMBERED if ordered else _BULLET
    items: list[list[str]] = []
    blank = False  # the line before was blank
    while i < len(lines):
        line = lines[i]
        start = marker.match(line)
        if start:
            items.append([line[start.end() :].strip()])
        elif not line.strip():
            blank = True
            i += 1
            continue
        elif _starts_block(line) or (blank and line[:1] != " "):
            break  # a fence, another kind of list, or a paragraph after a blank line
        else:
            items[-1].append(line.strip())  # the item goes on
        blank = False
        i += 1
    tag = "ol" if ordered else "ul"
    texts = ("\n".join(part for part in item if part) for item in items)
    body = "\n".join(f"<li>{_inline(text)}</li>" for text in texts)
    blocks.append(f"<{tag}>\n{body}\n</{tag}>")
    return i


def _paragraph(lines: list[str], i: int, blocks: list[str]) -> int:
    text: list[str] = []
    while i < len(lines) and lines[i].strip() and not (text and _starts_block(lines[i])):
        text.append(lines[i].strip())
        i += 1
    joined = "\n".join(text)
    blocks.append(f"<p>{_inline(joined)}</p>")
    return i


def _inline(text: str) -> str:
    """Escaped text with its code spans: a run of backticks up to the next run as long."""
    runs = [(m.start(), m.end()) for m in _TICKS.finditer(text)]
    by_length: dict[int, list[int]] = defaultdict(list)  # run length -> run indices, in order
    for k, (a, b) in enumerate(runs):
        by_length[b - a].append(k)
    out: list[str] = []
    done = 0  # text before this has been written
    k = 0
    while k < len(runs):
        a, b = runs[k]
        same = by_length[b - a]
        j = bisect.bisect_right(same, k)
        if j == len(same):  # no closing run: the backticks are text
            k += 1
            continue
        close = same[j]
        c, d = runs[close]
        out.append(html.escape(text[done:a]))
        out.append(f"<code>{html.escape(_code_span(text[b:c]))}</code>")
        done = d
        k = close + 1
    out.append(html.escape(text[done:]))
    return "".join(out)


def _code_span(code: str) -> str:
    code = code.replace("\n", " ")
    if len(code) > 2 and code[0] == code[-1] == " " and code.strip():
        return code[1:-1]  # `` `x` `` shows `x`, as in CommonMark
    return code
