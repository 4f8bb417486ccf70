"""A plain Accelerate loop (`accelerator.prepare`, `accelerator.backward`), watched
through the AcceleratedOptimizer it hands back, on a tiny Llama."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deadweight
from tests.e2e import seeded

pytestmark = pytest.mark.e2e
accelerate = pytest.importorskip("accelerate")

STEPS = 51  # past DW301's 50 steps


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """Accelerate keeps one process-wide state; each test (and the Trainer's tests
    after these) starts from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class TestAccelerateLoop(seeded.SeededBugs):
    precisions = ("no", "bf16")

    def loop(self, model: Any, precision: str) -> tuple[Any, Any]:
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision=precision)
        opt = torch.optim.AdamW(seeded.decay_groups(model), lr=1e-3)
        data = torch.utils.data.DataLoader(seeded.batches(STEPS), batch_size=None)
        model, opt, data = accelerator.prepare(model, opt, data)
        assert type(opt).__name__ == "AcceleratedOptimizer"
        first = next(iter(data))
        check = deadweight.check(model, lambda: model(input_ids=first, labels=first).loss, opt)
        with deadweight.watch(model, opt, every=10) as w:
            for ids in data:
                accelerator.backward(model(input_ids=ids, labels=ids).loss)
                opt.step()
                opt.zero_grad()
        report = w.report()
        assert report.subject["steps"] == STEPS
        return check, report
