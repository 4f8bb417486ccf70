"""Measure saved checkpoints: per-tensor statistics, quantization risk, differences, trends.

Three measurements, one per command, each judged by the DW4xx rules:

* `inspect_checkpoints` -> `InspectStats`: every tensor's statistics, and the
  quantization risk of every floating tensor under one scheme (plus each layer
  scalar quantized together with the largest weight of its layer);
* `diff_checkpoints` -> `DiffStats`: bitwise-unchanged tensors, relative change,
  tensors added, removed or reshaped;
* `trend_checkpoints` -> `TrendStats`: single-element tensors across a series of saves.

Only readers touch files (`deadweight.checkpoints.readers`); a checkpoint that cannot be read is
an error in the result, and the others are still measured.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

import numpy as np

from deadweight.checkpoints import native_reduce
from deadweight.checkpoints.name_matching import match_names
from deadweight.checkpoints.quant_stream import (
    checkpoint_source,
    stream_joint_risk,
    stream_quant_risk,
)
from deadweight.checkpoints.quantization import QuantRisk, Scheme
from deadweight.checkpoints.readers import (
    Checkpoint,
    CheckpointError,
    TensorEntry,
    open_checkpoint,
    step_of,
)
from deadweight.checkpoints.readers.base import PASS_THROUGH, StorageOrderEntry, reading_error
from deadweight.checkpoints.scan_stats import (
    CheckpointScan,
    DiffStats,
    InspectStats,
    TensorDiff,
    TrendStats,
)
from deadweight.checkpoints.tensor_pass import default_threads, scan_tensor
from deadweight.checkpoints.tensor_stats import tensor_stats
from deadweight.homologous import layer_key

_F = TypeVar("_F", bound=Callable[..., Any])


def _cycle_collector_paused(fn: _F) -> _F:
    """Run `fn` with Python's cycle collector off (back on after, if it was on).

    A full collection walks every object the process holds, and torch alone holds
    hundreds of thousands: the first one due in a fresh process (as in a CLI run) took
    79 ms of a 370 ms scan of 2.15 GB here. Reading checkpoints makes no reference
    cycles worth collecting; what it frees, reference counting frees.
    """

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        was_on = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()

    return cast(_F, paused)


Progress = Callable[[str, int], None]  # (what, bytes done) after each tensor

DEFAULT_SCHEME = "int4-group128"  # what on-device INT4 deployment (GPTQ/AWQ) commonly uses


def _open(path: str, unsafe_pickle: bool, errors: list[str]) -> Checkpoint | None:
    try:
        return open_checkpoint(path, unsafe_pickle=unsafe_pickle)
    except CheckpointError as exc:
        errors.append(str(exc))
        return None


@contextlib.contextmanager
def _per_file(path: str, errors: list[str]) -> Iterator[None]:
    """Whatever measuring one checkpoint raises (the readers' CheckpointError, or numpy's
    ValueError on a shape it cannot take, a MemoryError, a RecursionError) becomes that
    file's error, naming it: the other files are still measured. Interrupts pass."""
    try:
        yield
    except PASS_THROUGH:
        raise
    except BaseException as exc:
        errors.append(str(reading_error(path, exc)))


def _close(ckpt: Checkpoint, errors: list[str]) -> None:
    with _per_file(ckpt.path, errors):
        ckpt.close()


def scan_checkpoint(
    ckpt: Checkpoint,
    scheme: Scheme | None = None,
    progress: Progress | None = None,
    threads: int | None = None,
) -> CheckpointScan:
    """Statistics of every tensor; with a scheme, also its quantization risk.

    Each floating tensor is read in chunks, never whole: once by the native one-pass kernels
    on `threads` threads (default: every core) where they apply, else by numpy/torch, and
    again (quant_stream) for a scheme or a layer scalar the kernels do not measure."""
    scan = CheckpointScan(ckpt.path, step_of(ckpt.path), optimizer=ckpt.optimizer)
    entries = ckpt.entries()
    if not entries and ckpt.optimizer is None:
        # e.g. a whole pickled nn.Module: its tensors are not in a state dict
        raise CheckpointError(
            ckpt.path, "holds no tensors deadweight can read (save model.state_dict() instead)"
        )
    # Layer scalars are read first (a few bytes each), so each is quantized together with
    # its layer's largest weight while that weight is in memory anyway: one at a time.
    scalars_of: dict[str, list[tuple[str, float]]] = {}
    if scheme is not None:
        partners = _largest_per_layer(entries)
        for entry in entries:
            if entry.is_float and entry.numel == 1:
                partner = partners.get(_layer_prefix(entry.name))
                value = float(ckpt.array(entry).reshape(-1)[0])
                if partner is not None and math.isfinite(value):
                    scalars_of.setdefault(partner.name, []).append((entry.name, value))
    kernels = native_reduce.kernels()
    threads = threads or default_threads()
    pool = ThreadPoolExecutor(threads) if kernels is not None and threads > 1 else None
    try:
        for entry in entries:
            _scan_entry(
                ckpt, entry, scheme, scan, scalars_of.get(entry.name, []), kernels, pool, threads
            )
            if progress is not None:
                progress(entry.name, entry.nbytes)
    finally:
        if pool is not None:
            pool.shutdown()
    return scan


def _scan_entry(
    ckpt: Checkpoint,
    entry: TensorEntry,
    scheme: Scheme | None,
    scan: CheckpointScan,
    scalars: list[tuple[str, float]],
    kernels: native_reduce.Kernels | None,
    pool: ThreadPoolExecutor | None,
    threads: int,
) -> None:
    if isinstance(entry, StorageOrderEntry):
        # Its elements are not in C order: statistics hold, quantization blocks do not.
        scheme, scalars = None, []
    fast = None
    if entry.is_float and kernels is not None:
        fast = scan_tensor(ckpt, entry, kernels, pool, threads, scheme, scalars)
    risk: QuantRisk | None = None
    if fast is not None:
        stats, risk = fast.stats, fast.risk
        if fast.joint is not None:
            scan.joint.update((name, (entry.name, r)) for name, r in fast.joint.items())
            scalars = []
    elif not entry.is_float:
        stats = tensor_stats(entry.name, entry.shape, entry.dtype, entry.numel, None)
    else:
        stats = tensor_stats(entry.name, entry.shape, entry.dtype, entry.numel, ckpt.chunks(entry))
    scan.tensors[entry.name] = stats
    if scheme is None or not entry.is_float or stats.nonfinite:
        return
    # A scheme the one-pass kernels do not measure, or a layer scalar to quantize with this
    # weight: measured from more passes over the tensor, in chunks (peak memory is a few
    # chunks, not several copies of the tensor).
    source = checkpoint_source(ckpt, entry)
    if risk is None and entry.numel > 1:
        risk = stream_quant_risk(source, entry.shape, scheme)
    for name, value in scalars:
        scan.joint[name] = (entry.name, stream_joint_risk(value, source, entry.numel, scheme))
    if risk is not None:
        scan.quant[entry.name] = risk


def _largest_per_layer(entries: list[TensorEntry]) -> dict[str, TensorEntry]:
    """The largest weight of each layer that holds a single-element tensor: what a
    layer scalar would share a quantization range with."""
    scalar_layers = {
        _layer_prefix(e.name) for e in entries if e.is_float and e.numel == 1 and layer_key(e.name)
    }
    largest: dict[str, TensorEntry] = {}
    for entry in entries:
        layer = _layer_prefix(entry.name)
        bigger = layer not in largest or entry.numel > largest[layer].numel
        ordered = not isinstance(entry, StorageOrderEntry)
        if entry.is_float and entry.numel > 1 and layer in scalar_layers and bigger and ordered:
            largest[layer] = entry
    return largest


def _layer_prefix(name: str) -> str:
    """`layers.31.mlp.fc1.weight` -> `layers.31`; names without an index -> ``."""
    key = layer_key(name)
    if key is None:
        return ""
    template, index = key
    return template.split("{}")[0] + str(index)


@_cycle_collector_paused
def inspect_checkpoints(
    paths: Sequence[str],
    *,
    scheme: str | Scheme | None = DEFAULT_SCHEME,
    unsafe_pickle: bool = False,
    progress: Progress | None = None,
    threads: int | None = None,
) -> InspectStats:
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    parsed = Scheme.parse(scheme) if isinstance(scheme, str) else scheme
    stats = InspectStats([], str(parsed) if parsed else "none")
    for path in paths:
        ckpt = _open(path, unsafe_pickle, stats.errors)
        if ckpt is None:
            continue
        try:
            with _per_file(path, stats.errors):
                stats.scans.append(scan_checkpoint(ckpt, parsed, progress, threads))
        finally:
            _close(ckpt, stats.errors)
    return stats


@_cycle_collector_paused
def diff_checkpoints(a: str, b: str, *, unsafe_pickle: bool = False) -> DiffStats:
    stats = DiffStats(a, b)
    left = _open(a, unsafe_pickle, stats.errors)
    right = _open(b, unsafe_pickle, stats.errors)
    try:
        if left is None or right is None:
            return stats
        with _per_file(f"{a} vs {b}", stats.errors):
            _diff_entries(stats, left, right)
    finally:
        for ckpt in (left, right):
            if ckpt is not None:
                _close(ckpt, stats.errors)
    return stats


def _diff_entries(stats: DiffStats, left: Checkpoint, right: Checkpoint) -> None:
    entries_a, entries_b = left.entries(), right.entries()
    stats.names_a, stats.names_b = len(entries_a), len(entries_b)
    # An eager save and a compiled (or DDP, FSDP) one name the same tensors differently.
    names = match_names([e.name for e in entries_a], [e.name for e in entries_b])
    stats.renamed = names.removed
    la = {names.a[e.name]: e for e in entries_a}
    rb = {names.b[e.name]: e for e in entries_b}
    # What is in one file only is named as that file names it.
    stats.removed = [e.name for n, e in la.items() if n not in rb]
    stats.added = [e.name for n, e in rb.items() if n not in la]
    stats.matched = len(la.keys() & rb.keys())
    for name, ea in la.items():
        eb = rb.get(name)
        if eb is None:
            continue
        if ea.shape != eb.shape:
            stats.reshaped.append((name, list(ea.shape), list(eb.shape)))
        elif ea.dtype != eb.dtype:
            stats.retyped.append((name, ea.dtype, eb.dtype))
        elif not ea.is_float or _orders_differ(ea, eb):
            stats.listed_only.append(name)
        else:
            stats.tensors[name] = _compare(name, left, ea, right, eb)


def _orders_differ(ea: TensorEntry, eb: TensorEntry) -> bool:
    """Whether the two tensors' chunks come in different element orders (one is stored
    in Fortran order and too large to reorder): then they cannot be compared element by
    element. Two of the same shape, both as stored, line up."""
    return isinstance(ea, StorageOrderEntry) != isinstance(eb, StorageOrderEntry)


def _compare(
    name: str, left: Checkpoint, ea: TensorEntry, right: Checkpoint, eb: TensorEntry
) -> TensorDiff:
    equal = True
    diff_sq = base_sq = 0.0
    max_abs = 0.0
    diverged = False
    for ca, cb in zip(left.chunks(ea), right.chunks(eb), strict=True):
        ca, cb = ca.reshape(-1), cb.reshape(-1)
        bits = np.uint64 if ca.dtype.itemsize == 8 else np.uint32
        # Bitwise, on the raw bits: NaN == NaN and -0.0 != 0.0, as a checksum would see it.
        if equal and not np.array_equal(ca.view(bits), cb.view(bits)):
            equal = False
        finite_a, finite_b = np.isfinite(ca), np.isfinite(cb)
        if not (finite_a.all() and finite_b.all()):
            # A value that became (or stopped being) NaN/Inf is an unbounded change; where
            # both are non-finite the change is measured on the other elements, so one NaN
            # carried along does not turn the whole tensor's change into NaN.
            if not np.array_equal(finite_a, finite_b):
                diverged = True
            both = finite_a & finite_b
            ca, cb = ca[both], cb[both]
        d = cb.astype(np.float64) - ca
        diff_sq += float(np.dot(d, d))
        wide = ca.astype(np.float64)
        base_sq += float(np.dot(wide, wide))
        if d.size:
            max_abs = max(max_abs, float(np.abs(d).max()))
    if diverged:
        return TensorDiff(name, equal, math.inf, math.inf)
    relative = math.sqrt(diff_sq / base_sq) if base_sq else (0.0 if diff_sq == 0 else math.inf)
    return TensorDiff(name, equal, relative, max_abs)


@_cycle_collector_paused
def trend_checkpoints(paths: Sequence[str], *, unsafe_pickle: bool = False) -> TrendStats:
    ordered = sorted(paths, key=lambda p: (step_of(p) is None, step_of(p) or 0))
    stats = TrendStats(list(ordered), [step_of(p) for p in ordered])
    for k, path in enumerate(ordered):
        ckpt = _open(path, unsafe_pickle, stats.errors)
        if ckpt is None:
            continue
        try:
            with _per_file(path, stats.errors):
                for entry in ckpt.entries():
                    if entry.is_float and entry.numel == 1:
                        value = float(ckpt.array(entry).reshape(-1)[0])
                        stats.values.setdefault(entry.name, [None] * len(ordered))[k] = value
        finally:
            _close(ckpt, stats.errors)
    return stats
