"""The statistics the watch keeps on each device: one bucket per device holds its
parameters' accumulators, read with a constant number of calls per step and brought
to the host in one transfer per watched step (`StepMonitor` drives them)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deadweight import wrappers
from deadweight.distributed import ranks as distributed
from deadweight.fingerprints import fingerprint
from deadweight.watching.shard_record import VALUES_MAX, ShardRecord

# (found_inf, grad_scale) that a GradScaler sets on a fused optimizer for its step().
AmpStep = tuple[torch.Tensor, "torch.Tensor | None"]
# Steps whose per-step update sizes are kept on the device, to compare the updates
# right after an optimizer-state reset with those right before it.
RING = 64
# The small parameters' numbers in a record, in the order `measure_after` packs them.
SMALL_RECORD = ("path", "rpos", "rneg", "sens", "gsum", "zero_upd", "drift", "last_un")


def _views(buffer: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Consecutive views of `buffer`, one per shape."""
    out, offset = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(buffer[offset : offset + size].view(shape))
        offset += size
    return out


def _loc(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a DTensor (FSDP2) parameter or gradient; a plain tensor as is.

    Every statistic is taken on the slices: an op on the DTensor itself would make
    torch redistribute it, a collective the monitor does not control.
    """
    return distributed.local_tensor(t)


GradOf = Callable[[torch.Tensor], "torch.Tensor | None"]


def own_grad(p: torch.Tensor) -> torch.Tensor | None:
    # megatron-core's DDP keeps gradients in `main_grad` (`.grad` is None until its
    # optimizer copies them over for the step)
    return wrappers.gradient(p)


class DeviceBucket:
    """The device-side state for the monitored parameters that live on one device.

    With `shards` (FSDP2) every number is first measured on this rank's slices and
    the watched step's record is combined across the ranks (`shard_record.ShardRecord`).
    """

    def __init__(
        self,
        device: torch.device,
        positions: list[int],
        params: list[torch.Tensor],
        small: int,
        shards: distributed.Shards | None = None,
        grad_of: GradOf = own_grad,
    ) -> None:
        self.device = device
        self.grad_of = grad_of
        self.positions = positions  # indices into the monitor's parameter list
        self.local = {pos: k for k, pos in enumerate(positions)}  # and back
        self.params = params
        self.shards = shards
        self.shard_bytes = 0  # handed to the collectives that combine the slices
        n = len(params)
        f64: dict[str, Any] = {"device": device, "dtype": torch.float64}
        self.gsq = torch.zeros(n, **f64)  # sum of squared grad norms since the last record
        self.bad_grad = torch.full((n,), -1, device=device, dtype=torch.int64)
        # Steps a fused optimizer skipped on which this gradient held inf/NaN.
        self.skip_nonfinite = torch.zeros(n, device=device, dtype=torch.int64)
        self.index_cache: dict[tuple[int, ...], torch.Tensor] = {}
        with torch.no_grad():
            self.pnorm0 = torch.stack(
                torch._foreach_norm([_loc(p.detach()) for p in params])
            ).double()
            self.fp0 = torch.stack([fingerprint(_loc(p)) for p in params])
        self.moved = [False] * n  # sticky: once seen changed, never again "unchanged"

        self.small = [i for i, p in enumerate(params) if p.numel() <= small]
        self.large = [i for i, p in enumerate(params) if p.numel() > small]
        ns = len(self.small)
        sizes = [_loc(params[i]).numel() for i in self.small]
        self.seg = (
            torch.repeat_interleave(
                torch.arange(ns, device=device),
                torch.tensor(sizes, device=device, dtype=torch.long),
            )
            if ns
            else torch.zeros(0, dtype=torch.long, device=device)
        )
        # Flat float64 buffers of the small parameters (and their gradients), with a view
        # per parameter made once here: each step reads all of them with one
        # `_foreach_copy_`, whatever their number (a view or a `cat` per tensor and step
        # is a Python-and-dispatch cost that grows with the model's tensor count).
        total = int(sum(sizes))
        shapes = [_loc(params[i]).shape for i in self.small]
        self._bufs = {key: torch.zeros(total, **f64) for key in ("theta0", "pre", "post", "grad")}
        self._views = {key: _views(buf, shapes) for key, buf in self._bufs.items()}
        # Under FSDP2 a DTensor's local slice is a new view at each `to_local()`: those
        # are taken per step; plain parameters are read as they are.
        self._plain_small = None if shards is not None else [params[i] for i in self.small]
        tiny = [k for k, i in enumerate(self.small) if params[i].numel() <= VALUES_MAX]
        starts = [0, *itertools.accumulate(sizes)]
        self._tiny_index = torch.tensor(
            [j for k in tiny for j in range(starts[k], starts[k + 1])],
            dtype=torch.long,
            device=device,
        )
        self.theta0 = self._read_small("theta0")
        self.path = torch.zeros(ns, **f64)  # sum over steps of ||update||
        self.rpos = torch.zeros(ns, **f64)  # steps whose update points away from 0 (radially)
        self.rneg = torch.zeros(ns, **f64)
        self.sens = torch.zeros(ns, **f64)  # sum over steps of |<grad, theta>|
        self.gsum = torch.zeros(ns, **f64)  # sum over steps of ||grad||
        self.zero_upd = torch.zeros(ns, **f64)  # steps with a non-zero grad and no change
        self.ring = torch.zeros(RING, ns, **f64)  # ||update|| of the last RING steps
        self.pre_small: torch.Tensor | None = None
        self.last_un = torch.full((ns,), math.nan, **f64)  # ||update|| of the latest step
        self.gn_small: torch.Tensor | None = None
        self.copies: dict[int, torch.Tensor] = {}

    def _small_sources(self) -> list[torch.Tensor]:
        if self._plain_small is not None:
            return self._plain_small
        return [_loc(self.params[i]) for i in self.small]

    @torch.no_grad()
    def _read_small(self, key: str) -> torch.Tensor:
        """The small parameters' values, flat in float64, into buffer `key`: one call."""
        if self.small:
            torch._foreach_copy_(self._views[key], self._small_sources())
        return self._bufs[key]

    @torch.no_grad()
    def _read_small_grads(self) -> torch.Tensor:
        """The small parameters' gradients, flat in float64 (0 where a gradient is
        missing): one call, two when some are missing."""
        views, sources, missing = [], [], False
        for view, i in zip(self._views["grad"], self.small, strict=True):
            g = self.grad_of(self.params[i])
            if g is None:
                missing = True
                continue
            source = _loc(g).to_dense() if g.is_sparse else _loc(g)
            if source.shape != view.shape:  # kept flat elsewhere (a flat main copy's)
                source = source.reshape(view.shape)
            views.append(view)
            sources.append(source)
        if missing:
            self._bufs["grad"].zero_()
        if sources:
            torch._foreach_copy_(views, sources)
        return self._bufs["grad"]

    def _segsum(self, values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(len(self.small), dtype=torch.float64, device=self.device)
        return out.index_add_(0, self.seg, values)

    def _index(self, key: tuple[int, ...]) -> torch.Tensor:
        cached = self.index_cache.get(key)
        if cached is None:
            if len(self.index_cache) > 64:  # presence patterns churn (MoE): keep it bounded
                self.index_cache.clear()
            cached = self.index_cache[key] = torch.tensor(key, dtype=torch.long, device=self.device)
        return cached

    # -- every step -------------------------------------------------------------------

    def amp_weights(self, amp: AmpStep | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the step went through, 1 / scale) on this bucket's device, for a fused step."""
        if amp is None:
            return None
        found_inf, scale = amp
        ok = found_inf.to(self.device).reshape(-1)[0] == 0
        inv = torch.ones((), dtype=torch.float64, device=self.device)
        if scale is not None:
            inv = inv / scale.to(self.device, torch.float64).reshape(-1)[0]
        return ok, inv

    @torch.no_grad()
    def grads_before(self, step: int, present: list[int], amp: AmpStep | None = None) -> None:
        if not present:
            return
        grads = [_loc(self.grad_of(self.params[i])) for i in present]  # type: ignore[arg-type]
        norms = torch.stack(torch._foreach_norm(grads)).double()
        weights = self.amp_weights(amp)
        index = self._index(tuple(present))
        if weights is not None:  # the scaler's own inf/NaN are not the model's
            # ...but on a step it skips for them, whose they were is counted (device side)
            blamed = (~torch.isfinite(norms) & ~weights[0]).to(torch.int64)
            self.skip_nonfinite.index_add_(0, index, blamed)
            norms = torch.where(weights[0], norms * weights[1], 0.0)
        self.gsq.index_add_(0, index, norms * norms)
        seen = self.bad_grad.index_select(0, index)
        first = torch.where(~torch.isfinite(norms) & (seen < 0), step, seen)
        self.bad_grad.index_copy_(0, index, first)

    @torch.no_grad()
    def small_before(self, amp: AmpStep | None = None) -> None:
        if not self.small:
            return
        pre = self._read_small("pre")
        gcat = self._read_small_grads()
        weights = self.amp_weights(amp)
        if weights is not None:  # a skipped step then has no gradient, so no "lost" update
            gcat = torch.where(weights[0], gcat * weights[1], 0.0)
        self.sens += self._segsum(gcat * pre).abs()
        self.gn_small = self._segsum(gcat * gcat).sqrt()
        self.gsum += self.gn_small
        self.pre_small = pre

    @torch.no_grad()
    def small_after(self, step: int) -> None:
        if not self.small or self.pre_small is None:
            return
        post = self._read_small("post")
        update = post - self.pre_small
        un = self._segsum(update * update).sqrt()
        radial = self._segsum(update * self.pre_small)
        self.path += un
        self.rpos += radial > 0
        self.rneg += radial < 0
        self.ring[step % RING] = un
        self.last_un = un
        if self.gn_small is not None:
            self.zero_upd += (un == 0) & (self.gn_small > 0)
        self.pre_small = None

    # -- watched steps ----------------------------------------------------------------

    @torch.no_grad()
    def copy_before(self, chosen: list[int]) -> None:
        # One call for all: x * 1 is x bit for bit (signed zeros, inf and NaN included).
        copies = torch._foreach_mul([_loc(self.params[i]) for i in chosen], 1) if chosen else []
        self.copies = dict(zip(chosen, copies, strict=True))

    @torch.no_grad()
    def measure_after(self) -> dict[str, Any]:
        """Everything for one record, in one host transfer (two when a large parameter's
        norm is bitwise unchanged and its fingerprint must decide)."""
        params = self.params if self.shards is None else [_loc(p) for p in self.params]
        pnorm = torch.stack(torch._foreach_norm(params)).double()
        copied = sorted(self.copies)
        unorm = self._update_norms(copied, params)
        smalls, values = self._small_record()
        packed = torch.cat(
            [
                self.gsq,
                self.bad_grad.double(),
                pnorm,
                (pnorm == self.pnorm0).double(),
                unorm,
                *smalls,
                values,
            ]
        )
        if self.shards is not None:  # every rank's slices, combined: one collective
            flat = ShardRecord(self, copied).combine(packed)
        else:
            flat = packed.tolist()  # the one CPU-GPU sync of this step
        self.gsq.zero_()
        out, same_norm = self._unpack(flat, copied)
        self._update_moved(out["drift"], same_norm)
        out["moved"] = list(self.moved)
        return out

    def _update_norms(self, copied: list[int], params: list[torch.Tensor]) -> torch.Tensor:
        """The update norms of the large parameters `copy_before` copied."""
        if copied:
            # In place on the copies: no second buffer of the same size.
            deltas = [self.copies[i] for i in copied]
            torch._foreach_sub_(deltas, [params[i] for i in copied])
            unorm = torch.stack(torch._foreach_norm(deltas)).double()
        else:
            unorm = torch.zeros(0, dtype=torch.float64, device=self.device)
        self.copies = {}
        return unorm

    def _small_record(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The small parameters' accumulators and drift since the start (in the order of
        `SMALL_RECORD`), and the values of the tiny ones."""
        if not self.small:
            return [], torch.zeros(0, dtype=torch.float64, device=self.device)
        post = self._read_small("post")
        drift = self._segsum((post - self.theta0) ** 2).sqrt()
        smalls = [
            self.path, self.rpos, self.rneg, self.sens, self.gsum, self.zero_upd, drift,
            self.last_un,
        ]  # fmt: skip
        return smalls, post.index_select(0, self._tiny_index)

    def _unpack(self, flat: list[float], copied: list[int]) -> tuple[dict[str, Any], list[float]]:
        """The record's numbers by name, read back from what `measure_after` packed; and
        per parameter whether its norm is bitwise the one it had at the start."""
        n, ns = len(self.params), len(self.small)
        out: dict[str, Any] = {}
        cursor = 0

        def take(k: int) -> list[float]:
            nonlocal cursor
            part = flat[cursor : cursor + k]
            cursor += k
            return part

        out["gsq"] = take(n)
        out["bad_grad"] = [int(v) for v in take(n)]
        out["pnorm"] = take(n)
        same_norm = take(n)
        out["unorm"] = dict(zip(copied, take(len(copied)), strict=True))
        for key in SMALL_RECORD:
            out[key] = take(ns) if ns else []
        for k, i in enumerate(self.small):  # small parameters: this step's exact update
            if math.isfinite(out["last_un"][k]):
                out["unorm"][i] = out["last_un"][k]
        out["values"] = take(len(flat) - cursor)
        return out, same_norm

    def _update_moved(self, drift: list[float], same_norm: list[float]) -> None:
        """Bitwise-unchanged since the start: exact for small parameters (their start
        values are kept); for large ones an unchanged norm is necessary, and the
        fingerprint of the raw bits decides."""
        small_pos = {i: k for k, i in enumerate(self.small)}
        candidates = []
        for i in range(len(self.params)):
            if self.moved[i]:
                continue
            if i in small_pos:
                self.moved[i] = drift[small_pos[i]] != 0
            elif not same_norm[i]:
                self.moved[i] = True
            else:
                candidates.append(i)
        if candidates:
            fps = torch.stack([fingerprint(_loc(self.params[i])) for i in candidates])
            changed_here = fps != self.fp0[self._index(tuple(candidates))]
            if self.shards is not None and self.shards.ranks is not None:
                # The candidates follow from combined numbers: the same on every rank.
                changed_here = distributed.all_reduce(
                    self.shards.ranks, changed_here.to(torch.int64), "max", "watch: fingerprints"
                )
            changed = changed_here.bool().tolist()
            for i, c in zip(candidates, changed, strict=True):
                self.moved[i] = bool(c)

    @torch.no_grad()
    def ring_mean(self, steps: Sequence[int]) -> torch.Tensor:
        rows = torch.tensor([s % RING for s in steps], dtype=torch.long, device=self.device)
        return self.ring.index_select(0, rows).mean(0)
