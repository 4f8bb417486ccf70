"""Building and loading the native kernels: cache, opt-out, and every way it can fail."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from deadweight.probes import native_reduce

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
