from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from deadweight.checkpoints.quantization import (
    QuantRisk,
    Scheme,
    block_measure,
    fake_quantize,
    joint_risk,
    quant_risk,
    risk_of_worst_block,
)

# --- Scheme -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("int4", Scheme(4, "tensor", None, True)),
        ("int8", Scheme(8, "tensor", None, True)),
        ("int4-channel", Scheme(4, "channel", None, True)),
        ("int4-group128", Scheme(4, "group", 128, True)),
        ("int8-tensor-asym", Scheme(8, "tensor", None, False)),
        ("int4-group64-sym", Scheme(4, "group", 64, True)),
        ("INT8-asym", Scheme(8, "tensor", None, False)),
    ],
)
def test_parse_and_round_trip(text: str, expected: Scheme) -> None:
    scheme = Scheme.parse(text)
    assert scheme == expected
    assert Scheme.parse(str(scheme)) == scheme


@pytest.mark.parametrize(
    "text", ["int", "fp8", "int4-group", "int4-group0", "int1", "int17", "int4-row"]
)
def test_parse_rejects_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="int4-group128"):
        Scheme.parse(text)


# --- the incident (seed layer-scalar-adam-drift, section 6) -------------------------


def _incident_weights() -> np.ndarray:
    return np.random.default_rng(0).uniform(-2.0, 2.0, size=4096).astype(np.float32)


def test_drifted_scalar_breaks_int4_per_tensor() -> None:
    risk = joint_risk(56.25, _incident_weights(), Scheme.parse("int4"))
    assert risk.effective_bits == pytest.approx(4 - math.log2(56.25 / 2), abs=0.05)  # -0.81
    assert risk.verdict == "broken"
    assert risk.zero_fraction > 0.9  # "the layer's weights all collapse to 0"
    assert risk.worst_block is None


def test_healthy_scalar_keeps_four_bits() -> None:
    risk = joint_risk(1.0, _incident_weights(), Scheme.parse("int4"))
    assert risk.effective_bits == pytest.approx(4.0, abs=0.05)
    assert risk.verdict == "ok"


def test_drifted_scalar_degrades_int8() -> None:
    risk = joint_risk(56.25, _incident_weights(), Scheme.parse("int8"))
    assert risk.effective_bits == pytest.approx(8 - math.log2(28.125), abs=0.05)  # 3.19
    assert risk.verdict == "degraded"


def test_joint_per_group_hits_the_scalars_group_and_per_channel_isolates_it() -> None:
    group = joint_risk(56.25, _incident_weights(), Scheme.parse("int4-group128"))
    assert group.worst_block == 0
    assert group.effective_bits == pytest.approx(4 - math.log2(56.25 / 2), abs=0.1)
    # one group of 33 collapses, not the tensor
    assert 0.005 < group.zero_fraction < 0.3
    channel = joint_risk(56.25, _incident_weights(), Scheme.parse("int4-channel"))
    assert channel.effective_bits == 4.0
    assert channel.verdict == "ok"


# --- healthy weights: no false positive ---------------------------------------------


@pytest.fixture(scope="module")
def gaussian() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)


@pytest.mark.parametrize(
    "text", ["int4-channel", "int4-group128", "int8", "int8-channel", "int4-channel-asym"]
)
def test_gaussian_weights_are_ok(gaussian: np.ndarray, text: str) -> None:
    risk = quant_risk(gaussian, Scheme.parse(text))
    assert risk.verdict == "ok", risk
    # Groups of 128 are below 1 / (1 - 0.999) elements: the worst of 8192 groups loses
    # about a bit when its max happens to be just past twice its runner-up.
    slack = 1.5 if "group" in text else 1.0
    assert risk.effective_bits > Scheme.parse(text).bits - slack, risk


def test_gaussian_per_channel_ratio_is_max_over_quantile(gaussian: np.ndarray) -> None:
    risk = quant_risk(gaussian, Scheme.parse("int4-channel"))
    assert risk.worst_block is not None
    row = np.abs(gaussian[risk.worst_block])
    # slow reference: a full sort, the lower empirical quantile
    ordered = np.sort(row)
    expected = ordered[-1] / ordered[math.floor(0.999 * (row.size - 1))]
    assert risk.range_ratio == pytest.approx(expected, rel=1e-6)
    assert risk.outliers == row.size - 1 - math.floor(0.999 * (row.size - 1))


# --- block definitions ---------------------------------------------------------------


def test_a_lone_scalar_has_ratio_one() -> None:
    for text in ["int4", "int4-asym", "int4-channel", "int4-group128"]:
        risk = quant_risk(np.array([56.25]), Scheme.parse(text))
        assert risk.range_ratio == 1.0
        assert risk.effective_bits == 4.0
        assert risk.zero_fraction == 0.0


def test_tiny_block_drops_its_extreme_only_past_twice_the_next() -> None:
    scheme = Scheme.parse("int4")
    assert quant_risk(np.array([1.0, -0.5, 1.9]), scheme).range_ratio == 1.0
    assert quant_risk(np.array([1.0, -0.5, 2.1]), scheme).range_ratio == pytest.approx(2.1)
    asym = Scheme.parse("int4-asym")
    # range [-0.5, 2.1] = 2.6; without 2.1 it is [-0.5, 1] = 1.5: not halved
    assert quant_risk(np.array([1.0, -0.5, 2.1]), asym).range_ratio == 1.0
    assert quant_risk(np.array([1.0, -0.5, 9.0]), asym).range_ratio == pytest.approx(9.5 / 1.5)


def test_worst_block_indexes_rows_and_ragged_groups() -> None:
    w = np.random.default_rng(2).uniform(-1, 1, size=(6, 300))
    w[4, 290] = 50.0  # row 4, third (ragged, 44-wide) group of 128
    assert quant_risk(w, Scheme.parse("int4-channel")).worst_block == 4
    risk = quant_risk(w, Scheme.parse("int4-group128"))
    assert risk.worst_block == 4 * 3 + 2
    assert risk.outliers == 1
    w[4, 290] = 0.0
    w[1, 5] = 50.0
    assert quant_risk(w, Scheme.parse("int4-group128")).worst_block == 3


def test_all_zero_bulk_counts_as_ratio_one() -> None:
    w = np.zeros(5000)
    w[7] = 3.0
    risk = quant_risk(w, Scheme.parse("int4"))
    assert risk.range_ratio == 1.0
    assert risk.zero_fraction == 0.0
    assert quant_risk(np.zeros((3, 4)), Scheme.parse("int8-asym")).verdict == "ok"


def test_zero_fraction_counts_nonzero_elements_only() -> None:
    w = np.array([0.0, 0.0, 7.0, 0.4, -0.4, 0.6])  # step 1: 0.4 -> 0, 0.6 -> 1
    risk = quant_risk(w, Scheme.parse("int4"))
    assert risk.zero_fraction == pytest.approx(2 / 4)


def test_rejects_non_finite_and_bad_quantile() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        quant_risk(np.array([1.0, np.nan]), Scheme.parse("int4"))
    with pytest.raises(ValueError, match="bulk_quantile"):
        quant_risk(np.ones(3), Scheme.parse("int4"), bulk_quantile=1.0)


def test_empty_and_conv_shapes() -> None:
    assert quant_risk(np.zeros((0, 4)), Scheme.parse("int4")).verdict == "ok"
    conv = np.random.default_rng(3).standard_normal((8, 4, 3, 3)).astype(np.float32)
    for text in ["int4", "int4-channel", "int4-group16-asym"]:
        out = fake_quantize(conv, Scheme.parse(text))
        assert out.shape == conv.shape
        assert out.dtype == np.float32


# --- fake_quantize against torch (independent reference) ----------------------------
# Convention: torch's fake_quantize ops take a scale and zero point; deadweight picks
# them. Symmetric: scale = absmax / (2^(b-1) - 1), zero point 0; we pass quant_min =
# -2^(b-1) as torch's qint ranges do, which changes nothing since |x| / scale <=
# 2^(b-1) - 1. (torch's *observers* pick absmax / ((qmax - qmin) / 2) = absmax / 7.5 for
# int4 instead; that is a different scale, not compared here.) Asymmetric: the range
# is widened to include 0, as torch's MinMaxObserver does, zero point = round(-lo / scale).


def _torch_reference(x: np.ndarray, bits: int, symmetric: bool, per_channel: bool) -> np.ndarray:
    t = torch.from_numpy(x)
    dims = 1 if per_channel else None
    if symmetric:
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        absmax = t.abs().amax(dim=dims) if dims else t.abs().max()
        scale = absmax.double() / (2 ** (bits - 1) - 1)
        zero = torch.zeros_like(scale)
    else:
        qmin, qmax = 0, 2**bits - 1
        lo = (t.amin(dim=dims) if dims else t.min()).clamp(max=0).double()
        hi = (t.amax(dim=dims) if dims else t.max()).clamp(min=0).double()
        scale = (hi - lo) / qmax
        zero = torch.round(-lo / scale).clamp(qmin, qmax)
    if per_channel:
        return torch.fake_quantize_per_channel_affine(
            t, scale.float(), zero.int(), 0, qmin, qmax
        ).numpy()
    return torch.fake_quantize_per_tensor_affine(t, float(scale), int(zero), qmin, qmax).numpy()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("per_channel", [False, True])
def test_fake_quantize_matches_torch(bits: int, symmetric: bool, per_channel: bool) -> None:
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal((64, 256)) * rng.uniform(0.1, 3, size=(64, 1)) + 0.3).astype(
        np.float32
    )
    x[3, 7] = 40.0
    scheme = Scheme(bits, "channel" if per_channel else "tensor", None, symmetric)
    ours = fake_quantize(x, scheme)
    ref = _torch_reference(x, bits, symmetric, per_channel)
    step = np.abs(np.diff(np.unique(ref[3]))).min()
    differ = ours != ref
    # Only exact rounding ties may go the other way, by one step; none are expected.
    assert differ.mean() < 1e-3
    np.testing.assert_allclose(ours, ref, atol=step * 1.001, rtol=0)


# --- the formula against measurement ------------------------------------------------


def _with_outliers(bulk: np.ndarray, scheme: Scheme, size: float) -> np.ndarray:
    """One positive outlier `size` x the block's bulk absmax in every block (per-tensor:
    8 of them, few enough to stay outside the 0.999 bulk)."""
    w = bulk.copy()
    rows, cols = w.shape
    if scheme.granularity == "tensor":
        where = [(r, 3) for r in range(0, rows, rows // 8)]
        for r, c in where:
            w[r, c] = size * np.abs(bulk).max()
    elif scheme.granularity == "channel":
        w[:, 3] = size * np.abs(bulk).max(axis=1)
    else:
        assert scheme.group_size is not None
        g = scheme.group_size
        for start in range(0, cols, g):
            w[:, start + 1] = size * np.abs(bulk[:, start : start + g]).max(axis=1)
    return w


SWEEP_SCHEMES = [
    f"int{b}{g}{s}" for b in (4, 8) for g in ("", "-channel", "-group128") for s in ("", "-asym")
]


@pytest.mark.parametrize("text", SWEEP_SCHEMES)
def test_measured_error_follows_two_to_minus_effective_bits(text: str) -> None:
    scheme = Scheme.parse(text)
    bulk = np.random.default_rng(4).standard_normal((32, 2048)).astype(np.float32)
    offsets: list[float] = []
    collapsed: list[QuantRisk] = []
    for k in range(27):  # outliers from 1x to 2^13x the bulk: int8 reaches -5 bits
        risk = quant_risk(_with_outliers(bulk, scheme, 2 ** (k / 2)), scheme)
        if risk.effective_bits > 0:
            offsets.append(math.log2(risk.measured_error) + risk.effective_bits)
        else:
            collapsed.append(risk)
    assert len(offsets) >= 8 and len(collapsed) >= 4
    centre = statistics.median(offsets)
    assert max(abs(o - centre) for o in offsets) <= 1.5, (centre, offsets)
    assert all(r.zero_fraction > 0.5 for r in collapsed), collapsed
    assert all(r.verdict == "broken" for r in collapsed)


def _blocks(rng: np.random.Generator) -> list[np.ndarray]:
    """Single blocks of every kind the one-block path meets: ordinary groups, a lone top,
    ties at the top, zeros, subnormals, values near the float range's ends."""
    f32 = np.float32
    out = []
    for n in (1, 2, 3, 7, 64, 128, 999):
        for scale in (1e-3, 1.0, 60.0):
            out.append((rng.standard_normal(n) * scale).astype(f32))
        row = rng.standard_normal(n).astype(f32)
        row[rng.integers(0, n)] = 56.25  # alone at the top
        out.append(row)
        if n > 1:  # the top exactly twice the next: it stays
            out.append(np.concatenate([[-2.0, 1.0], rng.uniform(-1, 1, n - 2)]).astype(f32))
        out.append(np.where(rng.random(n) < 0.5, 0.0, rng.standard_normal(n)).astype(f32))
        out.append(np.full(n, -0.75, f32))  # every element ties
        out.append(np.zeros(n, f32))
        out.append((rng.standard_normal(n) * 1e-40).astype(f32))  # subnormal
        out.append((rng.standard_normal(n) * 3e38).clip(-3.4e38, 3.4e38).astype(f32))
        out.append(rng.standard_normal(n) * 1e-300)  # float64
        out.append(np.round(rng.standard_normal(n) * 4).astype(np.float64))
        out.append(rng.standard_normal(n).astype(np.float16))
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the blocks near the float range
@pytest.mark.parametrize("text", ["int4-group128", "int2-group128", "int8-group64", "int4-asym"])
def test_one_block_path_gives_what_the_many_block_path_gives(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    # risk_of_worst_block and block_measure take a one-block path for a symmetric tiny
    # block (what a checkpoint scan measures for every tensor): it must agree bit for bit
    # with block_bounds and fake_quantize_blocks, whatever the block holds.
    from deadweight.checkpoints import quantization

    scheme = Scheme.parse(text)
    blocks = _blocks(np.random.default_rng(8))
    lean = [
        (risk_of_worst_block(scheme, b, 3.5, 2, 5, 100), block_measure(b, scheme)) for b in blocks
    ]
    monkeypatch.setattr(quantization, "_tiny_symmetric", lambda *args: None)
    for block, (risk, measure) in zip(blocks, lean, strict=True):
        # repr: a NaN error (squares beyond the float range) compares equal to itself
        assert repr(risk_of_worst_block(scheme, block, 3.5, 2, 5, 100)) == repr(risk), block
        assert block_measure(block, scheme) == measure, block
