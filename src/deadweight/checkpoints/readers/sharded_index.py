"""Sharded checkpoints: transformers' `*.index.json` ({"metadata": ..., "weight_map": {name: shard}}).

The shards may be safetensors or torch files (`pytorch_model.bin.index.json`); each is opened by
its own reader, and every tensor is read from the shard that holds it. A shard must stay inside
the index's folder, symbolic links resolved; one physical file named several ways (links,
`./` prefixes) is opened and listed once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from deadweight.bounded_json import containers as count_containers
from deadweight.checkpoints.readers.base import (
    DEFAULT_CHUNK_BYTES,
    MAX_LISTED_PROBLEMS,
    Checkpoint,
    CheckpointError,
    ReaderBase,
    TensorEntry,
    bounded_int,
    inside_folder,
    open_regular,
    physical_file,
    shorten,
)


class ShardedCheckpoint(ReaderBase):
    """Every shard named by the index, validated together; one error lists all problems."""

    def __init__(self, path: str, open_shard: Callable[[str], Checkpoint]) -> None:
        self.path = path
        self.optimizer = None
        weight_map = _read_weight_map(path)
        folder = os.path.dirname(path)
        problems: list[str] = []
        self._shards: dict[str, Checkpoint] = {}
        self._held_names: dict[str, set[str]] = {}
        try:
            by_shard: dict[str, list[str]] = {}
            for name, shard in weight_map.items():
                by_shard.setdefault(shard, []).append(name)
            # Every name of one physical file (links, `./` prefixes) is read as one shard.
            opened: dict[tuple[int, int], str] = {}
            # shard as the index names it -> the path its tensors are read from
            self._read_from: dict[str, str] = {}
            escaping: list[str] = []
            for shard, names in by_shard.items():
                if len(problems) >= MAX_LISTED_PROBLEMS:
                    problems.append("and more (the other shards were not opened)")
                    break
                label = shorten(shard)
                shard_path = inside_folder(folder, shard)
                if shard_path is None:
                    escaping.append(label)
                    continue
                if shard.endswith(".json"):
                    # transformers never nests indexes; opening one from here could recurse
                    # (an index naming itself) and repeat its error at every level.
                    problems.append(
                        f"shard {label} is itself an index (.json), not a weight file "
                        f"({len(names)} tensor(s) mapped to it, e.g. {shorten(names[0])})"
                    )
                    continue
                key = physical_file(shard_path) if os.path.isfile(shard_path) else None
                if key is None:
                    problems.append(
                        f"shard {label} is missing ({len(names)} tensor(s) mapped to it, e.g. {shorten(names[0])})"
                    )
                    continue
                if key not in opened:
                    try:
                        reader = open_shard(shard_path)
                    except CheckpointError as exc:
                        problems.append(f"shard {label} is unreadable: {shorten(exc.problem, 300)}")
                        continue
                    opened[key] = shard_path
                    self._shards[shard_path] = reader
                first = opened[key]
                self._read_from[shard] = first
                held = self._held(first)
                absent = [n for n in names if n not in held]
                if absent:
                    shown = ", ".join(shorten(n) for n in absent[:5]) + (
                        f" and {len(absent) - 5} more" if len(absent) > 5 else ""
                    )
                    problems.append(
                        f"shard {label} does not hold {shown}, which the weight_map maps to it"
                    )
            if escaping:
                problems.insert(
                    0,
                    "the weight_map names shard files outside the index's directory (a path "
                    f"or a symbolic link that leaves it): {', '.join(escaping[:5])}"
                    + (f" and {len(escaping) - 5} more" if len(escaping) > 5 else ""),
                )
            if problems:
                raise CheckpointError(path, "; ".join(problems))
        except BaseException:
            self.close()
            raise
        # File order: shard by shard in the order the index first names them, each shard's own order.
        self._entries = [
            e
            for shard_path, reader in self._shards.items()
            for e in reader.entries()
            if e.name in weight_map and self._read_from[weight_map[e.name]] == shard_path
        ]

    def _held(self, shard_path: str) -> set[str]:
        """The tensor names a shard holds, listed once however many names the shard has."""
        if shard_path not in self._held_names:
            self._held_names[shard_path] = {e.name for e in self._shards[shard_path].entries()}
        return self._held_names[shard_path]

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        return self._shards[entry.file].chunks(entry, max_bytes)

    def raw_chunks(self, entry: TensorEntry, max_elements: int) -> Iterator[np.ndarray]:
        return self._shards[entry.file].raw_chunks(entry, max_elements)

    def droppable(self, entry: TensorEntry, address: int, nbytes: int) -> tuple[int, int] | None:
        return self._shards[entry.file].droppable(entry, address, nbytes)

    def array(self, entry: TensorEntry) -> np.ndarray:
        return self._shards[entry.file].array(entry)

    def close(self) -> None:
        for reader in self._shards.values():
            reader.close()


# The largest index worth reading: it names each tensor once (~100 bytes each), so 100 MB,
# the limit safetensors puts on a header, is a million tensors; past it is not an index.
MAX_INDEX_BYTES = 100_000_000
# The most JSON objects and lists an index may hold: transformers writes three.
MAX_INDEX_CONTAINERS = 1000


def _read_weight_map(path: str) -> dict[str, str]:
    with open_regular(path) as fh:  # a FIFO or /dev/zero is refused, never read
        size = os.fstat(fh.fileno()).st_size
        if size > MAX_INDEX_BYTES:
            raise CheckpointError(
                path, f"is {size} bytes, over the {MAX_INDEX_BYTES} an index can be (not an index?)"
            )
        raw = fh.read(MAX_INDEX_BYTES + 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            path, f"the index is not valid JSON ({shorten(str(exc), 200)})"
        ) from None
    # An index is an object holding two: metadata and weight_map. Decoding a list of a million
    # empty objects would take 24 times its size, so count the containers first (outside
    # strings, in one pass) and refuse a file of thousands.
    containers = count_containers(text)
    if containers > MAX_INDEX_CONTAINERS:
        raise CheckpointError(
            path,
            f"holds {containers} JSON objects and lists; an index holds a few (not an index?)",
        )
    try:
        # parse_int: no integer of thousands of digits to convert (quadratic in its length).
        index: Any = json.loads(text, parse_int=bounded_int)
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(
            path, f"the index is not valid JSON ({shorten(str(exc), 200)})"
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            path,
            'the index has no "weight_map" object of tensor name -> shard file (not a sharded checkpoint index?)',
        )
    return weight_map
