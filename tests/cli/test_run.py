"""`deadweight run -- python script.py`, end to end in subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deadweight.watching.event_log import read_log

TIMEOUT = 300  # generous: shared CI machines
ENV = {**os.environ, "COLUMNS": "200"}  # rich wraps at 80 columns without a terminal

SEED = """
import sys
from deadweight.demos import fused_rmsnorm as f

s = f.make(False)
f.train(s, 100)
sys.exit(3)
"""

RAISES = """
from deadweight.demos import fused_rmsnorm as f

s = f.make(False)
f.train(s, 12)
raise ValueError("bad batch 42")
"""

FOREVER = """
from deadweight.demos import fused_rmsnorm as f

s = f.make(False)
while True:
    s.optimizer.zero_grad(set_to_none=True)
    s.loss().backward()
    s.optimizer.step()
"""

GAN = """
import torch
import torch.nn.functional as F
from torch import nn


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


torch.manual_seed(0)
G, D = Generator(), Discriminator()
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
bce = F.binary_cross_entropy_with_logits
for step in range(10):
    real, z = torch.randn(16, 4) + 2, torch.randn(16, 4)
    opt_d.zero_grad()
    (bce(D(real), ones) + bce(D(G(z).detach()), zeros)).backward()
    opt_d.step()
    opt_g.zero_grad()
    bce(D(G(z)), ones).backward()
    opt_g.step()
    print(f"step {step}")  # with --format json, kept off stdout: it holds the report alone
"""

NO_OPTIMIZER = """
import sys
print("just data prep")
sys.exit(4)
"""


def dw_run(tmp_path: Path, script: str, *options: str, **kwargs) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(script))
    log = tmp_path / "run.jsonl"
    python = [sys.executable, str(path)]
    return subprocess.run(
        [sys.executable, "-m", "deadweight", "run", "--log", str(log), *options, "--", *python],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        **{"env": ENV, **kwargs},
    )


def events(tmp_path: Path, kind: str) -> list[dict]:
    return [e for e in read_log(tmp_path / "run.jsonl").events if e["event"] == kind]


def test_seed_incident_is_reported_and_the_exit_code_kept(tmp_path):
    result = dw_run(tmp_path, SEED, "--every", "10")
    assert result.returncode == 3, result.stderr
    assert "DW301" in result.stdout
    finding = next(line for line in result.stdout.splitlines() if "bitwise unchanged" in line)
    assert "l1.weight, norm.weight" in finding
    assert "100 steps" in result.stdout.splitlines()[0]
    assert events(tmp_path, "end")[0]["reason"] == "exited"
    assert f"deadweight: event log {tmp_path / 'run.jsonl'}" in result.stderr


def test_a_script_that_raises_shows_its_traceback_and_the_report(tmp_path):
    result = dw_run(tmp_path, RAISES, "--every", "5")
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert 'raise ValueError("bad batch 42")' in result.stderr
    header = result.stdout.splitlines()[0]
    assert header.startswith("deadweight watch · 12 steps")
    assert "run raised ValueError: bad batch 42" in header
    assert events(tmp_path, "end")[0]["reason"] == "raised ValueError: bad batch 42"


def _start_forever(tmp_path: Path, log: str = "run.jsonl") -> subprocess.Popen:
    path = tmp_path / "forever.py"
    path.write_text(textwrap.dedent(FOREVER))
    log = tmp_path / log
    command = ["deadweight", "run", "--every", "5", "--log", str(log), "--", sys.executable]
    proc = subprocess.Popen(
        [sys.executable, "-m", *command, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=ENV,
        start_new_session=True,  # a process group of its own, as a terminal job would be
        # Ctrl-C as at a terminal, even when this test runs in a background job: a shell
        # starts background commands with SIGINT ignored, and children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + TIMEOUT
    while not (log.exists() and '"event":"step"' in log.read_text()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no step event"
        time.sleep(0.05)
    return proc


def _kill_group(proc: subprocess.Popen) -> None:
    """Whatever happened, leave no script running (it is in deadweight's new session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.communicate()


@pytest.mark.parametrize("target", ["deadweight-only", "process-group"])
def test_ctrl_c_interrupts_the_script_and_reports(tmp_path, target):
    proc = _start_forever(tmp_path)
    try:
        sent = time.monotonic()
        if target == "deadweight-only":
            proc.send_signal(signal.SIGINT)
        else:  # Ctrl-C at a terminal: every process of the foreground group gets it
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=TIMEOUT)
        took = time.monotonic() - sent
    finally:
        _kill_group(proc)
    assert proc.returncode == 130, err
    assert "KeyboardInterrupt" in err
    assert "run interrupted" in out.splitlines()[0], out
    end = events(tmp_path, "end")
    assert len(end) == 1 and end[0]["reason"] == "interrupted"
    if target == "deadweight-only":
        assert took >= 1.0  # forwarded to the script after FORWARD_SIGINT_AFTER


@pytest.fixture(scope="module")
def gan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp_path = tmp_path_factory.mktemp("gan")
    return tmp_path, dw_run(tmp_path, GAN, "--every", "5", "--format", "json")


def test_two_models_and_two_optimizers_are_named_by_class(gan):
    tmp_path, result = gan
    assert result.returncode == 0, result.stderr
    names = {
        e["optimizer"]: [p["name"] for p in e["params"]] for e in events(tmp_path, "optimizer")
    }
    layers = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert sorted(names.values()) == [
        [f"Discriminator:{n}" for n in layers],
        [f"Generator:{n}" for n in layers],
    ]
    assert [e["step"] for e in events(tmp_path, "step") if e["optimizer"] == 0][-1] == 10


def test_json_output_parses(gan):
    _, result = gan
    report = json.loads(result.stdout)  # the script's prints are not in it
    assert "step 0\n" in result.stderr and "step 9\n" in result.stderr
    assert report["kind"] == "watch"
    assert report["subject"]["parameters"] == 8
    assert report["subject"]["optimizers"] == ["Adam#0", "Adam#1"]
    assert report["subject"]["end"] == "exited"


def test_a_command_that_steps_no_optimizer(tmp_path):
    result = dw_run(tmp_path, NO_OPTIMIZER)
    assert result.returncode == 4
    assert "just data prep" in result.stdout
    assert "the command imported torch in no Python process deadweight could see" in result.stderr
    assert not (tmp_path / "run.jsonl").exists()


def test_a_bad_select_fails_before_running_the_command(tmp_path):
    result = dw_run(tmp_path, NO_OPTIMIZER, "--select", "DW999")
    assert result.returncode == 2 and "unknown rule" in result.stderr
    assert "just data prep" not in result.stdout


# Says whether torch was imported before it ran: a sitecustomize may set up threads or
# devices that must be in place before torch loads, so deadweight runs it first.
SITECUSTOMIZE = """
import os
import sys
os.environ[{variable!r}] = __file__ + (" after torch" if "torch" in sys.modules else "")
"""

CHECK_SITECUSTOMIZE = """
import os
import torch

for variable in ("USER_SITECUSTOMIZE", "SCRIPT_DIR_SITECUSTOMIZE"):
    print(variable, os.environ.get(variable))
model = torch.nn.Linear(2, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
"""


def test_a_user_sitecustomize_still_runs_as_it_would_without_deadweight(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(variable="USER_SITECUSTOMIZE"))
    # Python puts the script's folder on sys.path only after `site` ran, so a
    # sitecustomize next to the script is not imported at startup, with or without us.
    (tmp_path / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(variable="SCRIPT_DIR_SITECUSTOMIZE")
    )
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(CHECK_SITECUSTOMIZE))
    env = {**ENV, "PYTHONPATH": str(site)}
    plain = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=TIMEOUT, env=env
    )
    watched = dw_run(tmp_path, CHECK_SITECUSTOMIZE, "--every", "1", env=env)
    assert watched.returncode == plain.returncode == 0, watched.stderr
    assert f"USER_SITECUSTOMIZE {site / 'sitecustomize.py'}\n" in plain.stdout
    assert set(plain.stdout.splitlines()) <= set(watched.stdout.splitlines())
    assert len(events(tmp_path, "step")) == 3  # and deadweight watched


def test_a_failing_user_sitecustomize_does_not_stop_watching(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("raise RuntimeError('broken site')\n")
    env = {**ENV, "PYTHONPATH": str(site)}
    result = dw_run(tmp_path, CHECK_SITECUSTOMIZE, "--every", "1", env=env)
    assert result.returncode == 0, result.stderr
    assert "Error in sitecustomize" in result.stderr and "broken site" in result.stderr
    assert len(events(tmp_path, "step")) == 3


def test_sigterm_to_deadweight_ends_the_script_too(tmp_path):
    proc = _start_forever(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        _kill_group(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    # Killed by the signal: no atexit, so no end record, and still a report.
    assert "log ends without an end record" in out.splitlines()[0], out
    assert not events(tmp_path, "end")


NESTED = """
import subprocess, sys
import torch
from torch import nn

child = '''
import os, sys, torch
print("torch threads", os.environ.get("OMP_NUM_THREADS"))
m = torch.nn.Linear(2, 2)
o = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    o.zero_grad(); m(torch.ones(1, 2)).sum().backward(); o.step()
'''
model = nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad(); model(torch.ones(2, 3)).sum().backward(); opt.step()
subprocess.run([sys.executable, "-c", child], check=True)  # a script started by the script
print("torch imported before the script?", "see stderr")
"""


def test_a_nested_script_writes_its_own_log(tmp_path):
    done = dw_run(tmp_path, NESTED, "--every", "1")
    assert done.returncode == 0, done.stderr
    main = events(tmp_path, "optimizer")
    assert [p["name"] for p in main[0]["params"]] == ["weight", "bias"]  # not overwritten
    nested = [p for p in tmp_path.iterdir() if p.name.startswith("run.pid")]
    assert len(nested) == 1
    assert [e["event"] for e in read_log(nested[0]).events].count("step") == 3


def test_torch_is_not_imported_for_processes_that_do_not_use_it(tmp_path):
    done = dw_run(
        tmp_path,
        """
        import os, sys
        os.environ["OMP_NUM_THREADS"] = "1"  # set before torch, as scripts do
        print("before", "torch" in sys.modules)
        import torch
        print("threads", torch.get_num_threads())
        """,
    )
    assert "before False" in done.stdout
    assert "threads 1" in done.stdout


# -- the event log never costs the user a file (issue 20) ---------------------------------

MARKS_THAT_IT_RAN = "open('ran', 'w').write('yes')\n"


def dw_log(tmp_path: Path, log: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", "run", "--log", log, "--", *command],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
        env=ENV,
    )


def test_an_existing_file_that_is_not_a_log_is_refused_before_the_script_starts(tmp_path):
    (tmp_path / "notes.md").write_text("x\n")
    result = dw_log(tmp_path, "notes.md", sys.executable, "-c", MARKS_THAT_IT_RAN)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("deadweight: error: --log ") and "notes.md" in line
    assert "is not a deadweight event log" in line
    assert (tmp_path / "notes.md").read_text() == "x\n"
    assert not (tmp_path / "ran").exists()


def test_the_script_itself_as_log_is_refused(tmp_path):
    (tmp_path / "t.py").write_text(MARKS_THAT_IT_RAN)
    result = dw_log(tmp_path, "t.py", sys.executable, "t.py")
    assert result.returncode == 2 and "is not a deadweight event log" in result.stderr
    assert (tmp_path / "t.py").read_text() == MARKS_THAT_IT_RAN
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("kind", ["directory", "fifo", "empty"])
def test_a_log_path_that_cannot_be_a_log_is_a_clear_error(tmp_path, kind):
    target = tmp_path / "log"
    if kind == "directory":
        target.mkdir()
        (target / "keep").write_text("k")
    elif kind == "fifo":
        os.mkfifo(target)
    else:  # an empty file may be anything (a package's __init__.py): not ours to fill
        target.write_text("")
    result = dw_log(tmp_path, "log", sys.executable, "-c", MARKS_THAT_IT_RAN)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("deadweight: error: --log ") and "Traceback" not in result.stderr
    assert not (tmp_path / "ran").exists()
    if kind == "directory":
        assert "is a directory" in line and (target / "keep").read_text() == "k"
    else:
        assert target.exists()


def test_files_that_only_start_like_the_log_are_never_touched(tmp_path):
    """`--log data` once removed data.rankings.csv and data.pidmap.txt (a prefix match)."""
    keep = {
        "data.rankings.csv": "r\n",
        "data.pidmap.txt": "p\n",
        "data.rank1.jsonl.bak": "b\n",
        "data.rank2.jsonl": "a user's file that happens to have a rank log's name\n",
    }
    for name, text in keep.items():
        (tmp_path / name).write_text(text)
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(NESTED_RANKED))
    result = dw_log(tmp_path, "data", sys.executable, str(script))
    assert result.returncode == 0, result.stderr
    for name, text in keep.items():
        assert (tmp_path / name).read_text() == text, name
    # rank 2 of the run could not have its log there, and says so; rank 1 wrote its own
    assert "data.rank2.jsonl" in result.stderr and "not writing" in result.stderr
    assert [e["event"] for e in read_log(tmp_path / "data.rank1.jsonl").events].count("step") == 2
    others = next(line for line in result.stderr.splitlines() if "other process" in line)
    assert others.endswith(f"{tmp_path / 'data.rank1.jsonl'}")


# Two nested processes with RANK set, as torchrun starts them (a rank log each).
NESTED_RANKED = """
import os, subprocess, sys
import torch

child = '''
import torch
m = torch.nn.Linear(2, 2)
o = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(2):
    o.zero_grad(); m(torch.ones(1, 2)).sum().backward(); o.step()
'''
m = torch.nn.Linear(2, 1)
o = torch.optim.SGD(m.parameters(), lr=0.1)
o.zero_grad(); m(torch.ones(1, 2)).sum().backward(); o.step()
for rank in ("1", "2"):
    subprocess.run([sys.executable, "-c", child], check=True, env={**os.environ, "RANK": rank})
"""


def test_a_rerun_replaces_the_earlier_runs_own_logs(tmp_path):
    first = dw_run(tmp_path, NESTED, "--every", "1")
    assert first.returncode == 0, first.stderr
    (stale,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.pid")]
    second = dw_run(tmp_path, NESTED, "--every", "1")
    assert second.returncode == 0, second.stderr
    assert len(events(tmp_path, "start")) == 1  # replaced, not appended to
    assert not stale.exists()  # the earlier run's nested log is gone, this one's is listed
    (fresh,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.pid")]
    assert str(fresh) in second.stderr and str(stale) not in second.stderr


def test_a_log_held_by_a_live_run_is_refused_and_left_alone(tmp_path):
    proc = _start_forever(tmp_path)  # writes run.jsonl, and keeps running
    try:
        log = tmp_path / "run.jsonl"
        second = dw_log(tmp_path, str(log), sys.executable, "-c", MARKS_THAT_IT_RAN)
        assert second.returncode == 2, second.stderr
        assert "another deadweight run" in second.stderr and "still running" in second.stderr
        assert not (tmp_path / "ran").exists()
        assert proc.poll() is None
        size = log.stat().st_size
        deadline = time.monotonic() + TIMEOUT
        while log.stat().st_size == size:  # the first run still writes its own log
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert read_log(log).events[0]["event"] == "start"
    finally:
        _kill_group(proc)


def test_a_concurrent_run_whose_log_looks_like_a_rank_log_is_not_reported_or_removed(tmp_path):
    """Run B logs to run.rank1.jsonl while run A (log run.jsonl) starts: A must neither
    remove B's live log nor report it as one of its own."""
    proc = _start_forever(tmp_path, log="run.rank1.jsonl")
    try:
        a = dw_run(tmp_path, NESTED, "--every", "1")
        assert a.returncode == 0, a.stderr
        assert (tmp_path / "run.rank1.jsonl").exists()
        others = next(line for line in a.stderr.splitlines() if "other process" in line)
        assert "run.rank1.jsonl" not in others and "run.pid" in others
        assert proc.poll() is None
    finally:
        _kill_group(proc)
