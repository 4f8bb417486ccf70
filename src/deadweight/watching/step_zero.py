"""The step-0 check of `deadweight run`: `deadweight.check` on the script's own first
training batch, with no change to the script.

Until the first optimizer step, module forward hooks (process-wide) keep the last
outermost forward that ran with gradients enabled: its module, its arguments and
its output. When a `torch.compile`d module is about to run, they give way to a hook
on the outermost module alone, which Dynamo never traces (process-wide hooks would
be traced into the compiled graph, and their removal would recompile it). At the first `.backward()` the loss is matched to that output: it is one
of the output's scalars (`model(x, y).loss`, nanoGPT's `logits, loss = model(X, Y)`),
or a chain of one-input operations on one (`loss / accumulation_steps`). At the
first `optimizer.step()` the hooks go, and `deadweight.check` runs on that module,
with a loss function that calls it again on the same arguments and picks the same
scalar. So the findings are `check`'s on the same model and batch, source lines of
the cuts included. The check leaves parameters, their gradients (the script's own,
about to be stepped), buffers, modes and RNG states as they were; later steps pay
nothing.

A loss computed outside the module (`F.cross_entropy(model(x), y)`) cannot be
replayed. The check then replays the module's forward with a fixed random
projection of the output tensor the loss was computed from as its loss, and keeps
only what holds for any loss computed from that output: which parameters get no
gradient and where the graph was cut (DW101/DW102, each parameter confirmed by the
script's own backward, which left it without a gradient too), and the optimizer
audit (DW2xx). Numerical verdicts (DW103-DW105) need the real loss and are left out;
the report says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deadweight import autograd_graph, wrappers
from deadweight.findings import Finding

log = logging.getLogger(__name__)

# How far the output is searched for the loss, and how many one-input operations may
# lie between the loss passed to backward() and a scalar of the output.
MAX_DEPTH = 4
MAX_HOPS = 8
# Findings that hold whatever loss is computed from the module's output; and those
# that do when the graph's structure proves them (a norm that divides a scalar out).
STRUCTURAL = ("DW101", "DW102", "DW2")
CANCELLED = ("DW104", "DW105")
STAND_IN = (
    " (by construction: found with a stand-in for the loss, which is computed outside the "
    "model; the structure holds for any loss computed from the model's output, the "
    "gradient's size is the stand-in's)"
)

Path = tuple[Any, ...]


@dataclass
class _Forward:
    """The last outermost grad-enabled forward before the first step."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any


@dataclass
class Replay:
    """How to run the first training forward again and get its loss."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    path: Path  # where in the output the loss (or the tensor it was computed from) is
    exact: bool  # the loss itself (True) or the output tensor it was computed from

    def loss_fn(self) -> Callable[[], torch.Tensor]:
        """The loss to check with. A stand-in (not `exact`) is a fixed random projection
        of the output tensor, plus zero times each parameter the script's own backward
        gave a gradient that the output does not lead to: those get one in the check as
        well (a temperature used only by the loss outside the module is not cut off)."""
        module, args, kwargs, path = self.module, self.args, self.kwargs, self.path
        if self.exact:
            return lambda: _pick(module(*args, **kwargs), path)
        reached = [p for p in module.parameters() if p.requires_grad and _got_gradient(p)]
        projection: dict[str, torch.Tensor] = {}

        def stand_in() -> torch.Tensor:
            out = _pick(module(*args, **kwargs), path)
            r = projection.get("r")
            if r is None or r.shape != out.shape:
                gen = torch.Generator(device="cpu").manual_seed(0)
                r = torch.randn(out.shape, generator=gen).to(out.device, torch.float32)
                projection["r"] = r
            loss = (out.float() * r).sum()
            # Only those the output does not already lead to: a second path would hide
            # a cancellation on the first one from the structure pass.
            upstream = autograd_graph.walk([out.grad_fn]).leaves if out.grad_fn else {}
            for p in reached:
                if id(p) not in upstream:
                    loss = loss + 0.0 * p.float().sum()
            return loss

        return stand_in


def _got_gradient(p: torch.Tensor) -> bool:
    """The script's backward gave `p` a gradient: in `.grad`, or, under megatron-core's
    DDP, added into its slice of the gradient buffer (zeroed before each step's
    backward, so a slice that is still all zero got nothing). Once, at step 0."""
    grad = wrappers.gradient(p)
    if grad is None:
        return False
    return grad is p.grad or bool(grad.any())


def _tensors(obj: Any, path: Path = (), depth: int = 0) -> Iterator[tuple[Path, torch.Tensor]]:
    """Every tensor in a forward's output, with the path to it (keys, indices)."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif depth >= MAX_DEPTH:
        return
    elif isinstance(obj, dict):  # transformers' ModelOutput is one
        for key, value in list(obj.items()):
            yield from _tensors(value, (*path, key), depth + 1)
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _tensors(value, (*path, i), depth + 1)


def _pick(obj: Any, path: Path) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def locate(loss: torch.Tensor, output: Any) -> tuple[Path, bool] | None:
    """Where `loss` comes from in `output`: (path, True) for one of its scalars (or a
    chain of one-input operations on one), (path, False) for the output tensor it was
    computed from by something else, None if it does not come from this output."""
    found = list(_tensors(output))
    by_tensor = {id(t): p for p, t in found}
    if id(loss) in by_tensor and loss.numel() == 1:
        return by_tensor[id(loss)], True
    by_node = {id(t.grad_fn): (p, t) for p, t in found if t.grad_fn is not None}
    node = loss.grad_fn
    for _ in range(MAX_HOPS):  # a scalar of the output, scaled or cast
        if node is None:
            break
        hit = by_node.get(id(node))
        if hit is not None and hit[1].numel() == 1:
            return hit[0], True
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            break
        node = inputs[0]
    # Computed from the output by other operations: the first output tensor its graph
    # reaches, breadth first over a bounded number of nodes.
    seen: set[int] = set()
    frontier = [loss.grad_fn] if loss.grad_fn is not None else []
    while frontier and len(seen) < 4096:
        node = frontier.pop(0)
        if id(node) in seen:
            continue
        seen.add(id(node))
        hit = by_node.get(id(node))
        if hit is not None and hit[1].is_floating_point():
            return hit[0], False
        frontier.extend(n for n, _ in node.next_functions if n is not None)
    return None


class FirstStep:
    """Captures the first training forward and loss; `run` checks them at the first
    optimizer step. Its hooks are process-wide and removed at that step (or `close`)."""

    def __init__(self) -> None:
        self._depth = 0
        self._last: _Forward | None = None
        self.replay: Replay | None = None
        self.unmatched: str | None = None  # why the loss could not be matched
        self.done = False
        self._root: nn.Module | None = None  # the outermost module now running
        register_pre = torch.nn.modules.module.register_module_forward_pre_hook
        register_post = torch.nn.modules.module.register_module_forward_hook
        self._handles = [
            register_pre(self._pre),
            register_post(self._post, with_kwargs=True, always_call=True),
        ]
        self._local = False

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0:
            self._root = module
        self._depth += 1
        if type(module).__name__ == "OptimizedModule" and self._root is not None:
            # torch.compile is about to trace what runs inside: process-wide hooks would
            # be traced into its graph and guarded on, so removing them at the first step
            # would recompile the model. From here on, only the outermost module is
            # hooked, by hooks of its own, which run eagerly around the compiled code.
            self._go_local(self._root)

    def _go_local(self, root: nn.Module) -> None:
        for handle in self._handles:
            handle.remove()
        self._local = True
        self._depth = 0
        self._handles = [root.register_forward_hook(self._post, with_kwargs=True, always_call=True)]

    def _post(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if not self._local:
            self._depth = max(0, self._depth - 1)
        if (
            self._depth == 0
            and torch.is_grad_enabled()
            and not torch.is_inference_mode_enabled()
            # not a forward that backward re-runs (reentrant activation checkpointing)
            and torch._C._current_graph_task_id() == -1
        ):
            self._last = _Forward(module, tuple(args), dict(kwargs), output)

    def on_backward(self, loss: torch.Tensor) -> None:
        """The script called backward on `loss` (the unscaled loss behind a GradScaler's)."""
        if self.done:
            return
        last = self._last
        self._last = None  # its output is not held past the backward
        if last is None:
            self.unmatched = "no module forward ran with gradients before the first backward"
            return
        try:
            where = locate(loss, last.output)
        except Exception as exc:  # an odd output: no check, never a failed step
            where = None
            log.debug("step-0 check: cannot search the output: %s", exc)
        if where is None:
            self.unmatched = (
                f"the loss passed to backward() does not come from the output of "
                f"{type(last.module).__name__}.forward"
            )
            return
        self.replay = Replay(last.module, last.args, last.kwargs, where[0], where[1])
        self.unmatched = None

    def ready(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """At an optimizer step's start: check now, unless the backward is still to come
        inside `step(closure)` (Lightning): then after the step."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        return self.replay is not None or not callable(closure)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._last = None

    def run(self, optimizer: Any) -> dict[str, Any]:
        """At the first optimizer step: the check event (findings as dicts, and how
        they were obtained). Never raises; removes the hooks first."""
        self.done = True
        self.close()
        replay, self.replay = self.replay, None
        if replay is None:
            return {"mode": "unavailable", "findings": [], "note": self.unmatched or "no loss seen"}
        try:
            return _checked(replay, optimizer)
        except Exception as exc:  # an out-of-memory, a refusal, a deadweight bug
            with contextlib.suppress(Exception):
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            return {
                "mode": "unavailable",
                "findings": [],
                "note": f"the step-0 check failed: {type(exc).__name__}: {exc}",
            }


def _checked(replay: Replay, optimizer: Any) -> dict[str, Any]:
    from deadweight.checking.api import check

    report = check(replay.module, replay.loss_fn(), optimizer)
    findings = list(report.findings)
    note = None
    if not replay.exact:  # only what holds for any loss computed from this output
        findings = [_structural(f) for f in findings if _holds_for_any_loss(f)]
        note = (
            "the loss is computed outside the module's forward: the step-0 check replayed the "
            "forward with a stand-in loss and reports only gradients that never arrive, where "
            "the graph was cut, cancellations proven by the graph's structure, and the "
            "optimizer audit (run `deadweight check` with the real loss for the rest)"
        )
    return {
        "mode": "replayed" if replay.exact else "structure-only",
        "model": type(replay.module).__name__,
        "findings": [f.to_dict() for f in findings],
        "note": note,
    }


def _holds_for_any_loss(finding: Finding) -> bool:
    if finding.code.startswith(STRUCTURAL):
        return True
    if finding.code not in CANCELLED:
        return False
    per_param = finding.evidence.get("params")
    return (
        isinstance(per_param, dict)
        and bool(per_param)
        and all(isinstance(e, dict) and e.get("by_construction") for e in per_param.values())
    )


def _structural(finding: Finding) -> Finding:
    if finding.code in CANCELLED:
        return dataclasses.replace(finding, message=finding.message + STAND_IN)
    return finding
