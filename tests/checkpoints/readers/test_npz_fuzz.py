"""The npz reader sees untrusted bytes: whatever the archive and its .npy headers say, it
raises CheckpointError naming the file or reads no more than the archive stores."""

from __future__ import annotations

import io
import struct
import tempfile
import zipfile
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
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
