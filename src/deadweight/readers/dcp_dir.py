"""torch.distributed.checkpoint (DCP) directories: a `.metadata` file plus `*.distcp` shards.

Read in this one process (`no_dist=True`, no process group), one tensor at a time, so memory
stays bounded by the largest tensor.

DCP's own `FileSystemReader.read_metadata` is a plain `pickle.load` of `.metadata`: a crafted
directory would run code on open. We unpickle it with an allow-list of the types DCP writes
(dataclasses, torch.Size, dtypes, paths) and hand that metadata to DCP, so its loader never
unpickles the file itself; `unsafe_pickle=True` lifts the allow-list.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from deadweight.readers.base import (
    DEFAULT_CHUNK_BYTES,
    CheckpointError,
    ReaderBase,
    TensorEntry,
)
from deadweight.readers.torch_file import dtype_name, tensor_chunks

# DCP flattens an optimizer state dict saved under `<key>` into `<key>.state.<param>.<moment>`
# and `<key>.param_groups.<i>.<option>`.
_OPTIMIZER_STATE = re.compile(r"^(?P<key>.+?)\.state\.(?P<param>.+)\.(?P<moment>[^.]+)$")


class _RefusedGlobal(Exception):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP `.metadata` pickle legitimately references."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            # Only data classes: the filesystem module also has writers whose constructors act.
            module == "torch.distributed.checkpoint.metadata"
            and isinstance(getattr(__import__(module, fromlist=[name]), name, None), type)
        ) or (
            (module, name)
            in {
                ("torch", "Size"),
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("torch.serialization", "_get_layout"),
                ("collections", "OrderedDict"),
                ("pathlib", "PosixPath"),
                ("pathlib", "WindowsPath"),
                ("pathlib", "PurePosixPath"),
                ("pathlib", "PureWindowsPath"),
            }
        )
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise _RefusedGlobal(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: str, *, unsafe_pickle: bool) -> Any:
    metadata_path = os.path.join(path, ".metadata")
    try:
        with open(metadata_path, "rb") as fh:
            metadata = pickle.load(fh) if unsafe_pickle else _MetadataUnpickler(fh).load()
    except _RefusedGlobal as exc:
        raise CheckpointError(
            path,
            f"the DCP .metadata pickle references {exc}, which is not a DCP metadata type; loading it "
            "could run arbitrary code. Re-save the checkpoint with torch.distributed.checkpoint, or "
            "pass --unsafe-pickle if you trust it",
        ) from None
    except OSError as exc:
        raise CheckpointError(path, f"cannot open .metadata ({exc.strerror})") from None
    except Exception as exc:  # torn or foreign pickles raise anything from EOFError to TypeError
        raise CheckpointError(
            path, f"the DCP .metadata file is unreadable ({type(exc).__name__}: {exc})"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            path, f"the .metadata file holds a {type(metadata).__name__}, not DCP Metadata"
        )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


def _reader(path: str, metadata: Any) -> Any:
    """A FileSystemReader that uses our already-validated metadata instead of unpickling again."""
    from torch.distributed.checkpoint import FileSystemReader

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _Reader(path)


class DcpDirectory(ReaderBase):
    def __init__(self, path: str, *, unsafe_pickle: bool = False) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self.optimizer = None
        metadata = read_metadata(path, unsafe_pickle=unsafe_pickle)
        self._metadata = metadata
        prefixes = {
            m.group("key")
            for name in metadata.state_dict_metadata
            if (m := _OPTIMIZER_STATE.match(name)) is not None
            and any(
                k.startswith(m.group("key") + ".param_groups.")
                for k in metadata.state_dict_metadata
            )
        }
        self._entries: list[TensorEntry] = []
        self._torch_dtypes: dict[str, torch.dtype] = {}
        optimizer_tensors: list[str] = []
        for name, item in metadata.state_dict_metadata.items():
            if not isinstance(item, TensorStorageMetadata):
                continue  # bytes items: pickled non-tensor values (ints, configs)
            if any(name.startswith(p + ".state.") for p in prefixes):
                optimizer_tensors.append(name)
                continue
            self._torch_dtypes[name] = item.properties.dtype
            shape = tuple(int(d) for d in item.size)
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            itemsize = torch.empty((), dtype=item.properties.dtype).element_size()
            self._entries.append(
                TensorEntry(name, shape, dtype_name(item.properties.dtype), path, numel * itemsize)
            )

        storage = getattr(metadata, "storage_data", None) or {}
        missing = sorted(
            {
                info.relative_path
                for info in storage.values()
                if not os.path.isfile(os.path.join(path, info.relative_path))
            }
        )
        if missing:
            raise CheckpointError(
                path, f"shard file(s) missing from the DCP directory: {', '.join(missing)}"
            )
        if prefixes:
            self.optimizer = self._summarise_optimizer(
                sorted(prefixes)[0], metadata, optimizer_tensors
            )

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def _load(self, names: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp

        state: dict[str, Any] = {
            n: torch.empty(shape, dtype=dtype) for n, (shape, dtype) in names.items()
        }
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming ... a single process": that is the intent.
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(state, storage_reader=_reader(self.path, self._metadata), no_dist=True)
            except Exception as exc:
                raise CheckpointError(
                    self.path, f"reading {', '.join(names)} failed ({type(exc).__name__}: {exc})"
                ) from None
        return state

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        tensor = self._load({entry.name: (entry.shape, self._torch_dtypes[entry.name])})[entry.name]
        return tensor_chunks(tensor, entry.dtype, max_bytes)

    def _summarise_optimizer(self, key: str, metadata: Any, names: list[str]) -> dict[str, Any]:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        params: set[str] = set()
        moments: set[str] = set()
        steps: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for name in names:
            m = _OPTIMIZER_STATE.match(name)
            if m is None or m.group("key") != key:
                continue
            params.add(m.group("param"))
            if m.group("moment") == "step":
                item = metadata.state_dict_metadata[name]
                if isinstance(item, TensorStorageMetadata) and item.size.numel() == 1:
                    steps[name] = (tuple(item.size), item.properties.dtype)
            else:
                moments.add(m.group("moment"))
        # Step counters are one-element tensors: cheap to read, and the rules want the step.
        values = [float(t.item()) for t in self._load(steps).values()] if steps else []
        return {
            "key": key,
            "params_with_state": len(params),
            "step": max(values) if values else None,
            "moments": sorted(moments),
            # Options (lr, betas...) are bytes items that DCP's planner unpickles with
            # weights_only=False: reading them would run whatever pickle the directory holds.
            "param_groups": [],
        }
