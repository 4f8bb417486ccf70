"""The report of a watch from its statistics: the live `Watch.report()` and
`deadweight report LOG` (and `deadweight run`, after the script) judge the same way.
No torch here: rebuilding a report from a log needs none."""

from __future__ import annotations

from collections.abc import Iterable

from deadweight.distributed.rank_stats import RankPresence
from deadweight.distributed.rules.distributed import presence_from_watch
from deadweight.registry import Selection, rules_consuming
from deadweight.report import Report
from deadweight.watching.watch_stats import WatchStats


def report_from_stats(
    stats: WatchStats,
    *,
    select: Iterable[str] | str | None = None,
    ignore: Iterable[str] | str | None = None,
    log: str | None = None,
) -> Report:
    """The watch's report: the rules judging `stats`, the step-0 check's findings, and
    the cross-rank ones when a distributed run recorded which rank holds what."""
    selection = Selection.of(select, ignore)
    findings = [f for r in rules_consuming(WatchStats) for f in r.judge(stats)]
    findings += stats.step0  # `deadweight run`'s step-0 check, in its own section
    presence = presence_from_watch(stats)
    if presence is not None:
        findings += [f for r in rules_consuming(RankPresence) for f in r.judge(presence)]
    subject = {
        "log": log,
        "steps": stats.steps,
        "optimizers": [f"{o.cls}#{o.index}" for o in stats.optimizers.values()],
        "parameters": len(stats.params),
        "complete": stats.complete,
        "end": (stats.end or {}).get("reason"),
        "detector_errors": stats.errors,
        "problems": stats.problems,
    }
    if stats.step0_mode is not None:
        subject["step0"] = {"mode": stats.step0_mode, "note": stats.step0_note}
    if stats.ranks is not None:
        subject["distributed"] = {**stats.ranks, "complete": stats.ranks_complete}
    return Report.of("watch", selection.filter(findings), subject)
