"""Measure whether an optimizer step consumes the gradient its previous step already used.

The loop that forgets `optimizer.zero_grad()` looks healthy: every backward adds its
gradient to what `.grad` already holds, so step k+1 applies the sum of the gradients of
steps 1..k+1. Nothing raises and the loss may even fall for a while.

`StaleGradients` watches a few small parameters of one optimizer (its *sentinels*):

* after each step it notes which tensor `.grad` is and its version counter (Python
  attribute reads, nothing on the device);
* at the first backward that reaches a sentinel after the step (a tensor hook, which
  runs *before* the new gradient is added), `.grad` is still that very tensor at that
  very version only if nothing zeroed it: `zero_grad(set_to_none=True)`,
  `model.zero_grad()` and `p.grad = None` leave None, `zero_grad(set_to_none=False)`
  bumps the version. Only then is one small device reduction taken, whether the old
  gradient is non-zero (`p.grad.data.zero_()` zeroes without bumping the version);
* a post-accumulate hook confirms that the backward really added into `.grad`
  (`torch.autograd.grad` runs the tensor hook but leaves `.grad` alone);
* later backwards before the next step check again, so a loop that zeroes the
  gradients after another loss reached them (a GAN's generator pass reaching the
  discriminator) is not counted;
* at the next step the suspicion is settled: the step consumed a stale gradient.

Healthy loops, which zero the gradients in one of the ways above, never get past the
first bullet: no device work at all. A confirmed case costs one small reduction per
sentinel per step, read back at once on the CPU and at the watch's next watched step
on an accelerator (no extra host sync per step).

Not seen: DeepSpeed (its engine zeroes its own buffers), FSDP2 (the sharded parameters
are not in the autograd graph; FSDP2 accumulates into them itself), and gradients kept
outside `.grad` (megatron-core's `main_grad`). Those stay quiet.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

Emit = Callable[[dict[str, Any]], None]

# Sentinels per optimizer: enough that one parameter the loss skips on some steps does
# not blind the check, few enough that the hooks cost nothing measurable.
SENTINELS = 2
# A sentinel must be small: a confirmed case reduces its gradient once per step.
SENTINEL_MAX_NUMEL = 4096

_IDLE, _ARMED, _PENDING, _SUSPECT = range(4)


def choose_sentinels(params: Sequence[torch.Tensor], held: Sequence[bool]) -> list[int]:
    """Positions of the sentinels among the `params` an optimizer holds (`held`):
    trainable leaves, the smallest first, and the last small one (the head's bias, which
    every backward reaches)."""
    candidates = [
        i
        for i, (p, h) in enumerate(zip(params, held, strict=True))
        if h and p.requires_grad and p.is_leaf and not p.is_sparse and _plain(p)
    ]
    if not candidates:
        return []
    small = [i for i in candidates if params[i].numel() <= SENTINEL_MAX_NUMEL]
    pool = small or [min(candidates, key=lambda i: params[i].numel())]
    chosen = [min(pool, key=lambda i: (params[i].numel(), i)), pool[-1]]
    return list(dict.fromkeys(chosen))[:SENTINELS]


def _plain(p: torch.Tensor) -> bool:
    """A plain tensor (a DTensor's grad lives on its shards, not through autograd)."""
    return type(p) in (torch.Tensor, torch.nn.Parameter)


class _Sentinel:
    __slots__ = ("grad", "position", "pre_flag", "stale", "state", "version")

    def __init__(self, position: int) -> None:
        self.position = position
        self.state = _IDLE
        self.grad: weakref.ref[torch.Tensor] | None = None
        self.version = -1
        self.pre_flag: torch.Tensor | None = None  # from the tensor hook, until accumulated
        self.stale: torch.Tensor | None = None  # the old gradient was non-zero (device bool)

    def untouched(self, param: torch.Tensor) -> torch.Tensor | None:
        """`.grad` if it is the tensor noted, at the version noted; else None."""
        g = param.grad
        if g is None or self.grad is None or self.grad() is not g or g._version != self.version:
            return None
        return g


class StaleGradients:
    """The check for one optimizer; `install` adds its hooks, `after_step` runs in the
    optimizer's post-step hook, `flush` at watched steps and when watching ends."""

    def __init__(
        self, index: int, params: Sequence[torch.Tensor], positions: Sequence[int], emit: Emit
    ) -> None:
        self.index = index
        self.emit = emit
        self.params = [params[i] for i in positions]
        self.sentinels = [_Sentinel(i) for i in positions]
        self.reported = False
        # Confirmed on an accelerator, not yet read: (step, device flags of the sentinels).
        self.unread: list[tuple[int, list[tuple[int, torch.Tensor]]]] = []
        self.disabled = False

    def install(self) -> list[RemovableHandle]:
        handles: list[RemovableHandle] = []
        for sentinel, param in zip(self.sentinels, self.params, strict=True):
            try:
                handles.append(param.register_hook(self._before_add(sentinel, param)))
                handles.append(param.register_post_accumulate_grad_hook(self._after_add(sentinel)))
            except Exception:  # a tensor subclass without hooks: this sentinel is blind
                continue
        return handles

    # -- hooks -----------------------------------------------------------------------------

    def _before_add(
        self, sentinel: _Sentinel, param: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        ref = weakref.ref(param)

        def hook(_: torch.Tensor) -> None:
            state = sentinel.state
            if state == _IDLE or self.disabled:
                return
            p = ref()
            with contextlib.suppress(Exception):  # never let deadweight stop training
                g = None if p is None else sentinel.untouched(p)
                if g is None:  # zeroed (None, or a new version) or replaced since
                    sentinel.state, sentinel.stale, sentinel.pre_flag = _IDLE, None, None
                    return
                with torch.no_grad():
                    nonzero = g.detach().ne(0).any()
                if state in (_ARMED, _PENDING):  # PENDING: torch.autograd.grad ran first
                    sentinel.pre_flag = nonzero
                    sentinel.state = _PENDING
                elif state == _SUSPECT and sentinel.stale is not None:
                    # zeroed behind the version counter (`.data.zero_()`) since: not stale
                    sentinel.stale = sentinel.stale & nonzero
            return

        return hook

    def _after_add(self, sentinel: _Sentinel) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            state = sentinel.state
            if state not in (_PENDING, _SUSPECT):
                return
            with contextlib.suppress(Exception):
                g = param.grad
                if g is None or sentinel.grad is None or sentinel.grad() is not g:
                    # added out of place (create_graph=True): no longer the tensor noted
                    sentinel.state, sentinel.stale, sentinel.pre_flag = _IDLE, None, None
                    return
                if state == _PENDING:
                    sentinel.stale, sentinel.pre_flag = sentinel.pre_flag, None
                    sentinel.state = _SUSPECT
                sentinel.version = g._version  # the next backward must find it here

        return hook

    # -- steps -----------------------------------------------------------------------------

    def after_step(self, step: int) -> None:
        """Settle the suspicions of the step just taken, then note the gradients it used."""
        if self.disabled:
            return
        confirmed: list[tuple[int, torch.Tensor]] = []
        for sentinel, param in zip(self.sentinels, self.params, strict=True):
            if sentinel.state == _SUSPECT and sentinel.stale is not None:
                confirmed.append((sentinel.position, sentinel.stale))
            g = param.grad
            if g is None:
                sentinel.state, sentinel.grad = _IDLE, None
            else:
                sentinel.state, sentinel.grad, sentinel.version = _ARMED, weakref.ref(g), g._version
            sentinel.stale = sentinel.pre_flag = None
        if confirmed and not self.reported:
            if all(flag.device.type == "cpu" for _, flag in confirmed):
                self._settle(step, confirmed)  # reading a CPU bool costs no sync
            elif len(self.unread) < 64:  # read at the next watched step, with no sync of its own
                self.unread.append((step, confirmed))

    def flush(self) -> None:
        """Read the flags confirmed on an accelerator since the last watched step."""
        unread, self.unread = self.unread, []
        for step, confirmed in unread:
            if self.reported:
                return
            self._settle(step, confirmed)

    def _settle(self, step: int, confirmed: list[tuple[int, torch.Tensor]]) -> None:
        flags = torch.stack([flag.reshape(()) for _, flag in confirmed]).cpu().tolist()
        stale = [pos for (pos, _), f in zip(confirmed, flags, strict=True) if f]
        if not stale:
            return
        self.reported = True  # once per optimizer: every later step is the same story,
        self.disabled = True  # so the hooks go back to costing nothing
        self.emit({"event": "stale_grad", "optimizer": self.index, "step": step, "params": stale})
