"""Under DDP every rank holds the same parameters: compare them across ranks at watched steps.

Per parameter tensor, each rank computes a checksum of the raw bits and the norm of
its copy; one all-reduce (MAX over [checksum, -checksum, norm, -norm]) says whether
the copies are bitwise identical and how far apart their norms are. The traffic is
4 float64 numbers per parameter tensor per watched step, whatever the tensors'
sizes. Only when some differ does a second, equally small exchange say which ranks
hold which copy. The first watched step also compares the names each rank's
optimizer covers, so the per-parameter vectors line up (and DW207 learns of a
mismatch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from deadweight.errors import CollectiveError
from deadweight.probes import distributed
from deadweight.probes.step_monitor import _fingerprint

# Checksums are cut to 52 bits so that they travel exactly as float64, in the same
# tensor as the norms: one collective instead of two.
_MASK = (1 << 52) - 1

Emit = Callable[[dict[str, Any]], None]


class ReplicaCheck:
    """Cross-rank comparison for one watched optimizer; every rank calls `after_step` alike."""

    def __init__(
        self,
        ranks: distributed.Ranks,
        index: int,
        names: Sequence[str],
        params: Sequence[torch.Tensor],
        stepped: Sequence[bool],
        emit: Emit,
        every: int,
    ) -> None:
        self.ranks = ranks
        self.index = index
        self.names = list(names)
        self.params = list(params)
        self.stepped = list(stepped)  # in the optimizer (not only in the watched model)
        self.emit = emit
        self.every = every
        self.positions: list[int] | None = None  # of the names every rank holds
        self.disabled = False
        # Payload handed to deadweight's collectives (for the benchmark): the one-off
        # name exchange, and the per-watched-step comparison.
        self.name_bytes = 0
        self.compare_bytes = 0
        self.checks = 0
        # Sharded (FSDP2 / DTensor) parameters differ across ranks by design.
        self.replicated = not any(hasattr(p, "to_local") for p in self.params)

    def due(self, step: int, start_step: int) -> bool:
        # Decided from the step counter alone, which every rank shares, never from
        # local observations: every rank must enter the same collectives.
        return step == start_step + 1 or step % self.every == 0

    def after_step(self, step: int, start_step: int) -> None:
        if self.disabled or not self.due(step, start_step):
            return
        try:
            if self.positions is None:
                self.positions = self._agree_on_names(step)
            if self.replicated and self.positions:
                self._compare(step)
            self.checks += 1
        except CollectiveError as exc:
            self.disabled = True
            self.emit(
                {
                    "event": "error",
                    "optimizer": self.index,
                    "step": step,
                    "detector": "ranks",
                    "message": str(exc),
                }
            )

    def _agree_on_names(self, step: int) -> list[int]:
        mine = (self.names, self.stepped)
        per_rank = distributed.all_gather_objects(self.ranks, mine, "watch: parameter names")
        self.name_bytes += sum(len(n) + 2 for n in self.names)
        union: list[str] = []
        seen: set[str] = set()
        for names, _ in per_rank:
            for n in names:
                if n not in seen:
                    seen.add(n)
                    union.append(n)
        stepped = [{n for n, s in zip(names, st, strict=True) if s} for names, st in per_rank]
        held = [set(names) for names, _ in per_rank]
        # Only ranks that watch the same model are replicas whose optimizers should
        # match; different models per rank (pipeline stages) are not a mismatch.
        if all(h == held[0] for h in held) and any(s != stepped[0] for s in stepped):
            self.emit(
                {
                    "event": "rank_params",
                    "optimizer": self.index,
                    "step": step,
                    "names": union,
                    "held": [[n in h for n in union] for h in stepped],
                }
            )
        common = [n for n in union if all(n in h for h in held)]
        where = {n: i for i, n in enumerate(self.names)}
        return [where[n] for n in common]

    def _compare(self, step: int) -> None:
        assert self.positions is not None
        tensors = [self.params[i].detach() for i in self.positions]
        with torch.no_grad():
            # on the parameters' device, then one transfer: no per-tensor sync
            sums = (torch.stack([_fingerprint(t) for t in tensors]) & _MASK).cpu().double()
            norms = torch.stack(torch._foreach_norm(tensors)).cpu().double()
        packed = torch.cat([sums, -sums, norms, -norms])
        self.compare_bytes += packed.numel() * packed.element_size()
        top = distributed.all_reduce(self.ranks, packed, "max", "watch: replica checksums")
        p = len(tensors)
        differ = (top[:p] != -top[p : 2 * p]).nonzero().flatten().tolist()
        if not differ:
            return
        mine = [int(sums[k]) for k in differ]
        self.compare_bytes += 8 * len(mine)
        per_rank = distributed.all_gather_objects(self.ranks, mine, "watch: diverged checksums")
        self.emit(
            {
                "event": "replicas",
                "optimizer": self.index,
                "step": step,
                "world_size": self.ranks.world_size,
                "params": [self.names[self.positions[k]] for k in differ],
                "norm_max": [float(top[2 * p + k]) for k in differ],
                "norm_min": [float(-top[3 * p + k]) for k in differ],
                # per diverged parameter: the ranks grouped by the copy they hold
                "groups": [_groups([row[j] for row in per_rank]) for j in range(len(differ))],
            }
        )


def _groups(values: Sequence[int]) -> list[list[int]]:
    out: dict[int, list[int]] = {}
    for rank, v in enumerate(values):
        out.setdefault(v, []).append(rank)
    return sorted(out.values(), key=lambda g: (-len(g), g))
