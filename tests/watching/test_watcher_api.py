"""The watch API: several models and optimizers, optimizers that grow, listeners."""

from __future__ import annotations

import torch
from torch import nn

import deadweight
from deadweight.watching.event_log import read_log


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def test_two_models_two_optimizers() -> None:
    gen, disc = nn.Sequential(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 1))
    g_opt = torch.optim.Adam(gen.parameters(), lr=1e-3)
    d_opt = torch.optim.SGD([disc[0].weight], lr=0.1)  # the bias is forgotten
    with deadweight.watch([gen, disc], [g_opt, d_opt], every=10) as w:
        for _ in range(60):
            _step(gen, g_opt, torch.randn(8, 4))
            _step(disc, d_opt, torch.randn(8, 4))
    names = set(w.stats.params)
    assert names == {"Sequential[0]:0.weight", "Sequential[0]:0.bias",
                     "Sequential[1]:0.weight", "Sequential[1]:0.bias"}  # fmt: skip
    (never,) = w.report().by_code("DW301")
    assert never.params == ("Sequential[1]:0.bias",)  # in no watched optimizer
    assert w.stats.params["Sequential[0]:0.weight"].steps == 60


class _Block(nn.Module):
    def __init__(self, cut: bool) -> None:
        super().__init__()
        self.ln_2 = nn.LayerNorm(8)
        self.mlp = nn.Sequential()
        self.mlp.c_fc = nn.Linear(8, 16)
        self.mlp.act = nn.GELU()
        self.mlp.c_proj = nn.Linear(16, 8)
        self.cut = cut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(self.ln_2(x))
        return x + (out.detach() if self.cut else out)


def test_a_finding_about_a_block_s_parameters_points_at_the_block() -> None:
    """The last block's MLP output detached: its ln_2 and its MLP never move, and the
    finding's place is the block that holds all six, not the first one's module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sequential(_Block(False), _Block(True)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with deadweight.watch(model, opt, every=10) as w:
        for _ in range(60):
            _step(model, opt, torch.randn(8, 4))
    (never,) = w.report().by_code("DW301")
    assert len(never.params) == 6 and all(p.startswith("1.1.") for p in never.params)
    assert never.location is not None and never.location.module == "1.1"


def test_parameters_added_mid_run_are_watched() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    with deadweight.watch(model, opt, every=5) as w:
        for _ in range(10):
            _step(model, opt, torch.randn(8, 4))
        opt.add_param_group({"params": model[0].parameters()})  # fine-tuning unfreezes it
        for _ in range(60):
            _step(model, opt, torch.randn(8, 4))
    track = w.stats.params["0.weight"]
    assert track.group == 1 and track.moved
    assert w.stats.params["1.weight"].steps == 70  # history carried over
    assert w.stats.steps == 70
    assert not w.report().by_code("DW301")


def test_listener_errors_reach_the_log(tmp_path) -> None:
    model = nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "run.jsonl"

    def broken(event: dict) -> None:
        raise RuntimeError("dashboard down")

    with deadweight.watch(model, opt, every=2, log=log) as w:
        w.add_listener(broken)
        for _ in range(4):
            _step(model, opt, torch.randn(2, 3))
    errors = [e for e in read_log(log).events if e["event"] == "error"]
    assert len(errors) == 1 and "dashboard down" in errors[0]["message"]
    assert "dashboard down" in str(w.report())
