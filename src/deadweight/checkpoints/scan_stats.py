"""What the checkpoint commands measured, as the DW4xx rules read it.

`checkpoint_scan` fills these in from the readers; `checkpoints/rules/` judges them
and imports nothing that reads a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deadweight.checkpoints.quantization import QuantRisk
from deadweight.checkpoints.tensor_stats import TensorStats


@dataclass
class CheckpointScan:
    path: str
    step: int | None
    tensors: dict[str, TensorStats] = field(default_factory=dict)
    optimizer: dict[str, object] | None = None
    quant: dict[str, QuantRisk] = field(default_factory=dict)
    # layer scalar -> (the weight it was quantized with, the risk of doing so)
    joint: dict[str, tuple[str, QuantRisk]] = field(default_factory=dict)


@dataclass
class InspectStats:
    scans: list[CheckpointScan]
    scheme: str
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TensorDiff:
    name: str
    unchanged: bool  # bitwise
    relative_change: float  # ||b - a|| / ||a||
    max_abs_change: float


@dataclass(frozen=True)
class PrefixRemoved:
    """A wrapper's prefix taken off one side's names so that they match the other's."""

    side: str  # "a" or "b"
    prefix: str  # `_orig_mod.`
    by: str  # what adds it: `torch.compile`
    names: int  # how many of that side's names it was taken off


@dataclass
class DiffStats:
    a: str
    b: str
    # Tensors are named as they are compared: after `renamed`, the same in both files.
    tensors: dict[str, TensorDiff] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    reshaped: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    retyped: list[tuple[str, str, str]] = field(default_factory=list)
    listed_only: list[str] = field(default_factory=list)  # int/bool tensors: not compared
    errors: list[str] = field(default_factory=list)
    renamed: list[PrefixRemoved] = field(default_factory=list)
    # How many tensors each file lists, and how many names both share (after
    # `renamed`), compared or not; all 0 unless both files were read.
    names_a: int = 0
    names_b: int = 0
    matched: int = 0


@dataclass
class TrendStats:
    paths: list[str]
    steps: list[int | None]
    # name -> value per checkpoint (None where the tensor is missing), single-element tensors
    values: dict[str, list[float | None]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
