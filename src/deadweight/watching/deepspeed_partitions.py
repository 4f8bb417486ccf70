"""A DeepSpeed optimizer seen through the user's own parameters.

DeepSpeed's optimizers (ZeRO stages 1-3, and its stage-0 mixed-precision wrapper)
keep fp32 master copies of the weights and hand those to the torch optimizer inside:
flat partitions, one per parameter group, stepped once per group (ZeRO-3: per
sub-group) with the groups swapped in and out around each call. Watched there, a
run would count several steps per training step, see one nameless tensor per group,
and judge the low-precision model weights, which change only when the fp32 master
crosses a rounding step, as updates lost. A detached layer or a drifting scalar
would be invisible.

So the DeepSpeed optimizer itself is watched, through `ZeroView`: a torch optimizer
in form (its own step hooks, `param_groups`, `state`) whose tensors are the fp32
master weights of each user parameter (views into DeepSpeed's partitions, named
after the parameter) and whose one step is DeepSpeed's whole step. Its hooks see
each parameter's gradient through `grad_of`, read without a copy from what DeepSpeed
reduced, and the updated masters after the step. Under DeepSpeed's fp16 loss scaler
the view tells the monitor, as a fused optimizer under a GradScaler does, whether
the step will be skipped (`found_inf`) and the scale the gradients carry
(`grad_scale`). Nothing of DeepSpeed's is modified but its optimizer's `step`,
wrapped while the view lives.

This reads DeepSpeed's internal layout (checked against each parameter's size).
Where the layout is not understood (another DeepSpeed version, NVMe swapping, more
than one data-parallel rank, a wrapper not mapped here) the view holds no tensors:
steps are still counted once each, the model's parameters are watched for movement
only, and `ZeroView.limit` says why.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

STAGE_1_2 = "DeepSpeedZeroOptimizer"
STAGE_3 = "DeepSpeedZeroOptimizer_Stage3"
UNFUSED = "FP16_UnfusedOptimizer"  # stage 0 under fp16 / bf16 with a torch optimizer
DEEPSPEED_OPTIMIZERS = (STAGE_1_2, STAGE_3, UNFUSED, "FP16_Optimizer", "BF16_Optimizer")
_ATTR = "_deadweight_zero_view"


def find_zero(obj: Any, depth: int = 16) -> Any:
    """The DeepSpeed optimizer in `obj` or in the `.optimizer` chain it holds."""
    seen: set[int] = set()
    for _ in range(depth):
        if obj is None or id(obj) in seen:
            return None
        seen.add(id(obj))
        if type(obj).__name__ in DEEPSPEED_OPTIMIZERS:
            return obj
        obj = getattr(obj, "optimizer", None)
    return None


def owner_of(inner: torch.optim.Optimizer) -> Any:
    """The DeepSpeed optimizer that steps `inner`, found among the objects that refer
    to it (zero-code mode meets the inner optimizer first). A scan of the heap, made
    once per optimizer that steps, and only once DeepSpeed is imported."""
    if "deepspeed" not in sys.modules:
        return None
    for referrer in gc.get_referrers(inner):
        holders = gc.get_referrers(referrer) if isinstance(referrer, dict) else [referrer]
        for holder in holders:
            if (
                type(holder).__name__ in DEEPSPEED_OPTIMIZERS
                and getattr(holder, "optimizer", None) is inner
            ):
                return holder
    return None


def on_next_step(zero: Any, build: Callable[[Any], ZeroView | None]) -> Callable[[], None]:
    """Call `build(zero)` at the start of the DeepSpeed optimizer's next step, when its
    groups are in place (zero-code mode finds it from inside a step, with DeepSpeed's
    groups swapped), and step through the view it returns. Returns the undo."""
    original = vars(zero).get("step")

    def first_step(*args: Any, **kwargs: Any) -> Any:
        undo()
        view = None
        try:
            view = build(zero)
        except Exception:  # never let deadweight stop training
            view = None
        return (view._zero_step if view is not None else zero.step)(*args, **kwargs)

    def undo() -> None:
        if vars(zero).get("step") is first_step:
            if original is None:
                del zero.step
            else:
                zero.step = original

    zero.step = first_step
    return undo


def view_of(obj: Any) -> ZeroView | None:
    """The view of the DeepSpeed optimizer inside `obj` (one per DeepSpeed optimizer,
    made on first use), or None if there is none."""
    zero = find_zero(obj)
    if zero is None:
        return None
    existing = vars(zero).get(_ATTR)
    if isinstance(existing, ZeroView) and not existing.released:
        return existing
    view = ZeroView(zero)
    setattr(zero, _ATTR, view)
    return view


def _world_size(group: Any) -> int:
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    try:
        return int(dist.get_world_size(group=group))
    except Exception:
        return 0  # unknown: treated as more than one rank


def _element_offset(t: torch.Tensor, base: torch.Tensor) -> int:
    return (t.data_ptr() - base.data_ptr()) // t.element_size()


def _master_view(flat: torch.Tensor, offset: int, numel: int, shape: torch.Size) -> torch.Tensor:
    if offset < 0 or offset + numel > flat.numel():
        raise LookupError("a parameter lies outside its group's partition")
    view = flat.detach().narrow(0, offset, numel).view(shape)
    view.requires_grad_(True)  # watched as trainable; nothing backpropagates into it
    return view


@dataclass
class _Group:
    """One DeepSpeed parameter group (ZeRO-3: sub-group) as the view watches it."""

    masters: list[torch.Tensor]  # each user parameter's fp32 master weights
    params: list[torch.Tensor]  # the user's parameters, in the same order
    hyper: int  # the torch optimizer's group holding its learning rate and betas
    state_on: list[torch.Tensor]  # per master: the tensor its optimizer state is kept on
    read_grads: Callable[[], list[torch.Tensor | None]]  # this step's, one per master


@dataclass
class _Layout:
    groups: list[_Group] = field(default_factory=list)
    skips_on_inf: bool = False  # DeepSpeed skips a step whose gradients hold inf/NaN


def _sized(g: Any, like: torch.Tensor) -> torch.Tensor | None:
    if isinstance(g, torch.Tensor) and g.numel() == like.numel():
        return g.view(like.shape)
    return None


def _slices(flat: Any, like: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor | None]:
    """Each tensor's gradient as a view of one flat gradient buffer, where it has one."""
    if not isinstance(flat, torch.Tensor):
        return [None] * len(like)
    flat = flat.reshape(-1)
    return [
        _sized(flat.narrow(0, off, t.numel()), t) if 0 <= off <= flat.numel() - t.numel() else None
        for t, off in zip(like, offsets, strict=True)
    ]


def _stage_1_2(zero: Any) -> _Layout:
    # Its step is skipped for inf/NaN gradients when it checks them (fp16), or when
    # the global norm it clips by comes out invalid, except under bf16.
    skips = bool(getattr(zero, "check_grad_overflow", False)) or (
        bool(getattr(zero, "compute_grad_norm", False)) and zero.dtype != torch.bfloat16
    )
    layout = _Layout(skips_on_inf=skips)
    for i, group in enumerate(zero.bit16_groups):
        if _world_size(zero.real_dp_process_group[i]) != 1:
            raise LookupError("the partitions span more than one data-parallel rank")
        params = list(group)
        in_partition = list(zero.params_in_partition[i])
        if {id(p) for p in in_partition} != {id(p) for p in params}:
            raise LookupError("this rank's partition does not hold every parameter")
        fp32 = zero.single_partition_of_fp32_groups[i]
        flat16 = zero.bit16_groups_flat[i]
        offsets = [_element_offset(p, flat16) for p in params]
        masters = [
            _master_view(fp32, off, p.numel(), p.shape)
            for p, off in zip(params, offsets, strict=True)
        ]
        order = {id(p): k for k, p in enumerate(in_partition)}

        def read(
            i: int = i,
            params: list[torch.Tensor] = params,
            order: dict[int, int] = order,
            offsets: list[int] = offsets,
            fp32: torch.Tensor = fp32,
        ) -> list[torch.Tensor | None]:
            found = zero.averaged_gradients.get(i)
            if isinstance(found, list | tuple):  # one tensor per parameter
                picks = [order.get(id(p)) for p in params]
                return [
                    _sized(found[k], p) if k is not None and k < len(found) else None
                    for p, k in zip(params, picks, strict=True)
                ]
            if not isinstance(found, torch.Tensor):  # offloaded: on the fp32 partition
                found = fp32.grad
            return _slices(found, params, offsets)

        layout.groups.append(_Group(masters, params, i, [fp32] * len(masters), read))
    return layout


def _stage_3(zero: Any) -> _Layout:
    layout = _Layout(skips_on_inf=True)  # an invalid global norm skips, in every dtype
    if _world_size(getattr(zero, "dp_process_group", None)) != 1:
        raise LookupError("the partitions span more than one data-parallel rank")
    for s, group in enumerate(zero.fp16_groups):
        params = list(group)
        flat16 = zero.fp16_partitioned_groups_flat[s]
        fp32 = zero.fp32_partitioned_groups_flat[s]
        if not isinstance(flat16, torch.Tensor) or fp32.numel() < flat16.numel():
            raise LookupError("the partitions are swapped out")
        masters, offsets = [], []
        for p in params:
            if int(p.ds_tensor.ds_numel) != p.ds_numel:
                raise LookupError("a parameter is split across ranks")
            offsets.append(_element_offset(p.ds_tensor, flat16))
            masters.append(_master_view(fp32, offsets[-1], p.ds_numel, p.ds_shape))

        def read(
            s: int = s,
            masters: list[torch.Tensor] = masters,
            offsets: list[int] = offsets,
            fp32: torch.Tensor = fp32,
        ) -> list[torch.Tensor | None]:
            grads = zero.averaged_gradients
            found = grads.get(s) if isinstance(grads, dict) else None
            if isinstance(found, list | tuple) and len(found) == len(masters):
                return [_sized(g, m) for g, m in zip(found, masters, strict=True)]
            return _slices(fp32.grad, masters, offsets)  # offloaded: on the fp32 partition

        hyper = int(zero.sub_group_to_group_id[s])
        layout.groups.append(_Group(masters, params, hyper, [fp32] * len(masters), read))
    return layout


def _unfused(zero: Any) -> _Layout:
    """Stage 0 under fp16 / bf16: one fp32 copy per parameter, stepped by the torch
    optimizer; the gradient is the model parameter's own until DeepSpeed's step."""
    layout = _Layout(skips_on_inf=True)  # its overflow check runs in every dtype
    for i, (group16, group32) in enumerate(zip(zero.fp16_groups, zero.fp32_groups, strict=True)):
        params, masters = list(group16), list(group32)

        def read(params: list[torch.Tensor] = params) -> list[torch.Tensor | None]:
            # DeepSpeed steps a parameter without a gradient with zeros (no copy here)
            return [
                p.grad
                if p.grad is not None
                else torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)
                for p in params
            ]

        layout.groups.append(_Group(masters, params, i, masters, read))
    return layout


_LAYOUTS = {STAGE_1_2: _stage_1_2, STAGE_3: _stage_3, UNFUSED: _unfused}


def _loss_scale(zero: Any) -> float:
    for holder, attr in ((zero, "loss_scale"), (zero, "cur_scale")):
        value = getattr(holder, attr, None)
        if isinstance(value, int | float):
            return float(value)
    value = getattr(getattr(zero, "loss_scale_config", None), "cur_scale", None)
    return float(value) if isinstance(value, int | float) else 1.0


class _PartitionState(Mapping[torch.Tensor, Any]):
    """`state.get(watched)`: the optimizer state of the partition the tensor lives in,
    so an emptied state (a reset) is seen for each parameter in it."""

    def __init__(self, inner: torch.optim.Optimizer, state_on: dict[int, torch.Tensor]) -> None:
        self.inner = inner
        self.state_on = state_on

    def __getitem__(self, key: torch.Tensor) -> Any:
        flat = self.state_on.get(id(key))
        if flat is None:
            raise KeyError(key)
        return self.inner.state.get(flat, {})

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(())

    def __len__(self) -> int:
        return 0


class ZeroView(torch.optim.Optimizer):
    """A DeepSpeed optimizer as a torch optimizer over the user's parameters' fp32
    master weights.

    Its `step` is DeepSpeed's own (installed on the DeepSpeed optimizer for as long as
    the view lives), so step hooks registered here run once per training step, before
    and after DeepSpeed's whole update. `release()` gives DeepSpeed its step back.
    """

    def __init__(self, zero: Any) -> None:
        self.zero = zero
        self.inner: torch.optim.Optimizer = zero.optimizer
        # What the monitor's events call it, and why its skipped steps were skipped.
        self.display_name = type(zero).__name__
        self.skip_cause = "DeepSpeed found inf/NaN gradients and skipped the step"
        self.released = False
        self.limit: str | None = None
        build = _LAYOUTS.get(type(zero).__name__)
        try:
            if build is None:
                raise LookupError(f"{type(zero).__name__} is not mapped")
            layout = build(zero)
        except Exception as exc:  # another layout: count the steps, movement only
            layout = _Layout()
            self.limit = (
                str(exc) if isinstance(exc, LookupError) else f"{type(exc).__name__}: {exc}"
            )
        self.layout = layout
        # id(master) -> the user's parameter, for names
        self.owners: dict[int, torch.Tensor] = {
            id(m): p for g in layout.groups for m, p in zip(g.masters, g.params, strict=True)
        }
        groups: list[dict[str, Any]] = [
            {**self._hyper(k), "params": list(g.masters)} for k, g in enumerate(layout.groups)
        ] or [{"params": []}]
        super().__init__(groups, defaults={})
        state_on = {
            id(m): on for g in layout.groups for m, on in zip(g.masters, g.state_on, strict=True)
        }
        self.state = _PartitionState(self.inner, state_on)  # type: ignore[assignment]
        self.found_inf: torch.Tensor | None = None
        self.grad_scale: torch.Tensor | None = None
        self._grads: dict[int, torch.Tensor] = {}
        self._original = vars(zero).get("step")  # an instance-level step already there
        self._ds_step = zero.step
        zero.step = self._zero_step

    def grad_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The gradient DeepSpeed will step `t` with, during this view's pre-hooks."""
        return self._grads.get(id(t))

    def _hyper(self, k: int) -> dict[str, Any]:
        group = self.inner.param_groups[self.layout.groups[k].hyper]
        return {key: value for key, value in group.items() if key != "params"}

    def _zero_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.released:
            return self._ds_step(*args, **kwargs)
        try:
            for k, group in enumerate(self.param_groups):
                if k < len(self.layout.groups):
                    group.update(self._hyper(k))  # a scheduler sets DeepSpeed's groups
            self._read_grads()
        except Exception:  # never let deadweight stop training
            self._grads = {}
            self.found_inf = self.grad_scale = None
        return self.step(*args, **kwargs)

    def _read_grads(self) -> None:
        grads: dict[int, torch.Tensor] = {}
        for group in self.layout.groups:
            for m, g in zip(group.masters, group.read_grads(), strict=True):
                if g is not None and g.device == m.device:
                    grads[id(m)] = g
        self._grads = grads
        self.found_inf = self.grad_scale = None
        if self.layout.skips_on_inf and grads:
            # DeepSpeed skips a step whose (loss-scaled) gradients hold inf/NaN; the
            # monitor is told so, and the scale, as a fused optimizer tells it.
            present = list(grads.values())
            norms = torch.stack([n.double() for n in torch._foreach_norm(present)])
            self.found_inf = (~torch.isfinite(norms).all()).to(torch.float32).reshape(1)
            scale = [_loss_scale(self.zero)]
            self.grad_scale = torch.tensor(scale, dtype=torch.float32, device=present[0].device)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """DeepSpeed's step; the pre-hooks ran just before it, with the gradients."""
        self._grads = {}
        if closure is not None:
            return self._ds_step(closure)
        return self._ds_step()

    def release(self) -> None:
        """Give DeepSpeed its own step back (if nothing wrapped it after the view)."""
        if self.released:
            return
        self.released = True
        if vars(self.zero).get("step") == self._zero_step:
            if self._original is None:
                del self.zero.step
            else:
                self.zero.step = self._original
        if vars(self.zero).get(_ATTR) is self:
            delattr(self.zero, _ATTR)
