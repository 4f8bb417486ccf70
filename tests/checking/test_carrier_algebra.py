"""The carrier algebra's shared operations against slow references: `map_carrier`
maps each distinct dim set once and hands back an unchanged carrier as it is, the
looked-up `all_dims` answers what `nontrivial` computes, a `DimMap` answers what its
mapping does, once per dim set, and `finish` what its two passes did."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from fractions import Fraction

import torch

from deadweight.checking import carrier_algebra
from deadweight.checking.carrier_algebra import (
    SCALE,
    SHIFT,
    Carrier,
    DimMap,
    Facet,
    all_dims,
    dim_map,
    finish,
    map_carrier,
    nontrivial,
)

Mapping = Callable[[frozenset[int]], frozenset[int] | None]


def map_reference(c: Carrier, mapping: Mapping) -> Carrier:
    """Every facet through the mapping, one call each, as the pass first did it."""
    pure = {}
    for e, f in c.pure.items():
        if f.full is None:
            pure[e] = f
            continue
        full = mapping(f.full)
        pure[e] = f if full == f.full else Facet(f.kind, full, f.uniform, f.degree, f.approx, f.tag)
    return Carrier(c.lost, c.partial, pure)


def random_carrier(
    rng: random.Random, ndim: int, tags: Sequence[int] = (1, 2, 3, 4), entities: int = 12
) -> Carrier:
    """Some entities lost or partial, the rest pure with random facets (a shift's tag
    drawn from `tags`); dim sets are drawn from a few shared ones, as on a real
    activation."""
    shared = [frozenset(rng.sample(range(ndim), rng.randint(0, ndim))) for _ in range(3)]
    lost = partial = 0
    pure = {}
    for e in range(entities):
        roll = rng.random()
        if roll < 0.15:
            lost |= 1 << e
        elif roll < 0.3:
            partial |= 1 << e
        elif roll < 0.9:
            kind = rng.choice((SCALE, SHIFT))
            full = None if rng.random() < 0.15 else frozenset(rng.choice(shared))
            pure[e] = Facet(
                kind,
                full,
                rng.random() < 0.7,
                rng.choice((Fraction(1), Fraction(-1, 2), Fraction(2)))
                if kind == SCALE
                else Fraction(1),
                rng.random() < 0.2,
                rng.choice(tags) if kind == SHIFT else 0,
            )
    return Carrier(lost, partial & ~lost, pure)


def test_map_carrier_matches_the_per_facet_map() -> None:
    rng = random.Random(0)
    calls = 0
    for _ in range(300):
        ndim = rng.randint(1, 4)
        c = random_carrier(rng, ndim)
        shape = [rng.choice((1, 2, 3)) for _ in range(ndim)]
        offset = rng.randint(0, 2)
        out_shape = [rng.choice((2, 3)) for _ in range(offset)] + shape

        mapping = Counted(out_shape, offset)
        assert map_carrier(c, mapping) == map_reference(c, mapping)
        calls += mapping.calls
    assert calls > 0


class Counted:
    """Dims moved right by `offset` into `out_shape`, those of size 1 dropped; the
    first one contracted (unknown full facet) when `offset` is 2."""

    def __init__(self, out_shape: list[int], offset: int) -> None:
        self.out_shape, self.offset, self.calls = out_shape, offset, 0

    def __call__(self, d: frozenset[int]) -> frozenset[int] | None:
        self.calls += 1
        if 0 in d and self.offset == 2:
            return None
        return nontrivial(self.out_shape, [x + self.offset for x in d])


def test_map_carrier_maps_each_distinct_dim_set_once() -> None:
    dims = frozenset({0, 1})
    c = Carrier(
        pure={e: Facet(SHIFT if e % 2 else SCALE, frozenset(dims), tag=e) for e in range(10)}
    )
    seen: list[frozenset[int]] = []

    def mapping(d: frozenset[int]) -> frozenset[int]:
        seen.append(d)
        return frozenset({1})

    mapped = map_carrier(c, mapping)
    assert seen == [dims]
    assert all(f.full == frozenset({1}) for f in mapped.pure.values())
    assert [f.tag for f in mapped.pure.values()] == list(range(10))


def test_map_carrier_returns_an_unchanged_carrier_as_it_is() -> None:
    c = Carrier(lost=0b1, pure={2: Facet(SCALE, frozenset({1})), 4: Facet(SHIFT, None, tag=3)})
    assert map_carrier(c, lambda d: d) is c
    changed = map_carrier(c, lambda d: frozenset())
    assert changed is not c
    assert changed.pure[2].full == frozenset() and changed.pure[4] is c.pure[4]
    assert c.pure[2].full == frozenset({1})  # the input is never changed


def test_all_dims_is_the_nontrivial_dims() -> None:
    rng = random.Random(1)
    for _ in range(200):
        shape = [rng.choice((0, 1, 2, 5)) for _ in range(rng.randint(0, 5))]
        expected = nontrivial(shape, range(len(shape)))
        assert all_dims(shape) == expected
        assert all_dims(torch.Size(shape)) == expected
        assert all_dims(tuple(shape)) == expected


def test_a_dim_map_answers_its_mapping_once_per_dim_set() -> None:
    rng = random.Random(2)
    calls: list[frozenset[int]] = []

    def mapping(d: frozenset[int]) -> frozenset[int] | None:
        calls.append(d)
        return None if 3 in d else frozenset(x + 1 for x in d)

    remembered = DimMap(mapping)
    for _ in range(200):
        d = frozenset(rng.sample(range(5), rng.randint(0, 5)))
        assert remembered(d) == (None if 3 in d else frozenset(x + 1 for x in d))
    assert len(calls) == len(set(calls)) <= 32  # each distinct set once (None included)


def test_dim_map_is_made_once_per_key_and_says_none_for_an_unreadable_call() -> None:
    made: list[str] = []

    def make(tag: str, readable: bool):  # type: ignore[no-untyped-def]
        def build():  # type: ignore[no-untyped-def]
            made.append(tag)
            return (lambda d: d) if readable else None

        return build

    key = ("test", object())  # a key no propagator makes
    first = dim_map(key, make("a", True))
    assert first is not None and dim_map(key, make("b", True)) is first
    unreadable = ("test-unreadable", object())
    assert dim_map(unreadable, make("c", False)) is None
    assert dim_map(unreadable, make("d", False)) is None
    assert made == ["a", "c"]
    # bounded: past 4096 keys the remembered maps are dropped, not grown without end
    for i in range(5000):
        dim_map(("test-many", i), make("x", True))
    assert len(carrier_algebra._DIM_MAPS) <= 4097


def finish_reference(lost: int, partial: int, pure: dict[int, Facet]) -> Carrier:
    """`finish` as two passes: the lost effects dropped, then the unknown full facets
    marked partial."""
    kept = {e: f for e, f in pure.items() if not lost >> e & 1}
    for e, f in kept.items():
        if f.full is None:
            partial |= 1 << e
    return Carrier(lost, partial & ~lost, kept)


def test_finish_matches_its_two_pass_reference() -> None:
    rng = random.Random(3)
    dropped = 0
    for _ in range(400):
        c = random_carrier(rng, rng.randint(1, 4))
        lost = c.lost | sum(1 << e for e in c.pure if rng.random() < 0.3)
        expected = finish_reference(lost, c.partial, dict(c.pure))
        got = finish(lost, c.partial, dict(c.pure))
        assert got == expected and list(got.pure) == list(expected.pure)
        dropped += len(c.pure) - len(got.pure)
    assert dropped > 100
