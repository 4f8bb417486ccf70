"""The npz reader sees untrusted bytes: whatever the archive and its .npy headers say, it
raises CheckpointError naming the file or reads no more than the archive stores."""

from __future__ import annotations

import io
import struct
import tempfile
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from tests.checkpoints.readers.bounded import BOUND_MB, BOUND_SECONDS, READ_ALL, run_bounded
from tests.fuzzing import FUZZ, fuzz

pytestmark = fuzz


def _open_and_read(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.npz"
        path.write_bytes(data)
        try:
            with open_checkpoint(str(path)) as ckpt:
                for entry in ckpt.entries():
                    # Deflate stores at most 1032 bytes per byte: no entry claims more.
                    assert entry.nbytes <= 1032 * len(data)
                    for _ in ckpt.chunks(entry, max_bytes=1 << 16):
                        pass
        except CheckpointError as exc:
            assert str(exc).startswith(f"{path}: ")


def _npy(header: str, data: bytes, version: int) -> bytes:
    text = header.encode("latin1", "replace")
    text += b" " * (63 - (10 + len(text)) % 64) + b"\n"
    length = struct.pack("<H", len(text)) if version == 1 else struct.pack("<I", len(text))
    return b"\x93NUMPY" + bytes([version, 0]) + length + text + data


def _archive(members: list[tuple[str, bytes]], compressed: bool) -> bytes:
    buffer = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compressed else zipfile.ZIP_STORED
    with zipfile.ZipFile(buffer, "w", compression=method) as archive:
        for name, payload in members:
            archive.writestr(name, payload)
    return buffer.getvalue()


_sizes = st.one_of(
    st.integers(min_value=-3, max_value=8),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([2**31, 2**32, 2**40, 2**62, 2**63, 2**64]),
)
_shapes = st.one_of(
    st.lists(_sizes, max_size=5).map(lambda dims: repr(tuple(dims))),
    st.sampled_from(["()", "(0x" + "f" * 5000 + ",)", "(-1, 0x" + "f" * 5000 + ")", "'x'", "[2]"]),
    st.text(max_size=8).map(repr),
)
_descrs = st.sampled_from(["<f4", "<f2", ">f8", "<i8", "|b1", "|u1", "|O", "<c8", "V3", "xx"])


@FUZZ
@given(
    st.lists(
        st.tuples(
            # zipfile cuts a name at NUL, and a name ending in / is a directory
            st.text(
                st.characters(blacklist_characters="\x00/", blacklist_categories=("Cs",)),
                max_size=5,
            ),
            _descrs,
            st.booleans(),
            _shapes,
            st.binary(max_size=64),
            st.sampled_from([1, 2]),
        ),
        max_size=3,
    ),
    st.booleans(),
)
def test_random_npy_headers(
    members: list[tuple[str, str, bool, str, bytes, int]], compressed: bool
) -> None:
    payloads = [
        (
            f"{name}.npy",
            _npy(
                f"{{'descr': {descr!r}, 'fortran_order': {fortran}, 'shape': {shape}, }}", data, v
            ),
        )
        for name, descr, fortran, shape, data, v in members
    ]
    _open_and_read(_archive(payloads, compressed))


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    _open_and_read(data)


def _valid_bytes() -> bytes:
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer,
        w=np.arange(12, dtype=np.float32).reshape(3, 4),
        f=np.asfortranarray(np.ones((2, 3))),
    )
    return buffer.getvalue()


VALID = _valid_bytes()


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6)
)
def test_byte_flips_of_a_valid_archive(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for position, value in flips:
        data[position] = value
    _open_and_read(bytes(data))


@FUZZ
@given(st.integers(min_value=0, max_value=len(VALID) - 1))
def test_every_truncation_of_a_valid_archive_is_refused(cut: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cut.npz"
        path.write_bytes(VALID[:cut])
        try:
            with open_checkpoint(str(path)) as ckpt:
                for entry in ckpt.entries():
                    for _ in ckpt.chunks(entry):
                        pass
        except CheckpointError as exc:
            assert str(exc).startswith(f"{path}: ")
            return
        raise AssertionError(f"an archive truncated to {cut} of {len(VALID)} bytes was read")


def _deflated_zeros(path: Path, shape: tuple[int, int], fortran: bool) -> None:
    """An npz of one float32 member of zeros, deflated (about 1000:1), written in pieces."""
    header = f"{{'descr': '<f4', 'fortran_order': {fortran}, 'shape': {shape}, }}"
    with (
        zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive,
        archive.open("w.npy", "w", force_zip64=True) as member,
    ):
        member.write(_npy(header, b"", 1))
        piece = bytes(16 << 20)
        for _ in range(shape[0] * shape[1] * 4 // len(piece)):
            member.write(piece)


@pytest.mark.parametrize("fortran", [True, False], ids=["fortran", "c-order"])
def test_a_large_member_is_streamed_in_either_order(tmp_path: Path, fortran: bool) -> None:
    """Issue 33, case 10: a 130 KB npz whose member claims Fortran order and 8192 x 4096
    float32 (128 MB) was held whole, twice (the issue's 8192 x 16384 took 1.17 GB)."""
    path = tmp_path / "zeros.npz"
    _deflated_zeros(path, (8192, 4096), fortran)
    body = READ_ALL + "\n    outcome['kind'] = type(ckpt.entries()[0]).__name__"
    outcome = run_bounded(str(path), body, timeout=BOUND_SECONDS * 6)
    assert outcome.other is None and outcome.error is None
    assert outcome.extra["kind"] == ("StorageOrderEntry" if fortran else "TensorEntry")
    assert outcome.seconds < BOUND_SECONDS and outcome.maxrss_mb < BOUND_MB


def test_a_large_fortran_member_gives_exact_statistics(tmp_path: Path) -> None:
    from deadweight.checkpoints.checkpoint_scan import diff_checkpoints, inspect_checkpoints
    from deadweight.checkpoints.readers import npz_file

    values = np.asfortranarray(np.arange(64 * 48, dtype=np.float32).reshape(64, 48) - 7)
    path = tmp_path / "f.npz"
    np.savez(path, w=values, c=np.ascontiguousarray(values))
    other = tmp_path / "c.npz"
    np.savez(other, w=np.ascontiguousarray(values), c=np.ascontiguousarray(values))
    limit = npz_file.FORTRAN_IN_MEMORY_BYTES
    npz_file.FORTRAN_IN_MEMORY_BYTES = 1024  # this member is larger: streamed as stored
    try:
        stats = inspect_checkpoints([str(path)])
        same = diff_checkpoints(str(path), str(path))
        mixed = diff_checkpoints(str(path), str(other))
    finally:
        npz_file.FORTRAN_IN_MEMORY_BYTES = limit
    # Both as stored, of one shape: they line up. One as stored, one in C order: they do not.
    assert same.tensors["w"].unchanged and "w" not in same.listed_only
    assert "w" in mixed.listed_only and "w" not in mixed.tensors
    (scan,) = stats.scans
    f, c = scan.tensors["w"], scan.tensors["c"]
    assert (f.min, f.max, f.nonfinite, f.zeros) == (c.min, c.max, c.nonfinite, c.zeros) == (
        -7.0, float(64 * 48 - 8), 0, 1,
    )  # fmt: skip
    assert np.isclose(f.mean, c.mean) and np.isclose(f.std, c.std)
    assert "w" not in scan.quant and "c" in scan.quant  # positions do not hold for w


@pytest.mark.parametrize(
    "names",
    [["a.npy", "a"], ["a", "a.npy"], ["a.npy", "a.npy"]],
    ids=["npy-first", "bare-first", "same"],
)
def test_two_members_naming_one_tensor_are_refused(tmp_path: Path, names: list[str]) -> None:
    """Issue 33, case 11: `a.npy` holding NaN/Inf and `a` holding zeros read as one row
    `a`, "no findings" (in the other order: "truncated archive?")."""
    bad, good = io.BytesIO(), io.BytesIO()
    np.save(bad, np.array([np.nan, np.inf, 1.0], dtype=np.float32))
    np.save(good, np.zeros(3, dtype=np.float32))
    path = tmp_path / "dup.npz"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile: "Duplicate name"
        path.write_bytes(_archive([(names[0], bad.getvalue()), (names[1], good.getvalue())], False))
    with pytest.raises(CheckpointError, match="held by more than one member: 'a'"):
        open_checkpoint(str(path))
