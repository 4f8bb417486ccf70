"""Sharded checkpoints: transformers' `*.index.json` ({"metadata": ..., "weight_map": {name: shard}}).

The shards may be safetensors or torch files (`pytorch_model.bin.index.json`); each is opened by
its own reader, and every tensor is read from the shard that holds it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from deadweight.readers.base import (
    DEFAULT_CHUNK_BYTES,
    Checkpoint,
    CheckpointError,
    ReaderBase,
    TensorEntry,
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
        try:
            by_shard: dict[str, list[str]] = {}
            for name, shard in weight_map.items():
                by_shard.setdefault(shard, []).append(name)
            for shard, names in by_shard.items():
                shard_path = os.path.join(folder, shard)
                if not os.path.isfile(shard_path):
                    problems.append(
                        f"shard {shard} is missing ({len(names)} tensor(s) mapped to it, e.g. {names[0]})"
                    )
                    continue
                try:
                    reader = open_shard(shard_path)
                except CheckpointError as exc:
                    problems.append(f"shard {shard} is unreadable: {exc.problem}")
                    continue
                self._shards[shard_path] = reader
                held = {e.name for e in reader.entries()}
                absent = [n for n in names if n not in held]
                if absent:
                    shown = ", ".join(absent[:5]) + (
                        f" and {len(absent) - 5} more" if len(absent) > 5 else ""
                    )
                    problems.append(
                        f"shard {shard} does not hold {shown}, which the weight_map maps to it"
                    )
            if problems:
                raise CheckpointError.listing(path, problems)
        except BaseException:
            self.close()
            raise
        # File order: shard by shard in the order the index first names them, each shard's own order.
        self._entries = [
            e
            for shard_path, reader in self._shards.items()
            for e in reader.entries()
            if e.name in weight_map and os.path.join(folder, weight_map[e.name]) == shard_path
        ]

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


def _read_weight_map(path: str) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as fh:
            index: Any = json.load(fh)
    except OSError as exc:
        raise CheckpointError(path, f"cannot open ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(path, f"the index is not valid JSON ({exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(
            path,
            'the index has no "weight_map" object of tensor name -> shard file (not a sharded checkpoint index?)',
        )
    escaping = sorted(
        {
            v
            for v in weight_map.values()
            if os.path.isabs(v) or ".." in v.replace("\\", "/").split("/")
        }
    )
    if escaping:
        raise CheckpointError(
            path,
            f"the weight_map names shard files outside the index's directory: {', '.join(escaping[:5])}",
        )
    return weight_map
