"""Which files of one lint run are in sight of each other through their imports.

A decay rule in `train.py` decides the groups of the model that `train.py` builds,
from `model.py`; one in a helper (`utils/optim.py`) decides them for the scripts that
import the helper. So the files *in sight* of a file are the file itself, the linted
files that import it, and every linted file those import, directly or not. A test
module or another model elsewhere in the tree that nothing here imports is not in
sight. Imports are matched to linted files by module name (`model`, `pkg.model`,
`.model`); a name several files could answer goes to the ones nearest the importer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

_DEPTH = 8  # package depth matched at most: `a.b.c.d.e.f.g.h`


def in_sight(
    imports: Mapping[str, Iterable[str]], wanted: Iterable[str]
) -> dict[str, frozenset[str]]:
    """For each path in `wanted`: the linted paths in sight of it. `imports` maps every
    linted Python file to the modules it imports (`python_facts.imported_modules`)."""
    paths = {path: os.path.abspath(path) for path in imports}
    by_abs = {absolute: path for path, absolute in paths.items()}
    index: dict[str, list[str]] = {}
    for path, absolute in paths.items():
        for name in _module_names(absolute):
            index.setdefault(name, []).append(path)
    edges = {
        path: {
            target
            for name in names
            for target in _resolve(paths[path], name, index, by_abs)
            if target != path
        }
        for path, names in imports.items()
    }
    importers: dict[str, set[str]] = {}
    for path, targets in edges.items():
        for target in targets:
            importers.setdefault(target, set()).add(path)
    out: dict[str, frozenset[str]] = {}
    for path in wanted:
        seen = {path, *importers.get(path, ())}
        stack = list(seen)
        while stack:
            for target in edges.get(stack.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    stack.append(target)
        out[path] = frozenset(seen)
    return out


def _module_names(absolute: str) -> list[str]:
    """`/src/pkg/model.py` -> ["model", "pkg.model", "src.pkg.model"]; a package's
    `__init__.py` answers to the package's name."""
    parts = list(os.path.splitext(absolute)[0].split(os.sep)[1:])
    if parts and parts[-1] == "__init__":
        parts.pop()
    return [".".join(parts[-k:]) for k in range(1, min(len(parts), _DEPTH) + 1)]


def _resolve(importer: str, name: str, index: dict[str, list[str]],
             by_abs: dict[str, str]) -> list[str]:  # fmt: skip
    if name.startswith("."):
        level = len(name) - len(name.lstrip("."))
        base = os.path.dirname(importer)
        for _ in range(level - 1):
            base = os.path.dirname(base)
        rest = name[level:].split(".") if name[level:] else []
        target = os.path.join(base, *rest)
        found = [by_abs.get(target + ".py"), by_abs.get(os.path.join(target, "__init__.py"))]
        return [f for f in found if f is not None]
    candidates = index.get(name, [])
    if len(candidates) <= 1:
        return candidates

    # Several files answer to the name (two projects' model.py): the nearest ones.
    def shared(path: str) -> int:
        return len(os.path.commonpath([importer, os.path.abspath(path)]))

    best = max(shared(c) for c in candidates)
    return [c for c in candidates if shared(c) == best]
