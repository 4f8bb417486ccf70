"""The README's promises: its rule table matches the registry, its quick start is two commands."""

from __future__ import annotations

import re
from pathlib import Path

from deadweight.cli.rules import markdown_table

README = (Path(__file__).parents[1] / "README.md").read_text()


def test_rule_table_matches_registry():
    table = README.split("<!-- rules:start -->")[1].split("<!-- rules:end -->")[0].strip()
    assert table == markdown_table(), "regenerate with: deadweight rules --format markdown"


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    quick = README.split("## Quick start")[1].split("\n## ")[0]
    commands = re.findall(r"```bash\n(.*?)\n```", quick, re.S)
    assert commands == [
        'pip install torch==2.13.0 -e ".[test]" && deadweight demo',
        "python -m pytest",
    ]
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert commands[1] in ci


def test_readme_says_the_tests_open_the_html_report_in_chromium_which_ci_installs():
    quick = " ".join(README.split("## Quick start")[1].split("\n## ")[0].split())
    assert "The HTML report's tests open the report in a real browser: Chromium" in quick
    assert "`.ci/run` installs Debian's `chromium` package" in quick
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    assert "apt-get install -y -qq chromium" in ci  # what the README promises
    development = " ".join(README.split("## Development")[1].split())
    assert "Chromium (for the HTML report's browser tests)" in development
