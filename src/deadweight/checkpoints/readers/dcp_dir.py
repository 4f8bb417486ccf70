"""torch.distributed.checkpoint (DCP) directories: a `.metadata` file plus `*.distcp` shards.

Read in this one process (`no_dist=True`, no process group), one tensor at a time, so memory
stays bounded by the largest tensor.

DCP's own `FileSystemReader.read_metadata` is a plain `pickle.load` of `.metadata`: a crafted
directory would run code on open. We unpickle it with an allow-list of the types DCP writes
(dataclasses, torch.Size, dtypes, paths) and hand that metadata to DCP, so its loader never
unpickles the file itself; `unsafe_pickle=True` lifts the allow-list for a `.metadata` the
allow-list refuses (and a note says its pickle ran). Tensors in the shards are always read
with torch's `weights_only` unpickler.

Every path the metadata names stays inside the directory (same policy as a sharded index:
no absolute paths, no `..`, and no symlink that resolves outside; any object the pickle puts
there is reduced to a plain str first, and DCP is given that str), and no tensor is given
more memory than its shards store: a hostile `.metadata` can claim any shape.
"""

from __future__ import annotations

import math
import os
import pickle
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from deadweight.checkpoints.readers.base import (
    DEFAULT_CHUNK_BYTES,
    CheckpointError,
    ReaderBase,
    TensorEntry,
    inside_folder,
    plain_path,
    shorten,
)
from deadweight.checkpoints.readers.notes import note
from deadweight.checkpoints.readers.torch_file import (
    UnmeasuredEntry,
    dtype_name,
    first_line,
    ran_pickle_note,
    tensor_chunks,
)

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


_REFUSAL = (
    "the DCP .metadata pickle references {}, which is not a DCP metadata type; loading it "
    "could run arbitrary code. Re-save the checkpoint with torch.distributed.checkpoint, or "
    "pass --unsafe-pickle if you trust it"
)


def read_metadata(path: str, *, unsafe_pickle: bool, notes: list[str] | None = None) -> Any:
    metadata_path = os.path.join(path, ".metadata")
    if inside_folder(path, ".metadata") is None or not os.path.isfile(metadata_path):
        raise CheckpointError(path, "the .metadata file is not a regular file inside the directory")
    try:
        with open(metadata_path, "rb") as fh:
            try:
                metadata = _MetadataUnpickler(fh).load()
            except _RefusedGlobal as exc:
                if not unsafe_pickle:
                    raise CheckpointError(path, _REFUSAL.format(exc)) from None
                # The user's opt-in, only because the allow-list refused this file: noted
                # before the pickle runs, so that the note stands whatever it does.
                text = ran_pickle_note(os.path.join(path, ".metadata"))
                if notes is not None:
                    notes.append(text)
                note(text)
                fh.seek(0)
                metadata = pickle.load(fh)
    except CheckpointError:
        raise
    except OSError as exc:
        raise CheckpointError(path, f"cannot open .metadata ({exc.strerror})") from None
    except KeyboardInterrupt:
        raise
    except (
        BaseException
    ) as exc:  # torn or foreign pickles raise anything from EOFError to TypeError
        raise CheckpointError(
            path, f"the DCP .metadata file is unreadable ({first_line(exc)})"
        ) from None
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            path, f"the .metadata file holds a {type(metadata).__name__}, not DCP Metadata"
        )
    if not isinstance(getattr(metadata, "storage_meta", None), StorageMeta):
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
        self.path = path
        self.optimizer = None
        self.notes: list[str] = []
        metadata = read_metadata(path, unsafe_pickle=unsafe_pickle, notes=self.notes)
        self._metadata = metadata
        try:
            optimizer_tensors = self._list(metadata)
            if self._prefixes:
                key = sorted(self._prefixes)[0]
                self.optimizer = self._summarise_optimizer(key, metadata, optimizer_tensors)
        except CheckpointError:
            raise
        except Exception as exc:  # a Metadata whose fields are not what DCP writes
            raise CheckpointError(
                path, f"the DCP .metadata does not describe a checkpoint ({first_line(exc)})"
            ) from None

    def _list(self, metadata: Any) -> list[str]:
        """Fill the entries from validated metadata; returns the optimizer's tensor names."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        path = self.path
        items = metadata.state_dict_metadata
        if not isinstance(items, dict) or not all(isinstance(k, str) for k in items):
            raise CheckpointError(path, "the .metadata has no table of tensor names")
        self._prefixes = {
            m.group("key")
            for name in items
            if (m := _OPTIMIZER_STATE.match(name)) is not None
            and any(k.startswith(m.group("key") + ".param_groups.") for k in items)
        }
        stored, problems = self._stored_bytes(metadata)
        if problems:
            raise CheckpointError.listing(path, problems)
        self._entries: list[TensorEntry] = []
        self._torch_dtypes: dict[str, torch.dtype] = {}
        optimizer_tensors: list[str] = []
        for name, item in items.items():
            if not isinstance(item, TensorStorageMetadata):
                continue  # bytes items: pickled non-tensor values (ints, configs)
            dtype = item.properties.dtype
            shape = _shape(item.size)
            if not isinstance(dtype, torch.dtype) or shape is None:
                raise CheckpointError(path, f"{name}: the .metadata gives no valid shape and dtype")
            if any(name.startswith(p + ".state.") for p in self._prefixes):
                optimizer_tensors.append(name)
                continue
            self._torch_dtypes[name] = dtype
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            reason = _unreadable(item, shape, nbytes, stored.get(name))
            if reason is None:
                self._entries.append(TensorEntry(name, shape, dtype_name(dtype), path, nbytes))
            else:
                text = f"{path}: {name}: {reason}"
                self.notes.append(text)
                note(text)
                self._entries.append(
                    UnmeasuredEntry(name, shape, dtype_name(dtype), path, nbytes, reason)
                )
        return optimizer_tensors

    def _stored_bytes(self, metadata: Any) -> tuple[dict[str, int | None], list[str]]:
        """Bytes the shards store per tensor (None where a transform, e.g. compression, makes
        the stored size no bound on the tensor's), and every path that is not a regular file
        inside the directory.

        The shard table is rebuilt from plain values: each path the pickle holds is reduced
        to a str, checked, and that str is what DCP is given to open (a pathlib object in a
        hostile pickle can show one name and open another)."""
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        storage = getattr(metadata, "storage_data", None) or {}
        if not isinstance(storage, dict):
            raise CheckpointError(self.path, "the .metadata has no table of shard files")
        stored: dict[str, int | None] = {}
        escaping: set[str] = set()
        missing: set[str] = set()
        checked: dict[str, str | None] = {}
        sizes: dict[str, int] = {}
        rebuilt: dict[Any, Any] = {}
        for index, info in storage.items():
            text = plain_path(getattr(info, "relative_path", None))
            if text is None:
                escaping.add(f"a {type(getattr(info, 'relative_path', None)).__name__}, not a path")
                continue
            if text not in checked:
                checked[text] = inside_folder(self.path, text)
            shard = checked[text]
            if shard is None:
                escaping.add(shorten(text, 200))
            elif not os.path.isfile(shard):
                missing.add(shorten(text, 200))
            fqn = getattr(index, "fqn", None)
            length, offset = getattr(info, "length", None), getattr(info, "offset", None)
            transforms = getattr(info, "transform_descriptors", None)
            if not (
                isinstance(fqn, str)
                and type(length) is int
                and type(offset) is int
                and (transforms is None or isinstance(transforms, (list, tuple)))
            ):
                raise CheckpointError(self.path, "the .metadata's shard table is malformed")
            rebuilt[index] = _StorageInfo(text, offset, length, transforms)
            # What the file holds there, whatever the metadata claims.
            size = sizes.setdefault(shard, _file_size(shard)) if shard is not None else 0
            length = max(0, min(length, size - offset)) if offset >= 0 else 0
            if transforms:
                stored[fqn] = None
            elif fqn not in stored or stored[fqn] is not None:
                stored[fqn] = (stored.get(fqn) or 0) + length
        metadata.storage_data = rebuilt
        problems = []
        if escaping:
            problems.append(
                "the .metadata names shard files outside the DCP directory: "
                + ", ".join(sorted(escaping)[:5])
            )
        if missing:
            problems.append(
                f"shard file(s) missing from the DCP directory: {', '.join(sorted(missing)[:5])}"
            )
        return stored, problems

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def _load(self, names: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        # zeros, not empty: chunks the shards do not cover must not show leftover memory.
        state: dict[str, Any] = {
            n: torch.zeros(shape, dtype=dtype) for n, (shape, dtype) in names.items()
        }
        with warnings.catch_warnings():
            # "torch.distributed is ... uninitialized, assuming ... a single process": that is the intent.
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp.load(state, storage_reader=_reader(self.path, self._metadata), no_dist=True)
            except (Exception, CheckpointException) as exc:
                # CheckpointException is a BaseException wrapping each rank's failure.
                raise CheckpointError(
                    self.path, f"reading {', '.join(names)} failed ({_failure(exc)})"
                ) from None
        return state

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        if isinstance(entry, UnmeasuredEntry):
            raise CheckpointError(self.path, f"{entry.name}: {entry.reason}")
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
                shape = _shape(item.size) if isinstance(item, TensorStorageMetadata) else None
                if shape is not None and math.prod(shape) == 1:
                    steps[name] = (shape, item.properties.dtype)
            else:
                moments.add(m.group("moment"))
        # Step counters are one-element tensors: cheap to read, and the rules want the step.
        try:
            values = [float(t.item()) for t in self._load(steps).values()] if steps else []
        except Exception as exc:  # the weights may still be readable: say so, go on
            problem = exc.problem if isinstance(exc, CheckpointError) else first_line(exc)
            text = f"{self.path}: the optimizer's step could not be read ({problem})"
            self.notes.append(text)
            note(text)
            values = []
        return {
            "key": key,
            "params_with_state": len(params),
            "step": max(values) if values else None,
            "moments": sorted(moments),
            # Options (lr, betas...) are bytes items that DCP's planner unpickles with
            # weights_only=False: reading them would run whatever pickle the directory holds.
            "param_groups": [],
        }


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path) if os.path.isfile(path) else 0
    except OSError:
        return 0


def _shape(size: object) -> tuple[int, ...] | None:
    """A tensor shape from the metadata, or None if it is not a sequence of sizes torch takes."""
    if not isinstance(size, (tuple, list)) or len(size) > 64:  # torch allows at most 64 dims
        return None
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in size):
        return None
    return tuple(size)


def _unreadable(item: Any, shape: tuple[int, ...], nbytes: int, stored: int | None) -> str | None:
    """Why a tensor the metadata lists cannot be read within the memory its shards store."""
    numel = math.prod(shape)
    covered = 0
    for chunk in item.chunks or []:
        sizes = _shape(getattr(chunk, "sizes", None))
        offsets = _shape(getattr(chunk, "offsets", None))
        if (
            sizes is None
            or offsets is None
            or len(sizes) != len(shape)
            or len(offsets) != len(shape)
        ):
            return "the .metadata describes its chunks wrongly: not read"
        covered += math.prod(sizes)
    if covered != numel:
        return f"the .metadata's chunks cover {covered} of its {numel} elements: not read"
    if stored is not None and nbytes > stored:
        # Each chunk is stored as a torch.save of its elements: never fewer bytes than them.
        return f"the .metadata claims {nbytes} bytes but its shards store {stored}: not read"
    return None


def _failure(exc: BaseException) -> str:
    """The first underlying error of a DCP load, in one line (CheckpointException's own text
    is each rank's whole traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) and first else exc
    refused = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
    if refused:
        return (
            f"a shard holds a pickle that needs arbitrary code to load ({refused[0][:200]}); "
            "DCP tensors are always read with torch's weights_only unpickler, --unsafe-pickle "
            "included"
        )
    return first_line(exc)
