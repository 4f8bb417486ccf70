"""What a reader wants the user told about a file it did read: code it ran, tensors it skipped.

Library code never prints. A reader keeps its notes on itself (`reader.notes`) and also hands
each one to whoever is collecting: forensics collects them around a scan and puts them in
the report (`subject["warnings"]`), and the CLI prints them. Opening happens in the calling
thread, so a context variable reaches every reader a scan opens, shards of a sharded index
included, without threading a list through each layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_collecting: ContextVar[list[str] | None] = ContextVar("deadweight_reader_notes", default=None)


def note(text: str) -> None:
    """Record `text` for the report being built, if one is (otherwise it stays on the reader)."""
    notes = _collecting.get()
    if notes is not None and text not in notes:
        notes.append(text)


@contextmanager
def collecting_notes() -> Iterator[list[str]]:
    """Every note readers opened inside the block leave, in order, each once."""
    notes: list[str] = []
    token = _collecting.set(notes)
    try:
        yield notes
    finally:
        _collecting.reset(token)
