"""Where a watch's events go: its statistics, its log, and its listeners.

Every event a watch emits (the monitors', the loop checks', the replica check's, the
loss log's and its own) is applied to the live `WatchStats`, written to the JSONL
log (`event_log.LogWriter`), and handed to each listener. A log that is opened late
(zero-code mode opens it at the first step, so processes that never step write
nothing) gets the events held until then. Nothing here may stop training: a failing
log or listener becomes an `error` event and is dropped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from deadweight.errors import InputError
from deadweight.watching.event_log import LogWriter
from deadweight.watching.watch_stats import WatchStats

Listener = Callable[[dict[str, Any]], None]


class EventWriter:
    """The statistics, log and listeners of one watch."""

    def __init__(self, stats: WatchStats, path: str | None, *, lazy: bool = False) -> None:
        """`path`: the log (None: no log); `lazy`: open it at `open_log()`, not now."""
        self.stats = stats
        self.path = path
        # Append to the log instead of replacing it: `deadweight run`'s process continuing,
        # after os.execv, the log its earlier image wrote.
        self.append = False
        self.file: LogWriter | None = None
        # Events before the log is opened (zero-code mode opens it at the first step, so
        # processes that never step, such as a launcher or data workers, write nothing).
        self.pending: list[dict[str, Any]] | None = [] if path is not None else None
        self.listeners: list[Listener] = []
        if path is not None and not lazy:
            self.open_log()

    @property
    def writes_log(self) -> bool:
        """Whether the log is open and writable."""
        return self.file is not None

    def add_listener(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def open_log(self) -> None:
        if self.path is None or self.file is not None or self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            self.file = LogWriter(self.path, append=self.append)
            for event in pending:
                self.file.write(event)
        except (OSError, InputError) as exc:  # InputError: a path no log may be written to
            self.error("log", exc)
            self.file = None

    def error(self, detector: str, exc: Exception) -> None:
        """An error that cannot go through `emit` (the log or a listener failed): into
        the statistics, and into the log when the log itself still works."""
        event = {
            "event": "error",
            "optimizer": None,
            "step": self.stats.steps,
            "detector": detector,
            "message": f"{type(exc).__name__}: {exc}",
        }
        self.stats.apply(event)
        if self.file is not None and detector != "log":
            with contextlib.suppress(Exception):
                self.file.write(event)
        elif self.pending is not None:
            self.pending.append(event)

    def emit(self, event: dict[str, Any]) -> None:
        try:
            self.stats.apply(event)
        except Exception as exc:
            self.error("statistics", exc)
        if self.pending is not None:
            self.pending.append(event)
        elif self.file is not None:
            try:
                self.file.write(event)
            except Exception as exc:  # a full disk must not stop training either
                self.error("log", exc)
                self.file = None
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception as exc:
                self.listeners.remove(listener)
                self.error(f"listener {listener!r}", exc)

    def close(self) -> None:
        if self.file is not None:
            with contextlib.suppress(Exception):  # a failing flush must not end the script
                self.file.close()
