"""`torch.save` files (.pt, .pth, .bin): a state dict, possibly nested, possibly with an optimizer.

Loaded with `weights_only=True`, which refuses pickles that would run code (FACTS: refused without
running, zip or legacy, any protocol); `unsafe_pickle=True` is the user's explicit opt-in.
"""

from __future__ import annotations

import os
import pickle
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from deadweight.readers.base import (
    DEFAULT_CHUNK_BYTES,
    CheckpointError,
    ReaderBase,
    TensorEntry,
    elements_per_chunk,
    output_dtype,
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_optimizer_state(value: object) -> bool:
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def _number(value: object) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def summarise_optimizer(key: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """What the rules need from an optimizer state dict, without listing its moments as weights."""
    state = state_dict.get("state")
    state = state if isinstance(state, Mapping) else {}
    steps = [
        s
        for per_param in state.values()
        if isinstance(per_param, Mapping)
        for s in [_number(per_param.get("step"))]
        if s is not None
    ]
    moments = sorted(
        {
            str(k)
            for per_param in state.values()
            if isinstance(per_param, Mapping)
            for k in per_param
            if k != "step"
        }
    )
    groups = []
    for group in state_dict.get("param_groups") or []:
        if not isinstance(group, Mapping):
            continue
        betas = group.get("betas")
        groups.append(
            {
                "lr": _number(group.get("lr")),
                "weight_decay": _number(group.get("weight_decay")),
                "betas": [_number(b) for b in betas] if isinstance(betas, (list, tuple)) else None,
                "eps": _number(group.get("eps")),
            }
        )
    return {
        "key": key,
        "params_with_state": len(state),
        "step": max(steps) if steps else None,
        "moments": moments,
        "param_groups": groups,
    }


def flatten(
    obj: object, prefix: str, tensors: dict[str, torch.Tensor], optimizers: list[dict[str, Any]]
) -> None:
    """Tensors of nested dicts/lists under dotted names; optimizer states summarised instead."""
    if isinstance(obj, torch.Tensor):
        # Sparse, quantized and other non-strided layouts have no flat element order to analyse.
        if obj.layout == torch.strided and not obj.is_quantized:
            tensors[prefix] = obj
    elif is_optimizer_state(obj):
        optimizers.append(summarise_optimizer(prefix, obj))  # type: ignore[arg-type]
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            flatten(value, f"{prefix}.{key}" if prefix else str(key), tensors, optimizers)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            flatten(value, f"{prefix}.{i}" if prefix else str(i), tensors, optimizers)
    # Other leaves (ints, strings, configs) are not tensors: ignored.


def load_refusal(refused: str) -> str:
    return (
        "the pickle needs arbitrary code to load (it holds objects other than tensors and plain "
        f"containers; torch says: {refused}), and loading it would run that code. Safe "
        "alternatives: re-save the weights "
        "with safetensors (safetensors.torch.save_file) or save only model.state_dict(); or, if "
        "you trust the file, pass --unsafe-pickle"
    )


class TorchFile(ReaderBase):
    """A torch.save file, memory-mapped where the format allows it (zip files since torch 1.6)."""

    def __init__(self, path: str, *, unsafe_pickle: bool = False) -> None:
        self.path = path
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise CheckpointError(path, f"cannot open ({exc.strerror})") from None
        if size == 0:
            raise CheckpointError(path, "the file is empty")
        # mmap keeps the weights on disk until read; the legacy (pre-zip) format cannot be mapped.
        mmap = zipfile.is_zipfile(path)
        try:
            with warnings.catch_warnings():
                # torch warns about pickle protocols and the like; library code stays quiet.
                warnings.simplefilter("ignore")
                loaded = torch.load(
                    path, map_location="cpu", weights_only=not unsafe_pickle, mmap=mmap
                )
        except pickle.UnpicklingError as exc:
            # weights_only names the global it refused ("Unsupported global: GLOBAL x.y", "GLOBAL
            # posix.system ... is blocked"); other unpickler errors are plain corruption.
            refused = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
            if not unsafe_pickle and refused:
                raise CheckpointError(path, load_refusal(refused[0])) from None
            raise CheckpointError(
                path, f"not a readable torch.save file ({_first_line(exc)})"
            ) from None
        except Exception as exc:  # torch raises RuntimeError, EOFError, ValueError... for bad files
            raise CheckpointError(
                path, f"not a readable torch.save file ({_first_line(exc)})"
            ) from None
        tensors: dict[str, torch.Tensor] = {}
        optimizers: list[dict[str, Any]] = []
        flatten(loaded, "", tensors, optimizers)
        if "" in tensors:  # torch.save(tensor): name it after the file
            tensors[os.path.splitext(os.path.basename(path))[0]] = tensors.pop("")
        self.optimizer = optimizers[0] if optimizers else None
        self._tensors = tensors
        self._entries = [
            TensorEntry(
                name, tuple(t.shape), dtype_name(t.dtype), path, t.numel() * t.element_size()
            )
            for name, t in tensors.items()
        ]

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        return tensor_chunks(self._tensors[entry.name], entry.dtype, max_bytes)

    def close(self) -> None:
        self._tensors = {}


def tensor_chunks(tensor: torch.Tensor, dtype: str, max_bytes: int) -> Iterator[np.ndarray]:
    """A CPU tensor's elements, flat in C order, converted chunk by chunk (bounded extra memory)."""
    # A non-contiguous tensor (a saved view) has no flat order without one copy of itself.
    flat = tensor.detach().contiguous().reshape(-1)
    per_chunk = elements_per_chunk(dtype, max_bytes)
    target = output_dtype(dtype)
    for start in range(0, flat.numel(), per_chunk):
        piece = flat[start : start + per_chunk]
        if piece.is_floating_point():
            piece = piece.to(torch.float64 if target == np.float64 else torch.float32)
        yield piece.numpy()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
