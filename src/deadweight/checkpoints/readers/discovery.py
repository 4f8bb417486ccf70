"""Turning command-line inputs (files, directories, globs) into checkpoint paths, and step numbers."""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence

from deadweight.checkpoints.readers.base import CheckpointError

CHECKPOINT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".npz")
# Files transformers' Trainer writes beside the weights: pickles of arguments and RNG state, not
# tensors worth analysing (training_args.bin would even be refused as unsafe).
SIDE_FILES = re.compile(r"^(training_args\.bin|scheduler\.pt|rng_state.*\.pth|scaler\.pt)$")
_GLOB_CHARS = re.compile(r"[*?\[]")
# step_of: the usual spellings of a training step in checkpoint names (HF checkpoint-1200,
# Megatron iter_0001200, DeepSpeed global_step1200, Lightning step=1200, torchtitan step-1200).
_STEP = re.compile(
    r"(?:global_step|checkpoint|ckpt|step|iter|iteration)[-_=]?(\d+)(?!\d)", re.IGNORECASE
)


def natural_key(path: str) -> tuple[tuple[int, str] | tuple[int, int], ...]:
    """step-100 before step-1000: digit runs compare as numbers."""
    parts = re.split(r"(\d+)", path)
    return tuple((1, int(p)) if i % 2 else (0, p) for i, p in enumerate(parts))


def step_of(path: str) -> int | None:
    """The training step a checkpoint path names, from its file name or else its directories."""
    parts = os.path.normpath(path).split(os.sep)
    for part in reversed(parts):
        stem = part
        for suffix in (*CHECKPOINT_SUFFIXES, ".index.json", ".json", ".ckpt"):
            stem = stem.removesuffix(suffix)
        matches = _STEP.findall(stem)
        if matches:
            return int(matches[-1])
    return None


def checkpoints_in_directory(directory: str) -> list[str]:
    """The checkpoints a directory holds: one DCP directory, one sharded index, or its files."""
    if os.path.isfile(os.path.join(directory, ".metadata")):
        return [directory]
    names = os.listdir(directory)
    indexes = sorted(n for n in names if n.endswith(".index.json"))
    if indexes:
        # transformers prefers safetensors when both an index for it and for .bin shards exist.
        preferred = [n for n in indexes if n.endswith(".safetensors.index.json")] or indexes
        return [os.path.join(directory, n) for n in sorted(preferred, key=natural_key)]
    files = [
        os.path.join(directory, n)
        for n in names
        if n.endswith(CHECKPOINT_SUFFIXES)
        and not SIDE_FILES.match(n)
        and os.path.isfile(os.path.join(directory, n))
    ]
    return sorted(files, key=natural_key)


def find_checkpoints(inputs: Sequence[str]) -> tuple[list[str], list[CheckpointError]]:
    """Checkpoint paths for `inputs`, and an error for each input that yields none.

    Each input's expansion is sorted naturally; inputs keep the order given. A directory without
    checkpoints of its own contributes those of its immediate subdirectories (a run directory of
    `checkpoint-100/`, `checkpoint-200/`, ...).
    """
    found: list[str] = []
    seen: set[str] = set()
    errors: list[CheckpointError] = []
    for raw in inputs:
        try:
            expanded = _expand(raw, errors)
        except CheckpointError as exc:
            errors.append(exc)
            continue
        except OSError as exc:  # a directory that cannot be listed, a name too long
            errors.append(CheckpointError(raw, f"cannot be listed ({exc.strerror or exc})"))
            continue
        for path in expanded:
            if path not in seen:
                seen.add(path)
                found.append(path)
    return found, errors


def _expand(raw: str, errors: list[CheckpointError]) -> list[str]:
    """The checkpoint paths one input names; raises CheckpointError when it names none.
    A subdirectory that cannot be listed is an error of its own: its siblings still count."""
    if os.path.exists(raw):
        targets = [raw]
    elif _GLOB_CHARS.search(raw):
        targets = sorted(glob.glob(raw), key=natural_key)
        if not targets:
            raise CheckpointError(raw, "no file or directory matches this pattern")
    else:
        raise CheckpointError(raw, "no such file or directory")
    expanded: list[str] = []
    for target in targets:
        if os.path.isdir(target):
            paths = checkpoints_in_directory(target)
            if not paths:
                subdirs = sorted(
                    (e.path for e in os.scandir(target) if e.is_dir()), key=natural_key
                )
                paths = []
                for sub in subdirs:
                    try:
                        paths.extend(checkpoints_in_directory(sub))
                    except OSError as exc:
                        errors.append(
                            CheckpointError(sub, f"cannot be listed ({exc.strerror or exc})")
                        )
            expanded.extend(paths)
        elif target.endswith((*CHECKPOINT_SUFFIXES, ".json")) or target == raw:
            expanded.append(target)
    if not expanded:
        raise CheckpointError(
            raw,
            "holds no checkpoint (looked for a DCP .metadata file, a *.index.json, or "
            f"{', '.join('*' + s for s in CHECKPOINT_SUFFIXES)} files)",
        )
    return expanded
