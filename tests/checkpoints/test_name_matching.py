"""Tensor names matched across the prefixes wrappers add: torch.compile's `_orig_mod.`,
DDP's `module.`, FSDP's `_fsdp_wrapped_module.`, activation checkpointing's
`_checkpoint_wrapped_module.`; the wrappers themselves build the names where they can
run on one CPU process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

import deadweight
from deadweight.checkpoints.name_matching import match_names


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.ln(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), *[Block() for _ in range(3)], nn.Linear(8, 10))


def _save(tensors: dict[str, torch.Tensor], path: Path) -> str:
    save_file({n: t.detach().clone().contiguous() for n, t in tensors.items()}, str(path))
    return str(path)


def _trained(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    return model


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A gloo process group of this one process, torn down after (DDP and FSDP need one)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- the matching ---------------------------------------------------------------------


def test_compiled_names_lose_orig_mod() -> None:
    eager = list(_model().state_dict())
    compiled = list(torch.compile(_model()).state_dict())
    assert all(n.startswith("_orig_mod.") for n in compiled)  # what torch.compile saves
    match = match_names(eager, compiled)
    assert match.a == {n: n for n in eager}  # the eager side keeps its names
    assert set(match.b.values()) == set(eager)
    [removed] = match.removed
    assert (removed.side, removed.prefix, removed.names) == ("b", "_orig_mod.", len(eager))
    assert removed.by == "torch.compile"


def test_each_side_loses_its_own_wrapper() -> None:
    ddp = ["module.fc.weight", "module.fc.bias"]
    compiled = ["_orig_mod.fc.weight", "_orig_mod.fc.bias"]
    match = match_names(ddp, compiled)
    assert set(match.a.values()) == set(match.b.values()) == {"fc.weight", "fc.bias"}
    assert {(r.side, r.prefix) for r in match.removed} == {("a", "module."), ("b", "_orig_mod.")}


def test_compiled_ddp_model_loses_both_prefixes() -> None:
    match = match_names(["fc.weight"], ["_orig_mod.module.fc.weight"])
    assert match.b == {"_orig_mod.module.fc.weight": "fc.weight"}
    assert {(r.prefix, r.names) for r in match.removed} == {("_orig_mod.", 1), ("module.", 1)}


def test_only_what_is_needed_is_removed() -> None:
    # the user's own submodule is called `module`: only torch.compile's prefix goes
    eager = ["module.weight", "head.weight"]
    compiled = ["_orig_mod.module.weight", "_orig_mod.head.weight"]
    match = match_names(eager, compiled)
    assert set(match.b.values()) == set(eager)
    assert [(r.side, r.prefix) for r in match.removed] == [("b", "_orig_mod.")]


def test_a_compiled_submodule_loses_its_prefix_inside_the_name() -> None:
    eager = ["layers.0.fc.weight", "layers.1.fc.weight"]
    compiled = ["layers.0._orig_mod.fc.weight", "layers.1._orig_mod.fc.weight"]
    assert set(match_names(eager, compiled).b.values()) == set(eager)


def test_module_is_only_ddp_in_front() -> None:
    # `enc.module.w` is the user's own naming: DDP only ever wraps the whole model
    match = match_names(["enc.w"], ["enc.module.w"])
    assert match.b == {"enc.module.w": "enc.module.w"} and match.removed == []


def test_no_removal_that_would_merge_two_tensors() -> None:
    # stripping b would name two of its tensors `w`: b keeps its raw names
    match = match_names(["w", "v"], ["_orig_mod.w", "w", "_orig_mod.v"])
    assert match.b == {n: n for n in ["_orig_mod.w", "w", "_orig_mod.v"]}
    assert match.removed == []


def test_no_removal_that_matches_nothing_more() -> None:
    match = match_names(["x.weight"], ["_orig_mod.y.weight"])
    assert match.removed == [] and match.b == {"_orig_mod.y.weight": "_orig_mod.y.weight"}


# -- diff across real wrappers --------------------------------------------------------


def _diff_is_complete(report: deadweight.Report, model: nn.Module) -> None:
    names = set(model.state_dict())
    assert report.subject["compared"] == len(names), report.subject
    assert report.subject["added"] == [] and report.subject["removed"] == []
    assert set(report.subject["relative_change"]) == names  # named as the unwrapped model
    assert not report.by_code("DW406")


def test_diff_eager_against_compiled(tmp_path: Path) -> None:
    model = _model()
    a = _save(model.state_dict(), tmp_path / "eager.safetensors")
    b = _save(torch.compile(_trained(model)).state_dict(), tmp_path / "compiled.safetensors")
    report = deadweight.diff_checkpoints(a, b)
    _diff_is_complete(report, model)
    assert report.subject["renamed"] == [
        {"side": "b", "prefix": "_orig_mod.", "by": "torch.compile", "names": 15}
    ]
    note = "matched names after removing the prefix `_orig_mod.` (torch.compile) from b's 15 names"
    assert report.subject["names_note"] == note
    assert note in " ".join(str(report).split())  # said in the text output


def test_diff_ddp_against_eager(tmp_path: Path, one_rank_group: None) -> None:
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(_model())
    a = _save(ddp.state_dict(), tmp_path / "ddp.safetensors")
    b = _save(_trained(model).state_dict(), tmp_path / "eager.safetensors")
    report = deadweight.diff_checkpoints(a, b)
    _diff_is_complete(report, model)
    assert [(r["side"], r["prefix"]) for r in report.subject["renamed"]] == [("a", "module.")]


def test_diff_fsdp_and_activation_checkpointing_names(tmp_path: Path, one_rank_group: None) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = _model()
    wrapped = _model()
    for k in range(1, 4):
        wrapped[k] = checkpoint_wrapper(wrapped[k])
    with pytest.warns(UserWarning, match="NO_SHARD"):  # one rank: FSDP does not shard
        fsdp = FSDP(wrapped, device_id=torch.device("cpu"), use_orig_params=True)
    # a save of named_parameters keeps every wrapper's prefix (state_dict() removes them)
    named = dict(fsdp.named_parameters())
    assert "_fsdp_wrapped_module.1._checkpoint_wrapped_module.fc.weight" in named
    a = _save(model.state_dict(), tmp_path / "eager.safetensors")
    b = _save(named, tmp_path / "fsdp.safetensors")
    report = deadweight.diff_checkpoints(a, b)
    _diff_is_complete(report, model)
    renamed = {(r["side"], r["prefix"]): r["names"] for r in report.subject["renamed"]}
    assert renamed == {("b", "_fsdp_wrapped_module."): 15, ("b", "_checkpoint_wrapped_module."): 12}
