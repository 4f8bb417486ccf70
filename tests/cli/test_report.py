"""`deadweight report LOG.jsonl`: logs of killed runs, cut-off lines, empty and newer logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import deadweight
from deadweight.cli import main
from deadweight.demos import fused_rmsnorm
from deadweight.watching.event_log import LOG_SCHEMA_VERSION, read_log

TIMEOUT = 300  # generous: shared CI machines
WIDE = {"COLUMNS": "200"}  # rich wraps at 80 columns without a terminal

TRAIN_FOREVER = """
import sys
import deadweight
from deadweight.demos import fused_rmsnorm as f

s = f.make(False, seed=1)
with deadweight.watch(s.model, s.optimizer, log=sys.argv[1], every=5):
    while True:
        s.optimizer.zero_grad(set_to_none=True)
        s.loss().backward()
        s.optimizer.step()
"""


def step_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [e for e in read_log(path).events if e["event"] == "step"]


def wait_for_steps(path: Path, proc: subprocess.Popen, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while len(step_events(path)) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the script wrote no step events"
        time.sleep(0.05)


def dw(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, **WIDE},
    )


def test_log_of_a_killed_run_is_reported_up_to_its_last_record(tmp_path):
    script, log = tmp_path / "train.py", tmp_path / "run.jsonl"
    script.write_text(TRAIN_FOREVER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(log)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_steps(log, proc, 12)  # step 55: past DW301's 50 steps
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == -signal.SIGKILL
    contents = read_log(log)
    assert not [e for e in contents.events if e["event"] == "end"]
    last = step_events(log)[-1]["step"]
    assert last >= 55

    result = dw("report", str(log))
    assert result.returncode in (0, 1), result.stderr  # findings or none, never an error
    header = result.stdout.splitlines()[0]
    assert f"· {last} steps ·" in header
    assert "log ends without an end record" in header
    # The seed's parameters never moved in those steps: the killed run still tells.
    assert result.returncode == 1
    assert "DW301" in result.stdout and "l1.weight" in result.stdout
    if contents.truncated:  # the kill landed in the middle of a write
        assert "cut off" in result.stderr

    as_json = json.loads(dw("report", str(log), "--format", "json").stdout)
    assert as_json["subject"]["steps"] == last
    assert as_json["subject"]["complete"] is False


@pytest.fixture(scope="module")
def complete_log(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The text of the log of a finished watched run (seed 1, 60 steps, every 10)."""
    path = tmp_path_factory.mktemp("log") / "run.jsonl"
    setup = fused_rmsnorm.make(False, seed=1)
    with deadweight.watch(setup.model, setup.optimizer, log=path, every=10):
        fused_rmsnorm.train(setup, 60)
    return path.read_text()


def report(capsys: pytest.CaptureFixture[str], path: Path, *args: str) -> tuple[int, str, str]:
    code = main(["report", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _wide(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in WIDE.items():
        monkeypatch.setenv(key, value)


def test_complete_log(capsys, tmp_path, complete_log):
    path = tmp_path / "run.jsonl"
    path.write_text(complete_log)
    code, out, err = report(capsys, path)
    assert code == 1
    assert out.splitlines()[0].startswith("deadweight watch · 60 steps · optimizers SGD#0")
    assert "without an end record" not in out
    assert "DW301" in out and "l1.weight" in out and "norm.weight" in out
    assert err == ""
    assert report(capsys, path, "--fail-on", "never")[0] == 0


def test_cut_off_last_line_is_read_with_a_note(capsys, tmp_path, complete_log):
    lines = complete_log.splitlines(keepends=True)
    steps = [i for i, line in enumerate(lines) if '"event":"step"' in line]
    # Killed while writing the last step record: it is half there, no end record.
    cut = "".join(lines[: steps[-1]]) + lines[steps[-1]][: len(lines[steps[-1]]) // 2]
    path = tmp_path / "cut.jsonl"
    path.write_text(cut)
    code, out, err = report(capsys, path)
    assert code == 1
    assert f"line {steps[-1] + 1} is cut off" in err
    assert "deadweight: note:" in err
    previous = json.loads(lines[steps[-2]])["step"]
    assert f"· {previous} steps ·" in out.splitlines()[0]
    assert "log ends without an end record" in out


def test_a_bad_line_in_the_middle_is_skipped_with_a_note(capsys, tmp_path, complete_log):
    lines = complete_log.splitlines(keepends=True)
    lines.insert(3, "{not json\n")
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(lines))
    code, out, err = report(capsys, path)
    assert code == 1 and "line 4 is not valid JSON" in err
    assert "· 60 steps ·" in out.splitlines()[0]


def test_empty_log_is_an_error(capsys, tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    code, out, err = report(capsys, path)
    assert code == 2
    assert f"{path} holds no watch events" in err
    assert out == ""


def test_missing_log_is_an_error(capsys, tmp_path):
    code, _, err = report(capsys, tmp_path / "nope.jsonl")
    assert code == 2 and "no such file" in err


def _bump_schema(text: str, version: int) -> list[dict]:
    events = [json.loads(line) for line in text.splitlines()]
    assert events[0]["event"] == "start"
    events[0]["schema_version"] = version
    return events


def test_newer_schema_is_read_with_a_clear_note(capsys, tmp_path, complete_log):
    newer = LOG_SCHEMA_VERSION + 1
    path = tmp_path / "newer.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in _bump_schema(complete_log, newer)))
    code, out, err = report(capsys, path)
    assert code == 1 and "DW301" in out
    assert f"log schema version {newer} is newer than this deadweight reads" in err
    assert "upgrade deadweight" in err


def test_newer_schema_with_a_changed_layout_is_not_a_crash(capsys, tmp_path, complete_log):
    newer = LOG_SCHEMA_VERSION + 1
    events = _bump_schema(complete_log, newer)
    for event in events:
        if event["event"] == "step":
            event["moved_v2"] = event.pop("moved")  # a layout this version cannot read
    events.insert(2, {"event": "from_the_future", "x": 1})  # unknown kinds are ignored
    path = tmp_path / "newer.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    code, out, err = report(capsys, path)
    # No step record could be read: an error naming the file, not a green "no findings".
    assert code == 2 and out == ""
    assert "upgrade deadweight" in err
    assert f"{path}: none of its 7 step events could be read" in err
    assert "a 'step' event without 'moved'; skipped" in err
    assert "Traceback" not in err


def test_several_runs_in_one_log_report_the_last(capsys, tmp_path, complete_log):
    path = tmp_path / "two.jsonl"
    path.write_text(complete_log + complete_log)
    code, _, err = report(capsys, path)
    assert code == 1 and "holds 2 runs; reporting the last one" in err


# -- malformed input (issue 20): every bad line or field a note naming it, the rest used --


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def _write_events(path: Path, events: list[dict]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


@pytest.mark.parametrize(
    ("line", "note"),
    [
        ('{"event":"step","x":' + "[" * 200_000 + "]" * 200_000 + "}\n", "nests deeper than"),
        ('{"event":"loss","n":' + "7" * 5000 + "}\n", "holds an integer of 5000 digits"),
        ('{"event":"step","s":"' + "\\ud800" + '"}\n', "not"),  # a lone surrogate
    ],
    ids=["nested-200k-deep", "5000-digit-integer", "lone-surrogate"],
)
def test_a_hostile_line_is_skipped_and_the_rest_is_read(capsys, tmp_path, complete_log, line, note):
    lines = _lines(complete_log)
    lines.insert(3, line)
    path = tmp_path / "hostile.jsonl"
    path.write_text("".join(lines))
    started = time.monotonic()
    code, out, err = report(capsys, path)
    assert time.monotonic() - started < 60  # generous: the fix reads it in well under 1 s
    assert code == 1, err
    assert "· 60 steps ·" in out.splitlines()[0] and "DW301" in out
    assert f"{path}: line 4" in err and note in err
    assert "Traceback" not in err


def test_a_string_lr_drops_that_field_not_the_log(capsys, tmp_path, complete_log):
    events = _events(complete_log)
    for event in events:
        if event["event"] == "optimizer":
            event["groups"][0]["lr"] = "fast"
        if event["event"] == "step":
            event["lr"], event["lr_sum"] = ["fast"], ["fast"]
    path = _write_events(tmp_path / "lr.jsonl", events)
    code, out, err = report(capsys, path)
    assert code == 1, err  # the parameters that never moved are still found
    assert "DW301" in out and "l1.weight" in out
    assert "line 2: an 'optimizer' event's group 'lr' is not a number or null; dropped" in err
    steps = [n for n, e in enumerate(events, start=1) if e["event"] == "step"]
    assert f"lines {steps[0]}-{steps[-1]}: a 'step' event's 'lr_sum' holds entries" in err
    assert "Unknown format code" not in err and "could not be read" not in err


@pytest.mark.parametrize("step", [-10, 10.5, "10", True, None])
def test_a_step_that_is_not_a_count_is_rejected_with_a_note(capsys, tmp_path, complete_log, step):
    events = _events(complete_log)
    first = next(n for n, e in enumerate(events) if e["event"] == "step")
    events[first]["step"] = step
    path = _write_events(tmp_path / "step.jsonl", events)
    code, out, err = report(capsys, path)
    assert code == 1 and "· 60 steps ·" in out.splitlines()[0]
    assert (
        f"line {first + 1}: a 'step' event whose 'step' is not a non-negative integer; skipped"
        in err
    )


def test_negative_steps_everywhere_are_an_error_not_no_findings(capsys, tmp_path, complete_log):
    events = _events(complete_log)
    for event in events:
        if event["event"] == "step":
            event["step"] = -event["step"]
    path = _write_events(tmp_path / "negative.jsonl", events)
    code, out, err = report(capsys, path)
    assert code == 2 and out == ""
    assert f"{path}: none of its 7 step events could be read" in err
    assert "not a non-negative integer" in err and "no findings" not in out


def test_arrays_shorter_than_the_parameters_reject_the_event(capsys, tmp_path, complete_log):
    events = _events(complete_log)
    last = max(n for n, e in enumerate(events) if e["event"] == "step")
    events[last]["moved"] = events[last]["moved"][:1]
    path = _write_events(tmp_path / "short.jsonl", events)
    code, out, err = report(capsys, path)
    assert code == 1 and "· 50 steps ·" in out.splitlines()[0]  # the record before it
    assert f"line {last + 1}: a 'step' event whose 'moved' holds 1 entries for 3" in err


def test_many_bad_lines_give_one_note(capsys, tmp_path, complete_log):
    lines = _lines(complete_log)
    lines[3:3] = ["{not json\n"] * 500
    path = tmp_path / "noisy.jsonl"
    path.write_text("".join(lines))
    code, _, err = report(capsys, path)
    assert code == 1
    notes = [line for line in err.splitlines() if "not valid JSON" in line]
    assert notes == [
        f"deadweight: note: {path}: lines 4-503 are not valid JSON (Expecting property name "
        "enclosed in double quotes); skipped"
    ]


@pytest.fixture(scope="module")
def saved_report(complete_log: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("saved") / "run.jsonl"
    path.write_text(complete_log)
    result = dw("report", str(path), "--format", "json")
    assert result.returncode == 1, result.stderr
    return json.loads(result.stdout)


BAD_REPORTS = {
    "findings-not-a-list": lambda d: d.update(findings="abc"),
    "finding-not-an-object": lambda d: d["findings"].append(5),
    "line-a-string": lambda d: d["findings"][0].update(location={"line": "x"}),
    "severity-unknown": lambda d: d["findings"][0].update(severity="fatal"),
    "subject-a-list": lambda d: d.update(subject=[1]),
    "loss-a-string": lambda d: d["subject"].update(loss="low"),
    "params-numbers": lambda d: d["findings"][0].update(params=[1, 2]),
    "a-json-list": lambda d: (d.clear(), d.update(kind="x", findings=[], subject={"tensors": 3})),
}


@pytest.mark.parametrize("mutate", list(BAD_REPORTS.values()), ids=list(BAD_REPORTS))
def test_a_saved_report_of_wrong_types_is_an_error_and_the_rest_is_rendered(
    capsys, tmp_path, complete_log, saved_report, mutate
):
    data = json.loads(json.dumps(saved_report))
    mutate(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    log = tmp_path / "run.jsonl"
    log.write_text(complete_log)
    code = main(["report", str(bad), str(log)])
    out, err = capsys.readouterr()
    assert code == 2
    assert f"deadweight: error: {bad} is not a valid deadweight report: " in err
    assert "· 60 steps ·" in out and "DW301" in out  # the log is still reported
    assert "Traceback" not in err


def test_a_bad_saved_report_is_skipped_in_the_html_page(
    capsys, tmp_path, complete_log, saved_report
):
    data = json.loads(json.dumps(saved_report))
    data["findings"].append(5)
    bad, log, page = tmp_path / "bad.json", tmp_path / "run.jsonl", tmp_path / "r.html"
    bad.write_text(json.dumps(data))
    log.write_text(complete_log)
    code = main(["report", str(bad), str(log), "-o", str(page)])
    _, err = capsys.readouterr()
    assert code == 2
    assert f"{bad} is not a valid deadweight report: finding 2 is not an object; skipped" in err
    assert "DW301" in page.read_text()


def test_a_deeply_nested_json_file_is_an_error_naming_it(capsys, tmp_path, complete_log):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 200_000 + "]" * 200_000)
    log = tmp_path / "run.jsonl"
    log.write_text(complete_log)
    code = main(["report", str(deep), str(log), "-o", str(tmp_path / "r.html")])
    _, err = capsys.readouterr()
    assert code == 2
    assert f"{deep} is neither a watch event log nor deadweight's JSON output" in err
    assert "nests deeper than" in err


def test_a_fifo_input_is_refused_without_blocking(tmp_path, complete_log):
    fifo = tmp_path / "run.jsonl"
    os.mkfifo(fifo)
    log = tmp_path / "good.jsonl"
    log.write_text(complete_log)
    for extra in ([], ["-o", str(tmp_path / "r.html")]):
        result = dw("report", str(fifo), str(log), *extra)  # TIMEOUT guards a hang
        assert result.returncode == 2
        assert f"{fifo} is not a regular file" in result.stderr
        assert "Traceback" not in result.stderr


def test_a_saved_diff_with_an_infinite_change_is_read_back(capsys, tmp_path):
    # A tensor that was all zeros (a fresh bias) changes infinitely; JSON writes inf as
    # null, and reading the report back rejected it as a wrong type.
    import torch
    from safetensors.torch import save_file

    a, b = tmp_path / "step-0.safetensors", tmp_path / "step-1.safetensors"
    save_file({"fc.bias": torch.zeros(3), "fc.weight": torch.ones(3)}, a)
    save_file({"fc.bias": torch.ones(3), "fc.weight": torch.full((3,), 2.0)}, b)
    saved = tmp_path / "diff.json"
    saved.write_text(deadweight.diff_checkpoints(str(a), str(b)).to_json())
    assert json.loads(saved.read_text())["subject"]["top_movers"][0]["relative_change"] is None
    page = tmp_path / "r.html"
    code = main(["report", str(saved), "-o", str(page)])
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "not a valid deadweight report" not in err
    assert "fc.bias" in page.read_text()
