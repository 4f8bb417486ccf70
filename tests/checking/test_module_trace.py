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
