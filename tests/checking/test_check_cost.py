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


def test_a_check_walks_the_model_seven_times() -> None:
    """Each walk of a model's modules costs Python per module (0.09 ms for a 12-layer
    GPT-2's 164). A check makes seven: its layout lists the modules once for FSDP2 and
    wrappers, and the parameters; before the forward the measurement lists the parameters, and the modules
    once for the snapshot and the module tracer; after it, the module cuts and the
    roles walk again, as the forward may have replaced a module or a parameter. It
    made nine."""
    from unittest import mock

    import torch
    from torch import nn

    import deadweight
    from tests.tiny_transformers import gpt2_config

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config()).train()
    ids = torch.randint(0, 100, (2, 8))
    walks = 0
    named_modules = nn.Module.named_modules  # modules() and named_parameters() use it

    def counted(self: nn.Module, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        nonlocal walks
        walks += self is model
        return named_modules(self, *args, **kwargs)  # type: ignore[arg-type]

    with mock.patch.object(nn.Module, "named_modules", counted):
        report = deadweight.check(model, lambda: model(input_ids=ids, labels=ids).loss)
    assert not report.findings
    assert walks == 7
