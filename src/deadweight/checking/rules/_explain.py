"""Which cut explains which parameter that got no gradient (shared by DW101 and DW102)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from deadweight.checking.check_stats import Cut, GradFlowStats, display_path
from deadweight.findings import Location

BACKWARD_KINDS = frozenset({"custom-op-no-autograd", "dropped-in-backward", "no-autograd-kernel"})
MODULE_KINDS = frozenset(
    {"never-ran", "skipped-at-random", "output-unused", "module-cut", "cut-inside"}
)


def _tier(cut: Cut) -> int:
    """Lower is a better explanation.

    A loss without graph explains everything. A node that dropped gradients in
    backward is observed directly. A forward cut whose result was followed into
    the loss is next; then a module that never ran or whose output was dropped;
    then forward cuts whose result was not seen reaching the loss (it may have
    travelled through Python values we could not follow); a module-level cut
    with no finer cause found inside is the last resort.
    """
    if cut.kind == "loss-no-grad-fn":
        return 0
    if cut.kind in BACKWARD_KINDS:
        return 1
    if cut.kind not in MODULE_KINDS:
        return 2 if cut.flows_to_loss else 5
    tiers = {"never-ran": 3, "skipped-at-random": 3, "output-unused": 4, "module-cut": 6}
    return tiers.get(cut.kind, 6)  # cut-inside: a module-level last resort too


@dataclass(frozen=True)
class CutGroup:
    """Cuts of one kind in one function (or one module), reported as one DW102."""

    key: tuple[str, ...]
    cuts: tuple[Cut, ...]
    params: tuple[str, ...]  # parameters with no gradient that this group explains

    @property
    def first(self) -> Cut:
        return self.cuts[0]

    @property
    def location(self) -> Location:
        cut = self.first
        if cut.site is None:
            return Location(module=cut.module)
        return Location(display_path(cut.site.file), cut.site.line, cut.site.function, cut.module)

    @property
    def ref(self) -> str:
        return str(self.location) or self.first.kind


@dataclass(frozen=True)
class Explanation:
    groups: tuple[CutGroup, ...]
    by_param: dict[str, tuple[int, ...]]  # param -> indexes into groups; () if unexplained


def explain(stats: GradFlowStats) -> Explanation:
    """Which cuts explain each parameter without a gradient. A parameter whose best
    explanation is a module skipped at random (LayerDrop) is left out: it gets
    gradients on other steps, and DW110 reports it."""
    missing = [p.name for p in stats.no_grad_params]
    chosen: dict[str, list[Cut]] = {}
    for name in list(missing):
        candidates = [c for c in stats.cuts if name in c.params]
        if not candidates:
            chosen[name] = []
            continue
        best = min(_tier(c) for c in candidates)
        picked = [c for c in candidates if _tier(c) == best]
        if any(c.kind == "skipped-at-random" for c in picked):
            missing.remove(name)
            continue
        if picked[0].kind in ("never-ran", "output-unused"):
            # the outermost module is where the output was dropped or the call skipped
            top = min(len((c.module or "").split(".")) for c in picked)
            picked = [c for c in picked if len((c.module or "").split(".")) == top]
        chosen[name] = picked

    grouped: dict[tuple[str, ...], list[Cut]] = defaultdict(list)
    members: dict[tuple[str, ...], list[str]] = defaultdict(list)
    param_keys: dict[str, list[tuple[str, ...]]] = {}
    for name in missing:
        keys = []
        for cut in chosen[name]:
            key = _group_key(cut)
            if cut not in grouped[key]:
                grouped[key].append(cut)
            if name not in members[key]:
                members[key].append(name)
            if key not in keys:
                keys.append(key)
        param_keys[name] = keys

    order = list(grouped)
    groups = tuple(CutGroup(k, tuple(grouped[k]), tuple(members[k])) for k in order)
    index = {k: i for i, k in enumerate(order)}
    return Explanation(groups, {n: tuple(index[k] for k in param_keys[n]) for n in missing})


def _group_key(cut: Cut) -> tuple[str, ...]:
    if cut.kind in MODULE_KINDS:
        return (cut.kind, cut.module or "")
    site = cut.site
    # Several ops of one kernel (x.pow, x * r, * weight) are one cut, and so is the
    # same kernel called from every layer.
    return (cut.kind, site.file if site else "", site.function if site else cut.op or "")
