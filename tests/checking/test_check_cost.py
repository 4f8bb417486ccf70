"""What a check adds to a forward+backward, counted in aten calls: the traced forward
adds none, and what grows with the parameter tensors is the parameter-write guard
alone (an alias, its integer view, a checksum at entry and at exit)."""

from __future__ import annotations

import pytest

from tests.check_calls import added_by_check

pytest.importorskip("transformers")

GUARD = {"aten.detach.default", "aten.view.dtype", "aten.sum.default"}


@pytest.mark.parametrize("layers, tensors", [(2, 28), (8, 100)])
def test_a_check_adds_five_aten_calls_per_parameter_tensor(layers: int, tensors: int) -> None:
    count, added = added_by_check(layers)
    assert count == tensors
    assert {op for op, n in added.items() if n >= tensors} == GUARD, added.most_common(10)
    assert sum(added.values()) <= 5 * tensors + 32, added.most_common(10)
