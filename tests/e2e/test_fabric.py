"""A Lightning Fabric loop (`fabric.setup`, `fabric.backward`), watched through the
_FabricModule and _FabricOptimizer it hands back, on a tiny Llama."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deadweight
from tests.e2e import seeded

pytestmark = pytest.mark.e2e
pytest.importorskip("lightning")

STEPS = 51  # past DW301's 50 steps


class TestFabricLoop(seeded.SeededBugs):
    # bf16-mixed: Fabric refuses any backward outside fabric.backward, check's included.
    precisions = ("32-true", "bf16-mixed")

    def loop(self, model: Any, precision: str) -> tuple[Any, Any]:
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
        opt = torch.optim.AdamW(seeded.decay_groups(model), lr=1e-3)
        model, opt = fabric.setup(model, opt)
        assert type(opt).__name__ == "FabricAdamW"
        data = seeded.batches(STEPS)
        check = deadweight.check(model, lambda: model(input_ids=data[0], labels=data[0]).loss, opt)
        with deadweight.watch(model, opt, every=10) as w:
            for ids in data:
                fabric.backward(model(input_ids=ids, labels=ids).loss)
                opt.step()
                opt.zero_grad()
        report = w.report()
        assert report.subject["steps"] == STEPS
        return check, report
