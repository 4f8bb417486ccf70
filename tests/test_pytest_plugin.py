"""The pytest plugin, run by pytest's own pytester: the `deadweight` fixture, the
`deadweight` marker, and the example a new model's test suite starts from."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from torch import nn

import deadweight
import deadweight.pytest_plugin
import deadweight.testing

pytest_plugins = ("pytester",)

EXAMPLE = Path(__file__).parents[1] / "examples" / "first_model_test"

MODELS = """
import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def fused_norm(x, g):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(8, 8) / 8**0.5)
        self.g = nn.Parameter(torch.ones(8))
        self.w2 = nn.Parameter(torch.randn(1, 8) / 8**0.5)

    def forward(self, x):
        return fused_norm(x @ self.w1.T, self.g) @ self.w2.T


def healthy():
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


BATCH = (torch.randn(16, 8), torch.randn(16, 1))
"""


@pytest.fixture(scope="module", autouse=True)
def _imported_before_the_inner_runs() -> None:
    # pytester's in-process runs unload what they imported: deadweight and the parts of
    # torch a check imports lazily are imported here once, so every run shares them.
    model = nn.Linear(2, 1)
    deadweight.check(model, lambda: model(torch.ones(1, 2)).sum())


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(models=MODELS)
    pytester.syspathinsert()
    return pytester


def test_the_plugin_is_registered_by_its_entry_point() -> None:
    (found,) = [e for e in entry_points(group="pytest11") if e.name == "deadweight"]
    assert found.value == "deadweight.pytest_plugin"


def test_loading_the_plugin_imports_neither_torch_nor_deadweights_checks() -> None:
    code = (
        "import sys, deadweight.pytest_plugin\n"
        "heavy = [m for m in ('torch', 'deadweight.checking.api', 'deadweight.testing') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_fixture_fails_a_broken_model_naming_its_parameters(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_models="""
import torch.nn.functional as F
from models import BATCH, Broken, healthy

def test_broken(deadweight):
    model = Broken()
    deadweight.assert_all_learn(model, deadweight.loss_from_batch(model, BATCH, F.mse_loss))

def test_healthy(deadweight):
    model = healthy()
    report = deadweight(model, deadweight.loss_from_batch(model, BATCH, F.mse_loss))
    assert report.ok
"""
    )
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*AssertionError: deadweight check: 2 findings at or above warning:*",
        "*error DW101 no-gradient*",
        "*params   w1, g*",
        "*FAILED test_models.py::test_broken*",
    ])  # fmt: skip
    assert "testing.py" not in result.stdout.str()  # the traceback stops at the test's line


def test_the_marker_allows_ignores_and_merges_from_class_to_test(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_marked="""
import pytest
import torch.nn.functional as F
from models import BATCH, Broken

def loss(deadweight, model):
    return deadweight.loss_from_batch(model, BATCH, F.mse_loss)

@pytest.mark.deadweight(allow=["w1", "g"])
def test_parameters_allowed(deadweight):
    model = Broken()
    deadweight.assert_all_learn(model, loss(deadweight, model))

@pytest.mark.deadweight(ignore="DW102")
class TestMerged:
    @pytest.mark.deadweight(ignore=["DW101"])
    def test_both_ignored(self, deadweight):
        model = Broken()
        deadweight.assert_all_learn(model, loss(deadweight, model))

    def test_only_the_class_marker(self, deadweight):
        model = Broken()
        deadweight.assert_all_learn(model, loss(deadweight, model))

@pytest.mark.deadweight(fail_on="error", thresholds={"noise-floor-ulps": 1e12})
def test_scalars_and_thresholds(deadweight):
    model = Broken()
    report = deadweight.check(model, loss(deadweight, model))
    assert {f.code for f in report.findings} >= {"DW101", "DW102"}
    deadweight.assert_no_findings(report, ignore=["DW101", "DW102"])

@pytest.mark.deadweight(ignor=["DW101"])
def test_typo(deadweight):
    pass
"""
    )
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*unknown @pytest.mark.deadweight keyword(s) ignor; known: allow, ignore, select*",
        "*FAILED test_marked.py::TestMerged::test_only_the_class_marker*",
    ])  # fmt: skip


def test_the_project_configuration_applies_under_the_marker(suite: pytest.Pytester) -> None:
    suite.makefile(".toml", deadweight='ignore = ["DW101", "DW102"]\n')
    suite.makepyfile(
        test_configured="""
import pytest
import torch.nn.functional as F
from models import BATCH, Broken

def test_configured(deadweight):
    model = Broken()
    deadweight.assert_all_learn(model, deadweight.loss_from_batch(model, BATCH, F.mse_loss))

@pytest.mark.deadweight(select=["DW101"])
def test_marker_select_keeps_the_configured_ignore(deadweight):
    model = Broken()
    deadweight.assert_all_learn(model, deadweight.loss_from_batch(model, BATCH, F.mse_loss))
"""
    )
    result = suite.runpytest("-p", "no:cacheprovider")
    # deadweight.toml ignores both rules the broken model triggers; a marker's select of
    # DW101 alone keeps the configured ignore, so that test could never fail: an error
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*could never fail*"])


def test_the_readme_example_fails_for_the_fused_model_only(pytester: pytest.Pytester) -> None:
    for name in ("model.py", "test_model.py"):
        shutil.copy(EXAMPLE / name, pytester.path / name)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines([
        "*params   w1, g*",
        "*FAILED test_model.py::test_every_parameter_learns[[]fused[]]*",
    ])  # fmt: skip
