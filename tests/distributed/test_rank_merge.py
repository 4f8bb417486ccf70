"""Merging per-rank findings and the cross-rank rules, without processes."""

from __future__ import annotations

import pytest
import torch

from deadweight.distributed import ranks as distributed
from deadweight.distributed.ranks import RankPresence
from deadweight.distributed.rules._ranks import merge_rank_findings
from deadweight.distributed.rules.distributed import (
    optimizer_differs_across_ranks,
    rank_dependent_gradient,
)
from deadweight.errors import InputError
from deadweight.findings import Finding, Location, Severity


def _finding(code: str, params: tuple[str, ...], message: str = "m") -> Finding:
    return Finding(code, "n", Severity.ERROR, message, params, Location(module="l1"))


def test_a_finding_on_every_rank_reads_as_in_one_process():
    a0 = _finding("DW101", ("l1.weight",), "rank 0's words")
    a1 = _finding("DW101", ("l1.weight",), "rank 1's words")
    assert merge_rank_findings([[a0], [a1]]) == [a0]


def test_a_finding_on_some_ranks_names_them():
    only = _finding("DW101", ("side.weight",))
    (merged,) = merge_rank_findings([[], [only], [only]])
    assert merged.evidence == {"ranks": [1, 2], "world_size": 3}
    assert merged.message == "m (on ranks 1, 2 of 3 only)"


def _presence(has_grad: list[list[bool]] | None, in_opt: list[list[bool]] | None) -> RankPresence:
    return RankPresence(
        names=("a", "b"),
        world_size=2,
        trainable=(True, True),
        has_grad=torch.tensor(has_grad) if has_grad is not None else None,
        in_optimizer=torch.tensor(in_opt) if in_opt is not None else None,
        wrapper="DistributedDataParallel",
    )


def test_rank_rules_fire_only_on_disagreement():
    agree = _presence([[True, False], [True, False]], [[True, True], [True, True]])
    assert list(rank_dependent_gradient(agree)) == []  # b is DW101's, on every rank
    assert list(optimizer_differs_across_ranks(agree)) == []
    split = _presence([[True, True], [True, False]], [[True, True], [False, True]])
    (grad,) = rank_dependent_gradient(split)
    assert grad.params == ("b",) and grad.evidence["ranks_without_gradient"] == [1]
    assert "1/2 of its size" in grad.message
    (opt,) = optimizer_differs_across_ranks(split)
    assert opt.params == ("a",) and opt.evidence["ranks_not_in_optimizer"] == [1]
    assert list(rank_dependent_gradient(_presence(None, None))) == []


def test_collective_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.timeout_s() == distributed.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "7.5")
    assert distributed.timeout_s() == 7.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv(distributed.TIMEOUT_ENV, bad)
        with pytest.raises(InputError, match=distributed.TIMEOUT_ENV):
            distributed.timeout_s()


def test_no_process_group_means_single_process():
    assert distributed.ranks_for(torch.nn.Linear(2, 2)) is None
