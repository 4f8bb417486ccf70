"""Small pieces of wording the rules' messages share."""

from __future__ import annotations

from collections.abc import Iterable

from deadweight.findings import Location

# A finding over parameters of more modules than this, with no module above them all
# but the model itself, names the model (the root) rather than a list.
MAX_LISTED_MODULES = 3


def name_list(names: list[str], n: int = 3) -> str:
    """`a, b, c and 4 more`: a message names a few parameters; `params` holds them all."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def module_of(names: str | Iterable[str]) -> Location:
    """The location of a parameter, or of a group of them: the deepest module that holds
    them all (`transformer.h.1` for its `ln_2` and `mlp` weights, not the module of the
    first name). Where only the model itself holds them all and they sit in a few
    top-level modules (a GAN's `Generator:net` and `Discriminator:net`), those are
    listed instead."""
    owners = [names.rpartition(".")[0]] if isinstance(names, str) else owner_modules(names)
    if not owners:
        return Location()
    parts = [o.split(".") if o else [] for o in owners]
    common: list[str] = []
    for level in zip(*parts, strict=False):
        if any(part != level[0] for part in level):
            break
        common.append(level[0])
    if common or any(not p for p in parts):
        return Location(module=".".join(common))
    tops = list(dict.fromkeys(p[0] for p in parts))
    if len(tops) > MAX_LISTED_MODULES:
        return Location(module="")
    return Location(module=", ".join(tops))


def owner_modules(names: Iterable[str]) -> list[str]:
    """The module path of each parameter name, once each, in order."""
    return list(dict.fromkeys(n.rpartition(".")[0] for n in names))
