"""The rule pages under docs/rules/: generated from the registry, one per rule with every
section, kept current by this test; `deadweight rules CODE` prints the same page."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deadweight import rule_docs
from deadweight.cli import main
from deadweight.registry import all_rules, get_rule

DOCS = Path(__file__).parents[1] / "docs" / "rules"


@pytest.mark.parametrize("code", [r.code for r in all_rules()])
def test_every_rule_documents_every_section(code: str) -> None:
    rule = get_rule(code)
    assert rule_docs.missing_sections(rule) == [], f"{code} lacks these sections"
    page = rule_docs.rule_page(rule)
    for heading in (*rule_docs.REQUIRED_SECTIONS, "Thresholds", "Turning it off"):
        assert f"\n## {heading}\n" in page, (code, heading)
    assert page.startswith(f"# {rule.code} {rule.name}\n")


REPO = Path(__file__).parents[1]


@pytest.mark.parametrize("code", [r.code for r in all_rules()])
def test_every_rule_page_names_the_file_that_judges_it(code: str) -> None:
    rule = get_rule(code)
    source = REPO / rule.source
    assert source.is_file(), rule.source
    assert f'code="{code}"' in source.read_text(), (code, rule.source)
    assert f"- source: [`{rule.source}`](../../{rule.source})" in rule_docs.rule_page(rule)
    assert (DOCS / rule.source.replace("src/", "../../src/", 1)).resolve() == source.resolve()


def test_deadweight_rules_prints_where_the_rule_is(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "DW302", "--format", "markdown"]) == 0
    assert "src/deadweight/watching/rules/dynamics.py" in capsys.readouterr().out
    assert main(["rules", "DW302", "--format", "json"]) == 0
    assert '"source": "src/deadweight/watching/rules/dynamics.py"' in capsys.readouterr().out


def test_a_rule_without_evidence_or_with_an_empty_fix_is_caught() -> None:
    rule = get_rule("DW101")
    no_evidence = dataclasses.replace(rule, doc=rule.doc.split("## Evidence")[0])
    assert rule_docs.missing_sections(no_evidence) == ["Evidence"]
    empty_fix = dataclasses.replace(
        rule, doc=rule.doc.replace(rule.sections()["Fix"], "").replace("## Fix\n", "## Fix\n\n")
    )
    assert "Fix" in rule_docs.missing_sections(empty_fix)


def test_thresholds_appear_on_the_pages_of_the_rules_they_govern() -> None:
    assert "`never-moved-steps` | `50`" in rule_docs.rule_page(get_rule("DW301"))
    assert "`outlier-z` | `5`" in rule_docs.rule_page(get_rule("DW402"))
    assert "no configurable threshold" in rule_docs.rule_page(get_rule("DW101"))
    assert "deadweight: ignore[DW501]" in rule_docs.rule_page(get_rule("DW501"))
    assert "// deadweight: ignore[DW511]" in rule_docs.rule_page(get_rule("DW511"))


def test_docs_rules_are_current() -> None:
    problems = rule_docs.stale_docs(DOCS)
    assert problems == [], "regenerate with: deadweight rules --write-docs docs/rules"


def test_stale_docs_are_detected_and_rewritten(tmp_path: Path) -> None:
    assert rule_docs.write_docs(tmp_path)  # everything written the first time
    assert rule_docs.stale_docs(tmp_path) == []
    page = tmp_path / "DW104.md"
    page.write_text(page.read_text().replace("## Fix", "## Fixes"))
    # A page an earlier version wrote for a rule that is gone, and a file of the user's.
    gone = (tmp_path / "DW101.md").read_text().replace("DW101", "DW999")
    (tmp_path / "DW999.md").write_text(gone)
    (tmp_path / "DW998.md").write_text("# my notes on a rule\n")
    (tmp_path / "index.md").unlink()
    problems = rule_docs.stale_docs(tmp_path)
    assert problems == [
        f"{page}: differs from the registry",
        f"{tmp_path / 'index.md'}: missing",
        f"{tmp_path / 'DW999.md'}: no such rule any more",
    ]
    assert main(["rules", "--check-docs", str(tmp_path)]) == 1
    assert main(["rules", "--write-docs", str(tmp_path)]) == 0
    assert main(["rules", "--check-docs", str(tmp_path)]) == 0
    assert not (tmp_path / "DW999.md").exists()
    assert (tmp_path / "DW998.md").read_text() == "# my notes on a rule\n"


def test_index_links_every_rule_page() -> None:
    index = rule_docs.index_page()
    for rule in all_rules():
        assert f"[{rule.code}]({rule.code}.md)" in index


def test_rules_code_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rules", "DW302", "--format", "markdown"]) == 0
    assert capsys.readouterr().out == rule_docs.rule_page(get_rule("DW302")) + "\n"
    assert main(["rules", "drift-without-gradient"]) == 0  # by name, rendered for the terminal
    out = capsys.readouterr().out
    assert "DW302 drift-without-gradient" in out and "Thresholds" in out and "drift-min" in out
    assert main(["rules", "DW3O2"]) == 2  # a typo is a usage error
