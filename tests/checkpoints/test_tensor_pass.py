"""The one-pass native scan against the slow references: `quant_risk`, `joint_risk` and
float64 statistics, exactly where the definitions are exact."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from deadweight.checkpoints import native_reduce, tensor_pass
from deadweight.checkpoints.quantization import Scheme, joint_risk, quant_risk
from deadweight.checkpoints.readers import open_checkpoint

KERNELS = native_reduce.kernels()
pytestmark = pytest.mark.skipif(
    KERNELS is None and native_reduce.compiler() is None,
    reason="no C compiler: the native kernels cannot be built here",
)

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _kernels() -> native_reduce.Kernels:
    assert KERNELS is not None, "a C compiler is there but the kernels did not build"
    return KERNELS


def _weights(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * 0.02
    flat = t.reshape(-1)
    n = flat.numel()
    # outliers at group edges and inside, exact zeros of both signs
    for index, value in ((0, 3.0), (n - 1, -2.5), (n // 2, 0.9), (min(127, n - 1), 1.5)):
        flat[index] = value
    flat[1:n:37] = 0.0
    flat[2:n:41] = -0.0
    return t


def _scan(
    tmp_path: Path,
    tensor: torch.Tensor,
    scheme: str | None,
    scalars: list[tuple[str, float]] = (),  # type: ignore[assignment]
    threads: int = 2,
) -> tuple[tensor_pass.PassResult, np.ndarray]:
    path = str(tmp_path / "w.safetensors")
    save_file({"w": tensor.contiguous()}, path)
    with open_checkpoint(path) as ckpt, ThreadPoolExecutor(threads) as pool:
        (entry,) = ckpt.entries()
        result = tensor_pass.scan_tensor(
            ckpt,
            entry,
            _kernels(),
            pool,
            threads,
            Scheme.parse(scheme) if scheme else None,
            scalars,
        )
        whole = ckpt.array(entry)
    assert result is not None
    return result, whole


@pytest.fixture(autouse=True)
def _small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Many chunks per tensor, each cut in several pieces that the threads take as they come
    # free: every boundary case is exercised.
    monkeypatch.setattr(tensor_pass, "CHUNK_ELEMENTS", 1024 + 512)
    monkeypatch.setattr(tensor_pass, "MIN_PIECE", 256)
    monkeypatch.setattr(tensor_pass, "PIECE_ELEMENTS", 300)


def _same_risk(got: object, want: object) -> None:
    for field in ("scheme", "effective_bits", "zero_fraction", "worst_block", "range_ratio",
                  "verdict", "measured_error", "outliers"):  # fmt: skip
        assert getattr(got, field) == getattr(want, field), (field, got, want)


SHAPES = [(48, 256), (33, 100), (5000,), (4096,), (3, 6, 64), (7, 128), (2, 3)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("scheme", ["int4-group128", "int4-group16", "int8-group7", "int3-group1"])
def test_group_risk_is_quant_risk_exactly(
    tmp_path: Path, dtype: str, shape: tuple[int, ...], scheme: str
) -> None:
    tensor = _weights(shape, seed=len(shape) + shape[0]).to(DTYPES[dtype])
    result, whole = _scan(tmp_path, tensor, scheme)
    assert result.risk is not None
    _same_risk(result.risk, quant_risk(whole, Scheme.parse(scheme)))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(48, 256), (4096,), (7, 128), (2, 384)], ids=str)
@pytest.mark.parametrize("scheme", ["int4-group128", "int4-group64", "int8-group128"])
def test_joint_risk_is_computed_in_the_same_pass_exactly(
    tmp_path: Path, dtype: str, shape: tuple[int, ...], scheme: str
) -> None:
    tensor = _weights(shape, seed=7).to(DTYPES[dtype])
    flat = tensor.view(-1)
    # the largest magnitude of some groups on their last element: the joint group that
    # starts one element earlier loses it (the rare path in the kernel)
    flat[255::256] = 0.7
    # and a negative one before a group whose own values are all smaller in magnitude
    flat[383::512] = -0.9
    scalars = [("s.big", 56.25), ("s.zero", 0.0), ("s.neg", -0.01), ("s.one", 1.0)]
    result, whole = _scan(tmp_path, tensor, scheme, scalars)
    assert result.joint is not None
    assert sorted(result.joint) == sorted(name for name, _ in scalars)
    for name, value in scalars:
        _same_risk(result.joint[name], joint_risk(value, whole, Scheme.parse(scheme)))


def _blocks_losing_their_top(kind: str, group: int, count: int, seed: int) -> torch.Tensor:
    """Every other block has its largest magnitude on its last element, so that the joint
    block (one element earlier) loses it and the kernel counts that block again on a new
    grid; the blocks between keep small last elements (the element before a joint block)."""
    rng = np.random.default_rng(seed)
    blocks = rng.standard_normal((count, group)) * 0.02
    odd = np.arange(1, count, 2)
    inside = rng.integers(0, group - 1, odd.size)
    sign = rng.choice([-1.0, 1.0], odd.size)
    blocks[odd, -1] = 0.9 * sign
    if kind == "tie":  # the top also inside: the joint block keeps the same grid
        blocks[odd, inside] = -0.9 * sign
    elif kind == "lone":  # one element far above the rest inside: the joint top is alone
        blocks[odd, inside] = 0.5 * sign
    elif kind == "bigger-before":  # the element before is larger still: the joint top
        blocks[odd - 1, -1] = -1.35
    blocks[:, 3] = 0.0
    return torch.tensor(blocks.reshape(-1))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("kind", ["tie", "lone", "alone", "bigger-before"])
@pytest.mark.parametrize("scheme", ["int4-group128", "int8-group100"])  # 100: vector tails
def test_joint_blocks_that_lose_their_top_count_exactly(
    tmp_path: Path, dtype: str, kind: str, scheme: str
) -> None:
    parsed = Scheme.parse(scheme)
    assert parsed.group_size is not None
    tensor = _blocks_losing_their_top(kind, parsed.group_size, 160, seed=11).to(DTYPES[dtype])
    # a small scalar: the worst block is one of the weights' own, not the scalar's
    scalars = [("s", 0.001)]
    result, whole = _scan(tmp_path, tensor, scheme, scalars)
    assert result.joint is not None
    want = joint_risk(0.001, whole, parsed)
    _same_risk(result.joint["s"], want)
    if kind == "lone":
        assert want.range_ratio > 4  # the joint blocks' top is alone: the bulk is below it


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["tie", "lone", "bigger-before"])
def test_joint_blocks_in_long_pieces_count_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, kind: str
) -> None:
    # Pieces of many batches: after a piece's first batch the usual joint blocks are counted
    # together, from bit masks, and only the others one by one.
    monkeypatch.setattr(tensor_pass, "CHUNK_ELEMENTS", 1 << 20)
    monkeypatch.setattr(tensor_pass, "MIN_PIECE", 1 << 12)
    tensor = _blocks_losing_their_top(kind, 128, 400, seed=13).to(DTYPES[dtype])
    result, whole = _scan(tmp_path, tensor, "int4-group128", [("s", 0.001)])
    assert result.joint is not None
    _same_risk(result.joint["s"], joint_risk(0.001, whole, Scheme.parse("int4-group128")))


def test_joint_falls_back_when_rows_are_not_whole_groups(tmp_path: Path) -> None:
    result, _ = _scan(tmp_path, _weights((33, 100), 1).float(), "int4-group16", [("s", 5.0)])
    assert result.risk is not None and result.joint is None  # the caller reads it whole


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scheme", [None, "int4-group128"])
def test_statistics_match_float64(tmp_path: Path, dtype: str, scheme: str | None) -> None:
    tensor = (_weights((40, 256), 3) * 50 + 1.0).to(DTYPES[dtype])
    result, whole = _scan(tmp_path, tensor, scheme)
    ref = whole.astype(np.float64).reshape(-1)
    stats = result.stats
    assert stats.min == ref.min() and stats.max == ref.max()
    assert stats.zeros == int(np.count_nonzero(ref == 0))
    assert stats.nonfinite == 0
    scale = math.sqrt(float(np.mean(ref * ref)))
    assert stats.mean == pytest.approx(ref.mean(), abs=1e-6 * scale)
    assert stats.std == pytest.approx(ref.std(), rel=1e-6)


@pytest.mark.parametrize(
    ("dtype", "spread", "scheme"),
    [("float32", 1e-4, None), ("bfloat16", 0.02, None), ("bfloat16", 0.02, "int4-group128")],
)
def test_small_spread_around_a_large_mean_keeps_its_std(
    tmp_path: Path, dtype: str, spread: float, scheme: str | None
) -> None:
    # A norm gain of 1.0 +- a little: squares about a shift near the mean, not about 0
    # (bf16's dot-product path moves its squares about 0 to that shift in double).
    gen = torch.Generator().manual_seed(0)
    tensor = (1.0 + spread * torch.randn(128 * 160, generator=gen)).to(DTYPES[dtype])
    result, whole = _scan(tmp_path, tensor, scheme)
    assert result.stats.std == pytest.approx(float(whole.astype(np.float64).std()), rel=1e-5)


def test_centred_bf16_matches_float64(tmp_path: Path) -> None:
    tensor = _weights((64, 384), 12).bfloat16()
    result, whole = _scan(tmp_path, tensor, "int4-group128")
    ref = whole.astype(np.float64).reshape(-1)
    stats = result.stats
    assert (stats.min, stats.max) == (ref.min(), ref.max())
    assert stats.zeros == int(np.count_nonzero(ref == 0))
    assert stats.mean == pytest.approx(ref.mean(), abs=1e-6 * float(np.sqrt(np.mean(ref * ref))))
    assert stats.std == pytest.approx(ref.std(), rel=1e-6)
    assert result.risk is not None
    _same_risk(result.risk, quant_risk(whole, Scheme.parse("int4-group128")))


def test_nan_and_inf_are_counted_and_the_rest_is_measured(tmp_path: Path) -> None:
    tensor = _weights((30, 128), 4).float()
    flat = tensor.view(-1)
    flat[5], flat[2000], flat[-1] = math.nan, math.inf, -math.inf
    result, whole = _scan(tmp_path, tensor, "int4-group128")
    ref = whole.reshape(-1).astype(np.float64)
    finite = ref[np.isfinite(ref)]
    assert result.stats.nonfinite == 3
    assert result.stats.min == finite.min() and result.stats.max == finite.max()
    assert result.stats.mean == pytest.approx(finite.mean(), abs=1e-9)
    assert result.stats.std == pytest.approx(finite.std(), rel=1e-6)
    assert result.risk is None  # undefined with NaN/Inf, as quant_risk says


def test_squares_beyond_float_range_are_taken_in_double(tmp_path: Path) -> None:
    tensor = torch.tensor([3e20, -2e20, 1e20, 0.0] * 600, dtype=torch.float32)
    result, whole = _scan(tmp_path, tensor, None)
    ref = whole.astype(np.float64)
    assert result.stats.nonfinite == 0
    assert result.stats.std == pytest.approx(ref.std(), rel=1e-9)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_16_bit_pattern_converts_exactly(dtype: str) -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)
    values = torch.from_numpy(bits.view(np.int16)).view(DTYPES[dtype]).double().numpy()
    kind = "f16" if dtype == "float16" else "bf16"
    raw = bits.view(np.float16) if dtype == "float16" else bits
    kernels = _kernels()
    for k in range(0, 1 << 16, 1):
        m = native_reduce.Moments.empty()
        kernels.moments(kind, raw[k : k + 1], 0.0, m)
        if math.isfinite(values[k]):
            assert (m.min, m.nonfinite) == (values[k], 0), hex(k)
            assert math.copysign(1, m.sum) == math.copysign(1, values[k]) or values[k] == 0
        else:
            assert (m.count, m.nonfinite) == (0, 1), hex(k)


def test_single_thread_and_many_threads_agree(tmp_path: Path) -> None:
    tensor = _weights((64, 256), 9).bfloat16()
    one, _ = _scan(tmp_path, tensor, "int4-group128", threads=1)
    many, _ = _scan(tmp_path, tensor, "int4-group128", threads=3)
    _same_risk(one.risk, many.risk)
    assert (one.stats.min, one.stats.max, one.stats.zeros) == (
        many.stats.min,
        many.stats.max,
        many.stats.zeros,
    )
    assert one.stats.mean == pytest.approx(many.stats.mean, abs=1e-9)


def _neighbours(value: float, dtype: str, steps: int = 3) -> list[float]:
    """`value` in `dtype` and the representable values up to `steps` units either side."""
    if dtype == "bfloat16":
        bits = int(np.array(value, np.float32).view(np.uint32)) >> 16
        words = np.array([bits + k for k in range(-steps, steps + 1)], np.uint32) << 16
        return words.view(np.float32).astype(np.float64).tolist()
    np_dtype = {"float16": np.float16, "float32": np.float32, "float64": np.float64}[dtype]
    uint = {"float16": np.uint16, "float32": np.uint32, "float64": np.uint64}[dtype]
    bits = np.array(value, np_dtype).view(uint)
    ks = np.array(range(-steps, steps + 1), np.int64).astype(uint)
    return (bits + ks).view(np_dtype).astype(np.float64).tolist()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scheme", ["int4-group128", "int8-group64"])
def test_elements_at_the_rounding_and_near_top_edges_count_exactly(
    tmp_path: Path, dtype: str, scheme: str
) -> None:
    # Every group holds values a few units around top / (2 * qmax) (the largest magnitude
    # that rounds to 0) and around top / 2 (the top is alone below it): the kernels'
    # compares (as floats, or as 16-bit words for bf16) must count them as quant_risk does.
    parsed = Scheme.parse(scheme)
    qmax = 2 ** (parsed.bits - 1) - 1
    group = parsed.group_size
    assert group is not None
    rng = np.random.default_rng(5)
    groups = []
    for g in range(300):
        top = float(torch.tensor(rng.uniform(0.01, 10.0)).to(DTYPES[dtype]).item())
        edges = _neighbours(top / (2 * qmax), dtype) + _neighbours(top / 2, dtype)
        if g % 3 == 0:  # the top alone: nothing at or above top / 2 but the top
            edges = [e for e in edges if e < top / 2]
        rest = rng.uniform(-top / 4, top / 4, group - 1 - len(edges))
        values = np.concatenate([[top], edges, rest]) * rng.choice([-1.0, 1.0], group)
        groups.append(rng.permutation(values))
    tensor = torch.tensor(np.stack(groups)).to(DTYPES[dtype])
    result, whole = _scan(tmp_path, tensor, scheme)
    assert result.risk is not None
    want = quant_risk(whole, parsed)
    _same_risk(result.risk, want)
    assert want.zero_fraction > 0  # the edges did land on both sides of the rounding bound


# the reference's float inverse overflows on purpose here
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("scale", [1e-39, 3e-41, 1e-44, 1e-30])
def test_subnormal_groups_are_measured_as_quant_risk_does(
    tmp_path: Path, dtype: str, scale: float
) -> None:
    # Tops in float's subnormal range: the grids' inverse overflows, and the fast steps
    # of the rounding bound are not exact there (the kernels' slow searches).
    values = np.random.default_rng(1).standard_normal((64, 128)) * scale
    tensor = torch.tensor(values).to(DTYPES[dtype])
    result, whole = _scan(tmp_path, tensor, "int4-group128")
    assert result.risk is not None
    _same_risk(result.risk, quant_risk(whole, Scheme.parse("int4-group128")))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_joint_risk_counts_elements_on_the_grids_edges_exactly(tmp_path: Path, dtype: str) -> None:
    """Every group's top is 7 (an int4 step of 1), its other elements on the zero bound
    (0.5), half the top (3.5) or one step either side of them: the element before each
    joint block and the one it drops are often exactly on an edge."""
    rng = np.random.default_rng(11)
    step = 2.0**-8 if dtype == "bfloat16" else 2.0**-23
    edges = np.array([0.5, 0.5 - step, 0.5 + 2 * step, 3.5, 3.5 - 8 * step, 3.5 + 16 * step, 0.0])
    values = rng.choice(np.concatenate([edges, -edges]), (48, 256))
    values.reshape(-1)[np.arange(96) * 128 + rng.integers(0, 127, 96)] = 7.0
    tensor = torch.from_numpy(values).to(DTYPES[dtype])
    scalars = [("s.small", 0.5), ("s.big", 56.25)]
    result, whole = _scan(tmp_path, tensor, "int4-group128", scalars)
    assert result.joint is not None and result.risk is not None
    _same_risk(result.risk, quant_risk(whole, Scheme.parse("int4-group128")))
    for name, value in scalars:
        _same_risk(result.joint[name], joint_risk(value, whole, Scheme.parse("int4-group128")))
