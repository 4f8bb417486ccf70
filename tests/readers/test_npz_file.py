from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest

from deadweight.readers import CheckpointError, open_checkpoint


@pytest.mark.parametrize("compressed", [False, True])
def test_round_trip_matches_np_load(tmp_path: Path, compressed: bool) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "model.w": rng.standard_normal((40, 30)).astype(np.float32),
        "model.h": rng.standard_normal(17).astype(np.float16),
        "model.d": rng.standard_normal(5),
        "fortran": np.asfortranarray(rng.standard_normal((6, 7)).astype(np.float32)),
        "big_endian": np.arange(10, dtype=">f4"),
        "steps": np.arange(3, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "scalar": np.float32(1.5),
    }
    path = str(tmp_path / "weights.npz")
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    reference = np.load(path, allow_pickle=False)
    with open_checkpoint(path) as ckpt:
        entries = ckpt.entries()
        assert [e.name for e in entries] == list(arrays)
        for entry in entries:
            want = reference[entry.name]
            assert entry.shape == want.shape and entry.nbytes == want.nbytes
            got = ckpt.array(entry)
            expected_dtype = (
                np.float64
                if want.dtype == np.float64
                else np.float32
                if want.dtype.kind == "f"
                else want.dtype
            )
            assert got.dtype == expected_dtype
            np.testing.assert_array_equal(got, want)
        by_name = {e.name: e for e in entries}
        assert by_name["mask"].dtype == "bool" and not by_name["mask"].is_float
        chunks = [c.copy() for c in ckpt.chunks(by_name["model.w"], max_bytes=512)]
        assert len(chunks) == 10
        np.testing.assert_array_equal(np.concatenate(chunks), arrays["model.w"].reshape(-1))
        fortran = [c.copy() for c in ckpt.chunks(by_name["fortran"], max_bytes=40)]
        np.testing.assert_array_equal(np.concatenate(fortran), arrays["fortran"].reshape(-1))


def test_object_member_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "obj.npz")
    np.savez(path, ok=np.ones(2), objects=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CheckpointError, match=r"obj\.npz: objects\.npy: holds Python objects"):
        open_checkpoint(path)


def test_not_a_zip_and_bad_member(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip at all")
    with pytest.raises(CheckpointError, match=r"junk\.npz: not an \.npz \(zip\) archive"):
        open_checkpoint(str(junk))
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("x.npy", b"garbage")
    with pytest.raises(CheckpointError, match=r"bad\.npz: x\.npy: not a readable \.npy member"):
        open_checkpoint(str(bad))
