"""Small pieces of wording the rules' messages share."""

from __future__ import annotations

from deadweight.findings import Location


def name_list(names: list[str], n: int = 3) -> str:
    """`a, b, c and 4 more`: a message names a few parameters; `params` holds them all."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def module_of(name: str) -> Location:
    """The location of a parameter: the module that owns it."""
    return Location(module=name.rpartition(".")[0])
