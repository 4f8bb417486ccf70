"""The header parser sees untrusted bytes: whatever they are, it raises CheckpointError or reads."""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from deadweight.checkpoints.readers.safetensors_file import SAFETENSORS_DTYPES
from tests.fuzzing import FUZZ, fuzz

pytestmark = fuzz


def _open_and_read(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.safetensors"
        path.write_bytes(data)
        try:
            with open_checkpoint(str(path)) as ckpt:
                for entry in ckpt.entries():
                    # Valid headers may still claim big tensors; the file size caps what exists.
                    assert entry.nbytes <= len(data)
                    for _ in ckpt.chunks(entry, max_bytes=1 << 16):
                        pass
        except CheckpointError as exc:
            assert str(exc).startswith(f"{path}: ")


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(data: bytes) -> None:
    _open_and_read(data)


@FUZZ
@given(
    st.binary(max_size=120), st.integers(min_value=0, max_value=2**64 - 1), st.binary(max_size=64)
)
def test_random_length_field_and_header(header: bytes, length: int, tail: bytes) -> None:
    _open_and_read(struct.pack("<Q", length) + header + tail)


_numbers = st.one_of(
    st.integers(min_value=-3, max_value=64),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
_entry = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(
            st.sampled_from(sorted(SAFETENSORS_DTYPES)), st.text(max_size=5), _numbers
        ),
        "shape": st.one_of(st.lists(_numbers, max_size=4), _numbers),
        "data_offsets": st.one_of(st.lists(_numbers, max_size=3), _numbers),
    },
)
_header = st.dictionaries(
    st.text(max_size=6),
    st.one_of(_entry, _numbers, st.lists(_numbers, max_size=2)),
    max_size=5,
)


@FUZZ
@given(_header, st.integers(min_value=0, max_value=300), st.booleans())
def test_random_json_headers(
    header: dict[str, object], data_size: int, with_metadata: bool
) -> None:
    if with_metadata:
        header["__metadata__"] = {"format": "pt"}
    body = json.dumps(header).encode()
    _open_and_read(struct.pack("<Q", len(body)) + body + bytes(data_size))


def _valid_bytes() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "v.safetensors"
        save_file(
            {"w": torch.randn(4, 3), "b": torch.arange(5), "h": torch.randn(6).bfloat16()},
            str(path),
            metadata={"format": "pt"},
        )
        return path.read_bytes()


VALID = _valid_bytes()


@FUZZ
@given(st.integers(min_value=0, max_value=len(VALID) - 1))
def test_every_truncation_of_a_valid_file_is_refused(cut: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cut.safetensors"
        path.write_bytes(VALID[:cut])
        try:
            open_checkpoint(str(path))
        except CheckpointError:
            return
        raise AssertionError(f"a file truncated to {cut} of {len(VALID)} bytes was accepted")


@FUZZ
@given(
    st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=4)
)
def test_byte_flips_of_a_valid_file(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for position, value in flips:
        data[position] = value
    _open_and_read(bytes(data))
