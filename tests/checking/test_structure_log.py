"""benchmarks/structure_log.py, the log that shows a change to the structure pass
left its conclusions as they were: it records carriers and verdicts, the same on two
runs of one tree, and its comparison names a case that differs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "structure_log.py"


@pytest.fixture(scope="module")
def script() -> Any:
    pytest.importorskip("transformers")
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("structure_log", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = saved  # the script puts its own folder on the path


def test_the_log_is_the_same_on_two_runs_and_a_change_shows(
    script: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a stock model, and a gain a LayerNorm cancels (planted)
    picked: dict[str, tuple[str, Any]] = {}
    for label, run in script.cases(quick=True):
        for prefix in ("gpt2/fp32", "a/layernorm/"):
            if label.startswith(prefix):
                picked.setdefault(prefix, (label, run))
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    for path in (first, second):
        assert script.write(path, picked.values()) == 2
    gpt2, planted = (json.loads(line) for line in first.read_text().splitlines())
    assert len(gpt2["log"]) > 50  # a carrier for each carrying call, then the verdict
    assert [e[0] for e in gpt2["log"][-3:]] == ["absorbed", "free means", "result"]
    assert any(f["code"] == "DW104" and f["params"] == ["gain"] for f in planted["findings"])
    assert script.compare(first, second) == 0

    changed = tmp_path / "changed.jsonl"
    gpt2["log"][10][0] = hex(int(gpt2["log"][10][0], 16) ^ 1)  # one more lost effect
    changed.write_text("".join(json.dumps(line) + "\n" for line in (gpt2, planted)))
    assert script.compare(first, changed) == 1
    assert "gpt2/fp32: log entry 10 differs" in capsys.readouterr().out


def test_compare_stops_clearly_on_a_file_that_is_not_a_log(script: Any, tmp_path: Path) -> None:
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps({"case": "x", "log": [], "findings": []}) + "\n")
    for text in ("<b>not json</b>\n", '{"no": "case"}\n', "[1]\n"):
        other = tmp_path / "other.jsonl"
        other.write_text(text)
        with pytest.raises(SystemExit, match=r"other\.jsonl:1: not a line of a structure log"):
            script.compare(log, other)
