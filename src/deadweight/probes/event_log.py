"""The watch event log: versioned JSON lines, append-only, flushed at every watched step.

One JSON object per line, each with an `event` key:

    start         schema_version, tool, time, pid, argv, config
    optimizer     an optimizer is watched: its class, groups, parameters (names,
                  shapes, group), which are small (exact statistics) and which have
                  their values logged; `start_step` when it continues an earlier
                  monitor of the same optimizer (parameters were added)
    step          a watched step: per-parameter arrays in the order of the
                  optimizer event (grad RMS over the window, param norm, update norm
                  where measured, bitwise moved-since-start, gradient presence
                  counts), and cumulative update statistics of the small parameters
    reset         Adam-family state went back to zero for some parameters, and why
    reset_effect  update sizes of the small parameters before and right after a reset
    nonfinite     first step a parameter's grad or value was NaN/Inf
    skip          a GradScaler skipped a step (`counted_as_step` when a fused
                  optimizer's step() ran and skipped inside)
    loss          (schema 2) training losses handed to `Watch.log_loss`, or seen by
                  `deadweight run` at `.backward()`, since the previous loss event:
                  `steps` and `values` (null where non-finite), one transfer per
                  watched step
    error         a detector failed and was disabled (training went on)
    end           the run ended: closed, exited, raised, or was interrupted

Counters in `step` events are cumulative since the optimizer was first watched, so
the last complete line of a killed run carries everything up to it.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from deadweight._version import __version__

# Bumped when a log carries what an older reader would miss without a word: new keys
# in an existing event keep the number. A reader accepts every version up to its own
# and notes a newer one (reading what it can). 2: `loss` events; a version-1 log has
# none, and the report then says the loss was not recorded.
LOG_SCHEMA_VERSION = 2


def _finite(value: Any) -> Any:
    """Non-finite floats become null: strict JSON has no NaN (the `nonfinite` event says which)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    return value


def encode(event: dict[str, Any]) -> str:
    try:
        return json.dumps(event, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN or Inf somewhere: rare, so only then walk the event
        return json.dumps(_finite(event), separators=(",", ":"), allow_nan=False)


def start_event(config: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    return {
        "event": "start",
        "schema_version": LOG_SCHEMA_VERSION,
        "tool": {"name": "deadweight", "version": __version__},
        "time": time.time(),
        "pid": os.getpid(),
        "argv": argv,
        "config": config,
    }


class LogWriter:
    """Writes events to a file, one line each, flushed when it matters."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        self._file: IO[str] | None = open(self.path, "w", encoding="utf-8")  # noqa: SIM115

    def write(self, event: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(encode(event) + "\n")
        # Every line but the per-optimizer introduction is a step or a rare event: flush
        # so a killed process loses at most what came after its last watched step.
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class LogContents:
    events: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # what could not be read, and why
    truncated: bool = False  # the last line was cut off (the writer was killed)


def read_log(path: str | os.PathLike[str]) -> LogContents:
    """Every valid event of a log; a cut-off last line or a bad line is noted, not fatal."""
    out = LogContents()
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    # A complete log ends with "\n", so the last element is "" unless the last write was cut.
    last = len(lines) - 1
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            if number - 1 == last:
                out.truncated = True
                out.problems.append(f"line {number} is cut off (the run was killed mid-write)")
            else:
                out.problems.append(f"line {number} is not valid JSON ({exc.msg}); skipped")
            continue
        if not isinstance(event, dict) or "event" not in event:
            out.problems.append(f"line {number} is not an event object; skipped")
            continue
        if event["event"] == "start":
            version = event.get("schema_version")
            if not isinstance(version, int) or version > LOG_SCHEMA_VERSION:
                out.problems.append(
                    f"line {number}: log schema version {version} is newer than this deadweight "
                    f"reads ({LOG_SCHEMA_VERSION}); upgrade deadweight. Reading what it can."
                )
        out.events.append(event)
    return out


def iter_runs(events: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Split a log into runs at each `start` event."""
    run: list[dict[str, Any]] = []
    for event in events:
        if event.get("event") == "start" and run:
            yield run
            run = []
        run.append(event)
    if run:
        yield run


def log_path_for_rank(path: str, rank: str | None) -> str:
    """Rank 0 writes `path`, rank N `STEM.rankN.EXT`: one log per rank of a job."""
    if not rank or rank == "0":
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.jsonl'}"
