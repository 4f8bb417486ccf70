"""Merging the findings each rank judged into one list for the whole job."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from deadweight.findings import Finding


def _key(f: Finding) -> tuple[str, tuple[str, ...], str]:
    # Messages carry numbers from each rank's own batch; code, parameters and place
    # say whether two ranks found the same problem.
    return f.code, f.params, str(f.location) if f.location else ""


def merge_rank_findings(per_rank: Sequence[Sequence[Finding]]) -> list[Finding]:
    """One finding per distinct problem, in the lowest rank's words.

    A problem every rank found reads exactly as in a single process; one found on
    some ranks only says which, in its message and as `evidence["ranks"]`.
    """
    world = len(per_rank)
    seen: dict[tuple[str, tuple[str, ...], str], tuple[Finding, list[int]]] = {}
    for rank, findings in enumerate(per_rank):
        for f in findings:
            key = _key(f)
            if key in seen:
                if rank not in seen[key][1]:
                    seen[key][1].append(rank)
            else:
                seen[key] = (f, [rank])
    merged = []
    for f, ranks in seen.values():
        if len(ranks) == world:
            merged.append(f)
            continue
        where = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world}"
        merged.append(
            dataclasses.replace(
                f,
                message=f"{f.message} (on {where} only)",
                evidence={**f.evidence, "ranks": ranks, "world_size": world},
            )
        )
    return merged
