"""Perturb parameters, re-run the loss, put them back: what both confirmations share.

Two procedures confirm a candidate by re-running the user's forward with the
candidate changed: `invariance` (the numerical screens' candidates, judged on the
loss) and `cancellation_confirmation` (the structure pass's candidates, judged on
the outputs of the ops that cancel them). Both

- change every member of a group at once, each by a different multiple (`spread`),
  so that parameters that cancel only jointly do not pass;
- put the parameters back bitwise afterwards, version counters too (`restored`);
- spend a bounded number of re-runs (`Budget`);
- split a group in which something moved until each member stands alone
  (`settle`);
- before trusting a change, make sure an unchanged re-run reproduces the checked
  forward (`reproduces`): a loss_fn that draws a new batch on every call cannot
  confirm anything either way.

What each perturbs, measures and tolerates stays with each procedure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import torch

from deadweight.checking import state

Member = TypeVar("Member")
Outcome = TypeVar("Outcome")

# Member k of a group is changed by 1 + 0.25 (k mod 8) times its own amount (1, 1.25,
# ... 2.75, then 1 again): a Linear's weight and bias before a LayerNorm, scaled
# together by the same factor, would cancel jointly; by different factors they do
# not, so a group that moved nothing shows each member unmoved on its own. Eight
# steps keep the largest multiple under 3.
SPREAD_STEP = 0.25
SPREAD_CYCLE = 8
# The message a confirmation leaves when an unchanged re-run does not reproduce.
FIXED_BATCH_HINT = "make it use one fixed batch"


def spread(k: int) -> float:
    """The multiple of its change the k-th member of a probed group gets."""
    return 1.0 + SPREAD_STEP * (k % SPREAD_CYCLE)


class Budget:
    """The re-runs of the forward a confirmation may still make."""

    def __init__(self, runs: int) -> None:
        self.left = runs

    def take(self) -> bool:
        """One re-run, if any is left."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def grant(self, runs: int = 1) -> None:
        """Re-runs added beyond the budget (a check that must always run)."""
        self.left += runs


@contextmanager
def restored(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Whatever is done to `params` inside comes back bitwise afterwards, and so do
    their autograd version counters: a graph the user holds from their own forward
    (which may have saved these parameters) must still backward after the check."""
    saved = [p.detach().clone() for p in params]
    versions = state.versions_of(list(params))
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
        state.set_versions(list(params), versions)


def settle(
    group: list[Member],
    trial: Callable[[list[Member]], Outcome],
    settled: Callable[[list[Member], Outcome], bool],
    record: Callable[[list[Member], Outcome], None],
    cut: Callable[[list[Member]], int],
) -> None:
    """Try `group` at once; when the trial does not settle it (something moved), split
    it at `cut` and try each part, until each member stands alone. `record` keeps the
    outcome of every group that settled or cannot be split."""
    outcome = trial(group)
    if len(group) == 1 or settled(group, outcome):
        record(group, outcome)
        return
    at = cut(group)
    settle(group[:at], trial, settled, record, cut)
    settle(group[at:], trial, settled, record, cut)


def halves(group: Sequence[object]) -> int:
    """Where to split a group with no better cut: in the middle."""
    return len(group) // 2


def reproduces(changes: Sequence[float] | None, tolerances: Sequence[float]) -> bool:
    """Whether an unchanged re-run reproduced the checked forward: each quantity it
    measured again moved by no more than its tolerance (`changes` None: the re-run
    could not be made, so nothing was reproduced)."""
    if changes is None:
        return False
    return all(c <= t for c, t in zip(changes, tolerances, strict=True))
