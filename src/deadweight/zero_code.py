"""The script side of `deadweight run`: watch every optimizer, close the log at exit.

`deadweight run` starts the user's command with `deadweight/_bootstrap` first on
PYTHONPATH and the settings in `DEADWEIGHT_RUN_*` variables; that folder's
`sitecustomize` calls `start()` before the script's first line runs. The log is
opened only when an optimizer first steps, so a launcher or data-loading process
that never steps writes nothing. Under torchrun every rank but 0 writes to
`LOG.rank{N}.jsonl`; any other process that steps after the first one claimed the
log (a script started by the script) writes to `LOG.pid{N}.jsonl`.
"""

from __future__ import annotations

import atexit
import os
import sys
from types import TracebackType

from deadweight.probes.event_log import log_path_for_rank
from deadweight.probes.step_monitor import MonitorConfig

ENV_LOG = "DEADWEIGHT_RUN_LOG"
ENV_EVERY = "DEADWEIGHT_RUN_EVERY"
ENV_FULL = "DEADWEIGHT_RUN_FULL"
ENV_OWNER = "DEADWEIGHT_RUN_OWNER"  # pid of the process that writes the main log
# "0": do not wrap Tensor.backward to record the loss (the report then has no loss curve)
ENV_LOSS = "DEADWEIGHT_RUN_LOSS"

_reason = ["exited"]


def claim_log_path(path: str) -> str:
    """The log this process writes, decided when it first steps an optimizer."""
    rank = os.environ.get("RANK")
    if rank is not None:
        return log_path_for_rank(path, rank)
    owner = os.environ.get(ENV_OWNER)
    if owner and owner != str(os.getpid()):
        stem, ext = os.path.splitext(path)
        return f"{stem}.pid{os.getpid()}{ext or '.jsonl'}"
    # Processes started from now on inherit this and write logs of their own.
    os.environ[ENV_OWNER] = str(os.getpid())
    return path


def start() -> None:
    from deadweight.watcher import GlobalWatch

    class RunWatch(GlobalWatch):
        def _open_log(self) -> None:
            if self.log_path is not None and self._writer is None and self._pending is not None:
                self.log_path = claim_log_path(self.log_path)
            super()._open_log()

    config = MonitorConfig(
        every=int(os.environ.get(ENV_EVERY, "20")), full=os.environ.get(ENV_FULL) == "1"
    )
    watch = RunWatch(
        config=config,
        log=os.environ[ENV_LOG],
        argv=list(sys.argv),
        loss=os.environ.get(ENV_LOSS) != "0",
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
    atexit.register(lambda: watch.close(_reason[0]))
