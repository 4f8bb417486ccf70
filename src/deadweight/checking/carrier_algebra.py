"""The carrier algebra of the structure pass (`cancellation.StructureTracker`).

For each parameter the pass follows two pure effects through the ops, each an exact
algebraic statement about the tensors it reaches (see `cancellation`): a *scale*
(theta -> lambda theta multiplies the tensor by lambda^degree) and a *shift*
(theta -> theta + delta adds a term). This module holds the abstract values, a
`Facet` per effect and a `Carrier` per tensor, and the operations on them that every
op propagator (`op_propagation`) shares: mapping dims through reshapes and
broadcasts, turning effects into plain dependences, merging carriers.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from fractions import Fraction
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar

import torch

Tensor = torch.Tensor
SCALE = 0
SHIFT = 1
KINDS = ("scale", "shift")
ZERO = Fraction(0)
ONE = Fraction(1)
_tags = itertools.count(1)


def new_tag() -> int:
    """A fresh identity for an added term (a shift), so that x - mean(x) is seen to
    cancel the very term that was added."""
    return next(_tags)


# -- the abstract values -------------------------------------------------------------


class Facet(NamedTuple):
    """One pure effect of one parameter on one tensor.

    full: the dims of the tensor along which the factor (scale) or the added term
    (shift) varies for a change in any direction of the parameter; None once that is
    no longer known (only the uniform facet holds). uniform: the effect of the
    uniform change (theta * c, theta + c) is still pure. degree: scale only, the
    tensor is multiplied by lambda^degree. approx: scale only, a constant (an eps)
    was added on the way, so a cancellation holds up to it. tag: shift only, the
    identity of the added term, so that x - mean(x) is seen to cancel it.

    Immutable, as a tuple: the pass makes thousands per forward, and a tuple is
    built in C where a frozen dataclass sets each field through Python.
    """

    kind: int
    full: frozenset[int] | None
    uniform: bool = True
    degree: Fraction = ONE
    approx: bool = False
    tag: int = 0


_NO_EFFECTS: Mapping[int, Facet] = MappingProxyType({})


class Carrier(NamedTuple):
    """How the parameters reach one tensor. Entities are 2 * parameter index + kind.

    lost: entities whose effect reaches it in no known form (every direction).
    partial: entities whose non-uniform directions reach it in no known form.
    Both are bit sets (entity e is bit e of an int): they grow with the parameters
    upstream, and nearly every call merges them, which for an int is one C operation
    whatever the size, where a frozenset copied every member (see `bits`).
    pure: the entities whose effect is still pure, with its facet (never changed
    once the carrier is made).
    """

    lost: int = 0
    partial: int = 0
    pure: Mapping[int, Facet] = _NO_EFFECTS

    def depends(self, entity: int) -> bool:
        return bool((self.lost | self.partial) >> entity & 1) or entity in self.pure

    def all_entities(self) -> int:
        """The lost and the pure entities, as a bit set."""
        return self.lost | bits_of(self.pure)


def bits_of(entities: Iterable[int]) -> int:
    """The bit set of some entities."""
    out = 0
    for e in entities:
        out |= 1 << e
    return out


def bits(entities: int) -> Iterator[int]:
    """The entities in a bit set, in increasing order."""
    while entities:
        low = entities & -entities
        yield low.bit_length() - 1
        entities ^= low


EMPTY = Carrier()


# -- remembered answers ---------------------------------------------------------------

V = TypeVar("V")


def remembered(
    store: dict[Any, V], key: Any, make: Callable[..., V], *args: Any, bound: int = 4096
) -> V:
    """`store[key]`, made by `make(*args)` the first time. The pass's answers that depend
    only on shapes (and parameter indices) are looked up this way: a forward repeats a
    few shapes layer after layer. Past `bound` entries the store is emptied, so it stays
    bounded whatever the shapes and models seen."""
    try:
        return store[key]
    except KeyError:
        pass
    if len(store) > bound:
        store.clear()
    value = store[key] = make(*args)
    return value


# -- dims ---------------------------------------------------------------------------


def nontrivial(shape: Sequence[int], dims: Iterable[int]) -> frozenset[int]:
    n = len(shape)
    return frozenset([d for d in dims if 0 <= d < n and shape[d] > 1])


def all_dims(shape: Sequence[int]) -> frozenset[int]:
    """The dims of `shape` longer than 1 (looked up: a forward has few distinct shapes)."""
    key = tuple(shape)
    return remembered(_ALL_DIMS, key, nontrivial, key, range(len(key)))


_ALL_DIMS: dict[tuple[int, ...], frozenset[int]] = {}


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def broadcast_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> Callable[[int], int]:
    offset = len(out_shape) - len(in_shape)
    return lambda d: d + offset


def reshape_dims(
    in_shape: Sequence[int], out_shape: Sequence[int], dims: frozenset[int]
) -> frozenset[int]:
    """Output dims sharing digits of the flat index with the given input dims."""
    if not dims:
        return frozenset()
    key = (tuple(in_shape), tuple(out_shape), dims)
    return remembered(_RESHAPED, key, _reshape_dims, key[0], key[1], dims)


_RESHAPED: dict[tuple[tuple[int, ...], tuple[int, ...], frozenset[int]], frozenset[int]] = {}


def _reshape_dims(
    in_shape: Sequence[int], out_shape: Sequence[int], dims: frozenset[int]
) -> frozenset[int]:
    def spans(shape: Sequence[int]) -> list[tuple[int, int]]:
        out = []
        inner = 1
        for size in reversed(shape):
            out.append((inner, inner * size))
            inner *= size
        return list(reversed(out))

    ins, outs = spans(in_shape), spans(out_shape)
    result = set()
    for d in dims:
        lo, hi = ins[d]
        for e, (olo, ohi) in enumerate(outs):
            if olo < hi and lo < ohi and out_shape[e] > 1:
                result.add(e)
    return frozenset(result)


DimMapping = Callable[[frozenset[int]], "frozenset[int] | None"]


class DimMap:
    """A pure function of a facet's dims (`map_carrier`'s mapping), remembered per dim
    set: the calls of one forward repeat a few shapes layer after layer, and their
    facets a few dim sets."""

    __slots__ = ("_known", "_mapping")

    def __init__(self, mapping: DimMapping) -> None:
        self._mapping = mapping
        self._known: dict[frozenset[int], frozenset[int] | None] = {}

    def __call__(self, dims: frozenset[int]) -> frozenset[int] | None:
        try:
            return self._known[dims]
        except KeyError:
            found = self._known[dims] = self._mapping(dims)
            return found


_DIM_MAPS: dict[Any, DimMap | None] = {}


def dim_map(key: Any, make: Callable[[], DimMapping | None]) -> DimMap | None:
    """The `DimMap` of an op's shapes and arguments (`key`, hashable), made by `make`
    the first time; None where `make` says the call cannot be read."""
    return remembered(_DIM_MAPS, key, _dim_map_of, make)


def _dim_map_of(make: Callable[[], DimMapping | None]) -> DimMap | None:
    mapping = make()
    return DimMap(mapping) if mapping is not None else None


# -- facet algebra ------------------------------------------------------------------


def map_facet(f: Facet, mapping: Callable[[frozenset[int]], frozenset[int] | None]) -> Facet:
    if f.full is None:
        return f
    full = mapping(f.full)
    if full == f.full:
        return f
    return Facet(f.kind, full, f.uniform, f.degree, f.approx, f.tag)


def map_carrier(c: Carrier, mapping: Callable[[frozenset[int]], frozenset[int] | None]) -> Carrier:
    """Each pure facet's dims mapped (`mapping` is a pure function of the dims). The
    facets of one tensor share few distinct dim sets (a parameter's scale and shift
    share one, the residual stream's many effects vary along the same dims), so each
    set is mapped once; a carrier that no mapping changes is returned as it is."""
    if not c.pure:
        return c
    mapped: dict[frozenset[int], frozenset[int] | None] = {}
    pure: dict[int, Facet] = {}
    changed = False
    for e, f in c.pure.items():
        full = f.full
        if full is not None:
            if full in mapped:
                new = mapped[full]
            else:
                new = mapped[full] = mapping(full)
            if new != full:
                f = Facet(f.kind, new, f.uniform, f.degree, f.approx, f.tag)
                changed = True
        pure[e] = f
    return Carrier(c.lost, c.partial, pure) if changed else c


def merge_general(carriers: Iterable[Carrier]) -> tuple[int, int]:
    lost = partial = 0
    for c in carriers:
        lost |= c.lost
        partial |= c.partial
    return lost, partial


def general(carriers: Iterable[Carrier]) -> Carrier:
    """Every effect turned into a plain dependence."""
    lost = partial = 0
    for c in carriers:
        lost |= c.all_entities()
        partial |= c.partial
    return Carrier(lost, partial & ~lost)


def finish(lost: int, partial: int, pure: dict[int, Facet]) -> Carrier:
    """The carrier of lost, partial and pure effects (a lost effect is no longer pure;
    a pure one whose full facet is unknown is partial)."""
    dropped = None
    for e, f in pure.items():  # one pass: it runs for nearly every carrying call
        if lost >> e & 1:
            if dropped is None:
                dropped = [e]
            else:
                dropped.append(e)
        elif f.full is None:
            partial |= 1 << e
    if dropped is not None:
        for e in dropped:
            del pure[e]
    return Carrier(lost, partial & ~lost, pure)


def flat_args(args: tuple, kwargs: dict) -> Iterator[Any]:
    """A call's arguments, one level of lists and tuples unpacked."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def tensor_outputs(out: Any) -> list[Tensor]:
    """The tensors a call returned."""
    if isinstance(out, Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [o for o in out if isinstance(o, Tensor)]
    return []


FLOAT32_ROUNDOFF = 2.0**-24
_ROUNDOFF: dict[torch.dtype, float] = {}


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the gap between 1 and the next number of `dtype` (its relative rounding
    error); float32's for a dtype that is not floating (an index, a mask)."""
    u = _ROUNDOFF.get(dtype)
    if u is None:
        u = float(torch.finfo(dtype).eps) / 2 if dtype.is_floating_point else FLOAT32_ROUNDOFF
        _ROUNDOFF[dtype] = u
    return u
