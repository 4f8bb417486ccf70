"""How deeply a JSON text nests, found in time linear in its length.

Every JSON file deadweight reads (an event log line, a saved report, a sharded index)
comes from elsewhere. `json.loads` itself is linear but recurses once per level, so the
depth is measured first, outside strings, and a text nested past what the caller reads
is refused before it is parsed.

The scan is a tokenizer whose tokens never overlap: each string is consumed whole, an
unterminated one to the end of the text, so no character is looked at twice. (A regex
that removes complete strings restarts at every quote of an unterminated one: 20,000
escaped quotes took 6 s, and 300 KB never finished.)
"""

from __future__ import annotations

import re

# A string (escapes consumed pairwise; possessive, so never re-tried) with its closing
# quote when it has one: an unterminated string runs to the end of the text.
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
# Every byte but the brackets: deleting them from UTF-8 keeps exactly the brackets (no
# byte of a multi-byte character is ASCII).
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_AS_PARENS = bytes.maketrans(b"[]{}", b"()()")


def _brackets(text: str) -> bytes:
    """The brackets of `text` outside strings, in order, as bytes."""
    skeleton = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    return skeleton.translate(None, _NOT_BRACKETS)


def containers(text: str) -> int:
    """How many objects and arrays `text` opens."""
    brackets = _brackets(text)
    return brackets.count(b"[") + brackets.count(b"{")


def deeper_than(text: str, limit: int) -> bool:
    """Whether the objects and arrays of `text` may nest more than `limit` deep.

    Exact for well-formed JSON; a text with unmatched brackets (which json refuses
    anyway) may be taken for deeper than it is."""
    parens = _brackets(text).translate(_AS_PARENS)
    if parens.count(b"(") <= limit:
        return False
    # Each round removes every innermost pair, all at C speed: a text `limit` deep is
    # empty of pairs after `limit` rounds; what is left unmatched counts as nesting.
    for depth in range(1, limit + 1):
        parens = parens.replace(b"()", b"")
        if b"()" not in parens:
            return depth + parens.count(b"(") > limit
    return True
