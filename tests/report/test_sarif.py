"""SARIF 2.1.0 output: what GitHub code scanning requires of a log, rule metadata from the
registry, relative locations, and fingerprints that survive code moving."""

from __future__ import annotations

import json
from pathlib import Path

import deadweight
from deadweight.registry import get_rule
from deadweight.report.sarif import FINGERPRINT, SRCROOT, to_sarif
from tests.linting.helpers import write

SOURCE = """
import torch
from torch.utils.checkpoint import checkpoint


def groups(model, weight_decay):
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": no_decay, "weight_decay": 0.0}]


def run(block, x):
    return checkpoint(block, x)


gain = torch.nn.Parameter(torch.ones(1))  # what the shape rule exempts: DW502 is a warning
"""


def sarif_of(tmp_path: Path, source: str = SOURCE) -> dict:
    write(tmp_path, source, "src/train.py")
    (tmp_path / "src" / "bad.py").write_text("def (:\n")
    report = deadweight.lint_paths([tmp_path / "src"], config=None)
    log = to_sarif(report, root=tmp_path)
    json.dumps(log)  # serialisable
    return log


def test_log_has_what_code_scanning_requires(tmp_path: Path) -> None:
    log = sarif_of(tmp_path)
    assert log["version"] == "2.1.0" and log["$schema"].endswith("sarif-2.1.0.json")
    (run,) = log["runs"]
    driver = run["tool"]["driver"]
    assert driver["name"] == "deadweight" and driver["version"] == deadweight.__version__
    assert driver["informationUri"].startswith("https://")
    assert run["originalUriBaseIds"][SRCROOT]["uri"] == tmp_path.resolve().as_uri() + "/"
    results = run["results"]
    assert [r["ruleId"] for r in results] == ["DW502", "DW504"]
    for result in results:
        assert driver["rules"][result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["level"] == "warning" and result["message"]["text"]
        (location,) = result["locations"]
        physical = location["physicalLocation"]
        assert physical["artifactLocation"] == {"uri": "src/train.py", "uriBaseId": SRCROOT}
        assert physical["region"]["startLine"] >= 1 and physical["region"]["startColumn"] >= 1
        assert set(result["partialFingerprints"]) == {FINGERPRINT}
    assert results[0]["locations"][0]["physicalLocation"]["region"] == {
        "startLine": 6, "startColumn": 50, "endLine": 6, "endColumn": 60,
    }  # fmt: skip
    assert results[1]["locations"][0]["logicalLocations"] == [
        {"fullyQualifiedName": "run", "kind": "function"}
    ]


def test_rules_carry_the_registry_documentation(tmp_path: Path) -> None:
    driver = sarif_of(tmp_path)["runs"][0]["tool"]["driver"]
    ids = [r["id"] for r in driver["rules"]]
    assert ids == ["DW501", "DW502", "DW503", "DW504", "DW511"]  # the lint family
    dw502 = driver["rules"][1]
    rule = get_rule("DW502")
    assert dw502["name"] == "shape-based-decay"
    assert dw502["shortDescription"]["text"] == rule.summary
    assert dw502["fullDescription"]["text"].startswith("Finds comparisons of a tensor's rank")
    assert dw502["help"]["markdown"] == rule.doc and "## Fix" in dw502["help"]["text"]
    assert dw502["defaultConfiguration"] == {"level": "warning"}


def test_unlintable_files_become_notifications(tmp_path: Path) -> None:
    (invocation,) = sarif_of(tmp_path)["runs"][0]["invocations"]
    assert invocation["executionSuccessful"] is True
    (note,) = invocation["toolExecutionNotifications"]
    assert note["level"] == "error" and "syntax error" in note["message"]["text"]
    physical = note["locations"][0]["physicalLocation"]
    assert (
        physical["artifactLocation"]["uri"] == "src/bad.py" and physical["region"]["startLine"] == 1
    )


def test_fingerprints_survive_lines_moving_and_tell_duplicates_apart(tmp_path: Path) -> None:
    before = sarif_of(tmp_path / "a")["runs"][0]["results"]
    moved = SOURCE.replace("import torch\n", "import torch\n\n\n# a comment pushes code down\n")
    after = sarif_of(tmp_path / "b", moved)["runs"][0]["results"]
    assert [r["locations"][0]["physicalLocation"]["region"]["startLine"] for r in after] == [9, 14]
    assert [r["partialFingerprints"] for r in before] == [r["partialFingerprints"] for r in after]
    twice = SOURCE + "\n\ndef run2(block, x):\n    return checkpoint(block, x)\n"
    prints = [
        r["partialFingerprints"][FINGERPRINT]
        for r in sarif_of(tmp_path / "c", twice)["runs"][0]["results"]
    ]
    assert len(set(prints)) == len(prints)


def test_paths_outside_the_root_are_absolute_uris(tmp_path: Path) -> None:
    write(tmp_path, SOURCE, "train.py")
    report = deadweight.lint_paths([tmp_path / "train.py"], config=None)
    elsewhere = tmp_path / "other"
    elsewhere.mkdir()
    result = to_sarif(report, root=elsewhere)["runs"][0]["results"][0]
    artifact = result["locations"][0]["physicalLocation"]["artifactLocation"]
    assert artifact == {"uri": (tmp_path / "train.py").resolve().as_uri()}
