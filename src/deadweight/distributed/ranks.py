"""torch.distributed plumbing: which rank we are, and small reductions with a deadline.

Everything deadweight exchanges between ranks goes through one gloo process group
of its own, created on first use with a timeout: per-parameter vectors (a flag or
a norm per parameter tensor, never the tensors themselves) and, for `check`, the
findings each rank judged. A separate group keeps deadweight's traffic off the
user's NCCL or gloo group (its collectives never interleave with training's), works
whatever backend training uses, and gives every collective a deadline, so a rank
that died or never calls in makes the others raise `CollectiveError` instead of
hanging.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from deadweight.distributed.rank_stats import RankPresence
from deadweight.errors import CollectiveError, InputError

# Seconds a deadweight collective waits for the other ranks. Long enough for a rank
# that is a checkpoint save or a slow data-loader batch behind the others; short
# enough that a dead rank turns into an error within minutes rather than the hours
# of NCCL's default watchdog. DEADWEIGHT_COLLECTIVE_TIMEOUT overrides it.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "DEADWEIGHT_COLLECTIVE_TIMEOUT"

_groups: dict[tuple[int, float], Any] = {}


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job, and the group deadweight talks over."""

    rank: int
    world_size: int
    backend: str  # the training process group's backend, as torch names it
    timeout_s: float

    def group(self) -> Any:
        """deadweight's own gloo group, created on first use.

        new_group is itself collective: every rank gets here in the same order
        because check() and watch() run on every rank. Its rendezvous has the same
        deadline as the collectives, so a rank that is already gone is caught here.
        """
        import torch.distributed as dist

        key = (id(dist.group.WORLD), self.timeout_s)
        group = _groups.get(key)
        if group is None:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            _groups[key] = group
        return group

    def describe(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "backend": self.backend,
            "timeout_s": self.timeout_s,
        }


def release_groups() -> None:
    """Drop deadweight's own gloo groups while the interpreter is still whole (at exit,
    after the hooks registered later, such as the zero-code watch's final collectives):
    a group left for interpreter shutdown to destroy, after the script's own
    destroy_process_group() or without one, aborted a torchrun rank now and then there
    ("terminate called without an active exception", 3 runs in 23 under load)."""
    import torch.distributed as dist

    while _groups:
        _, group = _groups.popitem()
        if dist.is_available() and dist.is_initialized():
            with contextlib.suppress(Exception):  # already torn down with the default group
                dist.destroy_process_group(group)
        del group


atexit.register(release_groups)


def timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise InputError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise InputError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


def is_wrapped_for_distribution(
    model: nn.Module, modules: Iterable[nn.Module] | None = None
) -> bool:
    """A DDP wrapper, or a module sharded with FSDP2's `fully_shard` (at any depth).
    `modules`: `model.modules()`, when the caller has just listed them."""
    if not isinstance(model, nn.Module):
        return False
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    return any(_is_fsdp2(m) for m in (model.modules() if modules is None else modules))


def _is_fsdp2(module: nn.Module) -> bool:
    fsdp_module = _fsdp_module_type()
    return fsdp_module is not None and isinstance(module, fsdp_module)


@functools.cache
def _fsdp_module_type() -> type | None:
    """FSDP2's module class, imported at first use (asked once per module per check:
    an import statement each time cost more than the isinstance)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return FSDPModule


def uses_fsdp2(model: nn.Module) -> bool:
    return isinstance(model, nn.Module) and any(_is_fsdp2(m) for m in model.modules())


def sharded_names(params: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of DTensor (sharded, e.g. FSDP2) parameters among `params`."""
    return [n for n, p in params if hasattr(p, "to_local") and hasattr(p, "placements")]


def ranks_for(
    model: nn.Module | None = None, modules: Iterable[nn.Module] | None = None
) -> Ranks | None:
    """This job's `Ranks` when it runs on more than one process, else None.

    A model wrapped for distribution in a process without an initialised process
    group is an error worth stating (DDP and FSDP2 cannot even be built that way, so
    it means the group was torn down before deadweight ran). `modules`:
    `model.modules()`, when the caller has just listed them.
    """
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if not initialised:
        if model is not None and is_wrapped_for_distribution(model, modules):
            raise InputError(
                f"{type(model).__name__} is wrapped for distributed training but "
                "torch.distributed is not initialised in this process (was "
                "destroy_process_group() called already?); run deadweight between "
                "init_process_group() and destroy_process_group()"
            )
        return None
    world = dist.get_world_size()
    if world == 1:
        return None
    if not dist.is_gloo_available():
        raise InputError(
            "deadweight reduces its statistics over a gloo process group, and this "
            "torch build has no gloo backend"
        )
    backend = str(dist.get_backend())
    return Ranks(dist.get_rank(), world, backend, timeout_s())


@contextlib.contextmanager
def local_backward(model: nn.Module) -> Iterator[None]:
    """Inside: a DDP model's forward and backward talk to no other rank.

    Gradients then stay those of this rank's own batch (DDP would otherwise fill a
    parameter this rank never used with the other ranks' average, hiding exactly
    what a check looks for), and a rank that runs an extra forward, as the
    functional probes do, waits for nobody: no gradient all-reduce, no buffer
    broadcast.
    """
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        yield
        return
    saved = (model.require_backward_grad_sync, model.require_forward_param_sync)
    model.require_backward_grad_sync = False
    model.require_forward_param_sync = False
    try:
        yield
    finally:
        model.require_backward_grad_sync, model.require_forward_param_sync = saved


@dataclass(frozen=True)
class Layout:
    """How a model is spread over processes, as a check needs to know it."""

    ranks: Ranks | None  # None in a single process
    shards: Shards | None  # the parameters are DTensors (FSDP2); None otherwise


@contextlib.contextmanager
def layout_for_check(model: Any) -> Iterator[Layout]:
    """The model's `Layout`; inside, a DDP model's forward and backward stay local
    (`local_backward`). The check's one distributed call before it measures."""
    # One walk of the modules serves the FSDP2 and wrapper questions below.
    modules = list(model.modules()) if isinstance(model, nn.Module) else None
    ranks = ranks_for(model, modules)
    sharded = False
    if modules is not None:
        # A forward under no_grad (an evaluation, a sample printed) leaves FSDP2's root
        # parameters gathered, registered in place of the DTensors; the check's own
        # forward would free their memory under it.
        fsdp2_reshard(model, modules)
        sharded = holds_dtensors(list(model.parameters()))
    layout = Layout(ranks, Shards(ranks) if sharded else None)
    if not isinstance(model, nn.Module):
        yield layout
        return
    with local_backward(model):
        yield layout


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) parameter that lives on this rank."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


@dataclass(frozen=True)
class Shards:
    """The model's parameters are DTensors (FSDP2): each rank holds a slice of each.

    Statistics are then sums over the local slices, added up across the ranks by
    one collective over small per-parameter vectors; no parameter is gathered
    whole. `ranks` is None in a single process (a one-rank mesh), where the local
    slice is the whole tensor.
    """

    ranks: Ranks | None

    def sum(self, t: torch.Tensor, what: str) -> torch.Tensor:
        return t if self.ranks is None else all_reduce(self.ranks, t, "sum", what)

    def mean(self, value: float | None, what: str) -> float | None:
        """The mean of the ranks' `value`s, or None on every rank when any rank has none.

        One all-reduce of [value / world, failed]: a rank whose value is None or not
        finite still enters it, so the others neither wait for it nor go on without
        it, and every rank gets the same answer. The mean is formed as
        `checking.sharded_flow` forms the checked loss (value / world, summed in float64),
        so an unchanged rerun reproduces that loss.
        """
        mine = value if value is not None and math.isfinite(value) else None
        if self.ranks is None:
            return mine
        world = self.ranks.world_size
        row = torch.tensor([0.0, 1.0] if mine is None else [mine / world, 0.0], dtype=torch.float64)
        total = all_reduce(self.ranks, row, "sum", what).tolist()
        return None if total[1] > 0 else float(total[0])


def holds_dtensors(params: Sequence[torch.Tensor]) -> bool:
    return any(hasattr(p, "to_local") and hasattr(p, "placements") for p in params)


def _layout(t: torch.Tensor) -> tuple[Any, Any]:
    """A DTensor's (placements, device mesh); (None, None) for a plain tensor."""
    return getattr(t, "placements", None), getattr(t, "device_mesh", None)


def share_of_sum(t: torch.Tensor, world_size: int) -> float:
    """The weight of this rank's local sums in a sum over all ranks.

    A DTensor sharded over k of the mesh's ranks is held once by every group of k
    ranks, so a plain sum over the world counts each element world / k times; a
    plain tensor is a full copy on every rank (counted world times).
    """
    placements, mesh = _layout(t)
    if placements is None or mesh is None:
        return 1.0 / world_size
    sharded_over = 1
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            sharded_over *= mesh.size(dim)
    return sharded_over / world_size


def one_copy_ranks(t: torch.Tensor) -> list[int]:
    """The global ranks whose local slices of `t`, in this order, make one whole copy.

    A DTensor sharded over one mesh dimension and replicated over another (HSDP) is
    held whole by each replica group: the ranks at coordinate 0 of every dimension
    it is not sharded over are one such group, in mesh order along the sharded
    dimension. A plain tensor is whole on every rank: [0].
    """
    placements, mesh = _layout(t)
    if placements is None or mesh is None:
        return [0]
    index = tuple(slice(None) if p.is_shard() else 0 for p in placements)
    return [int(r) for r in mesh.mesh[index].flatten().tolist()]


def replica_ranks(t: torch.Tensor) -> tuple[int, ...] | None:
    """For a DTensor, the global ranks holding the same local slice as this rank.

    Those share this rank's coordinates along the mesh dimensions the tensor is
    sharded over and differ along the others: HSDP's replicate dimension, or
    nobody else (just this rank) under plain FSDP2. None for a plain tensor.
    """
    placements, mesh = _layout(t)
    if placements is None or mesh is None:
        return None
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is outside the tensor's mesh
        return ()
    index = tuple(
        c if p.is_shard() else slice(None) for p, c in zip(placements, coordinate, strict=True)
    )
    return tuple(int(r) for r in mesh.mesh[index].flatten().tolist())


def ddp_ranks(model: nn.Module) -> tuple[int, ...] | None:
    """The global ranks of a DDP wrapper's process group when it is not the whole
    world (`DDP(module, process_group=group)`), else None."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return None
    import torch.distributed as dist

    ranks = tuple(int(r) for r in dist.get_process_group_ranks(model.process_group))
    return None if len(ranks) == dist.get_world_size() else ranks


def fsdp2_reshard(model: nn.Module, modules: Iterable[nn.Module] | None = None) -> None:
    """Put every FSDP2 module of `model` back in its sharded state (local, no collective).

    After a forward under no_grad, FSDP2 keeps the root module's parameters (and
    those of any module built with reshard_after_forward=False) gathered, since no
    backward comes to reshard them, and the next forward reuses the gathered copy: a
    value written to a sharded parameter in between would go unseen by it, and the
    stale copy would outlive the check into training. Resharding makes the next
    forward all-gather the shards as they are. `modules`: `model.modules()`, when the
    caller has just listed them.
    """
    for module in model.modules() if modules is None else modules:
        if _is_fsdp2(module):
            module.reshard()  # type: ignore[operator]


def fsdp2_unsharded(model: nn.Module) -> dict[int, torch.Tensor]:
    """id(sharded parameter) -> the unsharded parameter FSDP2 swaps in during forward.

    The autograd graph of a forward holds the unsharded parameters as its leaves,
    so this is how a leaf found in the graph is named. It reads FSDP2's internals
    (no public accessor exists); on a torch where they differ it returns what it
    can, and the leaves it misses go unnamed in the explanations.
    """
    out: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if not _is_fsdp2(module):
            continue
        try:
            state = module._get_fsdp_state()  # type: ignore[operator]
            groups = list(getattr(state, "_fsdp_param_groups", None) or [])
            single = getattr(state, "_fsdp_param_group", None)
            if single is not None:
                groups.append(single)
            for group in groups:
                for fsdp_param in group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        out[id(fsdp_param.sharded_param)] = unsharded
        except Exception:  # another torch's internals: explanations lose names only
            continue
    return out


def _run(what: str, ranks: Ranks, fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, group=ranks.group(), **kwargs)
    except RuntimeError as exc:  # gloo and the store report a timeout or a lost peer so
        raise CollectiveError(
            f"rank {ranks.rank}: {what} across {ranks.world_size} ranks failed within "
            f"{ranks.timeout_s:g} s ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); "
            "another rank has probably died or stopped calling deadweight"
        ) from exc


def all_reduce(
    ranks: Ranks, t: torch.Tensor, op: str = "sum", what: str = "a reduction"
) -> torch.Tensor:
    """Reduce a small CPU vector over deadweight's group; returns the reduced copy."""
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    out = t.detach().to("cpu", copy=True).contiguous()
    _run(what, ranks, dist.all_reduce, out, op=ops[op])
    return out


def all_gather_objects(ranks: Ranks, obj: Any, what: str) -> list[Any]:
    """Every rank's `obj`, in rank order (small metadata only: names, findings)."""
    import torch.distributed as dist

    out: list[Any] = [None] * ranks.world_size
    _run(what, ranks, dist.all_gather_object, out, obj)
    return out


def per_rank_flags(ranks: Ranks, rows: Sequence[Sequence[bool]], what: str) -> torch.Tensor:
    """(world_size, len(rows), P) bools: every rank's flag vectors, one all-reduce.

    Each rank fills only its own slice of a zero tensor, so a sum is a gather of
    bytes proportional to ranks x parameter tensors, not to their elements.
    """
    width = len(rows[0]) if rows else 0
    out = torch.zeros(ranks.world_size, len(rows), width, dtype=torch.int32)
    if rows:
        out[ranks.rank] = torch.tensor([list(r) for r in rows], dtype=torch.int32)
    return all_reduce(ranks, out, "sum", what).bool()


def names_digest(names: Sequence[str]) -> str:
    return hashlib.sha256("\0".join(names).encode()).hexdigest()[:16]


def check_same_names(ranks: Ranks, names: Sequence[str], what: str) -> None:
    """Raise when ranks hold different parameter lists (per-parameter vectors would mismatch)."""
    digests = all_gather_objects(ranks, (names_digest(names), len(names)), f"{what} names")
    if len(set(digests)) > 1:
        groups: dict[tuple[str, int], list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        listed = "; ".join(f"ranks {v}: {k[1]} parameters" for k, v in groups.items())
        raise InputError(
            f"the ranks hold different parameter lists ({listed}); deadweight compares "
            "parameters by name across ranks, so every rank must hold the same model"
        )


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "RankPresence",
    "Ranks",
    "Shards",
    "all_gather_objects",
    "all_reduce",
    "check_same_names",
    "ddp_ranks",
    "fsdp2_reshard",
    "fsdp2_unsharded",
    "holds_dtensors",
    "is_wrapped_for_distribution",
    "local_backward",
    "local_tensor",
    "one_copy_ranks",
    "per_rank_flags",
    "ranks_for",
    "release_groups",
    "replica_ranks",
    "sharded_names",
    "share_of_sum",
    "timeout_s",
    "uses_fsdp2",
]
