"""Shared settings for the fuzz suites (hypothesis) over every parser of untrusted input.

CI runs a bounded number of examples per test so the suite stays short. A long run sets
DEADWEIGHT_FUZZ_EXAMPLES, e.g. `DEADWEIGHT_FUZZ_EXAMPLES=10000 python -m pytest -m fuzz`.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# 200 examples per test keeps each fuzz test at a few seconds on 2 cores.
DEFAULT_EXAMPLES = 200


def examples() -> int:
    raw = os.environ.get("DEADWEIGHT_FUZZ_EXAMPLES", "")
    return int(raw) if raw.strip() else DEFAULT_EXAMPLES


# database=None: no .hypothesis directory in the checkout; failures print their example anyway.
FUZZ = settings(
    max_examples=examples(),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Every fuzz module sets `pytestmark = fuzz` so a long run can select them alone.
fuzz = pytest.mark.fuzz


# Byte edits to a valid file: (position, new byte) pairs, the position taken modulo
# the file's length so that every edit lands.
byte_edits = st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=8)


def mutate(base: bytes, changes: list[tuple[int, int]], cut: int | None) -> bytes:
    """`base` with the byte edits applied, then cut to `cut` bytes (None: whole)."""
    data = bytearray(base)
    for position, value in changes:
        data[position % len(data)] = value
    return bytes(data[:cut] if cut is not None else data)
