"""What `deadweight run` attaches to, and what it says when it cannot (issue 31).

The watch starts when torch has really been imported, whatever probed for it first
(`importlib.util.find_spec`, as transformers and datasets do), however it was loaded
(here: a LazyLoader). A run that trained
where deadweight could not watch is never reported as clean: it says so and exits 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from deadweight.watching import run_status
from deadweight.watching.event_log import read_log

TIMEOUT = 300  # generous: shared CI machines
ENV = {**os.environ, "COLUMNS": "200"}

LOOP = """
m = torch.nn.Linear(2, 2)
o = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    o.zero_grad(); m(torch.ones(1, 2)).sum().backward(); o.step()
"""

# Each of these imports torch its own way before the same three training steps (an
# import inside a function, runpy and `python -m` are run end to end in
# tests/e2e/test_run_real_scripts.py).
IMPORTS = {
    # transformers' and datasets' availability checks probe first
    "find_spec first": "import importlib.util\nassert importlib.util.find_spec('torch')\nimport torch\n",
    "LazyLoader": textwrap.dedent(
        """
        import importlib.util, sys
        spec = importlib.util.find_spec("torch")
        spec.loader = importlib.util.LazyLoader(spec.loader)
        torch = importlib.util.module_from_spec(spec)
        sys.modules["torch"] = torch
        spec.loader.exec_module(torch)
        """
    ),
}


def dw_run(
    cwd: Path, *command: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "deadweight",
            "run",
            "--every",
            "1",
            "--log",
            "run.jsonl",
            "--",
            *command,
        ],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd,
        env=env or ENV,
    )


def steps(path: Path) -> int:
    return [e["event"] for e in read_log(path).events].count("step")


@pytest.mark.parametrize("how", sorted(IMPORTS))
def test_the_watch_attaches_however_torch_is_imported(tmp_path, how):
    (tmp_path / "train.py").write_text(IMPORTS[how] + LOOP)
    done = dw_run(tmp_path, sys.executable, "train.py")
    assert done.returncode == 0, done.stderr
    assert steps(tmp_path / "run.jsonl") == 3


MANUAL_UPDATES = """
import torch
m = torch.nn.Linear(2, 2)
for _ in range(3):
    m.zero_grad()
    m(torch.ones(1, 2)).sum().backward()
    with torch.no_grad():
        for p in m.parameters():
            p -= 0.1 * p.grad
"""


def test_training_without_an_optimizer_step_is_not_a_clean_result(tmp_path):
    (tmp_path / "train.py").write_text(MANUAL_UPDATES)
    done = dw_run(tmp_path, sys.executable, "train.py")
    assert done.returncode == 2, done.stderr
    assert "ran backward 3 time(s) but stepped no torch.optim optimizer" in done.stderr
    assert "deadweight.check(model, loss_fn)" in done.stderr
    assert "stepped no optimizer and ran no backward" not in done.stderr


def test_a_script_that_fails_keeps_its_own_exit_code_when_unwatched(tmp_path):
    (tmp_path / "train.py").write_text(MANUAL_UPDATES + "raise SystemExit(5)\n")
    done = dw_run(tmp_path, sys.executable, "train.py")
    assert done.returncode == 5, done.stderr
    assert "stepped no torch.optim optimizer" in done.stderr


def test_torch_without_training_has_nothing_to_report_and_says_exactly_that(tmp_path):
    (tmp_path / "prep.py").write_text("import torch\nprint(torch.ones(2).sum().item())\n")
    done = dw_run(tmp_path, sys.executable, "prep.py")
    assert done.returncode == 0, done.stderr
    assert "stepped no optimizer and ran no backward (1 process(es) imported torch)" in done.stderr
    assert not (tmp_path / "run.jsonl").exists()


# Loads torch past the import system's finders, where deadweight waits for it.
PAST_THE_HOOK = (
    """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_AttachAfterTorch"]
import torch
"""
    + LOOP
)


# A finder of the script's own, ahead of deadweight's, hands out torch's spec.
FINDER_AHEAD = (
    """
import importlib.machinery, sys

class Ahead:
    def find_spec(self, name, path, target=None):
        if name == "torch":
            return importlib.machinery.PathFinder.find_spec(name, path, target)
        return None

sys.meta_path.insert(0, Ahead())
import torch
import colorsys  # the next module imported once torch is complete
"""
    + LOOP
)


def test_torch_found_by_another_finder_is_watched_from_the_next_import(tmp_path):
    (tmp_path / "train.py").write_text(FINDER_AHEAD)
    done = dw_run(tmp_path, sys.executable, "train.py")
    assert done.returncode == 0, done.stderr
    assert steps(tmp_path / "run.jsonl") == 3


def test_torch_loaded_where_deadweight_cannot_see_it_is_said_and_exits_2(tmp_path):
    (tmp_path / "train.py").write_text(PAST_THE_HOOK)
    done = dw_run(tmp_path, sys.executable, "train.py")
    assert done.returncode == 2, done.stderr
    assert "could not attach to process" in done.stderr
    assert "without passing through Python's import system" in done.stderr
    assert "deadweight.watch(model, optimizer)" in done.stderr


def test_a_watch_that_fails_to_start_is_said_and_exits_2(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    # A sitecustomize of the user's runs first (deadweight chains it): here it breaks
    # deadweight's own start, as a bug in deadweight would.
    (site / "sitecustomize.py").write_text(
        "import deadweight.watching.run_in_script as z\n"
        "def start(how='import torch'):\n"
        "    raise RuntimeError('broken start')\n"
        "z.start = start\n"
    )
    (tmp_path / "train.py").write_text("import torch\n" + LOOP)
    path = os.pathsep.join(p for p in (str(site), ENV.get("PYTHONPATH")) if p)
    done = dw_run(tmp_path, sys.executable, "train.py", env={**ENV, "PYTHONPATH": path})
    assert done.returncode == 2, done.stderr
    assert "could not attach to process" in done.stderr
    assert "starting the watch failed: RuntimeError: broken start" in done.stderr


# -- the summary itself, record by record ------------------------------------------------


def record(**fields) -> run_status.ProcessStatus:
    base = dict(
        pid=10,
        argv=["python", "train.py"],
        attached=True,
        how="import torch",
        error=None,
        ended=True,
        steps=0,
        backwards=0,
        log=None,
    )
    return run_status.ProcessStatus(**{**base, **fields})


def test_no_process_with_torch_says_nothing_was_watched():
    said = run_status.summarise([], log_written=False)
    assert not said.unwatched
    assert said.lines == [
        "the command imported torch in no Python process deadweight could see, so nothing was "
        "watched (a Python started with -E, -I or -S, or one where deadweight is not "
        "installed, is not seen)."
    ]


def test_a_launcher_that_never_trains_adds_nothing_to_a_watched_run():
    trained = record(pid=11, steps=40, backwards=40, log="run.jsonl")
    said = run_status.summarise([record(), trained], log_written=True)
    assert not said.unwatched and said.lines == []


def test_a_killed_process_is_not_called_clean_or_unwatched():
    said = run_status.summarise([record(ended=False)], log_written=False)
    assert not said.unwatched
    assert "ended before they could report what they saw" in said.lines[0]


def test_an_unwatched_process_beside_a_watched_one_still_fails_the_run():
    trained = record(pid=11, steps=40, backwards=40, log="run.jsonl")
    broken = record(pid=12, attached=False, error="ImportError: x")
    said = run_status.summarise([trained, broken], log_written=True)
    assert said.unwatched
    assert said.lines == [
        "could not attach to process 12 (`python train.py`): starting the watch failed: "
        f"ImportError: x. Nothing it did was watched; {run_status.WATCH_INSIDE}."
    ]


def test_records_are_read_back_and_half_written_ones_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv(run_status.ENV_STATUS, str(tmp_path))
    run_status.attached("import torch")
    run_status.ended("import torch", 3, 3, "run.jsonl")
    (tmp_path / "99-x.json.partial").write_text("{")
    (tmp_path / "98-y.json").write_text("not json")
    (read,) = run_status.read(str(tmp_path))
    assert (read.pid, read.steps, read.backwards, read.log, read.ended) == (
        os.getpid(),
        3,
        3,
        "run.jsonl",
        True,
    )
