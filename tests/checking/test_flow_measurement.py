"""`names_under`, the parameter names under a module path, against a scan of every
name: bisection over the sorted names must find exactly the same ones."""

from __future__ import annotations

import random

from deadweight.checking.flow_measurement import names_under


def scan(names: list[str], path: str) -> frozenset[str]:
    prefix = path if not path or path.endswith(":") else path + "."
    return frozenset(n for n in names if n.startswith(prefix))


def test_names_under_matches_a_scan_of_every_name() -> None:
    rng = random.Random(0)
    parts = ["layer", "layers", "layer_norm", "1", "10", "11", "a", "a-b", "a/b", "ü", "fc"]
    names = {
        ".".join(rng.choice(parts) for _ in range(rng.randint(1, 4))) + ".weight"
        for _ in range(400)
    }
    # several models in one run are named `Model:path` (deadweight run)
    names |= {f"Encoder:{n}" for n in list(names)[:50]} | {"Encoder2:fc.weight", "bias"}
    ordered = sorted(names)
    paths = {""} | {"Encoder:", "Encoder2:", "Encoder", "layer.1", "layer.10", "a", "a-b"}
    for n in names:
        pieces = n.split(".")
        paths.update(".".join(pieces[:i]) for i in range(1, len(pieces)))
    found_some = 0
    for path in sorted(paths):
        expected = scan(ordered, path)
        assert names_under(ordered, path) == expected, path
        found_some += bool(expected)
    assert found_some > 100
    assert names_under(ordered, "layer.1") != names_under(ordered, "layer.10")
