"""The Python source probe's facts, below the rules: trainable attributes, whether each is
live or frozen, cut sites and their kinds, spans, suppressions, import resolution."""

from __future__ import annotations

import ast
import textwrap

import pytest

from deadweight.linting.python_facts import Source
from deadweight.linting.source_python import find_suppressions, probe_python

MODEL = textwrap.dedent("""
    import torch as th
    from torch import nn, no_grad as ng


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.GELU()

        def forward(self, x):
            return self.act(self.fc(x))


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(2)])
            self.norm = nn.LayerNorm(4, elementwise_affine=False)
            self.scale = nn.Parameter(th.ones(1))
            self.frozen = nn.Linear(4, 4)
            self.frozen.weight.requires_grad = False
            self.head = nn.Linear(4, 1)
            self.register_buffer("mask", th.ones(4))

        def forward(self, x):
            with ng():
                for block in self.blocks:
                    x = block(x)
                x = self.frozen(self.norm(x))
            y = self.head(x) * self.mask.sum()
            return y + self.scale.detach(), self.scale
""").lstrip()


def test_attributes_live_frozen_and_cut_sites() -> None:
    facts = probe_python(MODEL, "model.py")
    (module,) = facts.modules
    assert module.owner == "Model"
    attrs = module.attributes
    # nn.GELU, an affine-free LayerNorm and buffers hold no trainable state
    assert set(attrs) == {"blocks", "frozen", "scale"}
    assert attrs["blocks"].constructor == "nn.ModuleList of Block"
    assert not attrs["blocks"].live and not attrs["blocks"].frozen
    assert attrs["frozen"].frozen
    assert attrs["scale"].live  # returned as is beside the detached copy
    no_grad, detach = module.cuts
    assert no_grad.kind == "no_grad" and no_grad.construct == "ng()"  # an import alias
    assert no_grad.attributes == ("blocks", "frozen")
    line = next(n for n, text in enumerate(MODEL.splitlines(), 1) if "with ng():" in text)
    assert (no_grad.span.line, no_grad.span.column, no_grad.span.end_column) == (line, 14, 18)
    assert detach.kind == "detach" and detach.attributes == ("scale",)


def test_suppressions_come_from_comments_only() -> None:
    source = textwrap.dedent("""
        a = 1  # deadweight: ignore[DW501, forward-gradient-cut]
        b = "# deadweight: ignore"
        c = 2  # deadweight: ignore
        d = 3  # deadweight:ignore[dw504]
    """)
    assert find_suppressions(source) == {
        2: frozenset({"DW501", "forward-gradient-cut"}),
        4: frozenset(),
        5: frozenset({"DW504"}),
    }


@pytest.mark.parametrize(
    "imports,expr,expected",
    [
        ("import torch.nn as nn", "nn.Linear", "torch.nn.Linear"),
        ("from torch import nn", "nn.Linear", "torch.nn.Linear"),
        ("from torch.nn import Linear as L", "L", "torch.nn.Linear"),
        ("import torch", "torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint"),
        ("try:\n    from torch.utils import checkpoint\nexcept ImportError:\n    pass",
         "checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint"),
    ],
)  # fmt: skip
def test_names_resolve_through_imports(imports: str, expr: str, expected: str) -> None:
    text = imports + "\n"
    source = Source(text, "m.py", ast.parse(text))
    node = ast.parse(expr, mode="eval").body
    assert source.resolve(node) == expected


def test_files_without_the_words_cost_one_parse() -> None:
    facts = probe_python("import torch\n\n\ndef f(x):\n    return x + 1\n", "m.py")
    assert (facts.modules, facts.rank_decay, facts.autograd_gaps, facts.checkpoints) == (
        (),
        (),
        (),
        (),
    )


def test_syntax_errors_propagate() -> None:
    with pytest.raises(SyntaxError):
        probe_python("def (:\n", "m.py")


SCALARS = textwrap.dedent("""
    import torch
    from torch import nn
    from torch.nn import Parameter


    class M(nn.Module):
        def __init__(self, dim, init=0.1):
            super().__init__()
            self.a = nn.Parameter(torch.ones(1))  # scalar
            self.b = nn.Parameter(torch.zeros(()))  # scalar
            self.c = Parameter(torch.tensor(0.5))  # scalar
            self.d = nn.Parameter(torch.tensor([-1.0]))  # scalar
            self.e = nn.Parameter(init * torch.ones(1))  # scalar
            self.f = nn.Parameter(torch.full((1,), init))  # scalar
            self.g = nn.Parameter(torch.ones(1).fill_(init))  # scalar
            self.register_parameter("h", nn.Parameter(torch.randn([])))  # scalar
            self.gain = nn.Parameter(torch.ones(dim))
            self.grid = nn.Parameter(torch.ones(1, 4))
            self.table = nn.Parameter(torch.zeros(4))
            self.frozen = nn.Parameter(torch.ones(1), requires_grad=False)
            self.values = nn.Parameter(torch.tensor(init))
            self.pair = nn.Parameter(torch.tensor([1.0, 2.0]))
""").lstrip()


def test_scalar_and_shape_1_parameters() -> None:
    facts = probe_python(SCALARS, "m.py")
    lines = [n for n, text in enumerate(SCALARS.splitlines(), 1) if text.endswith("# scalar")]
    assert [p.span.line for p in facts.scalar_parameters] == lines
    assert [p.target for p in facts.scalar_parameters] == [
        "self.a", "self.b", "self.c", "self.d", "self.e", "self.f", "self.g", "'h'"
    ]  # fmt: skip
    assert facts.scalar_parameters[0].construct == "nn.Parameter(torch.ones(1))"


def test_a_stored_lambda_that_calls_itself_ends() -> None:
    source = textwrap.dedent("""
        import torch
        from torch import nn


        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.f = lambda x: self.f(x) if x is None else self.lin(x).detach()

            def forward(self, x):
                return self.f(x)
    """)
    (module,) = probe_python(source, "m.py").modules
    (cut,) = module.cuts
    assert cut.function == "M.__init__" and cut.attributes == ("lin",)
