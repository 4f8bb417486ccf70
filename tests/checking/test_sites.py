from __future__ import annotations

import os

import torch

from deadweight.checking.check_stats import display_path
from deadweight.checking.sites import definition_site, user_site


def test_user_site_skips_torch_frames():
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(user_site())
            return x

    Probe()(torch.ones(1))
    assert seen[0].file == __file__
    assert seen[0].function.endswith("Probe.forward")


def test_definition_site_of_module_instance():
    site = definition_site(torch.nn.Linear(1, 1))
    assert site is not None and site.file.endswith(os.path.join("nn", "modules", "linear.py"))


def test_display_path_is_relative_below_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert display_path(str(tmp_path / "a" / "m.py")) == os.path.join("a", "m.py")
    assert display_path("/elsewhere/m.py") == "/elsewhere/m.py"
