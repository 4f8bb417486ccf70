"""Leave the model exactly as we found it: values, version counters, modes, buffers, grads, RNG.

The user may hold a live graph from their own forward while they call `check`
(forward -> check -> backward). That graph refuses to backward through a saved
tensor whose autograd version counter moved, even if its values are back, so
every in-place restore here also puts the version counter back
(`torch._C._autograd._unsafe_set_version_counter`), and only ever onto a tensor
whose values are bitwise those it had at that version.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from deadweight.checking.check_stats import ParamWrite, Site
from deadweight.distributed.ranks import local_tensor


def versions_of(tensors: Sequence[torch.Tensor]) -> list[int | None]:
    """Each tensor's autograd version counter (None for an inference tensor, which has none)."""
    out: list[int | None] = []
    for t in tensors:
        try:
            out.append(t._version)
        except (RuntimeError, NotImplementedError, TypeError):
            out.append(None)
    return out


_SET_VERSION = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
# Tensors whose version counter could not be put back (a subclass without a counter of
# its own, a torch without the call), counted for the report's subject.
_unrestored_versions = [0]


def set_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int | None]) -> None:
    """Put version counters back, after the tensors' values were put back bitwise."""
    for t, v in zip(tensors, versions, strict=True):
        if v is None:
            continue
        try:
            if t._version == v:
                continue
            if _SET_VERSION is None:
                raise RuntimeError("no torch._C._autograd._unsafe_set_version_counter")
            try:
                _SET_VERSION((t,), (v,))
            except TypeError:  # torch < 2.5 took one tensor and one int
                _SET_VERSION(t, v)
        except (RuntimeError, NotImplementedError, TypeError):
            _unrestored_versions[0] += 1


def unrestored_versions() -> int:
    """How many version counters `set_versions` failed to put back since the last call."""
    n, _unrestored_versions[0] = _unrestored_versions[0], 0
    return n


class ParamGuard:
    """Parameter values and version counters as they were, so that what a forward writes to
    them can be put back and reported; and the RNG state at entry, so that a loss
    function can be re-run on the same random draws.

    A copy is taken only of a parameter about to be written in place (the op tracer
    calls `before_write`): copying every parameter up front would double the model's
    memory. Writes the tracer cannot see are caught by `_checksums` at the end.
    """

    def __init__(
        self, named: Sequence[tuple[str, torch.Tensor]], rng: dict[str, Any] | None = None
    ) -> None:
        self._rng = rng
        self._named = list(named)
        self._params = [p for _, p in self._named]
        # what each parameter's .data was: a forward that rebinds it is undone from these
        # (aliases, not copies: they cost no memory while the storage stays the same)
        self._aliases = [p.detach() for p in self._params]
        self._versions = versions_of(self._params)
        self._index = {id(p): k for k, p in enumerate(self._params)}
        self._copies: dict[int, torch.Tensor] = {}
        self._seen: dict[int, tuple[str, str | None, Site | None]] = {}
        self._changed: list[tuple[int, torch.Tensor]] = []  # (index, 0-d bool on the device)
        # the aliases' memory as integers, viewed once for the checksums at entry and
        # at the end
        self._alias_bits = [_bits(a) for a in self._aliases]
        self._before = _checksums(self._alias_bits)

    def reset_rng(self) -> None:
        if self._rng is not None:
            _set_rng_state(self._rng)

    def before_write(
        self,
        param: torch.Tensor,
        how: str = "in-place",
        op: str | None = None,
        site: Site | None = None,
    ) -> None:
        k = self._index.get(id(param))
        if k is None:
            return
        self._seen.setdefault(k, (how, op, site))
        # A write into memory a forward rebound `.data` to leaves the user's memory
        # alone: the rebind is undone from the alias, no copy needed.
        if how != "rebind" and k not in self._copies and _same_data(param, self._aliases[k]):
            self._copies[k] = param.detach().clone()

    def restore(self) -> None:
        """Put back what was written so far (values and version counters)."""
        with torch.no_grad():
            for k, (p, alias) in enumerate(zip(self._params, self._aliases, strict=True)):
                if not _same_data(p, alias):
                    self._changed.append((k, _differs(p.detach(), alias)))
                    p.data = alias
            for k, saved in self._copies.items():
                p = self._params[k]
                self._changed.append((k, _differs(p.detach(), saved)))
                p.copy_(saved)
        # Only onto tensors whose values are bitwise back: a parameter written where no
        # tracer saw keeps its moved counter, so a graph that saved it still refuses.
        restored = sorted(self._copies)
        set_versions([self._params[k] for k in restored], [self._versions[k] for k in restored])

    def writes(self) -> list[ParamWrite]:
        """After the last `restore`: every parameter whose values a forward changed, one
        transfer for the lot. The checksums taken at entry catch what no tracer saw."""
        after = _checksums(self._alias_bits)
        changed_by_seen = _any_per_index(self._changed, len(self._params))
        unseen = _unequal(self._before, after)
        out = []
        for k, (name, _) in enumerate(self._named):
            seen = self._seen.get(k)
            if k in unseen:
                how, op, site = seen if seen is not None else ("unseen", None, None)
                out.append(ParamWrite(name, how, op, site, restored=False))
            elif changed_by_seen[k]:
                how, op, site = seen if seen is not None else ("rebind", None, None)
                out.append(ParamWrite(name, how, op, site, restored=True))
        return out


@contextmanager
def preserved(
    model: nn.Module,
    named: Sequence[tuple[str, nn.Parameter]] | None = None,
    named_modules: Sequence[tuple[str, nn.Module]] | None = None,
) -> Iterator[ParamGuard]:
    """Snapshot everything a forward+backward may change, restore it on exit (also on error).

    - train/eval flag of every submodule (a forward may toggle them);
    - buffers (BatchNorm running stats, counters), restored in place so tensor identity
      holds, with their version counters;
    - each parameter's `.grad` object, which is set aside so backward cannot accumulate into it;
    - the torch CPU and CUDA, Python `random` and NumPy global RNG states (dropout draws);
    - parameter values and version counters, through the yielded `ParamGuard`, which the
      op tracer calls before an in-place write to a parameter or to memory it shares
      (deadweight itself writes one only in the probes, which restore it).

    `named`, `named_modules`: `model.named_parameters()` and `model.named_modules()`,
    when the caller has just listed them.
    """
    modules = list(model.modules()) if named_modules is None else [m for _, m in named_modules]
    modes = [(m, m.training) for m in modules]
    buffers = _snapshot_buffers(modules)
    if named is None:
        named = list(model.named_parameters())
    params = [p for _, p in named]
    grads = [p.grad for p in params]
    rng = _rng_state()
    for p in params:
        p.grad = None
    guard = ParamGuard(named, rng)
    try:
        yield guard
    finally:
        guard.restore()
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        _restore_buffers(buffers)
        for m, training in modes:
            # only where the forward toggled it: nn.Module's __setattr__ is slow, and
            # a deep model has hundreds of modules
            if m.training != training:
                m.training = training
        _set_rng_state(rng)


@contextmanager
def grads_set_aside(tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Give `tensors` a None .grad for the duration, then put their own .grad back."""
    saved = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    try:
        yield
    finally:
        for t, g in zip(tensors, saved, strict=True):
            t.grad = g


@contextmanager
def post_accumulate_hooks_suspended(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Empty each parameter's post-accumulate-grad hook dict, refill it on exit.

    Such hooks exist for side effects (optimizer-in-backward steps and zeroes there);
    the check must not trigger them. The dict object itself stays, so the user's
    RemovableHandles keep working.
    """
    suspended = []
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks:
            suspended.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in suspended:
            hooks.update(saved)


# -- bitwise comparison and checksums ------------------------------------------------

# Integer dtypes by element size: a tensor's bits are compared and summed as these, so
# NaN == NaN and -0.0 != 0.0, and a sum of bit patterns wraps around instead of rounding.
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """`t`'s memory as integers of its element size, a view that follows later writes;
    None where impossible (sparse, quantized, a subclass without storage)."""
    t = local_tensor(t)
    try:
        if t.element_size() in _INT_OF_SIZE:
            return t.view(_INT_OF_SIZE[t.element_size()])
        # complex128: two int64 per element, through a float64 view (no copy, any strides)
        return torch.view_as_real(t).view(torch.int64)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _checksums(bit_views: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Per tensor (given as its `_bits`), the wrapping sum of its bit patterns, left on
    its device (no sync).

    One memory pass per tensor, at the speed of a plain sum (an int64 accumulator over
    int32 bits is 10x slower on CPU, so each sum stays in its own width and wraps).
    Any change of a single element changes it; what it can miss is a rearrangement of
    the same values, or changes whose bit patterns cancel exactly.
    """
    with torch.no_grad():
        return [None if bits is None else bits.sum(dtype=bits.dtype) for bits in bit_views]


def _unequal(before: list[torch.Tensor | None], after: list[torch.Tensor | None]) -> set[int]:
    """Indices whose checksums differ: one device-to-host transfer per device."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for k, (a, b) in enumerate(zip(before, after, strict=True)):
        if a is not None and b is not None and a.device == b.device:
            by_device.setdefault(a.device, []).append((k, a, b))
    changed: set[int] = set()
    for rows in by_device.values():
        # One comparison for all: stacking widens every sum to the widest integer
        # type, which keeps each value exactly, so equal stays equal.
        was = torch.stack([a for _, a, _ in rows])
        now = torch.stack([b for _, _, b in rows])
        flags = (was != now).tolist()  # the one sync per device
        changed.update(k for (k, _, _), f in zip(rows, flags, strict=True) if f)
    return changed


def _any_per_index(flags: list[tuple[int, torch.Tensor]], n: int) -> list[bool]:
    out = [False] * n
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for k, f in flags:
        by_device.setdefault(f.device, []).append((k, f))
    for rows in by_device.values():
        values = torch.stack([f for _, f in rows]).tolist()
        for (k, _), v in zip(rows, values, strict=True):
            out[k] = out[k] or bool(v)
    return out


def _differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on the device: whether `a` and `b` differ in shape, dtype or any bit."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return torch.ones((), dtype=torch.bool, device=b.device)
    ba, bb = _bits(a), _bits(b)
    if ba is None or bb is None:
        return torch.ones((), dtype=torch.bool, device=b.device)
    return (ba != bb).any()


def _same_data(p: torch.Tensor, alias: torch.Tensor) -> bool:
    """Whether `p` still holds the memory it had (a forward may rebind `p.data`)."""
    try:
        return (
            p.shape == alias.shape
            and p.dtype == alias.dtype
            and p.device == alias.device
            and local_tensor(p).data_ptr() == local_tensor(alias).data_ptr()
        )
    except (RuntimeError, TypeError, NotImplementedError):
        return True  # nothing to compare (no storage): leave it


# -- buffers and RNG ------------------------------------------------------------------

_BufferSnapshot = list[tuple[nn.Module, str, torch.Tensor, torch.Tensor, int | None]]


def _snapshot_buffers(modules: Sequence[nn.Module]) -> _BufferSnapshot:
    clones: dict[int, torch.Tensor] = {}  # shared buffers are cloned once
    snapshot: _BufferSnapshot = []
    for module in modules:
        for name, buf in module._buffers.items():
            if buf is None or buf.is_meta:
                continue
            if id(buf) not in clones:
                clones[id(buf)] = buf.detach().clone()
            snapshot.append((module, name, buf, clones[id(buf)], versions_of([buf])[0]))
    return snapshot


def _restore_buffers(snapshot: _BufferSnapshot) -> None:
    with torch.no_grad():
        restored = []
        for module, name, buf, saved, version in snapshot:
            # A forward may rebind a buffer to a new tensor; put the user's object back.
            module._buffers[name] = buf
            if buf.shape == saved.shape:
                buf.copy_(saved)
                restored.append((buf, version))
    # A graph of the user's own forward may have saved a buffer (BatchNorm saves its
    # running stats): its values are back, so is its version.
    set_versions([b for b, _ in restored], [v for _, v in restored])


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Inside: torch's, Python's and NumPy's random state drawn from `seed`; after,
    the state they had before."""
    saved = _rng_state()
    # Not torch.manual_seed: with CUDA not yet initialised it queues a seeding that
    # would run, after the check, when the user's process first touches the GPU.
    torch.random.default_generator.manual_seed(seed)
    if "cuda" in saved:
        torch.cuda.manual_seed_all(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        _set_rng_state(saved)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    # Only touch CUDA if the user's process already initialised it: querying it would.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
