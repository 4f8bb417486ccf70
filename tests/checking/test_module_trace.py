from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from deadweight.checking.module_trace import ModuleTracer


def test_records_calls_sites_and_cuts_and_removes_hooks():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    before = (len(module_mod._global_forward_pre_hooks), len(module_mod._global_forward_hooks))
    with ModuleTracer(model) as tracer:
        h = model[0](torch.ones(1, 2))
        with torch.no_grad():
            model[1](h)
    assert (
        len(module_mod._global_forward_pre_hooks),
        len(module_mod._global_forward_hooks),
    ) == before
    assert set(tracer.calls) == {"0", "1"}
    assert tracer.calls["0"].call_site.file == __file__
    assert tracer.calls["0"].output_nodes and not tracer.calls["0"].cut_roots
    assert tracer.calls["1"].cut_roots  # ran under no_grad with inputs that need grad


class _Routed(nn.Module):
    """Experts in a ModuleList and a ModuleDict, each fed some of the rows."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(3, 2)
        self.experts = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.heads = nn.ModuleDict({"a": nn.Linear(3, 1), "b": nn.Linear(3, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.experts[0](x[:5]).sum() + self.experts[1](x[5:]).sum()
        h = h + self.experts[0](x[:2]).sum()  # a second call adds its rows
        return h + self.heads["a"](x[:4]).sum() + self.router(x).sum()


def test_rows_are_counted_for_container_members():
    model = _Routed()
    with ModuleTracer(model) as tracer:
        model(torch.ones(7, 3))
    rows = {name: record.rows for name, record in tracer.calls.items()}
    assert rows == {"": 0, "router": 0, "experts.0": 7, "experts.1": 2, "heads.a": 4}
    assert tracer.calls["experts.0"].calls == 2
    assert tracer.calls["router"].call_site.function == "_Routed.forward"
