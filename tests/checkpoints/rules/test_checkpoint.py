"""DW401-DW405 on saved checkpoints: a case that fires, a healthy one that must not, and the
per-tensor statistics against torch on the loaded tensors."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import deadweight
from deadweight.checkpoints import checkpoint_scan, native_reduce, tensor_pass
from deadweight.checkpoints import tensor_stats as tensor_stats_module
from deadweight.checkpoints.quantization import Scheme, quant_risk
from deadweight.checkpoints.readers.safetensors_file import SafetensorsFile
from tests import tiny_transformers
from tests.watching.rules.test_dynamics import INCIDENT


def _save(tensors: dict[str, torch.Tensor], path: Path) -> str:
    save_file({n: t.detach().clone().contiguous() for n, t in tensors.items()}, str(path))
    return str(path)


def _pair(tmp_path: Path, a: dict, b: dict) -> tuple[str, str]:
    return _save(a, tmp_path / "step-0.safetensors"), _save(b, tmp_path / "step-1.safetensors")


# --- DW401 never-learned --------------------------------------------------------------


def test_dw401_lists_unchanged_tensors(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    a = {f"layers.{i}.weight": torch.randn(8, 8, generator=gen) for i in range(3)}
    b = {n: t + 0.01 for n, t in a.items()}
    b["layers.1.weight"] = a["layers.1.weight"].clone()  # no update reached it
    report = deadweight.diff_checkpoints(*_pair(tmp_path, a, b))
    (found,) = report.by_code("DW401")
    assert found.params == ("layers.1.weight",)
    assert found.evidence["unchanged"] == 1 and found.evidence["compared"] == 3
    assert "same checkpoint twice" not in found.message
    assert report.subject["relative_change"]["layers.1.weight"] == 0.0


def test_dw401_quiet_when_everything_changed(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    a = {f"layers.{i}.weight": torch.randn(8, 8, generator=gen) for i in range(3)}
    b = {n: t * 1.001 for n, t in a.items()}
    report = deadweight.diff_checkpoints(*_pair(tmp_path, a, b))
    assert not report.by_code("DW401"), str(report)
    # slow reference: ||b - a|| / ||a|| computed by torch
    for name, t in a.items():
        expected = float((b[name].double() - t.double()).norm() / t.double().norm())
        assert report.subject["relative_change"][name] == pytest.approx(expected, rel=1e-5)


def test_dw401_same_file_twice(tmp_path: Path) -> None:
    path = _save({"w": torch.randn(4, 4), "b": torch.zeros(4)}, tmp_path / "model.safetensors")
    (found,) = deadweight.diff_checkpoints(path, path).by_code("DW401")
    assert "same checkpoint twice" in found.message
    assert set(found.params) == {"w", "b"}


def test_dw401_never_compares_int_tensors(tmp_path: Path) -> None:
    step = torch.tensor([7], dtype=torch.int64)  # identical in both: not a weight
    mask = torch.ones(4, dtype=torch.bool)
    a = {"w": torch.randn(4, 4), "step": step, "mask": mask}
    b = {"w": a["w"] + 1, "step": step, "mask": mask}
    report = deadweight.diff_checkpoints(*_pair(tmp_path, a, b))
    assert not report.by_code("DW401"), str(report)
    assert sorted(report.subject["not_compared"]) == ["mask", "step"]
    assert report.subject["compared"] == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dw401_is_bitwise(tmp_path: Path, dtype: torch.dtype) -> None:
    nan = torch.tensor([1.0, math.nan, 3.0], dtype=dtype)
    a = {
        "zero": torch.zeros(3, dtype=dtype),
        "nan": nan,
        "moved": torch.ones(3, dtype=dtype),
    }
    b = {
        "zero": -torch.zeros(3, dtype=dtype),  # -0.0 == 0.0 numerically, not bitwise
        "nan": nan.clone(),  # the same NaN payload: bitwise unchanged
        "moved": torch.full((3,), 2.0, dtype=dtype),
    }
    report = deadweight.diff_checkpoints(*_pair(tmp_path, a, b))
    (found,) = report.by_code("DW401")
    assert found.params == ("nan",), str(report)
    assert "same checkpoint twice" not in found.message


def test_dw401_different_nan_payload_counts_as_changed(tmp_path: Path) -> None:
    quiet = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    other = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert math.isnan(float(quiet)) and math.isnan(float(other))
    report = deadweight.diff_checkpoints(
        *_pair(tmp_path, {"x": quiet, "y": torch.ones(2)}, {"x": other, "y": torch.ones(2)})
    )
    (found,) = report.by_code("DW401")
    assert found.params == ("y",)


def test_diff_change_around_a_carried_nan(tmp_path: Path) -> None:
    # a NaN present in both saves must not hide the other elements' change (it made the
    # relative change NaN and max |change| 0); a value turning Inf is an unbounded change
    a = {"carried": torch.tensor([1.0, math.nan]), "blown": torch.ones(2)}
    b = {"carried": torch.tensor([2.0, math.nan]), "blown": torch.tensor([1.0, math.inf])}
    report = deadweight.diff_checkpoints(*_pair(tmp_path, a, b))
    movers = {m["name"]: m for m in report.subject["top_movers"]}
    assert movers["carried"]["relative_change"] == pytest.approx(1.0)
    assert movers["carried"]["max_abs_change"] == pytest.approx(1.0)
    assert movers["blown"]["relative_change"] == math.inf
    assert report.subject["top_movers"][0]["name"] == "blown"
    assert not report.by_code("DW401")


# --- DW406 checkpoint-names-unmatched ----------------------------------------------------


def _weights(names: list[str], seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(4, 4, generator=gen) for n in names}


def test_dw406_most_names_unmatched(tmp_path: Path) -> None:
    # 1 of 17 tensors shared, as an eager save against a compiled one looked before
    # names were matched across `_orig_mod.`; here no known prefix explains it
    names = [f"layers.{i}.weight" for i in range(16)] + ["head.weight"]
    a = _weights(names)
    b = {("head.weight" if n == "head.weight" else f"blocks.{n}"): t + 1 for n, t in a.items()}
    report = deadweight.diff_checkpoints(*_pair(tmp_path, a, b))
    (found,) = report.by_code("DW406")
    assert found.severity is deadweight.Severity.WARNING
    ev = found.evidence
    assert (ev["tensors_a"], ev["tensors_b"], ev["matched"]) == (17, 17, 1)
    assert (
        ev["only_in_a"][0] == "layers.0.weight" and ev["only_in_b"][0] == "blocks.layers.0.weight"
    )
    assert "Only 1 of the 17 tensors" in found.message and "no wrapper prefix" in found.message
    assert report.failed("warning")  # not "no findings", exit 0


def test_dw406_counts_against_the_smaller_file(tmp_path: Path) -> None:
    # b holds a subset of a (a head dropped for fine-tuning): all of b is compared
    a = _weights([f"layers.{i}.weight" for i in range(10)])
    b = {n: t + 1 for n, t in list(a.items())[:3]}
    assert not deadweight.diff_checkpoints(*_pair(tmp_path, a, b)).by_code("DW406")


@pytest.mark.parametrize(("shared", "fires"), [(2, False), (1, True)])
def test_dw406_half_matched_is_enough(tmp_path: Path, shared: int, fires: bool) -> None:
    a = _weights(["w0", "w1", "w2", "w3"])
    b = {(n if k < shared else f"other.{n}"): t + 1 for k, (n, t) in enumerate(a.items())}
    report = deadweight.diff_checkpoints(*_pair(tmp_path, a, b))
    assert bool(report.by_code("DW406")) is fires
    assert report.subject["matched"] == shared


def test_dw406_after_removing_a_prefix_says_so(tmp_path: Path) -> None:
    a = _weights(["fc.weight", "ln.weight", "head.weight"])
    # compiled, but two tensors renamed besides: one matches after `_orig_mod.` goes
    b = {"_orig_mod.fc.weight": a["fc.weight"] + 1, "_orig_mod.x.weight": a["ln.weight"],
         "_orig_mod.y.weight": a["head.weight"]}  # fmt: skip
    report = deadweight.diff_checkpoints(*_pair(tmp_path, a, b))
    (found,) = report.by_code("DW406")
    assert "even after removing the prefix(es) `_orig_mod.` from b" in found.message
    assert found.evidence["renamed"] == ["_orig_mod. from b"]


# --- DW402 / DW403 / DW404 on real transformers models ----------------------------------


def _models() -> list[tuple[str, torch.nn.Module]]:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return [
        ("gpt2", tf.GPT2LMHeadModel(tiny_transformers.gpt2_config(n_layer=4))),
        ("llama", tf.LlamaForCausalLM(tiny_transformers.llama_config(num_hidden_layers=5))),
        ("bert", tf.BertForMaskedLM(tiny_transformers.bert_config(num_hidden_layers=6))),
    ]


def _train(model: torch.nn.Module, steps: int = 20) -> None:
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(1, 100, (4, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


@pytest.mark.parametrize("trained", [False, True], ids=["init", "20-adamw-steps"])
def test_healthy_transformers_are_quiet(tmp_path: Path, trained: bool) -> None:
    for name, model in _models():
        if trained:
            _train(model)
        path = _save(dict(model.state_dict()), tmp_path / f"{name}.safetensors")
        report = deadweight.inspect_checkpoints([path])
        assert not report.subject["errors"]
        assert not report.by_code("DW402"), f"{name}: {report}"
        assert not report.by_code("DW404"), f"{name}: {report}"
        warned = [f for f in report.by_code("DW403") if f.severity is not deadweight.Severity.INFO]
        assert not warned, f"{name}: {report}"


def _incident(path: Path, last: float) -> str:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i, value in enumerate([*INCIDENT[:-1], last]):
        tensors[f"layers.{i}.layer_scalar"] = torch.tensor([value])
        tensors[f"layers.{i}.mlp.weight"] = torch.rand(32, 32, generator=gen) * 4 - 2
    return _save(tensors, path)


def test_dw402_incident_table(tmp_path: Path) -> None:
    report = deadweight.inspect_checkpoints(
        [_incident(tmp_path / "model.safetensors", 56.25)], scheme=None
    )
    (found,) = report.by_code("DW402")
    assert found.params == ("layers.31.layer_scalar",)
    ev = found.evidence
    assert ev["statistic"] == "value" and ev["value"] == pytest.approx(56.25)
    assert ev["siblings_median"] == pytest.approx(float(np.median(INCIDENT[:-1])), rel=1e-6)
    assert ev["siblings_range"] == pytest.approx([0.197, 1.203], rel=1e-6)


def test_dw402_quiet_on_the_healthy_table(tmp_path: Path) -> None:
    report = deadweight.inspect_checkpoints(
        [_incident(tmp_path / "model.safetensors", 1.2)], scheme=None
    )
    assert not report.by_code("DW402"), str(report)


def test_dw402_norm_weight_rms_outlier(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    tensors = {
        f"model.layers.{i}.input_layernorm.weight": 1 + 0.05 * torch.randn(64, generator=gen)
        for i in range(8)
    }
    tensors["model.layers.5.input_layernorm.weight"] *= 9.0
    report = deadweight.inspect_checkpoints(
        [_save(tensors, tmp_path / "model.safetensors")], scheme=None
    )
    (found,) = report.by_code("DW402")
    assert found.params == ("model.layers.5.input_layernorm.weight",)
    assert found.evidence["statistic"] == "RMS"
    expected = float(tensors["model.layers.5.input_layernorm.weight"].pow(2).mean().sqrt())
    assert found.evidence["value"] == pytest.approx(expected, rel=1e-5)


# --- DW403 quantization-risk ------------------------------------------------------------


def test_dw403_outliers_leave_few_bits(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 64, generator=gen)
    weight[3, 7], weight[40, 1], weight[60, 60] = 400.0, -350.0, 300.0
    path = _save({"proj.weight": weight}, tmp_path / "model.safetensors")
    report = deadweight.inspect_checkpoints([path], scheme="int4")
    (found,) = report.by_code("DW403")
    assert found.severity is deadweight.Severity.WARNING
    direct = quant_risk(weight.numpy(), Scheme.parse("int4"))
    assert found.evidence["effective_bits"] == pytest.approx(direct.effective_bits)
    assert found.evidence["effective_bits"] < 0
    # the bulk is the central 99.9%: the 3 planted values and the next most extreme
    assert found.evidence["outliers"] == direct.outliers >= 3
    # slow reference: symmetric int4 per tensor, scale = absmax / 7, round to nearest
    w = weight.double().numpy()
    scale = np.abs(w).max() / 7
    q = np.clip(np.round(w / scale), -7, 7)
    zero_fraction = np.count_nonzero((q == 0) & (w != 0)) / np.count_nonzero(w)
    assert found.evidence["zero_fraction"] == pytest.approx(zero_fraction, abs=1e-3)
    assert zero_fraction > 0.99


def test_dw403_quiet_on_gaussian_weights(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(4)
    path = _save(
        {"proj.weight": torch.randn(128, 256, generator=gen) * 0.02}, tmp_path / "m.safetensors"
    )
    for scheme in ("int4", "int4-group128", "int8-channel"):
        report = deadweight.inspect_checkpoints([path], scheme=scheme)
        assert not report.by_code("DW403"), f"{scheme}: {report}"


# --- DW404 checkpoint-non-finite ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dw404_counts_nan_and_inf(tmp_path: Path, dtype: torch.dtype) -> None:
    bad = torch.randn(16, 16).to(dtype)
    bad[0, :3] = math.nan
    bad[5, 5] = math.inf
    bad[6, 6] = -math.inf
    inf_only = torch.ones(8, dtype=dtype)
    inf_only[2] = math.inf
    tensors = {"a.weight": bad, "b.weight": inf_only, "c.weight": torch.ones(8, dtype=dtype)}
    path = _save(tensors, tmp_path / "model.safetensors")
    report = deadweight.inspect_checkpoints([path])
    (found,) = report.by_code("DW404")
    assert found.severity is deadweight.Severity.ERROR
    assert found.evidence["nonfinite"] == {"a.weight": 5, "b.weight": 1}
    rows = {r["name"]: r for r in report.subject["tensors"][path]}
    assert rows["a.weight"]["nonfinite"] == 5
    # the finite values' statistics are still there
    finite = bad.float()[torch.isfinite(bad.float())]
    assert rows["a.weight"]["max"] == pytest.approx(float(finite.max()))


def test_dw404_quiet_on_a_healthy_file(tmp_path: Path) -> None:
    path = _save({"w": torch.randn(8, 8), "h": torch.randn(8).half()}, tmp_path / "m.safetensors")
    assert not deadweight.inspect_checkpoints([path]).by_code("DW404")


# --- DW405 monotone-drift ---------------------------------------------------------------


def _series(tmp_path: Path, steps: list[int], values: list[float]) -> list[str]:
    return [
        _save(
            {"layers.0.gate": torch.tensor([v]), "layers.0.weight": torch.randn(4, 4)},
            tmp_path / f"step-{s}.safetensors",
        )
        for s, v in zip(steps, values, strict=True)
    ]


def test_dw405_drift_rate_per_step(tmp_path: Path) -> None:
    steps = [100, 200, 400, 800, 1600]
    values = [1.0, 1.5, 2.0, 3.0, 5.0]
    paths = _series(tmp_path, steps, values)
    shuffled = paths[:]
    random.Random(0).shuffle(shuffled)
    assert shuffled != paths
    report = deadweight.trend_checkpoints(shuffled)
    assert report.subject["steps"] == steps
    assert report.subject["checkpoints"] == paths
    (found,) = report.by_code("DW405")
    assert found.params == ("layers.0.gate",)
    assert found.evidence["rate_per_step"] == pytest.approx(4.0 / 1500)
    assert found.evidence["values"] == pytest.approx(values)
    assert "rose" in found.message


def test_dw405_falling_drift(tmp_path: Path) -> None:
    paths = _series(tmp_path, [0, 10, 20, 30], [1.0, 0.8, 0.6, 0.3])
    (found,) = deadweight.trend_checkpoints(paths).by_code("DW405")
    assert "fell" in found.message
    assert found.evidence["rate_per_step"] == pytest.approx(-0.7 / 30)


@pytest.mark.parametrize(
    "values",
    [
        [1.0, 1.3, 1.1, 1.6, 1.4],  # wanders up and down
        [1.0, 2.0, 3.0],  # fewer than 4 saves
        [1.0, 1.02, 1.04, 1.06, 1.08],  # monotone, but under 10%
    ],
    ids=["wandering", "three-saves", "under-10-percent"],
)
def test_dw405_quiet(tmp_path: Path, values: list[float]) -> None:
    paths = _series(tmp_path, [10 * k for k in range(len(values))], values)
    assert not deadweight.trend_checkpoints(paths).by_code("DW405")


# --- per-tensor statistics against torch --------------------------------------------------

CHUNK_BYTES = 4096  # 1024 float32 elements per chunk: the big tensor spans many chunks


@pytest.mark.parametrize(
    ("scheme", "native"),
    [(None, False), ("int8", False), (None, True), ("int4-group16", True)],
    ids=["streamed", "whole", "native", "native-groups"],
)
def test_statistics_match_torch(
    tmp_path: Path, monkeypatch, scheme: str | None, native: bool
) -> None:
    if native:
        if native_reduce.kernels() is None:
            assert native_reduce.compiler() is None, "a C compiler is there but the build failed"
            pytest.skip("no C compiler: the native kernels cannot be built here")
        # Many chunks, each split among threads, rows across chunk boundaries.
        monkeypatch.setattr(tensor_pass, "CHUNK_ELEMENTS", 257 * 9)
        monkeypatch.setattr(tensor_pass, "MIN_PIECE", 257)
    else:
        monkeypatch.setattr(checkpoint_scan.native_reduce, "kernels", lambda: None)
    chunk_counts: dict[str, int] = {}
    original = SafetensorsFile.chunks

    def small_chunks(self, entry, max_bytes: int = CHUNK_BYTES):  # type: ignore[no-untyped-def]
        for chunk in original(self, entry, max_bytes):
            chunk_counts[entry.name] = chunk_counts.get(entry.name, 0) + 1
            yield chunk

    monkeypatch.setattr(SafetensorsFile, "chunks", small_chunks)
    monkeypatch.setattr(tensor_stats_module, "SLICE", 300)  # several slices per chunk too
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(301, 257, generator=gen) * 3 + 0.5
    big[::7, 3] = 0.0
    with_nan = torch.randn(40, 40, generator=gen)
    with_nan[1, 1], with_nan[2, 2] = math.nan, -math.inf
    tensors = {
        "big.fp32": big,
        "nan.fp32": with_nan,
        "x.fp16": (torch.randn(50, 30, generator=gen) * 100).half(),
        "x.bf16": (torch.randn(70, 33, generator=gen) * 1e-3).bfloat16(),
        "x.fp8": (torch.randn(64, 64, generator=gen) * 10).to(torch.float8_e4m3fn),
        "ids.int64": torch.arange(10),
    }
    tensors["x.fp16"][0, :5] = 0
    path = _save(tensors, tmp_path / "model.safetensors")
    report = deadweight.inspect_checkpoints([path], scheme=scheme)
    rows = {r["name"]: r for r in report.subject["tensors"][path]}
    if scheme is None and not native:
        assert chunk_counts["big.fp32"] == math.ceil(big.numel() / (CHUNK_BYTES // 4))
    loaded = load_file(path)
    for name, t in loaded.items():
        row = rows[name]
        assert row["shape"] == list(t.shape) and row["numel"] == t.numel()
        if not t.is_floating_point():
            assert not row["analysed"]
            continue
        wide = t.double().reshape(-1)
        finite = wide[torch.isfinite(wide)]
        assert row["analysed"], name
        assert row["nonfinite"] == wide.numel() - finite.numel(), name
        assert row["zeros"] == int((finite == 0).sum()), name
        assert row["min"] == float(finite.min()), name  # exact: widening is exact
        assert row["max"] == float(finite.max()), name
        if native:
            # float lanes added into doubles every 2048 elements: float rounding of the
            # tensor's scale, far below anything a report shows
            scale = float(finite.square().mean().sqrt())
            assert row["mean"] == pytest.approx(float(finite.mean()), abs=1e-6 * scale), name
        else:
            assert row["mean"] == pytest.approx(float(finite.mean()), rel=1e-9, abs=1e-12), name
        assert row["std"] == pytest.approx(float(finite.std(correction=0)), rel=1e-6), name
    assert rows["x.fp8"]["dtype"] == "float8_e4m3fn"
    assert rows["nan.fp32"]["nonfinite"] == 2


# --- optimizer state in a torch checkpoint -----------------------------------------------


def test_optimizer_is_summarised_not_analysed(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    path = str(tmp_path / "ckpt-1.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    report = deadweight.inspect_checkpoints([path])
    names = [r["name"] for r in report.subject["tensors"][path]]
    assert sorted(names) == sorted(f"model.{n}" for n in model.state_dict())
    summary = report.subject["optimizer"][path]
    assert summary["key"] == "optimizer"
    assert summary["params_with_state"] == 4
    group = summary["param_groups"][0] if "param_groups" in summary else None
    if group is not None:
        assert group["lr"] == pytest.approx(3e-4)
