"""Per-rule thresholds: documented defaults, validated overrides, and every one of them
actually reaching the rule that judges by it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import deadweight
from deadweight import thresholds
from deadweight.checkpoints.checkpoint_scan import DEFAULT_SCHEME
from deadweight.demos import fused_rmsnorm
from deadweight.errors import ConfigError
from deadweight.homologous import robust_outlier
from deadweight.registry import get_rule
from deadweight.thresholds import Thresholds

SRC = Path(deadweight.__file__).parent


def test_every_threshold_is_documented_and_names_real_rules() -> None:
    for name, field in thresholds.FIELDS.items():
        assert field.metadata["meaning"] and field.metadata["why"], name
        for code in field.metadata["rules"]:
            get_rule(code)  # raises for a code that is no rule
    assert Thresholds().quantization_scheme == DEFAULT_SCHEME


@pytest.mark.parametrize("name", list(thresholds.FIELDS))
def test_every_threshold_is_read_where_rules_judge(name: str) -> None:
    readers = [
        p for p in SRC.rglob("*.py")
        if p.name != "thresholds.py" and re.search(rf"\.{name}\b", p.read_text())
    ]  # fmt: skip
    assert readers, f"no module reads thresholds.{name}: it would be a setting without effect"


def test_updated_accepts_both_spellings_and_rejects_bad_values() -> None:
    t = Thresholds.of({"outlier-z": 6, "never_moved_steps": 10})
    assert (t.outlier_z, t.never_moved_steps) == (6, 10)
    assert Thresholds.of(None) is thresholds.DEFAULT and Thresholds.of(t) is t
    with pytest.raises(ConfigError) as info:
        Thresholds.of({"outlier-zed": 1, "skipped-steps-share": 2, "trend-min-saves": True})
    message = str(info.value)
    assert "unknown key 'outlier-zed' (did you mean 'outlier-z'?)" in message
    assert "skipped-steps-share is a share of the steps, at most 1" in message
    assert "trend-min-saves must be a number, got True" in message


def test_using_scopes_the_active_thresholds() -> None:
    assert thresholds.current() is thresholds.DEFAULT
    with thresholds.using({"outlier-z": 50}) as active:
        assert thresholds.current() is active and active.outlier_z == 50
        with thresholds.using(None):
            assert thresholds.current() is active
    assert thresholds.current() is thresholds.DEFAULT


def test_outlier_z_moves_the_layer_outlier_verdict() -> None:
    values = [1.0, 1.1, 0.9, 1.05, 0.95, 3.0]  # robust z of 3.0 is about 15
    assert robust_outlier(values) is not None
    with thresholds.using({"outlier-z": 20}):
        assert robust_outlier(values) is None
    with thresholds.using({"outlier-min-factor": 4}):  # 3x the median is no longer enough
        assert robust_outlier(values) is None


def test_never_moved_steps_reaches_watch_and_its_config() -> None:
    # 30 steps are fewer than the default 50: no DW301; with 20 configured, w1 and g
    setup = fused_rmsnorm.make(diff=False)
    with deadweight.watch(setup.model, setup.optimizer) as plain:
        fused_rmsnorm.train(setup, 30)
    assert not plain.report().by_code("DW301")
    setup = fused_rmsnorm.make(diff=False)
    with deadweight.watch(
        setup.model, setup.optimizer, thresholds={"never-moved-steps": 20}
    ) as tuned:
        fused_rmsnorm.train(setup, 30)
    (finding,) = tuned.report().by_code("DW301")
    assert set(finding.params) == {"l1.weight", "norm.weight"}


def test_noise_floor_ulps_reaches_check() -> None:
    # The floor is the fallback for a path through a call deadweight cannot see into
    # (here an autograd.Function): within a floor of 1e12 ulps a real gradient counts
    # as noise (DW103), within the default 16 it does not. A parameter whose path the
    # structure pass follows is judged by that, whatever the floor.
    import torch
    from torch import nn

    class Opaque(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):  # type: ignore[no-untyped-def, override]
            return t.clone()

        @staticmethod
        def backward(ctx, g):  # type: ignore[no-untyped-def, override]
            return g

    model = nn.Linear(4, 1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def opaque_loss() -> torch.Tensor:
        return ((Opaque.apply(model(x)) - y) ** 2).mean()

    def plain_loss() -> torch.Tensor:
        return ((model(x) - y) ** 2).mean()

    assert not deadweight.check(model, opaque_loss).by_code("DW103")
    flagged = deadweight.check(model, opaque_loss, thresholds={"noise-floor-ulps": 1e12})
    assert flagged.by_code("DW103")
    followed = deadweight.check(model, plain_loss, thresholds={"noise-floor-ulps": 1e12})
    assert not followed.by_code("DW103")


def test_watch_reads_the_configuration_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "deadweight.toml").write_text(
        'ignore = ["DW305"]\n[thresholds]\nnever-moved-steps = 20\n'
    )
    monkeypatch.chdir(tmp_path)
    setup = fused_rmsnorm.make(diff=False)
    with deadweight.watch(setup.model, setup.optimizer, config=True) as w:
        fused_rmsnorm.train(setup, 30)
    assert w.report().by_code("DW301")  # the configured 20 steps, not the default 50
    assert not w.report(ignore="DW301").by_code("DW301")  # ignore adds to the configured
    assert w.settings.ignore == ("DW305",)


def test_inspect_checkpoints_takes_the_scheme_from_thresholds(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    path = str(tmp_path / "m.safetensors")
    save_file({"w": torch.randn(8, 8)}, path)
    assert deadweight.inspect_checkpoints([path]).subject["scheme"] == DEFAULT_SCHEME
    tuned = deadweight.inspect_checkpoints([path], thresholds={"quantization-scheme": "int8"})
    assert tuned.subject["scheme"] == "int8"
    assert deadweight.inspect_checkpoints([path], scheme="none").subject["scheme"] == "none"
