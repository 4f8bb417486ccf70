"""Where the logs of one watched run go, and which files count as its logs (issue 20)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deadweight.watching.event_log import (
    encode,
    log_path_for_pid,
    log_path_for_rank,
    process_logs_beside,
    read_start,
    start_event,
)


def test_rank_and_pid_log_names() -> None:
    assert log_path_for_rank("out/run.jsonl", "0") == "out/run.jsonl"
    assert log_path_for_rank("out/run.jsonl", "3") == "out/run.rank3.jsonl"
    assert log_path_for_rank("out/data", "1") == "out/data.rank1.jsonl"
    assert log_path_for_pid("out/run.jsonl", 42) == "out/run.pid42.jsonl"


@pytest.mark.parametrize("rank", ["../../evil", "1/x", "-1", "1.0", "٣"])
def test_a_rank_that_is_not_a_number_never_becomes_part_of_a_path(rank: str) -> None:
    with pytest.raises(ValueError, match="not a number"):
        log_path_for_rank("out/run.jsonl", rank)


def test_only_exact_rank_and_pid_names_are_the_logs_beside(tmp_path: Path) -> None:
    names = [
        "data.rank1.jsonl", "data.pid77.jsonl",  # the two kinds
        "data.rankings.csv", "data.pidmap.txt", "data.rank1.jsonl.bak", "data.rank.jsonl",
        "data.rank1.csv", "xdata.rank1.jsonl", "data.rank1.pid2.jsonl",
    ]  # fmt: skip
    for name in names:
        (tmp_path / name).write_text("x\n")
    found = process_logs_beside(str(tmp_path / "data"))
    assert found == [str(tmp_path / "data.pid77.jsonl"), str(tmp_path / "data.rank1.jsonl")]


def test_read_start_knows_a_deadweight_log_from_anything_else(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    event = start_event({"every": 20}, ["train.py"])
    log.write_text(encode(event) + "\n" + '{"event":"end"}\n')
    assert read_start(log) == json.loads(encode(event))
    others = {
        "notes.md": "x\n",
        "empty": "",
        "cut.jsonl": encode(event)[:40],  # no end of line: cut off, not taken for a log
        "other_tool.jsonl": json.dumps({"event": "start", "tool": {"name": "other"}}) + "\n",
        "not_start.jsonl": '{"event":"step","tool":{"name":"deadweight"}}\n',
        "deep.jsonl": "[" * 100_000 + "\n",
        "binary": "\udcff\n",
    }
    for name, text in others.items():
        (tmp_path / name).write_text(text, errors="surrogateescape")
        assert read_start(tmp_path / name) is None, name
    assert read_start(tmp_path) is None and read_start(tmp_path / "missing") is None
    os.mkfifo(tmp_path / "pipe")  # opened without waiting for a writer, and not read
    assert read_start(tmp_path / "pipe") is None
