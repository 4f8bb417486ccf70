"""Which linted files are in sight of each other through their imports (what DW502 reads
to decide whether a scalar parameter is one its decay rule would exempt)."""

from __future__ import annotations

import os

from deadweight.linting.import_graph import in_sight


def paths(root: str, *names: str) -> list[str]:
    return [os.path.join(root, *name.split("/")) for name in names]


def test_a_script_its_model_and_the_files_that_import_it() -> None:
    train, model, layers, other = paths("/r", "train.py", "model.py", "layers.py", "other.py")
    imports = {
        train: ("model", "model.GPT", "torch"),
        model: ("torch", ".layers"),  # a relative import, one level
        layers: (),
        other: ("torch",),
    }
    found = in_sight(imports, [model, train, other])
    # model.py: itself, what it imports, and train.py which imports it
    assert found[model] == {model, layers, train}
    assert found[train] == {train, model, layers}
    assert found[other] == {other}


def test_packages_relative_imports_and_the_nearest_of_two_namesakes() -> None:
    a_train, a_model, b_model, init, gpt = paths(
        "/r", "a/train.py", "a/model.py", "b/model.py", "a/nets/__init__.py", "a/nets/gpt.py"
    )
    imports = {
        a_train: ("model", "nets", "nets.GPT"),
        a_model: (),
        b_model: (),
        init: (".gpt", ".gpt.GPT"),
        gpt: ("..model",),  # two levels up: a/model.py
    }
    found = in_sight(imports, [a_train, b_model])
    assert found[a_train] == {a_train, a_model, init, gpt}  # not b/model.py
    assert found[b_model] == {b_model}
