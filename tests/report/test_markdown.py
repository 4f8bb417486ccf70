"""The rule docs' Markdown as HTML: each construct of the subset, hostile input made inert
and converted in linear time, and every registered rule's docs through the HTML report."""

from __future__ import annotations

import re
import time
from html.parser import HTMLParser

import pytest

from deadweight.registry import all_rules
from deadweight.report import Report
from deadweight.report.markdown import to_html

ALLOWED_TAGS = {"p", "pre", "code", "ul", "ol", "li"}


class _Tags(HTMLParser):
    """Every tag and attribute of a fragment, and its text."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []
        self.text: list[str] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs.extend(attrs)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)

    def handle_data(self, data: str) -> None:
        self.text.append(data)


def _inert(out: str) -> _Tags:
    tags = _Tags(out)
    assert set(tags.tags) <= ALLOWED_TAGS, tags.tags
    assert tags.attrs == []  # no tag the converter writes has an attribute
    return tags


# -- each construct ------------------------------------------------------------------------


def test_paragraphs() -> None:
    assert to_html("One line\nand its next.\n\nA second one.") == (
        "<p>One line\nand its next.</p>\n<p>A second one.</p>"
    )


def test_fenced_code_keeps_its_indentation_and_drops_the_language() -> None:
    text = "Before.\n```python\ndef f(x):\n    return x < 1  # `not code`\n```\nAfter."
    assert to_html(text) == (
        "<p>Before.</p>\n"
        "<pre><code>def f(x):\n    return x &lt; 1  # `not code`</code></pre>\n"
        "<p>After.</p>"
    )


def test_an_indented_fence_loses_its_indentation() -> None:
    assert to_html("  ```\n  a\n    b\n  ```") == "<pre><code>a\n  b</code></pre>"


def test_inline_code() -> None:
    assert to_html("Call `f(a<b)` or ``x ` y``, not `this.") == (
        "<p>Call <code>f(a&lt;b)</code> or <code>x ` y</code>, not `this.</p>"
    )


def test_bullets_with_continuation_lines_and_blank_lines_between_items() -> None:
    text = "Evidence:\n- `steps`: steps with\n  exact statistics.\n\n- `mean_lr`: the lr.\n\nAfter."
    assert to_html(text) == (
        "<p>Evidence:</p>\n<ul>\n"
        "<li><code>steps</code>: steps with\nexact statistics.</li>\n"
        "<li><code>mean_lr</code>: the lr.</li>\n"
        "</ul>\n<p>After.</p>"
    )


def test_numbered_list() -> None:
    # DW104 explains its two passes as a numbered list.
    assert to_html("1. Structure,\n   followed.\n2. Confirmation.") == (
        "<ol>\n<li>Structure,\nfollowed.</li>\n<li>Confirmation.</li>\n</ol>"
    )


def test_a_nested_item_is_one_more_item() -> None:
    assert to_html("- a\n    - b\n      more\n- c") == (
        "<ul>\n<li>a</li>\n<li>b\nmore</li>\n<li>c</li>\n</ul>"
    )


def test_a_list_ends_at_a_fence_or_another_kind_of_list() -> None:
    assert to_html("- a\n```\nx\n```\n1. b\n- c") == (
        "<ul>\n<li>a</li>\n</ul>\n<pre><code>x</code></pre>\n"
        "<ol>\n<li>b</li>\n</ol>\n<ul>\n<li>c</li>\n</ul>"
    )


def test_empty_and_blank_input() -> None:
    assert to_html("") == ""
    assert to_html("\n \n\r\n") == ""


# -- hostile input -------------------------------------------------------------------------

HOSTILE = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    '`" onmouseover="alert(1)` and `<b title="x">`',
    '```"><script>alert(1)</script>\n<script>alert(2)</script>\n```',
    "- <script>alert(1)</script>\n- `</code><script>alert(2)</script>`",
    "1. <iframe src=javascript:alert(1)></iframe>",
    "&lt;script&gt; stays &amp;lt; text",
    "```\nunclosed fence <img src=x onerror=alert(1)>\n- no list here",
    "<!-- a comment --> <![CDATA[ x ]]> <?pi?>",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_input_comes_out_as_text(text: str) -> None:
    out = to_html(text)
    assert "<script" not in out and "<img" not in out and "<iframe" not in out
    assert "<!--" not in out and "<b " not in out
    tags = _inert(out)
    # Nothing is lost either: the text the browser shows is the input, less the markup
    # the subset gives meaning to (and a fence's info string, which it drops).
    shown = "".join(tags.text)
    kept = re.sub(r"^( *`{3,}).*$", r"\1", text, flags=re.M)
    for word in re.findall(r"alert\(\d\)|onerror|onmouseover|&lt;|&amp;", kept):
        assert word in shown


def test_an_unclosed_fence_runs_to_the_end() -> None:
    assert to_html("```\na\n- b") == "<pre><code>a\n- b</code></pre>"


# 1 MB of what makes naive converters slow: unmatched backtick runs of every length,
# one long line of backticks, deep list nesting, fences that never close.
LONG = {
    "ticks of many lengths": "".join("`" * (i % 50 + 1) + " x " for i in range(40_000)),
    "one line of backticks": "`" * 1_000_000 + "x",
    "spaces then a backtick": " " * 1_000_000 + "`",
    "nested bullets": "".join(" " * (i % 40) + "- item\n" for i in range(40_000)),
    "unclosed fences": "```\n" + "``\n" * 400_000,
    "one long paragraph": "word `code` " * 90_000,
    "blank lines in a list": "- a\n" + "\n" * 1_000_000 + "- b",
    "numbers": "1. " * 350_000,
}


@pytest.mark.parametrize("name", list(LONG))
def test_a_megabyte_converts_in_well_under_a_second(name: str) -> None:
    text = LONG[name]
    assert len(text) >= 900_000
    start = time.perf_counter()
    out = to_html(text)
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, f"{name}: {elapsed:.2f} s"
    assert "<script" not in out


# -- every rule's docs through the HTML report ---------------------------------------------


def test_every_rule_renders_through_the_html_report() -> None:
    pytest.importorskip("plotly", reason="the HTML report needs deadweight[html]")
    from deadweight.report import html as html_report

    rules = all_rules()
    findings = [rule.finding(f"{rule.code} fired") for rule in rules]
    page = html_report.render_html(
        [html_report.Section("all rules", Report.of("check", findings, {}))]
    )
    docs = page[page.index('<section id="rules">') :]
    docs = docs[: docs.index("</section>") + len("</section>")]
    for rule in rules:
        assert f'id="rule-{rule.code}"' in docs
    # No Markdown left as text: no fence at the start of a line anywhere, and no bullet
    # outside a code block.
    assert not re.search(r"^\s*```", docs, re.M)
    prose = re.sub(r"<pre><code>.*?</code></pre>", "", docs, flags=re.S)
    assert not re.search(r"^\s*- ", prose, re.M)
    assert not re.search(r"(^|>)\s*- ", prose, re.M)
    # Every code example is a code block, every evidence list a list.
    fences = sum(rule.doc.count("```") for rule in rules) // 2
    assert docs.count("<pre><code>") == fences
    assert docs.count("<ul>") >= sum("## Evidence\n- " in rule.doc for rule in rules)
