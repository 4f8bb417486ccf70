"""DW109: a forward that writes to parameters (through `.data`, `.detach()`, a view, or
in place under no_grad) is reported, and `check` puts the values back.

`.data` writes do not bump the autograd version counter, so they are found by the
op tracer (an in-place op on a tensor sharing a parameter's storage) and, for writes
it cannot see (NumPy, an extension kernel), by a checksum of every parameter before
and after the check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import deadweight
from deadweight.findings import Severity
from tests.conftest import marker_line


class Writer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(4, 4))
        self.other = nn.Linear(4, 4)
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "data":
            self.w.data.mul_(0.5)  # write data
        elif self.how == "data-setitem":
            self.w.data[0] = 0.0  # write data-setitem
        elif self.how == "detach":
            self.w.detach().add_(1.0)  # write detach
        elif self.how == "view":
            self.w.detach()[1].fill_(3.0)  # write view
        elif self.how == "no_grad":
            with torch.no_grad():
                self.w.copy_(self.w * 0.9)  # write no_grad
        elif self.how == "rebind":
            self.w.data = self.w.data * 2.0  # write rebind
        elif self.how == "numpy":
            self.w.detach().numpy()[:] = 1.0  # write numpy
        elif self.how == "clamp-noop":
            with torch.no_grad():
                self.w.clamp_(-100.0, 100.0)  # leaves every value as it was
        return self.out(torch.tanh(self.other(x) @ self.w))


SEEN = ["data", "data-setitem", "detach", "view", "no_grad", "rebind"]


def _check(how: str) -> tuple[Writer, deadweight.Report, torch.Tensor, int]:
    model = Writer(how)
    x = torch.randn(3, 4)
    before = model.w.detach().clone()
    version = model.w._version
    report = deadweight.check(model, lambda: F.mse_loss(model(x), torch.zeros(3, 1)))
    return model, report, before, version


@pytest.mark.parametrize("how", SEEN)
def test_seen_write_is_reported_and_restored(how: str) -> None:
    model, report, before, version = _check(how)
    assert torch.equal(model.w.detach(), before)
    assert model.w._version == version
    assert model.w.requires_grad
    (finding,) = report.by_code("DW109")
    assert finding.params == ("w",)
    assert finding.severity is Severity.WARNING
    (write,) = finding.evidence["writes"]
    assert write["restored"] is True
    assert write["line"] == marker_line(Writer.forward, f"write {how}")
    assert finding.location is not None and finding.location.line == write["line"]


def test_write_the_tracer_cannot_see_is_reported_as_not_restored() -> None:
    model, report, _, _ = _check("numpy")
    (finding,) = report.by_code("DW109")
    assert finding.params == ("w",)
    assert finding.severity is Severity.ERROR
    (write,) = finding.evidence["writes"]
    assert write["restored"] is False
    assert "not restored" in finding.message
    assert torch.equal(model.w.detach(), torch.ones(4, 4))  # what the forward left there


def test_write_that_changes_no_value_is_not_reported() -> None:
    model, report, before, version = _check("clamp-noop")
    assert not report.by_code("DW109")
    assert torch.equal(model.w.detach(), before)
    assert model.w._version == version


def test_healthy_model_has_no_dw109() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(5, 4)
    report = deadweight.check(model, lambda: model(x).pow(2).mean())
    assert not report.by_code("DW109")


def test_reading_data_for_logging_is_not_a_write() -> None:
    class Logging(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)
            self.norms: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.norms.append(float(self.fc.weight.data.norm()))
            scratch = self.fc.weight.detach().clone()
            scratch.mul_(0.0)  # a write to a copy, not to the parameter
            return self.fc(x)

    model = Logging()
    report = deadweight.check(model, lambda: model(torch.randn(3, 4)).sum())
    assert not report.by_code("DW109")
