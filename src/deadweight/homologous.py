"""Homologous parameters: the same name up to a layer index (`layers.{i}.X`).

Used wherever one layer is compared with its siblings: a layer scalar that drifted
while its 31 siblings learned (watch), or one tensor that stands out in a checkpoint.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from deadweight.thresholds import current

# A layer index is a whole dotted component that is a number: `h.11.ln_1.weight`,
# `model.layers.3.mlp`. Numbers inside a word (`fc1`, `conv2d`) are not indices, nor is
# one of more than MAX_INDEX_DIGITS digits: no model has 10**18 layers, and converting a
# name's 5000-digit component (a hostile checkpoint's) would raise past Python's limit.
MAX_INDEX_DIGITS = 18
_INDEX = re.compile(rf"(?:(?<=^)|(?<=\.))[0-9]{{1,{MAX_INDEX_DIGITS}}}(?=\.|$)")

MIN_SIBLINGS = 3  # fewer layers than this make no population to stand out from
# The robust z-score above which a layer stands out (`outlier-z`) and the factor by
# which positive values must also differ from the median (`outlier-min-factor`) are
# configurable; deadweight.thresholds explains their defaults (5 and 2).
OUTLIER_MIN_DEVIATION = 1.0  # with an exact 0 among the magnitudes: one median's size away


def layer_key(name: str) -> tuple[str, int] | None:
    """`blocks.3.layer_scalar` -> (`blocks.{}.layer_scalar`, 3); None without one index.

    Names with several numeric components (experts inside layers: `layers.2.experts.5.w`)
    are keyed on the last one, so the experts of one layer are compared with each
    other.
    """
    matches = list(_INDEX.finditer(name))
    if not matches:
        return None
    last = matches[-1]
    return name[: last.start()] + "{}" + name[last.end() :], int(last.group())


def homologous_groups(
    names: Iterable[str], shape_of: Callable[[str], object] | None = None
) -> dict[str, list[tuple[int, str]]]:
    """template -> [(index, name), ...] sorted by index, for groups of MIN_SIBLINGS or more.

    With `shape_of`, only parameters of one shape are siblings: layers built alike
    have equal shapes, and one built otherwise (wav2vec2's first conv, 1 input channel
    and kernel 10 against 16 and 3) has another RMS by its init alone. A template's
    members of the most common shape form its group.
    """
    groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name in names:
        key = layer_key(name)
        if key is not None:
            groups[key[0]].append((key[1], name))
    if shape_of is not None:
        for template, members in groups.items():
            shapes = Counter(repr(shape_of(n)) for _, n in members)
            common, _ = shapes.most_common(1)[0]
            groups[template] = [(i, n) for i, n in members if repr(shape_of(n)) == common]
    return {t: sorted(m) for t, m in groups.items() if len(m) >= MIN_SIBLINGS}


def robust_outlier(values: list[float]) -> tuple[int, float] | None:
    """(index, robust z) of the single most extreme value, if it is an outlier.

    Magnitudes are compared, not signs: a zero-initialised gate (ReZero's alpha) that
    Adam moved to -0.06 in two layers and +0.06 in a third is three alike layers.
    Nonzero magnitudes (RMS, gains, most scalars) are compared on a log scale, where
    0.13 among ~1.0 is as far out as 8 among ~1.0, and must differ from the median
    by a factor of 2 or more; with an exact zero among them, linearly, by at least
    one median's size.
    """
    if len(values) < 3 or any(not math.isfinite(v) for v in values):
        return None
    positive = all(v != 0 for v in values)
    xs = [math.log(abs(v)) for v in values] if positive else [abs(v) for v in values]
    median = statistics.median(xs)
    deviations = [abs(x - median) for x in xs]
    mad = statistics.median(deviations)
    index = max(range(len(xs)), key=deviations.__getitem__)
    limits = current()
    least = math.log(limits.outlier_min_factor) if positive else OUTLIER_MIN_DEVIATION * abs(median)
    if deviations[index] == 0 or deviations[index] < least:
        return None
    z = math.inf if mad == 0 else 0.6745 * deviations[index] / mad
    return (index, z) if z >= limits.outlier_z else None
