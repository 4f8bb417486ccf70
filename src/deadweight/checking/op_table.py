"""The op table of the structure pass: every torch call the tracer reports, by name,
to its propagator (`PROPAGATORS`), and the propagators of the ops that cancel.

The carrying ops live in `op_propagation`; here are the *cancelling* ones:
LayerNorm / RMSNorm / GroupNorm / BatchNorm (training) / InstanceNorm and
F.normalize remove a scale (the mean-subtracting ones a shift too), softmax,
log_softmax, cross_entropy and the softmax over keys inside
scaled_dot_product_attention a shift, each when the effect's varying dims avoid the
dims it normalizes over. What they cancel is reported to the tracker (`absorb`). A
call missing from the table turns every effect into a plain dependence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from fractions import Fraction
from typing import Any

import torch

from deadweight.checking.carrier_algebra import (
    EMPTY,
    SCALE,
    SHIFT,
    Carrier,
    DimMapping,
    Facet,
    dim_map,
    finish,
    flat_args,
    general,
    map_carrier,
    map_facet,
    nontrivial,
    norm_dim,
    remembered,
)
from deadweight.checking.op_propagation import (
    OpCall,
    add_term,
    exponent,
    mul_term,
    propagate_addmm,
    propagate_binary,
    propagate_conv,
    propagate_dropout,
    propagate_embedding,
    propagate_linear,
    propagate_matmul,
    propagate_multilinear,
    propagate_neg,
    propagate_permute,
    propagate_power,
    propagate_reduce,
    propagate_reshape,
    propagate_same,
    propagate_scale_keeping,
    propagate_slice,
)

Tensor = torch.Tensor


# -- the cancelling ops -----------------------------------------------------------


def _cancel(
    ctx: OpCall,
    c: Carrier,
    over: frozenset[int],
    allowed: frozenset[int] | None,
    kinds: tuple[int, ...],
    op: str,
    keep_scale: bool = False,
    keep_shift: bool = False,
) -> Carrier:
    """The normalized output's carrier: effects of the given kinds whose varying dims lie
    within `allowed` (None: outside `over`) are cancelled; the rest becomes plain."""
    lost, partial = c.lost, c.partial
    pure: dict[int, Facet] = {}
    free_means = []
    for e, f in c.pure.items():
        if f.kind in kinds:
            fits = f.full is not None and (
                (f.full <= allowed) if allowed is not None else not (f.full & over)
            )
            if fits:
                ctx.tracker.absorb(ctx, e, f, op, over, True)
                continue
            if f.uniform:
                if f.kind == SHIFT:
                    # only the mean is cancelled: noted in one call for all of them (every
                    # norm on the residual stream frees the mean of each bias upstream)
                    free_means.append(e)
                else:
                    ctx.tracker.absorb(ctx, e, f, op, over, False)
                partial |= 1 << e
                continue
        elif (f.kind == SCALE and keep_scale) or (f.kind == SHIFT and keep_shift):
            pure[e] = f
            continue
        lost |= 1 << e
    if free_means:
        ctx.tracker.free_means(free_means)
    return finish(lost, partial, pure)


def _affine(
    ctx: OpCall, normed: Carrier, weight: Any, bias: Any, out: Tensor, dims: Sequence[int]
) -> Carrier:
    """normed * weight + bias, weight and bias laid along the output dims `dims`."""
    result = normed
    shape = out.shape
    for value, is_weight in ((weight, True), (bias, False)):
        if not isinstance(value, Tensor):
            continue
        cv = ctx.c(value)
        if not (cv.lost or cv.pure or cv.partial):
            if is_weight:
                result = mul_term(result, EMPTY, nontrivial(shape, dims))
            continue
        laid = tuple(dims)[-value.dim() :] if value.dim() else ()
        mapping = dim_map(("affine", laid, shape), lambda laid=laid: _laid_along(shape, laid))  # type: ignore[misc]
        assert mapping is not None
        mapped = map_carrier(cv, mapping)
        if is_weight:
            # remembered: every norm of a forward asks the same
            varying = remembered(_NONTRIVIAL, (shape, laid), nontrivial, shape, laid)
            result = mul_term(result, mapped, varying)
        else:
            result = add_term(result, mapped)
    return result


_NONTRIVIAL: dict[tuple[torch.Size, tuple[int, ...]], frozenset[int]] = {}


def _laid_along(shape: Sequence[int], laid: tuple[int, ...]) -> DimMapping:
    """A weight's or bias's dims, laid along the output dims `laid`."""
    return lambda d: nontrivial(shape, [laid[x] for x in d])


def _propagate_layer_norm(rms: bool) -> Callable[[OpCall], Carrier]:
    def rule(ctx: OpCall) -> Carrier:
        x = ctx.arg(0, "input")
        shape = ctx.arg(1, "normalized_shape")
        w = ctx.arg(2, "weight")
        b = None if rms else ctx.arg(3, "bias")
        out = ctx.out
        if not isinstance(x, Tensor) or not isinstance(out, Tensor):
            return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
        n = len(shape) if isinstance(shape, (list, tuple, torch.Size)) else 1
        ndim = x.dim()
        over, dims = remembered(_LAST_DIMS, (ndim - n, ndim), _dims_between, ndim - n, ndim)
        normed = _cancel(ctx, ctx.c(x), over, None, kinds, op)
        return _affine(ctx, normed, w, b, out, dims)

    kinds = (SCALE,) if rms else (SCALE, SHIFT)
    op = "RMSNorm" if rms else "LayerNorm"
    return rule


def _dims_between(start: int, stop: int) -> tuple[frozenset[int], list[int]]:
    """The dims a norm normalizes over, as a set and in order."""
    return frozenset(range(start, stop)), list(range(start, stop))


_LAST_DIMS: dict[tuple[int, int], tuple[frozenset[int], list[int]]] = {}


def _propagate_group_norm(ctx: OpCall) -> Carrier:
    x, groups = ctx.arg(0, "input"), ctx.arg(1, "num_groups")
    w, b = ctx.arg(2, "weight"), ctx.arg(3, "bias")
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or x.dim() < 2:
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
    channels = x.shape[1]
    allowed = frozenset({0, 1}) if groups == channels else frozenset({0})
    over = frozenset(range(1, x.dim()))
    normed = _cancel(ctx, ctx.c(x), over, allowed, (SCALE, SHIFT), "GroupNorm")
    return _affine(ctx, normed, w, b, out, [1])


def _propagate_batch_norm(ctx: OpCall) -> Carrier:
    x = ctx.arg(0, "input")
    running_mean = ctx.arg(1, "running_mean")
    w, b = ctx.arg(3, "weight"), ctx.arg(4, "bias")
    training = ctx.arg(5, "training", False)
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or x.dim() < 2:
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
    if not training and running_mean is not None:
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])  # fixed statistics
    over = frozenset({0} | set(range(2, x.dim())))
    normed = _cancel(ctx, ctx.c(x), over, frozenset({1}), (SCALE, SHIFT), "BatchNorm")
    return _affine(ctx, normed, w, b, out, [1])


def _propagate_instance_norm(ctx: OpCall) -> Carrier:
    x = ctx.arg(0, "input")
    w, b = ctx.arg(3, "weight"), ctx.arg(4, "bias")
    use_input_stats = ctx.arg(5, "use_input_stats", True)
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not use_input_stats:
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
    over = frozenset(range(2, x.dim()))
    normed = _cancel(ctx, ctx.c(x), over, frozenset({0, 1}), (SCALE, SHIFT), "InstanceNorm")
    return _affine(ctx, normed, w, b, out, [1])


def _propagate_normalize(ctx: OpCall) -> Carrier:
    x = ctx.arg(0, "input")
    dim = ctx.arg(2, "dim", 1)
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not isinstance(dim, int):
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
    over = frozenset({norm_dim(dim, x.dim())})
    return _cancel(ctx, ctx.c(x), over, None, (SCALE,), "F.normalize")


def _propagate_softmax(log: bool) -> Callable[[OpCall], Carrier]:
    def rule(ctx: OpCall) -> Carrier:
        x = ctx.arg(0, "input")
        dim = ctx.arg(1, "dim")
        out = ctx.out
        if not isinstance(x, Tensor) or not isinstance(out, Tensor) or not isinstance(dim, int):
            return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
        over = frozenset({norm_dim(dim, x.dim())})
        op = "log_softmax" if log else "softmax"
        return _cancel(ctx, ctx.c(x), over, None, (SHIFT,), f"{op} over dim {dim}")

    return rule


def _propagate_cross_entropy(ctx: OpCall) -> Carrier:
    x, target = ctx.arg(0, "input"), ctx.arg(1, "target")
    rest = [
        ctx.c(v)
        for v in list(
            flat_args(
                ctx.args[2:], {k: v for k, v in ctx.kwargs.items() if k not in ("input", "target")}
            )
        )
    ]
    out = ctx.out
    if not isinstance(x, Tensor) or not isinstance(out, Tensor):
        return general([ctx.c(v) for v in flat_args(ctx.args, ctx.kwargs)])
    class_dim = 1 if x.dim() >= 2 else 0
    over = frozenset({class_dim})
    normed = _cancel(ctx, ctx.c(x), over, None, (SHIFT,), "cross_entropy over the classes")
    return general([normed, ctx.c(target), *rest])


def _propagate_sdpa(ctx: OpCall) -> Carrier:
    q, k, v = ctx.arg(0, "query"), ctx.arg(1, "key"), ctx.arg(2, "value")
    mask = ctx.arg(3, "attn_mask")
    dropout_p = ctx.arg(4, "dropout_p", 0.0)
    out = ctx.out
    if not all(isinstance(t, Tensor) for t in (q, k, v)) or not isinstance(out, Tensor):
        return general([ctx.c(t) for t in flat_args(ctx.args, ctx.kwargs)])
    seq = k.dim() - 2
    keys = _cancel(
        ctx,
        ctx.c(k),
        frozenset({seq}),
        None,
        (SHIFT,),
        "softmax over keys (scaled_dot_product_attention)",
    )
    cv = ctx.c(v)
    if cv.pure:
        vseq = v.dim() - 2
        offset = out.dim() - v.dim()

        def vmap(d: frozenset[int]) -> frozenset[int] | None:
            return None if vseq in d else nontrivial(out.shape, (x + offset for x in d))

        lost, partial = cv.lost, cv.partial
        pure = {}
        for e, f in cv.pure.items():
            mapped = map_facet(f, vmap)
            if f.kind == SCALE or dropout_p == 0:
                if mapped.full is None and not mapped.uniform:
                    lost |= 1 << e
                else:
                    pure[e] = mapped
            else:
                lost |= 1 << e
        cv = finish(lost, partial, pure)
    plain = general([ctx.c(q), keys, ctx.c(mask)])
    return add_term(plain, cv) if cv.pure else general([plain, cv])


EPS_OPS = {"LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm", "InstanceNorm", "F.normalize"}


# -- the table ------------------------------------------------------------------


def _names(*bases: str, methods: bool = True, functions: bool = True) -> list[str]:
    out = []
    for base in bases:
        if functions:
            out += [f"torch.{base}", f"torch.nn.functional.{base}"]
        if methods:
            out += [f"Tensor.{base}"]
    return out


PROPAGATORS: dict[str, Callable[[OpCall], Any]] = {}


# Calls whose propagator, when only the first argument carries effects and none of them
# is pure, gives each output that argument's carrier unchanged (it only maps the pure
# facets; plain dependences pass as they are). The tracker skips the propagator there:
# a quarter of a transformer's carrying calls, behind the norms where every effect is plain.
_CARRIES_THROUGH: set[str] = set()


def _register(
    names: Iterable[str], propagator: Callable[[OpCall], Any], *, carries_through: bool = False
) -> None:
    for n in names:
        PROPAGATORS[n] = propagator
        if carries_through:
            _CARRIES_THROUGH.add(n)


_register(
    _names(
        "float",
        "double",
        "half",
        "bfloat16",
        "to",
        "type",
        "type_as",
        "clone",
        "contiguous",
        "detach",
        "requires_grad_",
        "cpu",
        "cuda",
    ),
    propagate_same,
    carries_through=True,
)
_register(
    _names(
        "view",
        "reshape",
        "flatten",
        "unflatten",
        "squeeze",
        "unsqueeze",
        "view_as",
        "reshape_as",
        "expand",
        "expand_as",
        "broadcast_to",
        "repeat",
        "ravel",
    ),
    propagate_reshape,
    carries_through=True,
)
_register(
    [*_names("permute", "transpose", "t", "swapaxes", "swapdims"), "Tensor.T", "Tensor.mT"],
    propagate_permute,
    carries_through=True,
)
_register(
    [
        *_names("split", "chunk", "tensor_split", "narrow", "unbind", "select", "split_with_sizes"),
        "Tensor.__getitem__",
    ],
    propagate_slice,
    carries_through=True,
)
for _op, _aliases in {
    "add": ("add", "__add__", "__radd__", "__iadd__", "add_"),
    "sub": ("sub", "subtract", "__sub__", "__rsub__", "__isub__", "sub_"),
    "mul": ("mul", "multiply", "__mul__", "__rmul__", "__imul__", "mul_"),
    "div": ("div", "divide", "true_divide", "__truediv__", "__rtruediv__", "__itruediv__", "div_"),
}.items():
    _register(_names(*_aliases), propagate_binary(_op), carries_through=True)
_register(_names("neg", "negative", "__neg__"), propagate_neg, carries_through=True)
_register(_names("pow", "__pow__", "float_power"), propagate_power(exponent), carries_through=True)
_register(_names("square"), propagate_power(lambda _: Fraction(2)), carries_through=True)
_register(_names("sqrt"), propagate_power(lambda _: Fraction(1, 2)), carries_through=True)
_register(_names("rsqrt"), propagate_power(lambda _: Fraction(-1, 2)), carries_through=True)
_register(_names("reciprocal"), propagate_power(lambda _: Fraction(-1)), carries_through=True)
_register(_names("abs", "__abs__"), propagate_scale_keeping, carries_through=True)
_register(
    _names("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout"),
    propagate_dropout,
    carries_through=True,
)
_register(_names("sum"), propagate_reduce("sum"), carries_through=True)
_register(_names("mean"), propagate_reduce("mean"), carries_through=True)
_register(_names("amax", "amin"), propagate_reduce("max"), carries_through=True)
_register(_names("logsumexp"), propagate_reduce("lse"), carries_through=True)
_register(_names("var"), propagate_reduce("var"), carries_through=True)
_register(_names("std"), propagate_reduce("std"), carries_through=True)
_register(
    [*_names("norm"), "torch.linalg.vector_norm"], propagate_reduce("norm"), carries_through=True
)
_register(_names("matmul", "__matmul__", "__rmatmul__", "bmm", "mm"), propagate_matmul)
_register(["torch.nn.functional.linear", "torch._C._nn.linear"], propagate_linear)
_register(_names("addmm"), propagate_addmm)
_register(
    ["torch.einsum", "torch.functional.einsum", "torch.nn.functional.bilinear"],
    propagate_multilinear,
)
_register(
    [f"torch.nn.functional.conv{n}d" for n in (1, 2, 3)] + [f"torch.conv{n}d" for n in (1, 2, 3)],
    propagate_conv,
)
_register(["torch.nn.functional.embedding"], propagate_embedding)
_register(["torch.nn.functional.layer_norm", "torch.layer_norm"], _propagate_layer_norm(rms=False))
_register(["torch.nn.functional.rms_norm", "torch.rms_norm"], _propagate_layer_norm(rms=True))
_register(["torch.nn.functional.group_norm", "torch.group_norm"], _propagate_group_norm)
_register(["torch.nn.functional.batch_norm", "torch.batch_norm"], _propagate_batch_norm)
_register(["torch.nn.functional.instance_norm", "torch.instance_norm"], _propagate_instance_norm)
_register(["torch.nn.functional.normalize"], _propagate_normalize)
_register(_names("softmax"), _propagate_softmax(log=False))
_register(_names("log_softmax"), _propagate_softmax(log=True))
_register(["torch.nn.functional.cross_entropy"], _propagate_cross_entropy)
_register(
    [
        "torch.nn.functional.scaled_dot_product_attention",
        "torch._C._nn.scaled_dot_product_attention",
    ],
    _propagate_sdpa,
)

# The calls that can cancel, counted in call order so that a re-run finds the same one.
COUNTED = frozenset(PROPAGATORS)

# Registered with `carries_through=True` (see `_CARRIES_THROUGH`).
CARRY_THROUGH = frozenset(_CARRIES_THROUGH)
