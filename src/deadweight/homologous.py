"""Homologous parameters: the same name up to a layer index (`layers.{i}.X`).

Used wherever one layer is compared with its siblings: a layer scalar that drifted
while its 31 siblings learned (watch), or one tensor that stands out in a checkpoint.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

# A layer index is a whole dotted component that is a number: `h.11.ln_1.weight`,
# `model.layers.3.mlp`. Numbers inside a word (`fc1`, `conv2d`) are not indices.
_INDEX = re.compile(r"(?:(?<=^)|(?<=\.))\d+(?=\.|$)")

MIN_SIBLINGS = 3  # fewer layers than this make no population to stand out from


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


def homologous_groups(names: Iterable[str]) -> dict[str, list[tuple[int, str]]]:
    """template -> [(index, name), ...] sorted by index, for groups of MIN_SIBLINGS or more."""
    groups: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name in names:
        key = layer_key(name)
        if key is not None:
            groups[key[0]].append((key[1], name))
    return {t: sorted(m) for t, m in groups.items() if len(m) >= MIN_SIBLINGS}
