"""Where `deadweight.check`'s time goes on the dispatch-bound model, part by part.

`check_overhead.py --case dispatch` gives the ratio; this gives its parts, on the same
model (transformers' GPT-2 code, 12 layers of width 64, batch 2x32, one thread: every
kernel is tiny, so a step costs what Python and torch's dispatch cost per op, as on a
GPU). All times are this thread's CPU time (`time.thread_time`), so another process
taking the core does not count.

1. **The traced forward, step by step.** Five forwards run interleaved, round after
   round: the plain forward; under a pass-through `TorchFunctionMode` (what any mode
   costs per torch call); plus deadweight's module hooks (`ModuleTracer`); plus the op
   tracer's own bookkeeping (`OpTracer`: cuts, taint, parameter writes); plus the
   structure pass (`StructureTracker`), which is what `check` runs, with the garbage
   collector off as check keeps it there. Each step is given
   as the median of its per-round differences from the step below it, and per call:
   per torch call the mode sees, per module call, per call that carries a parameter's
   effect.
2. **The whole check, phase by phase.** A plain forward+backward and a `check`
   alternate; inside each check the phases of `measure_grad_flow` are timed (the
   traced forward, the backward, the gradient statistics, the state snapshot and
   restore, the cuts, the probes, the assembly) and the API around it. The garbage
   collector runs as it would for a user.
3. **The floor.** What the check would cost with a structure pass that cost nothing,
   and the budget that 1.7x a plain forward+backward leaves.

The phases are read by wrapping `checking.flow_measurement`'s steps: a step renamed
there stops this script with its name (tests/checking/test_check_breakdown.py runs it
small).

    python benchmarks/check_breakdown.py [--rounds 40] [--layers 12]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import deadweight
from deadweight.checking import api, cancellation, flow_measurement
from deadweight.checking.carrier_algebra import tensor_outputs
from deadweight.checking.module_trace import ModuleTracer
from deadweight.checking.op_trace import OpTracer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_overhead import build

# measure_grad_flow's steps, in the order they run
PHASES = (
    "_validated_params",
    "_trace",
    "_backward_step",
    "_collect_cuts",
    "_gradient_statistics",
    "_statistics_and_probes",
    "_assemble",
)
# every timed step of a check, in the order they run
LABELS = {
    "_validated_params": "validate the parameters",
    "__post_init__": "parameter index and structure tracker",
    "preserved_enter": "snapshot (modes, buffers, grads, RNG, checksums)",
    "_trace": "traced forward",
    "_backward_step": "backward",
    "_collect_cuts": "cuts and module records",
    "_gradient_statistics": "gradient statistics",
    "_statistics_and_probes": "structure verdict and probes",
    "restore": "parameter values put back (after backward, at exit)",
    "preserved_exit": "grads, buffers, modes and RNG put back",
    "writes": "parameter-write checksums",
    "_assemble": "assembly (roles, per-parameter records)",
}


class PassThrough(TorchFunctionMode):
    """A mode that only calls through: what intercepting a torch call costs at all."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        return func(*args, **(kwargs or {}))


class Counting(PassThrough):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.calls += 1
        return super().__torch_function__(func, types, args, kwargs)


def ladder(
    model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]
) -> dict[str, Callable[[], Any]]:
    """The five forwards of part 1, each adding one layer of check's tracing."""
    params = {id(p): p for p in model.parameters()}
    names = {id(p): n for n, p in model.named_parameters()}

    def ignore_write(*_: Any) -> None:
        return None

    def plain() -> Any:
        return loss_fn()

    def mode() -> Any:
        with PassThrough():
            return loss_fn()

    def hooks() -> Any:
        with ModuleTracer(model), PassThrough():
            return loss_fn()

    def traced(with_structure: bool) -> Any:
        modules = ModuleTracer(model)
        tracker = None
        if with_structure:
            tracker = cancellation.StructureTracker(dict(params), names)
            tracker.set_module_lookup(modules.current)
        tracer = OpTracer(
            modules.current, params=params, before_param_write=ignore_write, structure=tracker
        )
        with modules, tracer:
            return loss_fn()

    return {
        "plain forward": plain,
        "+ pass-through mode": mode,
        "+ module hooks": hooks,
        "+ op tracer": functools.partial(traced, False),
        "+ structure pass": functools.partial(traced, True),
    }


def counts(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Torch calls the mode sees, module calls, and calls whose arguments carry a
    parameter's effect, in one forward (untimed)."""
    mode = Counting()
    with mode:
        loss_fn()
    modules = ModuleTracer(model)
    with modules:
        loss_fn()
    carrying = 0
    observe = cancellation.StructureTracker._observe

    def counted(
        self: Any, func: Any, name: str, ordinal: int, args: tuple, kwargs: dict, out: Any
    ) -> None:
        nonlocal carrying
        if tensor_outputs(out) and self._carries_any(args, kwargs):
            carrying += 1
        observe(self, func, name, ordinal, args, kwargs, out)

    cancellation.StructureTracker._observe = counted  # type: ignore[method-assign]
    try:
        ladder(model, loss_fn)["+ structure pass"]()
    finally:
        cancellation.StructureTracker._observe = observe  # type: ignore[method-assign]
    return {
        "torch calls": mode.calls,
        "module calls": sum(r.calls for r in modules.calls.values()),
        "carrying calls": carrying,
    }


def timed(fn: Callable[[], Any], collect: bool = False) -> float:
    """This thread's CPU time for one call; with `collect`, the garbage collector runs
    as it would (check pauses it itself around its trace and backward), else it is off,
    as check keeps it through its traced forward. (No `gc.collect()` before: its walk
    of the heap leaves the caches cold for whatever is timed next.)"""
    if not collect:
        gc.disable()
    try:
        start = time.thread_time()
        fn()
        return time.thread_time() - start
    finally:
        gc.enable()


def part1(
    model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], rounds: int
) -> dict[str, float]:
    forwards = ladder(model, loss_fn)
    n = counts(model, loss_fn)
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(2):
        for fn in forwards.values():
            fn()
    for _ in range(rounds):
        for name, fn in forwards.items():
            times[name].append(timed(fn))
    plain = times["plain forward"]
    print(
        f"1. The traced forward ({n['torch calls']} torch calls, {n['module calls']} module "
        f"calls, {n['carrying calls']} of the calls carry a parameter's effect), "
        f"median of {rounds} interleaved rounds:"
    )
    per = {
        "+ pass-through mode": ("torch call", n["torch calls"]),
        "+ module hooks": ("module call", n["module calls"]),
        "+ op tracer": ("torch call", n["torch calls"]),
        "+ structure pass": ("carrying call", n["carrying calls"]),
    }
    added: dict[str, float] = {}
    names = list(forwards)
    print(f"   {'plain forward':<22} {statistics.median(plain) * 1e3:7.2f} ms")
    for below, name in itertools.pairwise(names):
        step = statistics.median(b - a for a, b in zip(times[below], times[name], strict=True))
        total = statistics.median(t / p for p, t in zip(plain, times[name], strict=True))
        what, k = per[name]
        added[name] = step
        print(
            f"   {name:<22} {step * 1e3:+7.2f} ms  ({step / max(k, 1) * 1e6:5.1f} us per {what}; "
            f"{total:.2f}x the plain forward so far)"
        )
    added["plain forward"] = statistics.median(plain)
    return added


@contextlib.contextmanager
def phases_timed() -> Iterator[dict[str, list[float]]]:
    """Inside: every check records the thread time of each of its phases."""
    acc: dict[str, list[float]] = defaultdict(list)
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name, None)
        if original is None:
            raise SystemExit(
                f"{getattr(owner, '__name__', owner)} has no {name}: "
                "update benchmarks/check_breakdown.py"
            )

        @functools.wraps(original)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                acc[label].append(time.thread_time() - start)

        saved.append((owner, name, original))
        setattr(owner, name, timed_call)

    preserved = flow_measurement.preserved

    @contextlib.contextmanager
    def preserved_timed(model: torch.nn.Module, *args: Any) -> Iterator[Any]:
        start = time.thread_time()
        with preserved(model, *args) as guard:
            acc["preserved_enter"].append(time.thread_time() - start)
            yield guard
            start = time.thread_time()
            restores = len(acc["restore"])
        # less the parameter restore the exit runs, which `restore` counts
        inside = sum(acc["restore"][restores:])
        acc["preserved_exit"].append(time.thread_time() - start - inside)

    try:  # a step not found stops the script with every step wrapped so far put back
        for name in PHASES:
            wrap(flow_measurement, name, name)
        wrap(flow_measurement._Run, "__post_init__", "__post_init__")
        wrap(flow_measurement.ParamGuard, "writes", "writes")
        wrap(flow_measurement.ParamGuard, "restore", "restore")
        wrap(api, "measure_grad_flow", "measure_grad_flow")
        saved.append((flow_measurement, "preserved", preserved))
        flow_measurement.preserved = preserved_timed  # type: ignore[assignment]
        yield acc
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def part2(
    model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], rounds: int
) -> dict[str, float]:
    def plain() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn().backward()

    def check() -> None:
        report = deadweight.check(model, loss_fn)
        assert not [f for f in report.findings if f.severity.rank >= 1], report

    with phases_timed() as acc:
        for _ in range(2):
            plain()
            check()
        acc.clear()
        plain_times, check_times = [], []
        per_check: dict[str, list[float]] = defaultdict(list)
        for _ in range(rounds):
            plain_times.append(timed(plain, collect=True))
            before = {k: len(v) for k, v in acc.items()}
            check_times.append(timed(check, collect=True))
            for k, v in acc.items():  # a step may run more than once per check
                per_check[k].append(sum(v[before.get(k, 0) :]))
    step = statistics.median(plain_times)
    whole = statistics.median(check_times)
    ratio = statistics.median(c / p for p, c in zip(plain_times, check_times, strict=True))
    med = {k: statistics.median(v) for k, v in per_check.items()}
    print()
    print(
        f"2. The whole check, median of {rounds} rounds: plain forward+backward "
        f"{step * 1e3:.2f} ms, check {whole * 1e3:.2f} ms ({ratio:.2f}x, median of the "
        "paired ratios). Its phases:"
    )
    named = 0.0
    for key in LABELS:
        named += med.get(key, 0.0)
        print(f"   {LABELS[key]:<52} {med.get(key, 0.0) * 1e3:6.2f} ms")
    inside = med["measure_grad_flow"] - named
    outside = whole - med["measure_grad_flow"]
    print(f"   {'the rest of measure_grad_flow':<52} {inside * 1e3:6.2f} ms")
    print(f"   {'the API around it (layout, rules, report)':<52} {outside * 1e3:6.2f} ms")
    return {"plain": step, "check": whole, "ratio": ratio, **med}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    if args.layers < 1 or args.rounds < 1:
        parser.error("--layers and --rounds must be at least 1")
    torch.set_num_threads(1)
    model, ids = build(2, 32, width=64, layers=args.layers, heads=4)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: transformers GPT2LMHeadModel, {n_params / 1e6:.2f}M parameters, "
        f"{args.layers} layers of width 64, batch 2x32, 1 thread, torch {torch.__version__}"
    )

    def loss_fn() -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    forward = part1(model, loss_fn, args.rounds)
    whole = part2(model, loss_fn, args.rounds)
    structure = forward["+ structure pass"]
    without = (whole["check"] - structure) / whole["plain"]
    budget = 0.7 * whole["plain"]
    print()
    print(
        f"3. The floor: with a structure pass that cost nothing, check would be "
        f"{without:.2f}x; 1.7x leaves {budget * 1e3:.2f} ms over a plain forward+backward, "
        f"and everything but the structure pass takes "
        f"{(whole['check'] - whole['plain'] - structure) * 1e3:.2f} ms of it."
    )


if __name__ == "__main__":
    main()
