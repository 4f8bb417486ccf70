"""What the framework callbacks share: start a watch on what the framework hands over,
forward it, close it exactly once, and log the report."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from torch import nn

from deadweight.integrations.forward import forward_to
from deadweight.report import Report
from deadweight.watching.watcher import Watch, watch
from deadweight.wrappers import torch_optimizer


def rank_path(path: str | os.PathLike[str] | None, rank: int, world_size: int) -> str | None:
    """One log per process: `run.jsonl` becomes `run.rank3.jsonl` when there are several."""
    if path is None:
        return None
    path = os.fspath(path)
    if world_size <= 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


FORWARD_CHOICES = ("auto", "none", "tensorboard", "wandb")


def checked_forward(forward: Any) -> Any:
    """A callback's `forward=` option: one of FORWARD_CHOICES, or a writer/run object."""
    if isinstance(forward, str) and forward not in FORWARD_CHOICES:
        raise ValueError(
            f"forward must be one of {', '.join(FORWARD_CHOICES)} or a writer/run, got {forward!r}"
        )
    return forward


class WatchSession:
    """One watch per training run; `close` is idempotent (so is `Watch.close`)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        every: int,
        log: str | os.PathLike[str] | None,
        full: bool,
        max_forwarded: int,
    ) -> None:
        self.logger = logger
        self.every = every
        self.log = log
        self.full = full
        self.max_forwarded = max_forwarded
        self.watch: Watch | None = None  # kept after close, for its `stats`
        self.report: Report | None = None
        self.forwarders: list[Any] = []
        self._open = False

    @property
    def open(self) -> bool:
        return self._open

    def start(
        self,
        models: Sequence[nn.Module],
        optimizers: Sequence[Any],
        *,
        scaler: Any = None,
        targets: Sequence[Any] = (),
        step_offset: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> Watch | None:
        """Start watching, or log why not and return None: deadweight never stops training."""
        if self._open:
            self.close("not closed: a new run started")
        # Handed on as they are: watch() looks through the wrappers itself (a DeepSpeed
        # optimizer is watched through its view, not through the torch optimizer inside).
        found = [opt for opt in optimizers if torch_optimizer(opt) is not None]
        if not found:
            kinds = ", ".join(type(o).__name__ for o in optimizers) or "none"
            self.logger.warning(
                "deadweight: no torch.optim.Optimizer to watch (got %s); not watching", kinds
            )
            return None
        try:
            self.watch = watch(
                list(models),
                found,
                every=self.every,
                log=rank_path(self.log, rank, world_size),
                full=self.full,
                scaler=scaler,
            )
        except Exception as exc:
            self.logger.warning("deadweight: could not start watching: %s", exc, exc_info=True)
            return None
        self._open = True
        self.report = None
        self.forwarders = []
        for target in targets:
            try:
                self.forwarders.append(
                    forward_to(
                        self.watch, target, max_params=self.max_forwarded, step_offset=step_offset
                    )
                )
            except TypeError as exc:
                self.logger.warning("deadweight: not forwarding: %s", exc)
        return self.watch

    def close(self, reason: str = "closed") -> Report | None:
        """Remove every hook, keep the report and log it; later calls return the same one."""
        w = self.watch
        if w is None or not self._open:
            return self.report
        self._open = False
        w.close(reason)
        self.report = w.report()
        level = logging.INFO if self.report.ok else logging.WARNING
        self.logger.log(level, "deadweight watch (%s):\n%s", reason, self.report)
        return self.report
