"""What fits deadweight into existing workflows: the pre-commit hook, the CI recipe and
the configuration docs, each checked against the real command line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from deadweight import config
from deadweight.cli import build_parser, main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
CHECKPOINTED = (
    "import torch\n\ndef f(block, x):\n    return torch.utils.checkpoint.checkpoint(block, x)\n"
)


def hooks() -> dict[str, dict]:
    return {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}


def test_pre_commit_hook_runs_deadweight_lint_on_python_and_rust_files() -> None:
    hook = hooks()["deadweight-lint"]
    assert hook["language"] == "python" and hook["types_or"] == ["python", "rust"]
    command, *args = hook["entry"].split()
    assert command in PYPROJECT["project"]["scripts"] and args == ["lint"]
    files = re.compile(hook["files"])
    for name in ("train.py", "src/model/attn.py", "crates/model/src/lib.rs"):
        assert files.search(name), name
    for name in ("README.md", "model.pyc", "notes.rst", "setup.cfg"):
        assert not files.search(name), name
    # Rust is parsed with the same pins as the package's rust extra
    assert hook["additional_dependencies"] == PYPROJECT["project"]["optional-dependencies"]["rust"]


def test_pre_commit_hook_entry_fails_on_a_staged_file_with_findings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.py").write_text(CHECKPOINTED)
    (tmp_path / "good.py").write_text("def f(x):\n    return x\n")
    args = hooks()["deadweight-lint"]["entry"].split()[1:]
    assert main([*args, "good.py"]) == 0  # pre-commit passes the staged file names
    assert main([*args, "good.py", "bad.py"]) == 1
    assert "bad.py:4:" in capsys.readouterr().out


def workflow() -> dict:
    return yaml.safe_load((ROOT / "examples" / "ci" / "github-workflow.yml").read_text())


def runs(job: dict) -> list[str]:
    return [step["run"] for step in job["steps"] if "run" in step]


def test_ci_recipe_uploads_the_lint_sarif_for_code_scanning() -> None:
    lint = workflow()["jobs"]["lint"]
    assert lint["permissions"]["security-events"] == "write"
    (sarif_run,) = [r for r in runs(lint) if "--format sarif" in r]
    output = sarif_run.split("--output ")[1].split()[0]
    (upload,) = [s for s in lint["steps"] if "upload-sarif" in s.get("uses", "")]
    assert upload["with"]["sarif_file"] == output
    assert "--fail-on never" in sarif_run  # the upload happens whatever was found...
    assert "deadweight lint ." in runs(lint)  # ...and a later step fails the job


def test_every_deadweight_command_of_the_ci_recipe_parses() -> None:
    commands = [r for job in workflow()["jobs"].values() for r in runs(job)]
    dw = [c for c in commands if c.startswith("deadweight ")]
    assert len(dw) == 3
    parser = build_parser()
    for command in dw:
        parser.parse_args(command.split()[1:])  # argparse exits on an unknown option


def test_ci_recipe_lint_writes_sarif_and_check_passes_the_tiny_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "m.py").write_text(CHECKPOINTED)
    out = tmp_path / "deadweight.sarif"
    assert (
        main(["lint", str(tmp_path), "--format", "sarif", "-o", str(out), "--fail-on", "never"])
        == 0
    )
    sarif = json.loads(out.read_text())
    assert sarif["runs"][0]["results"][0]["ruleId"] == "DW504"
    monkeypatch.chdir(ROOT)
    (check,) = [r for r in runs(workflow()["jobs"]["model"]) if r.startswith("deadweight check")]
    assert main(check.split()[1:]) == 0


def test_configuration_docs_name_every_key_and_their_examples_load() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    for key in config.KEYS:
        assert f"| `{key}` |" in text, key
    blocks = re.findall(r"```toml\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    tool = tomllib.loads(blocks[0])["tool"]["deadweight"]
    assert config.from_table(tool, root=ROOT).thresholds.never_moved_steps == 200
    own = config.from_table(tomllib.loads(blocks[1]), root=ROOT, own_file=True)
    assert own.fail_on == "error"


@pytest.mark.parametrize("page", ["ci.md", "configuration.md", "testing.md"])
def test_doc_links_point_at_files_that_exist(page: str) -> None:
    path = ROOT / "docs" / page
    for target in re.findall(r"\]\(([^)#]+)\)", path.read_text()):
        if not target.startswith("http"):
            assert (path.parent / target).exists(), target


def test_readme_first_test_path_runs_the_example_that_names_the_broken_parameters() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Your model's first test")[1].split("\n## ")[0]
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.S)[0].splitlines()
    target = commands[1].split()[3]
    assert commands[1].startswith("python -m pytest ") and (ROOT / target).is_dir()
    # tests/test_pytest_plugin.py runs that example and matches these lines in its output
    assert "params   w1, g" in section and "error DW101 no-gradient" in section
    assert "docs/testing.md" in section
