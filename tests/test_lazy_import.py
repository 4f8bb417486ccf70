"""`import deadweight` is cheap (the pytest plugin loads in every pytest run): public names
are imported on first use, and every one of them resolves."""

from __future__ import annotations

import subprocess
import sys

import deadweight


def test_import_deadweight_does_not_import_torch() -> None:
    code = "import sys, deadweight\nassert 'torch' not in sys.modules\nprint(deadweight.check)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "function check" in out.stdout  # and the name still resolves, importing torch


def test_every_public_name_resolves() -> None:
    assert set(deadweight.__all__) == {"__version__", *deadweight._EXPORTS}
    for name in deadweight.__all__:
        assert getattr(deadweight, name) is not None, name
    assert set(deadweight.__all__) <= set(dir(deadweight))
    try:
        deadweight.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
