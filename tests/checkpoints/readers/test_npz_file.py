from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from tests.checkpoints.readers.bounded import run_bounded


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


def _npz_with_header(path: Path, header: str, data: bytes = bytes(16)) -> str:
    """An .npz of one member `w.npy` whose .npy header dict is `header`, as written."""
    text = header.encode("latin1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"  # numpy pads the header to 64
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("w.npy", npy)
    return str(path)


def _shape_header(shape: str, fortran: bool = False) -> str:
    return f"{{'descr': '<f4', 'fortran_order': {fortran}, 'shape': {shape}, }}"


@pytest.mark.parametrize(
    ("shape", "fortran", "problem"),
    [
        ("(-5, 3)", False, "has a negative size"),
        (f"({10**30},)", False, "size of 2**63 or more"),
        (f"(0x{'f' * 4000},)", False, "size of 2**63 or more"),  # str() of it raises
        ("(-1, 0x" + "f" * 4000 + ")", False, "has a negative size"),
        ("(1099511627776, 1099511627776)", False, "but the member holds 16"),
        ("(1099511627776,)", False, "but the member holds 16"),
        ("(1099511627776, 4)", True, "but the member holds 16"),  # read whole: 16 TB
        ("(3,)", False, "needs 12 bytes, but the member holds 16"),
        ("('a',)", False, "not a readable .npy member"),
    ],
    ids=lambda value: str(value)[:24],
)
def test_a_shape_the_member_does_not_hold_is_refused(
    tmp_path: Path, shape: str, fortran: bool, problem: str
) -> None:
    path = _npz_with_header(tmp_path / "bad.npz", _shape_header(shape, fortran))
    outcome = run_bounded(path, timeout=60, memory=1 << 30)
    assert outcome.other is None, outcome.other
    assert outcome.error is not None and outcome.error.startswith(f"{path}: w.npy: ")
    assert problem in outcome.error
    assert len(outcome.error) < 1000


def test_a_deflated_member_claiming_more_than_deflate_can_hold_is_refused(
    tmp_path: Path,
) -> None:
    # A Fortran-order member is read whole: the old reader allocated the claimed 1 GB at once.
    claimed = 1 << 30
    text = _shape_header(f"({claimed // 4},)", fortran=True).encode("latin1")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + bytes(16)
    path = tmp_path / "claims.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("w.npy", npy)
    # The zip's sizes claim the 1 GB too: far more than 1032 times the bytes stored.
    data = bytearray(path.read_bytes())
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        struct.pack_into("<I", data, data.find(signature) + offset, len(npy) - 16 + claimed)
    path.write_bytes(bytes(data))
    outcome = run_bounded(str(path), timeout=60, memory=1 << 30)
    assert outcome.other is None, outcome.other
    assert outcome.error is not None and "at most" in outcome.error and "stored" in outcome.error


def test_every_bad_member_is_listed_once(tmp_path: Path) -> None:
    path = tmp_path / "two.npz"
    np.savez(path, good=np.ones(2, np.float32), bad=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(str(path))
    assert str(info.value).count("bad.npy") == 1
