"""One watched step's statistics of DTensor (FSDP2) parameters, combined over the ranks
(see `step_monitor`: every rank measures its own slices; this puts them together)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from deadweight.distributed import ranks as distributed

if TYPE_CHECKING:
    from deadweight.watching.device_buckets import DeviceBucket

# Values of parameters up to this many elements are logged at every watched step
# (layer scalars' trajectories; the incident's table of 32 values).
VALUES_MAX = 16


class ShardRecord:
    """One watched step's numbers of a bucket of DTensor (FSDP2) parameters, combined
    over the ranks in one collective of a few float64 per parameter tensor and rank.

    Each rank measured its own slices. Squared norms and sums add up (weighted by
    `distributed.share_of_sum`, so a replicated copy counts once). A per-step norm
    accumulated over steps (the path of a small parameter, its gradient sizes)
    cannot be split exactly: the ranks' sums are combined as a root sum of squares,
    exact for a parameter one rank holds whole (a layer scalar) and for slices whose
    sizes keep their proportions, and otherwise between the true value and
    sqrt(ranks) times below it. Step counts (radial directions, lost updates) are
    averaged over the ranks that hold a non-empty slice. Values of the tiny
    parameters are put back together from the slices of one replica group
    (`distributed.one_copy_ranks`), in mesh order (dim-0 shards).
    """

    def __init__(self, bucket: DeviceBucket, copied: list[int]) -> None:
        self.bucket = bucket
        self.copied = copied  # the large parameters copied this step, as `unorm` lists them

    def combine(self, packed: torch.Tensor) -> list[float]:
        b = self.bucket
        shards = b.shards
        assert shards is not None
        ranks = shards.ranks
        world = ranks.world_size if ranks is not None else 1
        n, ns, c = len(b.params), len(b.small), len(self.copied)
        w = torch.tensor(
            [distributed.share_of_sum(p, world) for p in b.params], dtype=torch.float64
        )
        w_small = w[b.small] if ns else torch.zeros(0, dtype=torch.float64)
        tiny = [i for i in b.small if b.params[i].numel() <= VALUES_MAX]
        local = packed.detach().to("cpu", torch.float64)
        cut = [n, n, n, n, c, *([ns] * 8)]
        parts = list(local[: sum(cut)].split(cut))
        gsq, bad, pnorm, same, unorm = parts[:5]
        path, rpos, rneg, sens, gsum, zero_upd, drift, last_un = parts[5:]
        values = local[sum(cut) :]
        # Update norms in a slot per parameter: the row's layout then never depends on
        # what this rank copied, so the ranks' rows always line up.
        u2 = torch.zeros(n, dtype=torch.float64)
        if c:
            u2[self.copied] = unorm**2 * w[self.copied]
        holders = torch.tensor(
            [float(distributed.local_tensor(b.params[i]).numel() > 0) for i in b.small]
        )
        counts = [distributed.local_tensor(b.params[i]).numel() for i in tiny]
        slots = torch.zeros(sum(b.params[i].numel() for i in tiny), dtype=torch.float64)
        offset = cursor = 0
        for i, k in zip(tiny, counts, strict=True):
            slots[offset : offset + k] = values[cursor : cursor + k]
            offset += b.params[i].numel()
            cursor += k
        row = torch.cat(
            [
                gsq * w, torch.where(bad >= 0, bad, math.inf), pnorm**2 * w, same, u2,
                path**2 * w_small, rpos, rneg, sens * w_small, gsum**2 * w_small, zero_upd,
                drift**2 * w_small, last_un**2 * w_small, holders,
                torch.tensor(counts, dtype=torch.float64), slots,
            ]
        )  # fmt: skip
        table = torch.zeros(world, row.numel(), dtype=torch.float64)
        table[ranks.rank if ranks is not None else 0] = row
        if ranks is not None:
            table = distributed.all_reduce(ranks, table, "sum", "watch: sharded statistics")
        b.shard_bytes += table.numel() * table.element_size()
        cut[4] = n
        cols = list(table[:, : sum(cut) + ns + len(tiny)].split([*cut, ns, len(tiny)], dim=1))
        t_gsq, t_bad, t_pn, t_same, t_un = cols[:5]
        t_path, t_rpos, t_rneg, t_sens, t_gsum, t_zero, t_drift, t_last, t_hold, t_counts = cols[5:]
        held = t_hold.sum(0).clamp(min=1)
        first_bad = t_bad.min(0).values
        out = [
            t_gsq.sum(0), torch.where(torch.isinf(first_bad), -1.0, first_bad),
            t_pn.sum(0).sqrt(), t_same.min(0).values, t_un.sum(0).sqrt()[self.copied],
            t_path.sum(0).sqrt(), t_rpos.sum(0) / held, t_rneg.sum(0) / held, t_sens.sum(0),
            t_gsum.sum(0).sqrt(), t_zero.sum(0) / held, t_drift.sum(0).sqrt(), t_last.sum(0).sqrt(),
        ]  # fmt: skip
        slot_table = table[:, sum(cut) + ns + len(tiny) :]
        whole: list[float] = []
        offset = 0
        for j, i in enumerate(tiny):
            size = b.params[i].numel()
            # one replica's slices only: under HSDP every shard is held twice or more
            for r in distributed.one_copy_ranks(b.params[i]):
                k = int(t_counts[r, j])
                whole += slot_table[r, offset : offset + k].tolist()
            offset += size
        return [v for part in out for v in part.tolist()] + whole
