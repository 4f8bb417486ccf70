"""Replicated parameters must stay identical: compare their copies across ranks at watched steps.

Per parameter tensor, each rank computes a checksum of the raw bits and the norm of
its copy (its local shard, for a DTensor); one all-reduce (MAX over [checksum,
-checksum, norm, -norm]) says whether the copies are bitwise identical and how far
apart their norms are. Only when some differ does a second, equally small exchange
say which ranks hold which copy. The first watched step also compares the names
each rank's optimizer covers, so the per-parameter vectors line up (and DW207
learns of a mismatch), and which ranks hold copies of each tensor:

- a plain parameter: every rank, or the ranks of the DDP wrapper's process group
  (`DDP(process_group=...)`): each data-parallel group is compared within itself;
- a DTensor parameter: the ranks that hold the same shard, those that share its
  coordinates along the mesh dimensions it is sharded over (HSDP's replicate
  dimension); under plain FSDP2 no other rank holds it, so there is nothing to
  compare.

Each replica group has its own rows in the one all-reduce, filled by its members
only (-inf elsewhere, which MAX ignores): the traffic is 4 float64 numbers per
parameter tensor and replica group per watched step, whatever the tensors' sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deadweight.distributed import ranks as distributed
from deadweight.errors import CollectiveError
from deadweight.fingerprints import fingerprint

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
        holders: Sequence[tuple[int, ...] | None] | None = None,
    ) -> None:
        """`holders`: per parameter, the ranks that hold copies of this rank's
        tensor (`distributed.replica_ranks`); None for one that every rank holds."""
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
        self.holders = list(holders) if holders is not None else [None] * len(self.params)
        # Settled at the first watched step: every replica group with 2 or more
        # ranks gets a slot (the same numbering on every rank), `slot_of` maps each
        # compared position to this rank's slot (-1: no copy elsewhere), and
        # `present` marks the (slot, position) pairs some rank fills.
        self.slots: list[tuple[int, ...]] = []
        self.slot_of: torch.Tensor | None = None
        self.present: torch.Tensor | None = None

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
            if self.positions and self.slots:
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
        # Holders travel as a short list of distinct groups and an index per
        # parameter (-1: every rank), nothing at all when every rank holds them all.
        distinct = sorted({h for h in self.holders if h is not None})
        index = (
            [distinct.index(h) if h is not None else -1 for h in self.holders] if distinct else None
        )
        mine = (self.names, self.stepped, distinct, index)
        per_rank = distributed.all_gather_objects(self.ranks, mine, "watch: parameter names")
        self.name_bytes += sum(len(n) + 2 for n in self.names)
        if distinct:
            self.name_bytes += 8 * (sum(len(h) for h in distinct) + len(self.holders))
        union: list[str] = []
        seen: set[str] = set()
        for names, *_ in per_rank:
            for n in names:
                if n not in seen:
                    seen.add(n)
                    union.append(n)
        stepped = [{n for n, s in zip(names, st, strict=True) if s} for names, st, *_ in per_rank]
        held = [set(names) for names, *_ in per_rank]
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
        self._assign_slots(per_rank, common)
        return [where[n] for n in common]

    def _assign_slots(self, per_rank: list[Any], common: list[str]) -> None:
        everyone = tuple(range(self.ranks.world_size))
        # groups[r][k]: the ranks that rank r says hold copies of common[k]
        groups: list[list[tuple[int, ...]]] = []
        for names, _, distinct, index in per_rank:
            at = {n: i for i, n in enumerate(names)}
            groups.append(
                [
                    everyone if index is None or index[at[n]] < 0 else tuple(distinct[index[at[n]]])
                    for n in common
                ]
            )
        self.slots = sorted({g for row in groups for g in row if len(g) > 1})
        number = {g: i for i, g in enumerate(self.slots)}
        self.slot_of = torch.tensor(
            [number.get(g, -1) for g in groups[self.ranks.rank]], dtype=torch.long
        )
        self.present = torch.zeros(len(self.slots), len(common), dtype=torch.bool)
        for r, row in enumerate(groups):
            for k, g in enumerate(row):
                if g in number and r in g:
                    self.present[number[g], k] = True

    def _compare(self, step: int) -> None:
        assert self.positions is not None and self.slot_of is not None
        assert self.present is not None
        tensors = [distributed.local_tensor(self.params[i].detach()) for i in self.positions]
        with torch.no_grad():
            # on the parameters' device, then one transfer: no per-tensor sync
            sums = (torch.stack([fingerprint(t) for t in tensors]) & _MASK).cpu().double()
            norms = torch.stack(torch._foreach_norm(tensors)).cpu().double()
        mine = torch.stack([sums, -sums, norms, -norms])  # (4, P)
        p = len(tensors)
        packed = torch.full((len(self.slots), 4, p), -math.inf, dtype=torch.float64)
        for s in range(len(self.slots)):
            member = self.slot_of == s
            packed[s][:, member] = mine[:, member]
        self.compare_bytes += packed.numel() * packed.element_size()
        top = distributed.all_reduce(self.ranks, packed, "max", "watch: replica checksums")
        differ = self.present & (top[:, 0] != -top[:, 1])  # (slots, P)
        if not differ.any():
            return
        cells = differ.nonzero().tolist()  # (slot, position) pairs, the same on every rank
        mine_sums = [int(sums[k]) if int(self.slot_of[k]) == s else None for s, k in cells]
        self.compare_bytes += 8 * sum(v is not None for v in mine_sums)
        per_rank = distributed.all_gather_objects(
            self.ranks, mine_sums, "watch: diverged checksums"
        )
        ks = sorted({k for _, k in cells})
        by_k: dict[int, list[int]] = {
            k: [j for j, (_, kk) in enumerate(cells) if kk == k] for k in ks
        }
        self.emit(
            {
                "event": "replicas",
                "optimizer": self.index,
                "step": step,
                # the size of the replica groups compared (the world under plain DDP)
                "world_size": max(len(self.slots[cells[j][0]]) for j in range(len(cells))),
                "params": [self.names[self.positions[k]] for k in ks],
                "norm_max": [max(float(top[cells[j][0], 2, k]) for j in by_k[k]) for k in ks],
                "norm_min": [min(float(-top[cells[j][0], 3, k]) for j in by_k[k]) for k in ks],
                # per diverged parameter: the ranks grouped by the copy they hold
                "groups": [
                    [g for j in by_k[k] for g in _groups([row[j] for row in per_rank])] for k in ks
                ],
            }
        )


def _groups(values: Sequence[int | None]) -> list[list[int]]:
    """Ranks grouped by the value they sent (None: not a holder of this copy)."""
    out: dict[int, list[int]] = {}
    for rank, v in enumerate(values):
        if v is not None:
            out.setdefault(v, []).append(rank)
    return sorted(out.values(), key=lambda g: (-len(g), g))
