"""Building and loading the native kernels: cache, opt-out, and every way it can fail."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from deadweight.checkpoints import native_reduce
from deadweight.checkpoints.quantization import Scheme, fake_quantize

HAS_COMPILER = native_reduce.compiler() is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler here")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A cache directory of its own, and no kernels remembered from other tests."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DEADWEIGHT_CACHE_DIR", str(cache))
    monkeypatch.delenv("DEADWEIGHT_NATIVE", raising=False)
    native_reduce.kernels.cache_clear()
    yield cache
    native_reduce.kernels.cache_clear()


@needs_compiler
def test_built_once_into_the_cache_and_reused(fresh: Path) -> None:
    first = native_reduce.kernels()
    assert first is not None
    built = sorted(os.listdir(fresh))
    assert len(built) == 1 and built[0].startswith("native_reduce-")
    assert os.path.dirname(first.path) == str(fresh)
    stamp = os.stat(first.path).st_mtime_ns
    native_reduce.kernels.cache_clear()
    again = native_reduce.kernels()
    assert again is not None and again.path == first.path
    assert os.stat(again.path).st_mtime_ns == stamp  # loaded, not rebuilt
    m = native_reduce.Moments.empty()
    again.moments("f32", np.array([1.0, -2.0, 0.0], dtype=np.float32), 0.0, m)
    assert (m.min, m.max, m.sum, m.zeros, m.count) == (-2.0, 1.0, -1.0, 1, 3)


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_can_be_turned_off(fresh: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DEADWEIGHT_NATIVE", value)
    assert native_reduce.kernels() is None
    assert not fresh.exists()  # nothing compiled, nothing written


def test_no_compiler_means_no_kernels(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_reduce, "compiler", lambda: None)
    assert native_reduce.kernels() is None


def test_a_compiler_that_fails_means_no_kernels(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(native_reduce, "compiler", lambda: ["false"])
    assert native_reduce.kernels() is None
    assert not fresh.exists() or not any(n.endswith(".so") for n in os.listdir(fresh))


@needs_compiler
def test_an_unwritable_cache_falls_back_to_a_private_temp_dir(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("DEADWEIGHT_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(native_reduce.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    loaded = native_reduce.kernels()
    assert loaded is not None
    assert loaded.path.startswith(str(tmp_path / "tmp"))


@needs_compiler
def test_a_library_of_another_version_is_not_loaded(
    fresh: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The loader expects a newer ABI than the source declares: it builds, asks the library
    # its version, and refuses it rather than calling functions with the wrong signature.
    monkeypatch.setattr(native_reduce, "ABI_VERSION", native_reduce.ABI_VERSION + 1)
    assert native_reduce.kernels() is None


@needs_compiler
@pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX ownership")
def test_a_directory_others_can_write_is_never_used(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A cache directory anyone can write to (or a planted /tmp one): a library there could
    # be anybody's, so nothing is loaded from it or built into it.
    fresh.mkdir()
    fresh.chmod(0o777)
    shared_tmp = tmp_path / "tmp"
    (shared_tmp / f"deadweight-{os.getuid()}").mkdir(parents=True)
    (shared_tmp / f"deadweight-{os.getuid()}").chmod(0o777)
    monkeypatch.setattr(native_reduce.tempfile, "gettempdir", lambda: str(shared_tmp))
    assert native_reduce.kernels() is None
    assert os.listdir(fresh) == []
    fresh.chmod(0o700)
    native_reduce.kernels.cache_clear()
    assert native_reduce.kernels() is not None  # its own, private: used


@needs_compiler
@pytest.mark.skipif(native_reduce.platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.parametrize("flags", [("-O3", "-mavx2", "-mfma"), ("-O3",)], ids=["avx2", "sse2"])
def test_narrower_vector_builds_give_the_same_answers(
    fresh: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...]
) -> None:
    """The kernel is written for any vector width: a build for an older CPU (AVX2, or
    x86-64's baseline SSE2) must agree with this machine's native build."""
    native = native_reduce.kernels()
    assert native is not None
    native_reduce.kernels.cache_clear()
    monkeypatch.setattr(native_reduce, "FLAG_SETS", (flags,))
    narrow = native_reduce.kernels()
    assert narrow is not None and narrow.path != native.path
    rng = np.random.default_rng(3)
    values = (rng.standard_normal(64 * 128 + 77) * 0.02).astype(np.float32)
    values[::97] = 0.0
    values[5::131] = -0.0
    values[300] = 9.0  # an outlier alone in its group
    for kind, data in (
        ("f32", values[: 64 * 128]),
        ("f64", values[: 64 * 128].astype(np.float64)),
        ("f16", values[: 64 * 128].astype(np.float16)),
        ("bf16", (values[: 64 * 128].view(np.uint32) >> 16).astype(np.uint16)),
    ):
        results = []
        for kernels in (native, narrow):
            m, g, gj = (native_reduce.Moments.empty(), native_reduce.Groups.empty(),
                        native_reduce.Groups.empty())  # fmt: skip
            kernels.groups(kind, data, 128, 128, 7, 0, 0.0, m, g, data[:1], gj)
            whole = native_reduce.Moments.empty()
            kernels.moments(kind, values[: 64 * 128 + 77].astype(data.dtype) if kind != "bf16"
                            else data, 0.0, whole)  # fmt: skip
            results.append((m, g, gj, whole))
        (m1, g1, j1, w1), (m2, g2, j2, w2) = results
        for a, b in ((m1, m2), (w1, w2)):
            assert (a.min, a.max, a.count, a.zeros, a.nonfinite) == (
                b.min, b.max, b.count, b.zeros, b.nonfinite), kind  # fmt: skip
            assert a.sum == pytest.approx(b.sum, rel=1e-5, abs=1e-6), kind
            assert a.squares == pytest.approx(b.squares, rel=1e-5), kind
        for a, b in ((g1, g2), (j1, j2)):
            assert (a.worst_ratio, a.worst_block, a.zero_rounded) == (
                b.worst_ratio, b.worst_block, b.zero_rounded), kind  # fmt: skip


def test_kernels_refuse_arrays_they_cannot_read() -> None:
    loaded = native_reduce.kernels()
    if loaded is None:
        pytest.skip("no kernels here")
    strided = np.arange(10, dtype=np.float32)[::2]
    with pytest.raises(ValueError, match="contiguous"):
        loaded.moments("f32", strided, 0.0, native_reduce.Moments.empty())
    with pytest.raises(ValueError, match="whole rows"):
        loaded.groups(
            "f32", np.zeros(10, np.float32), 4, 4, 7, 0, 0.0,
            native_reduce.Moments.empty(), native_reduce.Groups.empty(),
        )  # fmt: skip


def _loaded() -> native_reduce.Kernels:
    loaded = native_reduce.kernels()
    if loaded is None:
        pytest.skip("no kernels here")
    return loaded


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 values (already bf16-exact or not) as bf16 words, truncated."""
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _bf16_values(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def _groups(
    kernels: native_reduce.Kernels, words: np.ndarray, fast: bool, shift: float = 0.0
) -> tuple[native_reduce.Moments, native_reduce.Groups, native_reduce.Groups]:
    m, g, gj = (native_reduce.Moments.empty(), native_reduce.Groups.empty(),
                native_reduce.Groups.empty())  # fmt: skip
    kernels.groups("bf16", words, 128, 128, 7, 0, shift, m, g, words[:1], gj, fast=fast)
    return m, g, gj


BF16_CASES = {
    "centred": lambda rng: rng.standard_normal(96 * 128) * 0.02,
    "all negative": lambda rng: -np.abs(rng.standard_normal(96 * 128)) - 0.01,
    "all positive": lambda rng: np.abs(rng.standard_normal(96 * 128)) + 0.01,
    "negative zeros": lambda rng: np.where(rng.random(96 * 128) < 0.9, -0.0, -1.5),
    "zeros of both signs": lambda rng: np.where(
        rng.random(96 * 128) < 0.5, 0.0, np.where(rng.random(96 * 128) < 0.5, -0.0, 2.0)
    ),
    "one sign per flush": lambda rng: (
        np.repeat(rng.choice([-1.0, 1.0], 6), 16 * 128)
        * (np.abs(rng.standard_normal(96 * 128)) + 0.5)
    ),
    "outliers": lambda rng: (
        rng.standard_normal(96 * 128) * np.where(np.arange(96 * 128) % 300 == 7, 80.0, 1.0)
    ),
    "huge": lambda rng: rng.standard_normal(96 * 128) * 1e30,
    "on the grid's edges": lambda rng: _on_grid_edges(rng),
    "few near the top": lambda rng: _few_near_the_top(rng),
}


def _on_grid_edges(rng: np.random.Generator) -> np.ndarray:
    """Top 7 (an int4 step of 1) in every group, and elements exactly on the zero bound
    (0.5) and half the top (3.5), or one bf16 step either side, often in a group's last
    place and so also the element before the next block behind a scalar."""
    edges = np.array([0.5, 0.49804688, 0.50390625, 3.5, 3.484375, 3.515625, 0.0])
    x = rng.choice(np.concatenate([edges, -edges]), 96 * 128)
    x[np.arange(96) * 128 + rng.integers(0, 127, 96)] = 7.0
    return x


def _few_near_the_top(rng: np.random.Generator, lanes: int = 32) -> np.ndarray:
    """Every group has at least two elements of at least half its top, so no own block has a
    top standing alone (every own range ratio is 1). In the even groups two of three such
    elements share one of the kernel's `lanes` vector lanes (lanes - 1 and 127: bf16 has 32
    of 16 bits, float32 16) and one is the group's last: fewer lanes than elements reach
    half the top, and the block behind a scalar loses one of them while the element before
    it (the odd group's last) adds none. Group 50 has two, in one lane, the second its
    last: behind a scalar, its top is alone."""
    last = lanes - 1
    x = rng.standard_normal(96 * 128) * 0.05
    for group in range(96):
        lane = int(rng.integers(0, last))
        places = [lane, last, 127] if group % 2 == 0 else [lane, last, 64]
        x[group * 128 + np.array(places)] = rng.permutation([8.0, -4.0, rng.choice([4.0, 5.5])])
    x[50 * 128 : 51 * 128] = rng.standard_normal(128) * 0.05
    x[50 * 128 + last], x[50 * 128 + 127] = 8.0, -5.5
    return x


@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bf16_dot_product_path_agrees_with_float64_and_the_float_lanes(case: str) -> None:
    """bf16 groups of 128 are summed by the CPU's bf16 dot product and their extremes taken
    on the 16-bit words. Against float64, and against the float-lane path of the same
    build, every count and extreme is exact."""
    kernels = _loaded()
    words = _bf16(BF16_CASES[case](np.random.default_rng(8)))
    ref = _bf16_values(words).astype(np.float64)
    fast, lanes = _groups(kernels, words, True), _groups(kernels, words, False)
    m = fast[0]
    assert (m.count, m.nonfinite, m.zeros) == (ref.size, 0, int(np.count_nonzero(ref == 0)))
    assert (m.min, m.max) == (ref.min(), ref.max())
    scale = float(np.sqrt(np.mean(ref * ref))) or 1.0
    assert m.sum == pytest.approx(ref.sum(), abs=1e-6 * scale * ref.size)
    assert m.squares == pytest.approx(float(np.sum(ref * ref)), rel=1e-6)
    for a, b in zip(fast, lanes, strict=True):
        for field in ("min", "max", "count", "zeros", "nonfinite", "worst_ratio", "worst_block",
                      "zero_rounded"):  # fmt: skip
            assert getattr(a, field, None) == getattr(b, field, None), (field, case)
    if case == "few near the top":
        assert fast[1].worst_ratio == 1.0
        assert fast[2].worst_block == 50 and fast[2].worst_ratio > 8.0 / 0.5


@pytest.mark.parametrize("position", [0, 5, 2047, 2048, 9000, 96 * 128 - 1])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_bf16_dot_product_path_redoes_a_flush_with_nan_or_inf(position: int, bad: float) -> None:
    kernels = _loaded()
    values = np.random.default_rng(2).standard_normal(96 * 128) * 0.02
    values[position] = bad
    words = _bf16(values)
    ref = _bf16_values(words).astype(np.float64)
    finite = ref[np.isfinite(ref)]
    m, _, _ = _groups(kernels, words, True)
    assert (m.count, m.nonfinite) == (finite.size, 1)
    assert (m.min, m.max, m.zeros) == (
        finite.min(),
        finite.max(),
        int(np.count_nonzero(finite == 0)),
    )
    assert m.sum == pytest.approx(finite.sum(), abs=1e-9)
    assert m.squares == pytest.approx(float(np.sum(finite * finite)), rel=1e-6)


def test_bf16_dot_product_path_reads_subnormals_as_zero_in_its_sums() -> None:
    """VDPBF16PS treats subnormal inputs as 0: sums of subnormal bf16 (below 1.2e-38) are
    lost, everything else (extremes, zeros, grids) still counts them. This also shows the
    path is taken where the CPU has it."""
    kernels = _loaded()
    if not kernels.fast_bf16:
        pytest.skip("this CPU has no bf16 dot product")
    values = np.random.default_rng(4).standard_normal(32 * 128) * 1e-39
    words = _bf16(values)
    ref = _bf16_values(words).astype(np.float64)
    fast, lanes = _groups(kernels, words, True), _groups(kernels, words, False)
    assert fast[0].sum == 0.0 and lanes[0].sum != 0.0
    assert abs(fast[0].sum - ref.sum()) < 1.2e-38 * ref.size
    assert (fast[0].min, fast[0].max, fast[0].zeros) == (
        ref.min(),
        ref.max(),
        int(np.count_nonzero(ref == 0)),
    )
    assert (fast[1].worst_ratio, fast[1].worst_block, fast[1].zero_rounded) == (
        lanes[1].worst_ratio, lanes[1].worst_block, lanes[1].zero_rounded)  # fmt: skip


@pytest.mark.parametrize("qmax", [7, 127, 1])
def test_bf16_grid_table_is_the_rounding_grid_of_every_magnitude(qmax: int) -> None:
    """Entry 2w: the largest word rounding to 0 (|v| * inv <= 0.5 in float32, as fake
    quantization multiplies) and the smallest word with 2|v| >= top, for the top whose word
    is w; entry 2w + 1: inv = float32(1 / (top / qmax)). Found here by bisection over the
    words, for every finite top, subnormals included."""
    kernels = _loaded()
    table = kernels.grid_table(qmax)
    tops_w = np.arange(0x7F80, dtype=np.uint32)
    tops = _bf16_values(tops_w)
    scale = tops.astype(np.float64) / qmax
    scale = np.where(scale > 0, scale, 1.0)
    with np.errstate(over="ignore"):
        inv = (1.0 / scale).astype(np.float32)

    def largest(predicate: object) -> np.ndarray:
        # the largest word w in [0, 0x7f80) with predicate(w) (a prefix of the words), else 0
        lo = np.zeros(tops.size, np.int64)
        hi = np.full(tops.size, 0x7F80, np.int64)
        while np.any(hi - lo > 1):
            mid = (lo + hi) // 2
            ok = predicate(mid)  # type: ignore[operator]
            lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
        return lo

    with np.errstate(over="ignore", invalid="ignore"):
        zero_word = largest(lambda w: _bf16_values(w.astype(np.uint16)) * inv <= np.float32(0.5))
        below_half = largest(lambda w: _bf16_values(w.astype(np.uint16)) * np.float32(2) < tops)
    near_word = np.where(tops > 0, below_half + 1, 0)
    got_words = table[0::2][: tops.size]
    assert np.array_equal(got_words & 0xFFFF, zero_word)
    assert np.array_equal(got_words >> 16, near_word)
    assert np.array_equal(table[1::2][: tops.size], inv.view(np.uint32))


@pytest.mark.parametrize("mean", [0.0, 1.0, -3.7, 250.0])
def test_bf16_dot_product_squares_are_moved_to_the_shift_exactly_enough(mean: float) -> None:
    """The dot products square about 0; each flush moves the squares to the shift in
    double. A spread 1e-2 of the mean (mean^2 / variance 10^4) keeps float64's std."""
    kernels = _loaded()
    rng = np.random.default_rng(6)
    spread = 0.01 * abs(mean) if mean else 0.02
    words = _bf16(mean + spread * rng.standard_normal(64 * 128))
    ref = _bf16_values(words).astype(np.float64)
    shift = float(np.float32(ref[:4096].mean()))
    m, _, _ = _groups(kernels, words, True, shift)
    variance = m.squares / m.count - (m.sum / m.count - shift) ** 2
    assert math.sqrt(variance) == pytest.approx(ref.std(), rel=1e-6)
    assert m.sum / m.count == pytest.approx(ref.mean(), abs=1e-7 * abs(mean) + 1e-9)


def test_float_groups_count_the_elements_when_few_lanes_are_near_the_top() -> None:
    """float32 groups of 128 take the lanes near the top (16 on AVX-512: positions 16
    apart share one) as a lower bound on the elements near it, and count the elements
    when the bound is under 3. The layout of _few_near_the_top, in those lanes: every
    range ratio is 1 but that of group 50 behind a scalar, where its top stands alone."""
    kernels = _loaded()
    data = _few_near_the_top(np.random.default_rng(4), lanes=16).astype(np.float32)
    m, g, gj = (native_reduce.Moments.empty(), native_reduce.Groups.empty(),
                native_reduce.Groups.empty())  # fmt: skip
    kernels.groups("f32", data, 128, 128, 7, 0, 0.0, m, g, data[:1], gj)
    assert g.worst_ratio == 1.0
    assert gj.worst_block == 50 and gj.worst_ratio > 8.0 / 0.5
    fq = fake_quantize(data, Scheme.parse("int4-group128"))
    assert g.zero_rounded == int(np.count_nonzero((fq == 0) & (data != 0)))


def _fields(s: ctypes.Structure) -> tuple:
    return tuple(getattr(s, name) for name, _ in s._fields_)


@needs_compiler
@pytest.mark.parametrize("kind", ["f32", "bf16", "f16", "f64"])
def test_pieces_shared_by_threads_give_what_one_call_per_piece_gives(kind: str) -> None:
    # dw_run_pieces: each caller takes the next piece left; every piece's results must be
    # those of reducing it alone, whichever thread took it, joint groups included.
    loaded = _loaded()
    rng = np.random.default_rng(11)
    values = (rng.standard_normal(40 * 128 + 50) * 0.02).astype(np.float32)
    values[77] = 5.0  # an outlier alone in its group
    values[::53] = 0.0
    data = _bf16(values) if kind == "bf16" else values.astype({"f32": np.float32,
        "f16": np.float16, "f64": np.float64}[kind])  # fmt: skip
    spans = [(0, 1280), (1280, 2560), (2560, 3840), (3840, 5120)]
    table = loaded.grid_table(7) if kind == "bf16" else None
    pieces = (native_reduce.Piece * 6)()
    out = [(native_reduce.Moments.empty(), native_reduce.Groups.empty(),
            native_reduce.Groups.empty()) for _ in pieces]  # fmt: skip
    for i, (lo, hi) in enumerate(spans):
        m, g, gj = out[i]
        before = data[lo - 1 : lo] if lo else None
        pieces[i] = native_reduce.Piece(
            data[lo:].ctypes.data, (hi - lo) // 128, 128, 128, lo // 128,
            None if before is None else before.ctypes.data,
            ctypes.addressof(m), ctypes.addressof(g), ctypes.addressof(gj), None, 0,
        )  # fmt: skip
    m, g, _ = out[4]  # a short group of 50 (a 1-D tensor's last), not joint
    pieces[4] = native_reduce.Piece(data[5120:].ctypes.data, 1, 50, 50, 40, None,
                                    ctypes.addressof(m), ctypes.addressof(g), None, None, 0)  # fmt: skip
    m, _, _ = out[5]  # moments only (group 0)
    pieces[5] = native_reduce.Piece(data.ctypes.data, data.size, 1, 0, 0, None,
                                    ctypes.addressof(m), None, None, None, 0)  # fmt: skip
    taken = ctypes.c_int64(0)
    with ThreadPoolExecutor(2) as pool:
        runs = [
            pool.submit(loaded.run_pieces, kind, pieces, taken, 7, 0.01, table) for _ in range(2)
        ]
        loaded.run_pieces(kind, pieces, taken, 7, 0.01, table)
        for run in runs:
            run.result()
    assert taken.value >= len(pieces)
    for i, (lo, hi) in enumerate(spans):
        alone = (native_reduce.Moments.empty(), native_reduce.Groups.empty(),
                 native_reduce.Groups.empty())  # fmt: skip
        before = data[lo - 1 : lo] if lo else None
        loaded.groups(kind, data[lo:hi], 128, 128, 7, lo // 128, 0.01, alone[0], alone[1],
                      before, alone[2])  # fmt: skip
        assert [_fields(s) for s in out[i]] == [_fields(s) for s in alone], i
    alone_m, alone_g = native_reduce.Moments.empty(), native_reduce.Groups.empty()
    loaded.groups(kind, data[5120:], 50, 50, 7, 40, 0.01, alone_m, alone_g)
    assert (_fields(out[4][0]), _fields(out[4][1])) == (_fields(alone_m), _fields(alone_g))
    whole = native_reduce.Moments.empty()
    loaded.moments(kind, data, 0.01, whole)
    assert _fields(out[5][0]) == _fields(whole)
    assert out[0][1].worst_block == 0 and out[0][1].worst_ratio > 2  # the outlier's group


@needs_compiler
def test_a_piece_drops_the_pages_it_was_given_once_read(tmp_path: Path) -> None:
    status = Path("/proc/self/status")
    if not status.exists() or not hasattr(mmap.mmap, "madvise"):
        pytest.skip("needs /proc/self/status and madvise (Linux)")

    def resident_file_kb() -> int:
        line = next(li for li in status.read_text().splitlines() if li.startswith("RssFile:"))
        return int(line.split()[1])

    loaded = _loaded()
    values = np.random.default_rng(5).standard_normal(4 << 20).astype(np.float32)  # 16 MB
    path = tmp_path / "values.bin"
    values.tofile(path)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        data = np.frombuffer(mapped, dtype=np.float32)
        m = native_reduce.Moments.empty()
        piece = native_reduce.Piece(data.ctypes.data, data.size, 1, 0, 0, None,
                                    ctypes.addressof(m), None, None, None, 0)  # fmt: skip
        page = mmap.PAGESIZE
        first = -(-data.ctypes.data // page) * page
        piece.drop, piece.drop_len = first, (12 << 20) // page * page
        float(data.sum(dtype=np.float64))  # every page resident
        held = resident_file_kb()
        loaded.run_pieces("f32", (native_reduce.Piece * 1)(piece), ctypes.c_int64(0), 0, 0.0, None)
        dropped = held - resident_file_kb()
        assert m.count == data.size and m.sum == pytest.approx(
            float(values.sum(dtype=np.float64)), rel=1e-5
        )
        del data
    assert 11 << 10 <= dropped <= 13 << 10, f"{dropped} KB dropped, not the 12 MB given"
