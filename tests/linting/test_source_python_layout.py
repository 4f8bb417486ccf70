"""A class's trainable state by attribute path: containers opened to the members they are
built with, and what an access of `self` reaches."""

from __future__ import annotations

import ast
import textwrap

import pytest

from deadweight.linting.python_facts import Source
from deadweight.linting.source_python_layout import Layout, Layouts, self_path

MODEL = textwrap.dedent("""
    from collections import OrderedDict

    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)


    class GPT(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(8, 4),
                drop=nn.Dropout(0.1),
                h=nn.ModuleList([Block() for _ in range(n)]),
                ln_f=nn.LayerNorm(4),
            ))
            self.mlp = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4))
            self.named = nn.Sequential(OrderedDict([("fc", nn.Linear(4, 4)), ("act", nn.ReLU())]))
            self.pair = nn.ModuleList([Block(), nn.Linear(4, 4)])
            self.stack = nn.Sequential(*[Block() for _ in range(n)])
            self.grown = nn.ModuleList([nn.Linear(4, 4)])
            self.grown.append(nn.Linear(4, 4))
            self.gains = nn.ParameterList([nn.Parameter(torch.ones(4))])
            self.lm_head = nn.Linear(4, 8, bias=False)
""").lstrip()


@pytest.fixture(scope="module")
def layout() -> Layout:
    source = Source(MODEL, "m.py", ast.parse(MODEL))
    classes = {c.name: c for c in source.tree.body if isinstance(c, ast.ClassDef)}
    return Layouts(source, classes).layout(classes["GPT"])


def test_containers_open_to_the_members_they_are_built_with(layout: Layout) -> None:
    assert layout.attrs == {
        "transformer.wte": "nn.Embedding",
        "transformer.h": "nn.ModuleList of Block",  # a comprehension: one leaf
        "transformer.ln_f": "nn.LayerNorm",
        "mlp.0": "nn.Linear",
        "mlp.2": "nn.Linear",
        "named.fc": "nn.Linear",
        "pair.0": "Block",
        "pair.1": "nn.Linear",
        "stack": "nn.Sequential of Block",  # *[...]: one leaf
        "grown": "nn.ModuleList of nn.Linear",  # appended to: its members are not known
        "gains.0": "nn.Parameter",
        "lm_head": "nn.Linear",
    }
    assert layout.containers["transformer"] == {"wte", "drop", "h", "ln_f"}
    assert layout.containers["mlp"] == {"0", "1", "2"}


@pytest.mark.parametrize(
    "access,leaves",
    [
        ("self.transformer.ln_f", {"transformer.ln_f"}),
        ("self.transformer['ln_f']", {"transformer.ln_f"}),
        ("self.transformer.h", {"transformer.h"}),
        ("self.transformer.h[i]", None),  # indexing a leaf: the caller follows the value
        ("self.transformer.drop", set()),  # built without parameters
        ("self.transformer.drop.p", set()),
        ("self.transformer", {"transformer.wte", "transformer.h", "transformer.ln_f"}),
        ("self.transformer[key]", {"transformer.wte", "transformer.h", "transformer.ln_f"}),
        ("self.mlp[0]", {"mlp.0"}),
        ("self.mlp[1]", set()),
        ("self.mlp", {"mlp.0", "mlp.2"}),
        ("self.mlp[-1]", {"mlp.0", "mlp.2"}),  # not a written key: any of them
        ("self.lm_head", {"lm_head"}),
        ("self.lm_head.weight", None),  # past a leaf: the caller looks at what follows
        ("self.config", None),
    ],
)
def test_what_an_access_reaches(layout: Layout, access: str, leaves: set[str] | None) -> None:
    path = self_path(ast.parse(access, mode="eval").body)
    assert path is not None
    found = layout.resolve(path)
    assert (None if found is None else set(found)) == leaves


def test_past_a_leaf_without_exact_gives_the_leaf(layout: Layout) -> None:
    path = self_path(ast.parse("self.transformer.wte.weight", mode="eval").body)
    assert path == ("transformer", "wte", "weight")
    assert layout.resolve(path, exact=False) == {"transformer.wte"}


def test_self_path_needs_an_attribute_of_self() -> None:
    def parse(text: str) -> ast.expr:
        return ast.parse(text, mode="eval").body

    assert self_path(parse("self.h[0].attn")) == ("h", "0", "attn")
    assert self_path(parse("self[0]")) is None
    assert self_path(parse("other.h")) is None
    assert self_path(parse("m.c_fc"), aliases={"m": ("mlp",)}) == ("mlp", "c_fc")
