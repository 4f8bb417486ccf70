"""`torch.save` files (.pt, .pth, .bin): a state dict, possibly nested, possibly with an optimizer.

Loaded with `weights_only=True`, which refuses pickles that would run code (FACTS: refused without
running, zip or legacy, any protocol); `unsafe_pickle=True` is the user's explicit opt-in, and
applies only to a file the safe load refuses: that file's pickle is run, and a note says so.

The file is untrusted input: a few hundred bytes of pickle can claim a 2^40-element tensor
(a stride-0 view of one stored element), nest containers thousands of levels deep, or share
one list a billion ways. Work and memory here follow the bytes stored, never the claims.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import numpy as np
import torch

from deadweight.checkpoints.readers import file_kind
from deadweight.checkpoints.readers.base import (
    DEFAULT_CHUNK_BYTES,
    CheckpointError,
    ReaderBase,
    TensorEntry,
    elements_per_chunk,
    output_dtype,
)
from deadweight.checkpoints.readers.notes import note

# State dicts nest a handful of levels (model -> layers -> 12 -> attn -> weight); optimizer and
# trainer states a few more. 1000 is far beyond any real checkpoint and keeps the names
# (one dotted component per level) small.
MAX_DEPTH = 1000
# Tensor names in real checkpoints are under 300 characters (FSDP and PEFT names included).
MAX_NAME_CHARS = 4096
# A view that repeats its stored elements (torch.zeros(1).expand(n, m)) is measured by
# reading every element it claims only while that costs no more than one read chunk of a
# real tensor; beyond that it is listed, not measured (the file's bytes say nothing more).
REPEAT_READ_BYTES = DEFAULT_CHUNK_BYTES
# An error message quotes at most this much of an exception's first line: a hostile file
# can make torch's message hold its own bytes.
_QUOTED_CHARS = 300


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class UnmeasuredEntry(TensorEntry):
    """A tensor that is listed (name, shape, dtype) but whose values are not analysed."""

    reason: str = ""

    @property
    def is_float(self) -> bool:
        # Consumers analyse exactly the float entries: this one is listed like an int tensor.
        return False


def is_optimizer_state(value: object) -> bool:
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def _number(value: object) -> float | None:
    try:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value.item())
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    except (OverflowError, RuntimeError, ValueError):  # a 10**400 int, a complex scalar
        return None
    return None


def _key_text(key: object) -> str:
    """A container key as a name component; never raises (a 5000-digit int has no str())."""
    if isinstance(key, str):
        return key
    if isinstance(key, int) and key.bit_length() > 64:
        return f"<{key.bit_length()}-bit int>"
    try:
        return str(key)
    except Exception:
        return f"<{type(key).__name__}>"


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
            _key_text(k)
            for per_param in state.values()
            if isinstance(per_param, Mapping)
            for k in per_param
            if k != "step"
        }
    )
    groups = []
    param_groups = state_dict.get("param_groups")
    for group in param_groups if isinstance(param_groups, (list, tuple)) else []:
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
    obj: object,
    prefix: str,
    tensors: dict[str, torch.Tensor],
    optimizers: list[dict[str, Any]],
    *,
    path: str = "",
) -> None:
    """Tensors of nested dicts/lists under dotted names; optimizer states summarised instead.

    Iterative, so depth costs no Python stack; each container is visited once, so a pickle
    that shares one list many ways (memo references: [x, x] sixty levels deep) costs what it
    stores. A container reached again is not listed twice (tensors reached twice are: tied
    weights have two names)."""
    seen: set[int] = set()
    # (object, its parent's name, its key, depth); names are built when popped, so the stack
    # holds references, not one string per pending child.
    stack: list[tuple[object, str, str | None, int]] = [(obj, prefix, None, 0)]
    while stack:
        value, parent, key, depth = stack.pop()
        is_tensor = isinstance(value, torch.Tensor)
        if not is_tensor and (not isinstance(value, (Mapping, list, tuple)) or id(value) in seen):
            continue  # other leaves (ints, strings, configs) are not tensors: ignored
        name = parent if key is None else (f"{parent}.{key}" if parent else key)
        if len(name) > MAX_NAME_CHARS:
            raise CheckpointError(
                path, f"holds a key path longer than {MAX_NAME_CHARS} characters: not a state dict"
            )
        if isinstance(value, torch.Tensor):
            # Sparse, quantized and other non-strided layouts have no flat element order.
            if value.layout == torch.strided and not value.is_quantized:
                tensors[name] = value
            continue
        seen.add(id(value))
        if depth >= MAX_DEPTH:
            raise CheckpointError(
                path, f"nests containers more than {MAX_DEPTH} levels deep: not a state dict"
            )
        if is_optimizer_state(value):
            optimizers.append(summarise_optimizer(name, value))  # type: ignore[arg-type]
            continue
        if isinstance(value, Mapping):
            items = [(_key_text(k), v) for k, v in value.items()]
        else:  # a list or tuple (the only other containers that get here)
            items = [(str(i), v) for i, v in enumerate(cast("Sequence[object]", value))]
        stack.extend((v, name, k, depth + 1) for k, v in reversed(items))


def load_refusal(refused: str) -> str:
    # What to do first, torch's words last: a caller may cut a long message (a sharded
    # index quotes each shard's problem to a few hundred characters).
    return (
        "the pickle needs arbitrary code to load, and loading it would run that code. If you "
        "trust the file, pass --unsafe-pickle; safer: re-save the weights with safetensors "
        "(safetensors.torch.save_file) or save only model.state_dict() (it holds objects other "
        f"than tensors and plain containers; torch says: {refused[:_QUOTED_CHARS]})"
    )


def ran_pickle_note(path: str) -> str:
    return f"{path}: --unsafe-pickle ran this file's pickle (any code in it has run)"


def _unpickler_says(exc: pickle.UnpicklingError) -> str:
    """The line of torch's weights_only message that says what it refused ("Unsupported
    operand 139"), not its paragraph about the PyTorch 2.6 default."""
    lines = [line.strip() for line in str(exc).splitlines()]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            said = line.partition("WeightsUnpickler error")[2].strip(" :") or next(
                (rest for rest in lines[i + 1 :] if rest), ""
            )
            if said:
                return f"UnpicklingError: {said[:_QUOTED_CHARS]}"
    return first_line(exc)


def _torch_load(path: str, *, weights_only: bool, mmap: bool) -> Any:
    with warnings.catch_warnings():
        # torch warns about pickle protocols and the like; library code stays quiet.
        warnings.simplefilter("ignore")
        return torch.load(path, map_location="cpu", weights_only=weights_only, mmap=mmap)


@cache
def _unconvertible(dtype: torch.dtype) -> str | None:
    """Why values of `dtype` cannot be handed out as numpy (fp4, uint3, complex32), or None."""
    try:
        probe = torch.zeros(1, dtype=dtype)
        if probe.is_floating_point():
            probe.to(torch.float32).numpy()
        else:
            probe.numpy()
            output_dtype(dtype_name(dtype))
    except Exception:
        return f"deadweight cannot convert {dtype_name(dtype)} values to numpy: not measured"
    return None


def unmeasured_reason(tensor: torch.Tensor) -> str | None:
    """Why `tensor` is listed but not measured, or None when it can be read in bounded work."""
    unconvertible = _unconvertible(tensor.dtype)
    if unconvertible is not None:
        return unconvertible
    claimed = tensor.numel() * tensor.element_size()
    stored = tensor.untyped_storage().nbytes()
    if claimed <= max(stored, REPEAT_READ_BYTES):
        return None
    repeats = any(n > 1 and s == 0 for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    kind = "a broadcast (expanded, stride-0) view" if repeats else "a view with overlapping strides"
    shape = "×".join(map(str, tensor.shape))
    return (
        f"{kind}: its {shape} elements ({claimed} bytes) repeat {stored} stored bytes; "
        "statistics of the repeats would cost reading every claimed element: not measured"
    )


class TorchFile(ReaderBase):
    """A torch.save file, memory-mapped where the format allows it (zip files since torch 1.6)."""

    def __init__(self, path: str, *, unsafe_pickle: bool = False) -> None:
        self.path = path
        self.notes: list[str] = []
        self.ran_pickle = False
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise CheckpointError(path, f"cannot open ({exc.strerror})") from None
        if size == 0:
            raise CheckpointError(path, "the file is empty")
        try:
            kind = file_kind.sniff(path)
        except OSError as exc:
            raise CheckpointError(path, f"cannot open ({exc.strerror})") from None
        if kind.kind == "pickle" and unsafe_pickle:
            loaded = self._load_raw_pickle()
        elif not kind.is_torch:  # said in words, with nothing of it run
            raise CheckpointError(path, file_kind.explain(kind))
        else:
            # mmap keeps the weights on disk until read; the legacy (pre-zip) format
            # cannot be mapped.
            loaded = self._load(kind.kind == "torch-zip", unsafe_pickle)
        tensors: dict[str, torch.Tensor] = {}
        optimizers: list[dict[str, Any]] = []
        try:
            flatten(loaded, "", tensors, optimizers, path=path)
            if "" in tensors:  # torch.save(tensor): name it after the file
                tensors[os.path.splitext(os.path.basename(path))[0]] = tensors.pop("")
            self._entries = [self._entry(name, t) for name, t in tensors.items()]
        except CheckpointError:
            raise
        except Exception as exc:  # an --unsafe-pickle object whose methods raise, a torn tensor
            raise CheckpointError(
                path, f"not a readable torch.save file ({first_line(exc)})"
            ) from None
        self.optimizer = optimizers[0] if optimizers else None
        self._tensors = tensors

    def _load(self, mmap: bool, unsafe_pickle: bool) -> Any:
        path = self.path
        try:
            return _torch_load(path, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            if not unsafe_pickle:
                # weights_only names the global it refused ("Unsupported global: GLOBAL x.y",
                # "GLOBAL posix.system ... is blocked"); other unpickler errors are corruption.
                refused = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line]
                if refused:
                    raise CheckpointError(path, load_refusal(refused[0])) from None
                raise CheckpointError(
                    path, f"not a readable torch.save file ({_unpickler_says(exc)})"
                ) from None
        except Exception as exc:  # torch raises RuntimeError, EOFError, ValueError... for bad files
            raise CheckpointError(
                path, f"not a readable torch.save file ({first_line(exc)})"
            ) from None
        # The user's opt-in, for this file only because the safe load refused it: from here
        # on its pickle runs. Noted first, so that the note stands even if the load fails.
        self.ran_pickle = True
        self._note(ran_pickle_note(path))
        try:
            return _torch_load(path, weights_only=False, mmap=mmap)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the pickle's own code may raise anything, SystemExit too
            raise CheckpointError(
                path,
                f"not a readable torch.save file ({first_line(exc)}); its pickle was run "
                "(--unsafe-pickle)",
            ) from None

    def _load_raw_pickle(self) -> Any:
        """A raw `pickle.dump` file, with --unsafe-pickle: the user's opt-in for a file
        they trust, noted before it runs."""
        path = self.path
        self.ran_pickle = True
        self._note(ran_pickle_note(path))
        try:
            with open(path, "rb") as f, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return pickle.load(f)  # the user's explicit --unsafe-pickle
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # the pickle's own code may raise anything
            raise CheckpointError(
                path,
                f"not a readable pickle ({first_line(exc)}); its pickle was run (--unsafe-pickle)",
            ) from None

    def _entry(self, name: str, tensor: torch.Tensor) -> TensorEntry:
        shape, dtype = tuple(tensor.shape), dtype_name(tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        reason = unmeasured_reason(tensor)
        if reason is None:
            return TensorEntry(name, shape, dtype, self.path, nbytes)
        self._note(f"{self.path}: {name}: {reason}")
        return UnmeasuredEntry(name, shape, dtype, self.path, nbytes, reason)

    def _note(self, text: str) -> None:
        self.notes.append(text)
        note(text)

    def entries(self) -> list[TensorEntry]:
        return list(self._entries)

    def chunks(
        self, entry: TensorEntry, max_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> Iterator[np.ndarray]:
        if isinstance(entry, UnmeasuredEntry):
            raise CheckpointError(self.path, f"{entry.name}: {entry.reason}")
        return tensor_chunks(self._tensors[entry.name], entry.dtype, max_bytes)

    def close(self) -> None:
        self._tensors = {}


def _c_order_pieces(tensor: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """`tensor`'s elements in C order as flat contiguous pieces of at most `limit` elements
    (views where it is contiguous, small copies where not): never a copy of the whole."""
    if tensor.is_contiguous():
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), limit):
            yield flat[start : start + limit]
    elif tensor.numel() <= limit:
        yield tensor.contiguous().reshape(-1)
    else:  # numel > limit >= 1: at least one row along dim 0
        row = tensor.numel() // tensor.shape[0]
        rows = limit // row
        if rows:
            for i in range(0, tensor.shape[0], rows):
                yield tensor[i : i + rows].contiguous().reshape(-1)
        else:
            for i in range(tensor.shape[0]):
                yield from _c_order_pieces(tensor[i], limit)


def _exact_chunks(tensor: torch.Tensor, per_chunk: int) -> Iterator[torch.Tensor]:
    """Consecutive flat chunks of exactly `per_chunk` elements (the last may be shorter)."""
    held: list[torch.Tensor] = []
    have = 0
    for piece in _c_order_pieces(tensor, per_chunk):
        while piece.numel():
            take = min(per_chunk - have, piece.numel())
            held.append(piece[:take])
            have += take
            piece = piece[take:]
            if have == per_chunk:
                yield held[0] if len(held) == 1 else torch.cat(held)
                held, have = [], 0
    if have:
        yield held[0] if len(held) == 1 else torch.cat(held)


def tensor_chunks(tensor: torch.Tensor, dtype: str, max_bytes: int) -> Iterator[np.ndarray]:
    """A CPU tensor's elements, flat in C order, converted chunk by chunk (bounded extra memory:
    a non-contiguous view is copied a chunk at a time, never whole)."""
    per_chunk = elements_per_chunk(dtype, max_bytes)
    target = output_dtype(dtype)
    for piece in _exact_chunks(tensor.detach(), per_chunk):
        if piece.is_floating_point():
            piece = piece.to(torch.float64 if target == np.float64 else torch.float32)
        yield piece.numpy()


def first_line(exc: BaseException) -> str:
    try:
        text = str(exc).strip().splitlines()
    except Exception:  # an --unsafe-pickle exception whose __str__ raises
        text = []
    if not text:
        return type(exc).__name__
    line = text[0] if len(text[0]) <= _QUOTED_CHARS else text[0][:_QUOTED_CHARS] + "…"
    return f"{type(exc).__name__}: {line}"
