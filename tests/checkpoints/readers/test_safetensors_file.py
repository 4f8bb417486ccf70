from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from deadweight.checkpoints.readers import CheckpointError, open_checkpoint
from deadweight.checkpoints.readers.safetensors_file import HUGE_PAGE
from tests.checkpoints.readers.bounded import run_bounded

ALL_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape) * 3).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, dtype=dtype)


def reference(t: torch.Tensor) -> np.ndarray:
    """The slow reference: torch's own conversion."""
    if t.dtype == torch.float64:
        return t.numpy()
    if t.is_floating_point():
        return t.float().numpy()
    return t.numpy()


def raw_file(
    path: Path, header: object, data: bytes = b"", *, header_bytes: bytes | None = None
) -> str:
    body = header_bytes if header_bytes is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return str(path)


def test_round_trip_every_dtype_matches_safetensors_loader(tmp_path: Path) -> None:
    tensors = {
        f"layer.{i}.{str(d).removeprefix('torch.')}": sample(d, (3, 5))
        for i, d in enumerate(ALL_DTYPES)
    }
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 4)
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path)
    expected = load_file(path)
    with open_checkpoint(path) as ckpt:
        entries = ckpt.entries()
        assert {e.name for e in entries} == set(tensors)
        assert ckpt.optimizer is None
        for entry in entries:
            t = expected[entry.name]
            assert entry.shape == tuple(t.shape)
            assert entry.dtype == str(t.dtype).removeprefix("torch.")
            assert entry.nbytes == t.numel() * t.element_size()
            assert entry.file == path
            assert entry.is_float == t.is_floating_point()
            got = ckpt.array(entry)
            want = reference(t)
            assert got.dtype == want.dtype, entry.name
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_entries_come_in_file_order(tmp_path: Path) -> None:
    path = str(tmp_path / "m.safetensors")
    save_file({"b": torch.zeros(2), "a": torch.zeros(3)}, path)
    with open_checkpoint(path) as ckpt:
        starts = [e.name for e in ckpt.entries()]
    # safetensors sorts by dtype then name when writing; whatever it chose, we follow the offsets.
    header = json.loads(
        Path(path).read_bytes()[8 : 8 + struct.unpack("<Q", Path(path).read_bytes()[:8])[0]]
    )
    header.pop("__metadata__", None)
    assert starts == sorted(header, key=lambda n: header[n]["data_offsets"][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64])
def test_tensor_larger_than_max_bytes_comes_in_several_chunks(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    t = sample(dtype, (1000, 37))
    path = str(tmp_path / "big.safetensors")
    save_file({"w": t, "after": torch.ones(3)}, path)
    with open_checkpoint(path) as ckpt:
        entry = next(e for e in ckpt.entries() if e.name == "w")
        chunks = [c.copy() for c in ckpt.chunks(entry, max_bytes=4096)]
    assert len(chunks) == -(-t.numel() * (8 if dtype == torch.int64 else 4) // 4096)
    assert all(c.nbytes <= 4096 and c.ndim == 1 for c in chunks)
    np.testing.assert_array_equal(np.concatenate(chunks), reference(t).reshape(-1))


def test_fp8_table_covers_every_bit_pattern(tmp_path: Path) -> None:
    bits = torch.arange(256, dtype=torch.uint8)
    path = str(tmp_path / "fp8.safetensors")
    save_file(
        {
            "e4m3": bits.clone().view(torch.float8_e4m3fn),
            "e5m2": bits.clone().view(torch.float8_e5m2),
        },
        path,
    )
    with open_checkpoint(path) as ckpt:
        for entry in ckpt.entries():
            want = bits.view(getattr(torch, entry.dtype)).float().numpy()
            np.testing.assert_array_equal(ckpt.array(entry), want)  # NaNs compare equal here


def _valid(tmp_path: Path) -> str:
    path = str(tmp_path / "ok.safetensors")
    save_file(
        {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 2, dtype=torch.float16)},
        path,
    )
    return path


def _problem(path: str) -> str:
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    assert str(info.value).startswith(f"{path}: ")
    return str(info.value)


def test_empty_and_short_files(tmp_path: Path) -> None:
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    assert "empty" in _problem(str(empty))
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\x01\x02\x03")
    assert "shorter than the 8-byte header length" in _problem(str(short))


def test_header_length_beyond_file_and_absurd(tmp_path: Path) -> None:
    beyond = tmp_path / "beyond.safetensors"
    beyond.write_bytes(struct.pack("<Q", 1000) + b"{}")
    assert "runs past the end of the 10-byte file" in _problem(str(beyond))
    absurd = tmp_path / "absurd.safetensors"
    absurd.write_bytes(struct.pack("<Q", 2**63) + b"{}")
    assert "over the 100 MB" in _problem(str(absurd))


def test_header_not_json_or_not_object(tmp_path: Path) -> None:
    assert "not valid JSON" in _problem(
        raw_file(tmp_path / "a.safetensors", None, header_bytes=b"{nope")
    )
    assert "not valid JSON" in _problem(
        raw_file(tmp_path / "b.safetensors", None, header_bytes=b"\xff\xfe")
    )
    assert "JSON list, not an object" in _problem(raw_file(tmp_path / "c.safetensors", [1, 2]))
    dup = b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "a": {}}'
    assert "duplicate key 'a'" in _problem(
        raw_file(tmp_path / "d.safetensors", None, dup, header_bytes=dup)
    )


def test_every_problem_is_listed_in_one_error(tmp_path: Path) -> None:
    header = {
        "unknown": {"dtype": "F7", "shape": [1], "data_offsets": [0, 4]},
        "mismatch": {"dtype": "F32", "shape": [3], "data_offsets": [4, 12]},
        "badshape": {"dtype": "F32", "shape": [-1], "data_offsets": [12, 16]},
        "outside": {"dtype": "F32", "shape": [246], "data_offsets": [16, 1000]},
        "badoffsets": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]},
        "notobject": 3,
    }
    message = _problem(raw_file(tmp_path / "bad.safetensors", header, bytes(20)))
    assert "unknown: unknown dtype 'F7'" in message
    assert (
        "mismatch: shape [3] of float32 needs 12 bytes but data_offsets [4, 12] span 8" in message
    )
    assert "badshape: shape [-1] is not a list of non-negative integers" in message
    assert "outside: data_offsets [16, 1000] run past the 20-byte data section" in message
    assert "badoffsets: data_offsets [8, 4]" in message
    assert "notobject: entry is not an object" in message


def test_overlap_gap_and_trailing_data(tmp_path: Path) -> None:
    overlap = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    assert "b: bytes 4..12 overlap a" in _problem(
        raw_file(tmp_path / "o.safetensors", overlap, bytes(12))
    )
    gap = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
    }
    assert "bytes 4..8 of the data section are not covered" in _problem(
        raw_file(tmp_path / "g.safetensors", gap, bytes(12))
    )
    trailing = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    assert (
        "bytes 4..9 of the data section are not covered by any tensor (trailing data)"
        in _problem(raw_file(tmp_path / "t.safetensors", trailing, bytes(9)))
    )


def test_truncated_valid_file_names_the_file(tmp_path: Path) -> None:
    path = _valid(tmp_path)
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:-3])
    assert "run past" in _problem(path)


def test_metadata_is_kept_and_not_an_entry(tmp_path: Path) -> None:
    path = str(tmp_path / "meta.safetensors")
    save_file({"a": torch.ones(1)}, path, metadata={"format": "pt"})
    with open_checkpoint(path) as ckpt:
        assert [e.name for e in ckpt.entries()] == ["a"]
        assert getattr(ckpt, "metadata", None) == {"format": "pt"}


def test_file_changed_after_open_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = _valid(tmp_path)
    with open_checkpoint(path) as ckpt:
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[:-8])
        with pytest.raises(CheckpointError, match="ended early"):
            for entry in ckpt.entries():
                ckpt.array(entry)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_stays_bounded_by_max_bytes(tmp_path: Path, dtype: torch.dtype) -> None:
    import tracemalloc

    path = str(tmp_path / "big.safetensors")
    save_file({"w": torch.randn(2048, 1024).to(dtype)}, path)  # 4 or 8 MB
    with open_checkpoint(path) as ckpt:
        (entry,) = ckpt.entries()
        tracemalloc.start()
        total = 0.0
        for chunk in ckpt.chunks(entry, max_bytes=64 << 10):
            total += float(chunk.sum(dtype=np.float64))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 1 << 20, f"peak {peak} bytes for 64 KB chunks"
    assert total == pytest.approx(float(load_file(path)["w"].double().sum()), rel=1e-6)


def _resident_file_kb() -> int:
    status = Path("/proc/self/status")
    if not status.exists():
        pytest.skip("needs /proc/self/status (Linux)")
    line = next(li for li in status.read_text().splitlines() if li.startswith("RssFile:"))
    return int(line.split()[1])


def test_a_read_stopped_early_drops_its_window(tmp_path: Path) -> None:
    # A consumer that stops reading (a selection pass that found its element) drops the
    # generator: the window it held must leave the process's resident memory too, or
    # every early stop leaves one window behind for the rest of the scan.
    path = str(tmp_path / "big.safetensors")
    save_file({"w": torch.randn(8 << 20)}, path)  # 32 MB
    with open_checkpoint(path) as ckpt:
        (entry,) = ckpt.entries()
        chunks = ckpt.chunks(entry, max_bytes=32 << 20)
        first = next(chunks)
        assert float(first.sum(dtype=np.float64)) != 0.0  # every page touched
        held = _resident_file_kb()
        del first
        chunks.close()
        dropped = held - _resident_file_kb()
    assert dropped > 24 << 10, f"only {dropped} KB of the 32 MB window left"


def test_droppable_spans_whole_huge_pages_only(tmp_path: Path) -> None:
    # A thread drops the pages of its piece of a chunk as it finishes (droppable gives
    # them): only the 2 MB pieces of the address space wholly inside the piece, so that a
    # huge page the neighbouring piece still reads is never split (SafetensorsFile._drop).
    path = str(tmp_path / "big.safetensors")
    save_file({"w": torch.randn(8 << 20)}, path)  # 32 MB
    with open_checkpoint(path) as ckpt:
        (entry,) = ckpt.entries()
        (chunk,) = ckpt.raw_chunks(entry, entry.numel)
        mb = (1 << 20) // chunk.itemsize  # elements per MB
        boundary = -(-chunk.ctypes.data // HUGE_PAGE) * HUGE_PAGE  # the first in the chunk
        start = (boundary - chunk.ctypes.data + (HUGE_PAGE >> 2)) // chunk.itemsize
        # 1.5 MB from a quarter into a huge page: none whole; 8 MB: the next three
        at = chunk.ctypes.data + start * chunk.itemsize
        assert ckpt.droppable(entry, at, (mb + mb // 2) * chunk.itemsize) is None
        assert ckpt.droppable(entry, at, 8 * mb * chunk.itemsize) == (
            boundary + HUGE_PAGE,
            3 * HUGE_PAGE,
        )
        copy = chunk[start : start + 8 * mb].copy()
        assert ckpt.droppable(entry, copy.ctypes.data, copy.nbytes) is None
        del chunk


# Hostile headers: time and memory follow the bytes stored, never what a header claims.


def _header_file(path: Path, parts: list[bytes], data: bytes = b"") -> str:
    """A safetensors file whose header is the concatenation of `parts`, written piece by
    piece (a 96 MB header built as one list of small bytes would take gigabytes here)."""
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", sum(map(len, parts))))
        for part in parts:
            fh.write(part)
        fh.write(data)
    return str(path)


def _members(fmt: bytes, n: int, per_part: int = 100_000) -> list[bytes]:
    """`fmt % i` for i < n joined by commas, in parts of `per_part` members."""
    parts = []
    for start in range(0, n, per_part):
        stop = min(n, start + per_part)
        parts.append((b"," if start else b"") + b",".join(fmt % i for i in range(start, stop)))
    return parts


@pytest.mark.parametrize("digits", [4000, 21])
def test_an_integer_of_more_than_20_digits_is_refused(tmp_path: Path, digits: int) -> None:
    # The reported case, 1000 integers of 4000 digits (4 MB, under Python's 4300-digit
    # limit), took minutes to multiply out; any integer over 2**64's 20 digits is refused.
    count = 1000 if digits == 4000 else 1
    shape = b",".join([b"9" * digits] * count)
    header = b'{"x":{"dtype":"F32","shape":[' + shape + b'],"data_offsets":[0,4]}}'
    outcome = run_bounded(_header_file(tmp_path / "d.safetensors", [header], bytes(4)))
    assert outcome.other is None and outcome.error is not None
    assert len(outcome.error) < 1000
    if count == 1:
        assert "x: an integer literal of 21 digits" in outcome.error


def test_a_shape_is_multiplied_out_only_while_it_could_fit(tmp_path: Path) -> None:
    shape = b",".join([b"2"] * 1000)
    header = b'{"x":{"dtype":"F32","shape":[' + shape + b'],"data_offsets":[0,4]}}'
    message = _problem(_header_file(tmp_path / "twos.safetensors", [header], bytes(4)))
    assert "needs more than the 4-byte data section holds" in message
    assert len(message) < 1000  # the shape is quoted cut short, not in full


def test_a_million_twos_take_no_time(tmp_path: Path) -> None:
    # 2 MB of twos: their product took minutes (quadratic in its 2 million bits).
    header = b'{"x":{"dtype":"F32","shape":[' + b",".join([b"2"] * 1_000_000)
    path = _header_file(tmp_path / "t.safetensors", [header, b'],"data_offsets":[0,4]}}'])
    outcome = run_bounded(path, timeout=60)
    assert outcome.other is None and outcome.error is not None


_HEADERS = {
    # json.loads made 2.8 GB of Python objects of this one.
    "objects in a shape": [b'{"x":{"dtype":"F32","shape":[', b"{}," * 31_000_000, b"{}]}}"],
    # 5.6 GB, with a 96 MB error message.
    "tiny top-level entries": [b"{", *_members(b'"%x":{}', 8_000_000), b"}"],
    "tiny metadata pairs": [b'{"__metadata__":{', *_members(b'"%x":""', 8_000_000), b"}}"],
}


@pytest.mark.parametrize("kind", list(_HEADERS))
def test_a_96_mb_header_of_tiny_json_values_takes_bounded_memory(tmp_path: Path, kind: str) -> None:
    # Each entry is now decoded on its own (at most 64 KiB of it), metadata is validated
    # without being kept, and reading stops after 20 problems.
    parts = _HEADERS[kind]
    assert 90e6 < sum(map(len, parts)) < 100e6  # just under safetensors' 100 MB limit
    path = _header_file(tmp_path / "tiny.safetensors", parts)
    # Reading 96 MB and decoding it to text takes about 300 MB; the old parser ran out of
    # the 2 GB of address space given past the imports.
    outcome = run_bounded(path, timeout=300, memory=2 << 30)
    assert outcome.other is None, outcome.other
    assert outcome.maxrss_mb < 700
    if kind != "tiny metadata pairs":  # a valid file of no tensors
        assert outcome.error is not None and len(outcome.error) < 5000


def test_metadata_is_decoded_when_asked_for(tmp_path: Path) -> None:
    path = str(tmp_path / "m.safetensors")
    save_file({"a": torch.ones(1)}, path, metadata={"format": "pt", "note": "x" * 1000})
    with open_checkpoint(path) as ckpt:
        assert ckpt.metadata == {"format": "pt", "note": "x" * 1000}  # type: ignore[attr-defined]


def test_a_nested_header_value_is_refused_with_one_line(tmp_path: Path) -> None:
    nested = b'{"x":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}}'
    message = _problem(_header_file(tmp_path / "n.safetensors", [nested], bytes(4)))
    assert "nests objects or lists" in message and "not a safetensors header" in message


def test_many_broken_entries_list_twenty_and_stop(tmp_path: Path) -> None:
    body = json.dumps({f"t{i}": {"dtype": "F7"} for i in range(10_000)}).encode()
    message = _problem(_header_file(tmp_path / "many.safetensors", [body]))
    assert message.count("unknown dtype") == 7  # three problems each, twenty listed
    assert message.endswith("and more (the header was read no further)")
