"""One watched run of the second seed incident for every HTML report test: it takes
minutes on a busy machine, and each test only reads it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.report.html_inputs import drift_log


@pytest.fixture(scope="session")
def drift_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return drift_log(tmp_path_factory.mktemp("drift") / "drift.jsonl")
