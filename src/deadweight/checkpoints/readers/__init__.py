"""Checkpoint readers: one module per format behind one small interface.

`open_checkpoint(path)` returns a `Checkpoint` whatever the format: its `entries()` describe the
model tensors and `chunks()` streams their values with bounded memory.
"""

from __future__ import annotations

import os
import stat

from deadweight.checkpoints.readers.base import (
    PASS_THROUGH,
    Checkpoint,
    CheckpointError,
    GuardedCheckpoint,
    TensorEntry,
    not_regular,
    reading_error,
)
from deadweight.checkpoints.readers.discovery import find_checkpoints, natural_key, step_of

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
    """Open a checkpoint file, sharded index json or DCP directory; raises CheckpointError.

    Whatever a reader raises, opening the file or later reading it (a ValueError from
    numpy, a RecursionError, a MemoryError, torch's BaseException-derived
    CheckpointException), comes out as one CheckpointError naming the file: the caller
    reports it and goes on with the other files. Interrupts and exits pass through."""
    name = os.fspath(path)
    try:
        reader = _open_reader(name, unsafe_pickle)
    except CheckpointError:
        raise
    except PASS_THROUGH:
        raise
    except BaseException as exc:
        raise reading_error(name, exc) from None
    return GuardedCheckpoint(reader)


def _open_reader(name: str, unsafe_pickle: bool) -> Checkpoint:
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError:
        raise CheckpointError(name, "no such file or directory") from None
    except OSError as exc:
        raise CheckpointError(name, f"cannot open ({exc.strerror})") from None
    if stat.S_ISDIR(mode):
        if os.path.isfile(os.path.join(name, ".metadata")):
            from deadweight.checkpoints.readers.dcp_dir import DcpDirectory

            return DcpDirectory(name, unsafe_pickle=unsafe_pickle)
        raise CheckpointError(
            name,
            "is a directory without a DCP .metadata file; name the checkpoint files in it (find_checkpoints does)",
        )
    # Checked here for every format, torch's included: a FIFO would hang the reader's
    # open() until a writer came, a device such as /dev/zero never ends.
    if not stat.S_ISREG(mode):
        raise CheckpointError(name, not_regular(mode))
    if name.endswith(".json"):
        from deadweight.checkpoints.readers.sharded_index import ShardedCheckpoint

        return ShardedCheckpoint(
            name, lambda shard: open_checkpoint(shard, unsafe_pickle=unsafe_pickle)
        )
    if name.endswith(".safetensors"):
        from deadweight.checkpoints.readers.safetensors_file import SafetensorsFile

        return SafetensorsFile(name)
    if name.endswith(".npz"):
        from deadweight.checkpoints.readers.npz_file import NpzFile

        return NpzFile(name)
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        from deadweight.checkpoints.readers.torch_file import TorchFile

        return TorchFile(name, unsafe_pickle=unsafe_pickle)
    raise CheckpointError(
        name,
        "unknown checkpoint format (expected .safetensors, .pt, .pth, .bin, .ckpt, .npz, an *.index.json or a DCP directory)",
    )
