"""The watch event log: versioned JSON lines, append-only, flushed at every watched step.

One JSON object per line, each with an `event` key:

    start         schema_version, tool, time, pid, argv, config; `run_id` under
                  `deadweight run` (the same in every log of one run)
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
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from deadweight._version import __version__
from deadweight.bounded_json import deeper_than
from deadweight.output_files import open_log
from deadweight.watching.event_schema import EventChecker, Rejected
from deadweight.watching.watch_stats import LOG_SCHEMA_VERSION


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
    """Writes events to a file, one line each, flushed when it matters.

    The log is written in place (a killed run keeps every line up to its last watched
    step), opened by `output_files.open_log`: never through a symbolic link, never a FIFO
    or a directory. Raises OSError or InputError when it cannot be opened."""

    def __init__(self, path: str | os.PathLike[str], *, append: bool = False) -> None:
        self.path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd = open_log(self.path, append=append)
        self._file: IO[str] | None = os.fdopen(fd, "a" if append else "w", encoding="utf-8")

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
    # events that were objects with an `event` kind but could not be used, per kind
    rejected: dict[str, int] = field(default_factory=dict)


def read_log(path: str | os.PathLike[str]) -> LogContents:
    """Every usable event of a log; a cut-off last line, a bad line or a field of the
    wrong type is noted (with its line numbers), not fatal."""
    out = LogContents()
    checker = EventChecker()
    notes = _Notes()
    with open(path, encoding="utf-8", errors="replace") as f:
        # Line by line: the text of a long log is never held whole next to its events.
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            # Only the last line can lack its "\n": the writer was killed mid-write.
            cut = not line.endswith("\n")
            try:
                event = parse_line(line)
            except json.JSONDecodeError as exc:
                if cut:
                    out.truncated = True
                    notes.add(number, "is cut off (the run was killed mid-write)")
                else:
                    notes.add(number, f"is not valid JSON ({exc.msg}); skipped")
                continue
            except LineTooComplex as exc:
                notes.add(number, f"{exc}; skipped")
                continue
            if not isinstance(event, dict) or "event" not in event:
                notes.add(number, "is not an event object; skipped")
                continue
            try:
                for note in checker.check(event):
                    notes.add(number, note)
            except Rejected as exc:
                notes.add(number, f"{exc}; skipped")
                kind = str(event["event"])[:40]
                out.rejected[kind] = out.rejected.get(kind, 0) + 1
                continue
            if event["event"] == "start":
                version = event.get("schema_version")
                # (One that is no number was dropped by the checker, with its own note.)
                if isinstance(version, int) and version > LOG_SCHEMA_VERSION:
                    notes.add(
                        number,
                        f"log schema version {version} is newer than this deadweight reads "
                        f"({LOG_SCHEMA_VERSION}); upgrade deadweight. Reading what it can.",
                    )
            if not _merged_into(out.events, event):
                out.events.append(event)
    out.problems = notes.lines()
    return out


def _merged_into(events: list[dict[str, Any]], event: dict[str, Any]) -> bool:
    """Append a `loss` event to the `loss` event just before it, when both are plain
    (their steps and values pair up): what the statistics read is the same, and a log of
    a million one-value loss events is held as two lists, not a million dicts (a 49 MB
    log peaked at 766 MB)."""
    if event.get("event") != "loss" or not events or events[-1].get("event") != "loss":
        return False
    last = events[-1]
    if set(event) != {"event", "steps", "values"} or set(last) != set(event):
        return False
    if not (
        len(event["steps"]) == len(event["values"]) and len(last["steps"]) == len(last["values"])
    ):
        return False
    last["steps"].extend(event["steps"])
    last["values"].extend(event["values"])
    return True


# Limits on one line of a log. The writer nests 4 deep (an optimizer event's parameter
# shapes): 32 levels leave room for any newer event and keep a hostile line from
# exhausting the recursion limit (a RecursionError deep inside json). Integers are
# bounded by Python's own limit on int() of a string (4300 digits by default, which
# keeps its quadratic cost to milliseconds); the schema bounds the counts it reads.
MAX_DEPTH = 32
_INT_DIGITS = re.compile(r"value has (\d+) digits")


class LineTooComplex(ValueError):
    """A line nests deeper, or holds longer integers, than any event can."""


def parse_line(line: str) -> Any:
    """json.loads of one line within MAX_DEPTH and the integer limit (else LineTooComplex)."""
    # Only a line with many brackets can nest deeply: then its depth is measured, in
    # time linear in its length, before json recurses into it.
    if line.count("[") + line.count("{") > MAX_DEPTH and deeper_than(line, MAX_DEPTH):
        raise LineTooComplex(f"nests deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(line)
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise LineTooComplex(f"nests deeper than {MAX_DEPTH} levels") from None
    except json.JSONDecodeError:
        raise
    except ValueError as exc:  # an integer past the limit, a lone surrogate, ...
        digits = _INT_DIGITS.search(str(exc))
        if digits:
            raise LineTooComplex(f"holds an integer of {digits.group(1)} digits") from None
        raise LineTooComplex(f"cannot be decoded ({exc})") from None


class _Notes:
    """Problems by what went wrong, each with the lines it happened on: a damaged
    10,000-step log gives one note per kind of damage, not 10,000."""

    def __init__(self) -> None:
        self.by_text: dict[str, list[int]] = {}

    def add(self, line: int, text: str) -> None:
        self.by_text.setdefault(text, []).append(line)

    def lines(self) -> list[str]:
        # "line 4 is not valid JSON ...", "lines 3-9: a 'step' event whose ..."
        out = []
        for text, numbers in self.by_text.items():
            span = line_span(numbers)
            if text.startswith("is "):
                out.append(f"{span} {'is' if len(numbers) == 1 else 'are'} {text[3:]}")
            else:
                out.append(f"{span}: {text}")
        return out


def line_span(numbers: list[int]) -> str:
    """`line 4`, `lines 3-9`, `lines 3, 5-7 and 12 more`: where a problem was met."""
    if len(numbers) == 1:
        return f"line {numbers[0]}"
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:4]]
    more = sum(b - a + 1 for a, b in runs[4:])
    return "lines " + ", ".join(shown) + (f" and {more} more" if more else "")


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
    """Rank 0 writes `path`, rank N `STEM.rankN.EXT`: one log per rank of a job.

    Raises ValueError for a rank that is not a number: it becomes part of a file name."""
    if not rank or rank == "0":
        return path
    if not (rank.isascii() and rank.isdigit()):
        raise ValueError(f"rank {rank!r} is not a number")
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{int(rank)}{ext or '.jsonl'}"


def log_path_for_pid(path: str, pid: int) -> str:
    """`STEM.pidN.EXT`: the log of another process of the same run (a script started by
    the script) that steps an optimizer."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.pid{pid}{ext or '.jsonl'}"


def process_logs_beside(path: str) -> list[str]:
    """The files next to `path` named as its rank and pid logs (`STEM.rankN.EXT`,
    `STEM.pidN.EXT`, N digits): exactly those names, never a mere prefix match
    (`data.rankings.csv` is no log of `data`). Whose they are is `read_start`'s to say."""
    directory, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    pattern = re.compile(rf"{re.escape(stem)}\.(?:rank|pid)[0-9]+{re.escape(ext or '.jsonl')}")
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names if pattern.fullmatch(n))


# A start event holds the command line and the configuration: well under this, unless
# argv is huge. A first line longer than this is not taken for a deadweight log.
_START_LINE_LIMIT = 1 << 20


def read_start(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The `start` event on the first line of `path` when it is a deadweight event log
    (a regular file whose first line is a start event written by deadweight), else None.

    Never blocks: a FIFO or a device at `path` is opened without waiting and not read."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            head = fh.readline(_START_LINE_LIMIT)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not head.endswith(b"\n"):
        return None
    try:
        event = json.loads(head)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past all reason
        return None
    if not isinstance(event, dict) or event.get("event") != "start":
        return None
    tool = event.get("tool")
    if not isinstance(tool, dict) or tool.get("name") != "deadweight":
        return None
    return event
