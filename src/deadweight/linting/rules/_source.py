"""What the source rules (DW5xx) share: a Location from a probe's Span."""

from __future__ import annotations

from deadweight.findings import Location
from deadweight.linting.source_files import Span


def location(path: str, span: Span, function: str | None) -> Location:
    return Location(
        file=path,
        line=span.line,
        function=function,
        column=span.column,
        end_line=span.end_line,
        end_column=span.end_column,
    )
