"""What each process of a `deadweight run` tells the `run` command about itself.

A run is watched from inside the script's processes; only they know whether watching
started there and whether they trained. `deadweight run` makes a private folder
for the run (`DEADWEIGHT_RUN_STATUS`), and every process that imports torch writes
one small JSON record into it: when watching starts, and again at exit with the
optimizer steps it watched and the backward passes it saw. A process that never
imports torch writes nothing. After the command `run` reads the records back
(`summarise`): a run that trained where deadweight could not watch is then never
reported as clean, and "stepped no optimizer" is said only when it is true.

No torch here: the bootstrap calls this at exit in processes that may not have it
loaded, and `run` itself never imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any

ENV_STATUS = "DEADWEIGHT_RUN_STATUS"
SUFFIX = ".json"
# The command line shown for a process is cut to this many characters.
MAX_SHOWN = 120
# What to do when a process could not be watched from outside.
WATCH_INSIDE = (
    "watch it from inside the script instead: `with deadweight.watch(model, optimizer): ...` "
    "around the training loop (README: During training)"
)

# (pid, folder) -> this process's record (a forked child writes one of its own)
_mine: dict[tuple[int, str], str] = {}


@dataclass(frozen=True)
class ProcessStatus:
    """One process of the run, as it described itself."""

    pid: int
    argv: list[str]
    attached: bool  # watching started
    how: str | None  # what started it ("import torch", ...)
    error: str | None  # why watching could not start
    ended: bool  # it reached its exit handlers (False: killed, or still running)
    steps: int  # optimizer steps it watched
    backwards: int  # backward passes it saw
    log: str | None  # the log it wrote, None when it wrote none
    hooked: list[str] = field(default_factory=list)  # sys.meta_path, when not attached

    @property
    def command(self) -> str:
        text = shlex.join(self.argv) if self.argv else "?"
        return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."

    @property
    def trained_unwatched(self) -> bool:
        """Backward ran but no optimizer step was seen: it trained some other way."""
        return self.attached and self.ended and self.steps == 0 and self.backwards > 0


def _path() -> str | None:
    folder = os.environ.get(ENV_STATUS)
    if not folder or not os.path.isdir(folder):  # another machine of the job, or gone
        return None
    pid = os.getpid()
    key = (pid, folder)
    if key not in _mine:
        _mine[key] = os.path.join(folder, f"{pid}-{secrets.token_hex(4)}{SUFFIX}")
    return _mine[key]


def _write(record: dict[str, Any]) -> None:
    path = _path()
    if path is None:
        return
    python = os.path.basename(sys.executable or "python")
    record = {"pid": os.getpid(), "argv": [python, *map(str, sys.argv)], **record}
    partial = path + ".partial"
    try:
        with open(partial, "w", encoding="utf-8") as fh:
            json.dump(record, fh)
        os.replace(partial, path)  # `run` never reads half a record
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(partial)


def attached(how: str) -> None:
    """Watching started in this process (written at once: a killed process leaves it)."""
    _write({"attached": True, "how": how, "ended": False, "steps": 0, "backwards": 0})


def ended(how: str, steps: int, backwards: int, log: str | None) -> None:
    """At exit, after the watch closed: what it saw."""
    _write(
        {
            "attached": True,
            "how": how,
            "ended": True,
            "steps": steps,
            "backwards": backwards,
            "log": log,
        }
    )


def not_attached(error: str | None, meta_path: list[Any]) -> None:
    """At exit of a process that imported torch without watching starting."""
    _write(
        {
            "attached": False,
            "error": error,
            "ended": True,
            "hooked": [type(f).__name__ for f in meta_path],
        }
    )


def read(folder: str) -> list[ProcessStatus]:
    """Every process's last record, in the order the processes started (by pid, as
    well as that can be told); an unreadable record is skipped."""
    out = []
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(SUFFIX))
    except OSError:
        return []
    for name in names:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                data = json.load(fh)
            out.append(
                ProcessStatus(
                    pid=int(data["pid"]),
                    argv=[str(a) for a in data.get("argv") or []],
                    attached=bool(data.get("attached")),
                    how=_text(data.get("how")),
                    error=_text(data.get("error")),
                    ended=bool(data.get("ended")),
                    steps=int(data.get("steps") or 0),
                    backwards=int(data.get("backwards") or 0),
                    log=_text(data.get("log")),
                    hooked=[str(h) for h in data.get("hooked") or []],
                )
            )
        except (OSError, ValueError, TypeError, KeyError):
            continue
    out.sort(key=lambda r: r.pid)
    return out


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass
class RunAttach:
    """What the records say about the run as a whole, for `deadweight run`.

    `unwatched`: a process trained, or may have, where deadweight did not watch it
    (`run` then exits 2 unless the script failed); `lines`: what to tell the user."""

    unwatched: bool = False
    lines: list[str] = field(default_factory=list)


def summarise(records: list[ProcessStatus], *, log_written: bool) -> RunAttach:
    """The verdict on the run's processes; `log_written`: some process wrote the main log."""
    result = RunAttach()
    for r in records:
        if not r.attached or r.error is not None:
            result.unwatched = True
            result.lines.append(_could_not_attach(r))
        elif r.trained_unwatched:
            result.unwatched = True
            result.lines.append(
                f"process {r.pid} (`{r.command}`) ran backward {r.backwards} time(s) but "
                "stepped no torch.optim optimizer, so none of its training was watched: "
                "deadweight watches optimizer steps. A loop that updates the parameters "
                "itself can be checked on a batch with deadweight.check(model, loss_fn)."
            )
        elif r.steps and r.log is None:
            result.lines.append(
                f"process {r.pid} (`{r.command}`) was watched for {r.steps} step(s) but wrote "
                "no log (its error is above)."
            )
    if log_written or result.lines:
        return result
    if not records:
        result.lines.append(
            "the command imported torch in no Python process deadweight could see, so nothing "
            "was watched (a Python started with -E, -I or -S, or one where deadweight is not "
            "installed, is not seen)."
        )
    elif any(not r.ended for r in records):
        cut = [r for r in records if not r.ended]
        result.lines.append(
            f"{len(cut)} process(es) ended before they could report what they saw (killed?): "
            + ", ".join(f"{r.pid} (`{r.command}`)" for r in cut)
            + "; no optimizer step reached the log."
        )
    else:
        result.lines.append(
            f"the command stepped no optimizer and ran no backward ({len(records)} process(es) "
            "imported torch), so there is nothing to report."
        )
    return result


def _could_not_attach(r: ProcessStatus) -> str:
    if r.error is not None:
        why = f"starting the watch failed: {r.error}"
    else:
        ahead = [h for h in r.hooked if h != "_AttachAfterTorch"]
        why = (
            "torch was loaded without passing through Python's import system where deadweight "
            "waits for it" + (f" (import hooks: {', '.join(ahead)})" if ahead else "")
        )
    return (
        f"could not attach to process {r.pid} (`{r.command}`): {why}. Nothing it did was "
        f"watched; {WATCH_INSIDE}."
    )
