"""Names from a model, a checkpoint, a log or a saved report, made safe to show.

A tensor, parameter or file name is data from elsewhere: a checkpoint can name a tensor
`\\x1b]52;c;...` (an OSC 52 clipboard write), `[link=...]` (rich markup) or `<a href>`
(plotly's mini-HTML). Every renderer shows such a name as text:

* `safe_text`: control characters as visible escapes (`\\x1b`), and code points no
  encoding can write (a lone surrogate, `\\ud800`, which a JSON file can name) too, for
  every renderer;
* `plain`: a rich `Text` of it, which rich never parses as markup;
* `plotly_text`: escaped for plotly, which parses a subset of HTML in every string it
  draws (titles, legends, axis and tick labels, hover text) and shows `&lt;` as `<`.

JSON and SARIF need none of this: `json.dumps` writes control characters as `\\u001b`.
Names are escaped when they are rendered, never when a `Finding` is made: the JSON
keeps them exact.
"""

from __future__ import annotations

import html

from rich.text import Text

# Characters a terminal acts on instead of showing: C0 (ESC starts every escape
# sequence, BEL ends OSC), DEL, C1 (0x9b is a one-byte CSI), the bidirectional
# overrides and isolates that reorder what is shown (CVE-2021-42574, "Trojan Source"),
# and the Unicode line and paragraph separators.
_BIDI = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
# Lone surrogates (U+D800-U+DFFF): valid in a Python str, as `\ud800` in JSON, but no
# UTF encoding writes them: printed or saved, they end the command with a traceback.
_SURROGATES = range(0xD800, 0xE000)
_UNSAFE = [*range(0x20), 0x7F, *range(0x80, 0xA0), *map(ord, _BIDI), 0x2028, 0x2029, *_SURROGATES]
_NAMED = {"\n": r"\n", "\t": r"\t", "\r": r"\r"}
_ESCAPES = {
    c: _NAMED.get(chr(c)) or (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _UNSAFE
}
# Messages and fixes deadweight wrote may run over several lines.
_ESCAPES_KEEP_NEWLINES = {c: e for c, e in _ESCAPES.items() if chr(c) != "\n"}


def safe_text(value: object, *, keep_newlines: bool = False) -> str:
    """`str(value)` with every control character, and every lone surrogate, shown as an
    escape: `\\x1b`, `\\n`, `\\u202e`, `\\ud800`. Backslashes stay as they are (Windows
    paths)."""
    return str(value).translate(_ESCAPES_KEEP_NEWLINES if keep_newlines else _ESCAPES)


def plain(value: object, style: str = "", *, keep_newlines: bool = False) -> Text:
    """A rich `Text` of `safe_text(value)`: shown as it is, never read as markup."""
    return Text(safe_text(value, keep_newlines=keep_newlines), style=style)


def plotly_text(value: object) -> str:
    """`safe_text(value)` for a string plotly draws: `<`, `>` and `&` as entities."""
    return html.escape(safe_text(value), quote=False)


def html_text(value: object, *, keep_newlines: bool = False) -> str:
    """`safe_text(value)` for an HTML page, quotes escaped too (attributes)."""
    return html.escape(safe_text(value, keep_newlines=keep_newlines))
