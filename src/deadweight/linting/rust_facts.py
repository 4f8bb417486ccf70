"""What a candle Rust source file was found to contain: the facts `source_rust` gathers
and `rules/lint_rust.py` judges. Data only."""

from __future__ import annotations

from dataclasses import dataclass, field

from deadweight.linting.source_files import Span
from deadweight.linting.suppressions import Suppressions


@dataclass(frozen=True)
class FusedCall:
    span: Span
    function: str | None  # "Model::forward", or the free function holding the call
    op: str  # "ops::softmax_last_dim", "RmsNorm::forward", "apply_op2_no_bwd"
    replacement: str
    receiver: str | None = None  # the RmsNorm / LayerNorm expression


@dataclass(frozen=True)
class RustSourceFacts:
    path: str
    calls: tuple[FusedCall, ...] = ()
    parse_errors: tuple[Span, ...] = ()
    suppressions: Suppressions = field(default_factory=dict)
