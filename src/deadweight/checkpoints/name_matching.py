"""Matching the tensor names of two checkpoints across the wrappers that rename them.

The same model saved through a wrapper gets other names: `torch.compile` puts
`_orig_mod.` in front of every one, DistributedDataParallel and DataParallel `module.`,
FSDP (1) `_fsdp_wrapped_module.` in front of each wrapped module's tensors, activation
checkpointing's wrapper `_checkpoint_wrapped_module.`. Compared by raw name, an eager
save and a compiled one share almost nothing, and every tensor looks removed from one
file and added to the other.

`match_names` removes those prefixes where doing so matches more tensors, and only
there: a side keeps its raw names unless removing a prefix finds it more partners, and
a removal that would give two tensors of one file the same name is never made.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from deadweight.checkpoints.scan_stats import PrefixRemoved


@dataclass(frozen=True)
class Wrapper:
    prefix: str  # with its dot: `_orig_mod.`
    by: str  # what adds it, for the message
    # Nested wrappers (a compiled block, an FSDP unit per layer) put the prefix before
    # any module's names; DDP wraps only the whole model, and a user's own submodule
    # may well be called `module`, so `module.` is only removed in front of the name.
    anywhere: bool


WRAPPERS = (
    Wrapper("_orig_mod.", "torch.compile", anywhere=True),
    Wrapper("_fsdp_wrapped_module.", "FSDP", anywhere=True),
    Wrapper("_checkpoint_wrapped_module.", "activation checkpointing", anywhere=True),
    # FSDP's FlattenParamsWrapper, in saves of torch 1.12 and earlier
    Wrapper("_fpw_module.", "FSDP (torch <= 1.12)", anywhere=True),
    Wrapper("module.", "DistributedDataParallel / DataParallel", anywhere=False),
)


@dataclass(frozen=True)
class NameMatch:
    """The name each raw name of either side is compared under, and what was removed."""

    a: dict[str, str]
    b: dict[str, str]
    removed: list[PrefixRemoved]


def _strip(name: str, wrappers: Sequence[Wrapper]) -> str:
    parts = name.split(".")
    inner = {w.prefix[:-1] for w in wrappers if w.anywhere}
    if inner:  # never the last part: that is the tensor's own name
        parts = [p for p in parts[:-1] if p not in inner] + parts[-1:]
    if any(not w.anywhere for w in wrappers) and len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def _variants(names: Sequence[str]) -> list[tuple[tuple[Wrapper, ...], dict[str, str]]]:
    """Each set of wrappers whose removal renames some of `names` without making two of
    them one, with the names it gives; the empty set (raw names) first."""
    # (`module.` in `_orig_mod.module.x` shows only once `_orig_mod.` is off)
    every = [_strip(n, WRAPPERS) for n in names]
    present = [
        w
        for w in WRAPPERS
        if any(
            _strip(n, [o for o in WRAPPERS if o is not w]) != s
            for n, s in zip(names, every, strict=True)
        )
    ]
    out: list[tuple[tuple[Wrapper, ...], dict[str, str]]] = []
    for size in range(len(present) + 1):
        for chosen in itertools.combinations(present, size):
            mapping = {n: _strip(n, chosen) for n in names}
            if len(set(mapping.values())) == len(mapping):
                out.append((chosen, mapping))
    return out


def match_names(a: Sequence[str], b: Sequence[str]) -> NameMatch:
    """The renaming of each side that matches the most names; among equals, the one that
    removes the fewest prefixes (raw names when removing any matches nothing more)."""
    best: tuple[int, int] | None = None
    chosen: tuple[tuple[tuple[Wrapper, ...], dict[str, str]], ...] = ()
    for va, vb in itertools.product(_variants(a), _variants(b)):
        matches = len(set(va[1].values()) & set(vb[1].values()))
        score = (matches, -(len(va[0]) + len(vb[0])))
        if best is None or score > best:
            best, chosen = score, (va, vb)
    (wa, ma), (wb, mb) = chosen
    removed = [
        PrefixRemoved(side, w.prefix, w.by, _renamed_by(w, wrappers, mapping))
        for side, wrappers, mapping in (("a", wa, ma), ("b", wb, mb))
        for w in wrappers
    ]
    return NameMatch(ma, mb, removed)


def _renamed_by(wrapper: Wrapper, chosen: tuple[Wrapper, ...], mapping: dict[str, str]) -> int:
    """How many names removing `wrapper` changes, on top of the other chosen ones (in
    `_orig_mod.module.x`, `module.` comes off only once `_orig_mod.` has)."""
    others = [w for w in chosen if w is not wrapper]
    return sum(_strip(raw, others) != new for raw, new in mapping.items())


def describe(removed: Sequence[PrefixRemoved]) -> str:
    """`matched names after removing the prefix `_orig_mod.` (torch.compile) from b's 17
    names`: what the diff did to names, in one sentence."""
    parts = [
        f"the prefix `{r.prefix}` ({r.by}) from {r.side}'s {r.names} name"
        + ("s" if r.names != 1 else "")
        for r in removed
    ]
    return "matched names after removing " + " and ".join(parts)
