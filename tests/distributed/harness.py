"""Run a worker function on N gloo ranks in fresh processes, with a deadline.

Plain spawned processes rather than `torch.multiprocessing.spawn`: that one kills
every rank as soon as one fails, and some tests need the survivors of a dead rank
to finish their reports.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

# A rank that takes longer than this is hung; the test fails instead of CI waiting.
DEADLINE_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int,
    world: int,
    port: int,
    out: str,
    worker: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    torch.set_num_threads(1)
    backend = os.environ.get("DW_TEST_BACKEND", "gloo")
    # The training group's own timeout: short where a test kills a rank on purpose.
    timeout = timedelta(seconds=float(os.environ.get("DW_TEST_PG_TIMEOUT", "60")))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    try:
        result = worker(rank, world, *args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result, default=str))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    worker: Callable[..., Any],
    world: int,
    tmp_path: Path,
    *args: Any,
    env: dict[str, str] | None = None,
    deadline_s: float = DEADLINE_S,
) -> dict[int, Any]:
    """Each rank's JSON result by rank; ranks that wrote none are missing."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(
            target=_entry,
            args=(r, world, port, str(tmp_path), worker, args, env or {}),
            daemon=True,
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    hung = []
    for r, p in enumerate(procs):
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            hung.append(r)
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    if hung:
        raise AssertionError(f"ranks {hung} still running after {deadline_s:g} s")
    results = {}
    for r in range(world):
        f = tmp_path / f"rank{r}.json"
        if f.exists():
            results[r] = json.loads(f.read_text())
    return results
