"""Checkpoint readers: one module per format behind one small interface.

`open_checkpoint(path)` returns a `Checkpoint` whatever the format: its `entries()` describe the
model tensors and `chunks()` streams their values with bounded memory.
"""

from __future__ import annotations

import os

from deadweight.readers.base import Checkpoint, CheckpointError, TensorEntry
from deadweight.readers.discovery import find_checkpoints, natural_key, step_of

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "TensorEntry",
    "find_checkpoints",
    "natural_key",
    "open_checkpoint",
    "step_of",
]


def open_checkpoint(path: str | os.PathLike[str], *, unsafe_pickle: bool = False) -> Checkpoint:
    """Open a checkpoint file, sharded index json or DCP directory; raises CheckpointError."""
    name = os.fspath(path)
    if os.path.isdir(name):
        if os.path.isfile(os.path.join(name, ".metadata")):
            from deadweight.readers.dcp_dir import DcpDirectory

            return DcpDirectory(name, unsafe_pickle=unsafe_pickle)
        raise CheckpointError(
            name,
            "is a directory without a DCP .metadata file; name the checkpoint files in it (find_checkpoints does)",
        )
    if not os.path.exists(name):
        raise CheckpointError(name, "no such file or directory")
    if name.endswith(".json"):
        from deadweight.readers.sharded_index import ShardedCheckpoint

        return ShardedCheckpoint(
            name, lambda shard: open_checkpoint(shard, unsafe_pickle=unsafe_pickle)
        )
    if name.endswith(".safetensors"):
        from deadweight.readers.safetensors_file import SafetensorsFile

        return SafetensorsFile(name)
    if name.endswith(".npz"):
        from deadweight.readers.npz_file import NpzFile

        return NpzFile(name)
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        from deadweight.readers.torch_file import TorchFile

        return TorchFile(name, unsafe_pickle=unsafe_pickle)
    raise CheckpointError(
        name,
        "unknown checkpoint format (expected .safetensors, .pt, .pth, .bin, .ckpt, .npz, an *.index.json or a DCP directory)",
    )
