"""The script side of `deadweight run`: watch every optimizer, close the log at exit.

`deadweight run` starts the user's command with `deadweight/watching/_bootstrap` first on
PYTHONPATH and the settings in `DEADWEIGHT_RUN_*` variables; that folder's
`sitecustomize` calls `start()` before the script's first line runs. The log is
opened only when an optimizer first steps, so a launcher or data-loading process
that never steps writes nothing. Under torchrun every rank but 0 writes to
`LOG.rank{N}.jsonl`; any other process that steps after the first one claimed the
log (a script started by the script) writes to `LOG.pid{N}.jsonl`.

`deadweight run` has claimed (and locks) the main log itself. A rank or pid log is
created only where no file is, or over a deadweight log: one of this same run (the
`run_id` of its start event, from `DEADWEIGHT_RUN_ID`) or an earlier run's that no live
run holds. A file of the user's that happens to have such a name is never overwritten;
that process then writes no log and says so.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import TracebackType

from deadweight.watching.event_log import log_path_for_pid, log_path_for_rank, read_start

ENV_LOG = "DEADWEIGHT_RUN_LOG"
ENV_EVERY = "DEADWEIGHT_RUN_EVERY"
ENV_FULL = "DEADWEIGHT_RUN_FULL"
ENV_OWNER = "DEADWEIGHT_RUN_OWNER"  # pid of the process that writes the main log
# "0": do not record the loss at `.backward()` (the report then has no loss curve)
ENV_LOSS = "DEADWEIGHT_RUN_LOSS"
# Written into the start event of every log of one `deadweight run`: the parent reports
# the rank and pid logs that carry it, and no others.
ENV_RUN_ID = "DEADWEIGHT_RUN_ID"
ENV_CHECK = "DEADWEIGHT_RUN_CHECK"  # "0": no step-0 check (`deadweight run --no-check`)

_reason = ["exited"]


def claim_log_path(path: str) -> str:
    """The log this process writes, decided when it first steps an optimizer."""
    rank = os.environ.get("RANK")
    if rank is not None:
        try:
            return log_path_for_rank(path, rank)
        except ValueError:  # not a number: not a name to put in a path; a log of its own
            return log_path_for_pid(path, os.getpid())
    owner = os.environ.get(ENV_OWNER)
    if owner and owner != str(os.getpid()):
        return log_path_for_pid(path, os.getpid())
    # Processes started from now on inherit this and write logs of their own.
    os.environ[ENV_OWNER] = str(os.getpid())
    return path


def may_write(path: str, main: str, run_id: str | None) -> bool:
    """Whether this process may (over)write `path`: the main log, which `deadweight run`
    claimed for this run; a new file, created here and now; a log of this run; or an
    earlier run's log that no live run holds (the script has started: it is replaced)."""
    if os.path.abspath(path) == os.path.abspath(main):
        return True
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        return True
    except FileExistsError:
        pass
    except OSError:
        return True  # the writer reports why it cannot write there
    start = read_start(path)
    if start is None:
        return False  # not a deadweight log: the user's file
    if run_id is not None and start.get("run_id") == run_id:
        return True
    return not _held_by_a_live_run(path)


def _held_by_a_live_run(path: str) -> bool:
    """Whether a running `deadweight run` holds `path` as its main log (it is locked)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no locks, so none held
        return False
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return True  # cannot tell: leave it alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a file system without locks
    finally:
        os.close(fd)  # releases the probe's lock
    return False


def start(how: str = "import torch") -> None:
    """Watch this process (`how`: what started it, for `deadweight run`'s summary)."""
    # Here, not at the top: `deadweight run` itself reads the ENV_* names above and
    # never imports torch.
    from deadweight.watching import run_status
    from deadweight.watching.global_watch import GlobalWatch
    from deadweight.watching.step_monitor import MonitorConfig

    run_id = os.environ.get(ENV_RUN_ID)

    class RunWatch(GlobalWatch):
        def _open_log(self) -> None:
            events = self._events
            if events.path is not None and events.file is None and events.pending is not None:
                main = events.path
                events.path = claim_log_path(main)
                if not may_write(events.path, main, run_id):
                    print(
                        f"deadweight: not writing {events.path}: the file exists and is not "
                        "a log of this run (this process is watched without a log)",
                        file=sys.stderr,
                    )
                    events.path, events.pending = None, None
                    return
                for event in events.pending:
                    if event.get("event") == "start" and run_id is not None:
                        event["run_id"] = run_id
                # This run's log started by this very process: an earlier image of it,
                # replaced by os.execv. Its events are kept; this image's follow them as
                # a run of their own (the report reads the last, the page shows each).
                earlier = read_start(events.path) or {}
                events.append = (
                    run_id is not None
                    and earlier.get("run_id") == run_id
                    and (earlier.get("pid") == os.getpid())
                )
            super()._open_log()

    config = MonitorConfig(
        every=int(os.environ.get(ENV_EVERY, "20")), full=os.environ.get(ENV_FULL) == "1"
    )
    watch = RunWatch(
        config=config,
        log=os.environ[ENV_LOG],
        argv=list(sys.argv),
        loss=os.environ.get(ENV_LOSS) != "0",
        check=os.environ.get(ENV_CHECK) != "0",
    )
    previous_hook = sys.excepthook

    def excepthook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        _reason[0] = (
            "interrupted"
            if issubclass(kind, KeyboardInterrupt)
            else f"raised {kind.__name__}: {exc}"
        )
        previous_hook(kind, exc, tb)

    sys.excepthook = excepthook

    def at_exit() -> None:
        watch.close(_reason[0])
        # What `deadweight run` needs to tell a watched run from one that trained
        # some other way (run_status.summarise).
        logged = watch.log_path if watch.steps_taken and watch.writes_log else None
        run_status.ended(how, watch.steps_taken, watch.backwards, logged)

    atexit.register(at_exit)
    run_status.attached(how)
