"""Run a reader in a child process under a time limit and an address-space limit.

A regression of a hang or of unbounded memory must fail the test, not hang it or take the
machine down: the child gets `timeout` seconds and at most `memory` bytes more address
space than it had after its imports, and reports its peak resident memory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass

from tests.cli_runner import BOUND_MB, BOUND_SECONDS

__all__ = ["BOUND_MB", "BOUND_SECONDS", "READ_ALL", "Outcome", "run_bounded"]

# What each child reports on its last line of stdout.
_PRELUDE = """
import json, resource, sys, time
_started = time.monotonic()
from deadweight.checkpoints.readers import CheckpointError, open_checkpoint

def _vm_bytes():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()

resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + {memory}, resource.RLIM_INFINITY))
outcome = {{"error": None, "other": None}}
try:
{body}
except CheckpointError as exc:
    outcome["error"] = str(exc)
except BaseException as exc:  # what the test is looking for: anything else
    outcome["other"] = f"{{type(exc).__name__}}: {{str(exc)[:500]}}"
# VmHWM, not ru_maxrss: on Linux ru_maxrss carries the forking parent's peak across exec.
with open("/proc/self/status") as fh:
    outcome["maxrss_kb"] = next(int(l.split()[1]) for l in fh if l.startswith("VmHWM:"))
outcome["seconds"] = time.monotonic() - _started
print(json.dumps(outcome))
"""

# Each path below is opened and every tensor read through, as a scan would.
READ_ALL = """
with open_checkpoint(PATH) as ckpt:
    for entry in ckpt.entries():
        for _ in ckpt.chunks(entry, max_bytes=1 << 20):
            pass
"""


@dataclass(frozen=True)
class Outcome:
    error: str | None  # the CheckpointError's message
    other: str | None  # any other exception: a bug
    maxrss_mb: float
    returncode: int
    seconds: float  # in the child, imports included
    extra: dict[str, object]  # what the body put in `outcome` besides the above


def run_bounded(
    path: str, body: str = READ_ALL, *, timeout: float = 60, memory: int = 2 << 30
) -> Outcome:
    """Runs `body` (with PATH bound to `path`) in a child; raises on a timeout."""
    code = _PRELUDE.format(
        memory=memory, body=textwrap.indent(f"PATH = {path!r}\n" + body.strip(), "    ")
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"the child printed nothing (rc {done.returncode}): {done.stderr[-2000:]}"
    report = json.loads(lines[-1])
    known = {"error", "other", "maxrss_kb", "seconds"}
    extra = {k: v for k, v in report.items() if k not in known}
    return Outcome(
        report["error"],
        report["other"],
        report["maxrss_kb"] / 1024,
        done.returncode,
        report["seconds"],
        extra,
    )
