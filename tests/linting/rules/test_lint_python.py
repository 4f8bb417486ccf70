"""DW501-DW504 on Python sources: each rule fires at the exact line and column on the
pattern, stays quiet on ordinary correct code, and DW501's verdicts agree with what
autograd actually does when the module runs."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests.linting.helpers import (
    lines_of,
    lint_source,
    load,
    marked,
    positions,
    without_grad,
    write,
)

HEADER = """
import torch
import torch.nn.functional as F
from torch import nn
"""


def src(body: str) -> str:
    return HEADER + textwrap.dedent(body)


# ------------------------------------------------------------------ DW501: cases that fire

CUT_CASES = {
    "no_grad block around a submodule": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc = nn.Linear(4, 4)
                self.head = nn.Linear(4, 1)

            def forward(self, x):
                with torch.no_grad():  # DW501
                    h = self.enc(x)
                return self.head(h)
        """,
        {"enc.weight", "enc.bias"},
    ),
    "lookup table read under no_grad in a helper, passed as an argument": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.rel_bias = nn.Linear(8, 1, bias=False)
                self.proj = nn.Linear(4, 4)

            def _lookup(self, buckets, bias):
                with torch.no_grad():  # DW501
                    table = bias.weight[:, buckets]
                return table.transpose(0, 1)

            def _position_bias(self, x):
                buckets = torch.arange(x.shape[-1]) % 8
                return self._lookup(buckets, self.rel_bias)

            def forward(self, x):
                return self.proj(x) + self._position_bias(x).sum()
        """,
        {"rel_bias.weight"},
    ),
    ".item() of a parameter turned back into math": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = nn.Parameter(torch.ones(1))
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                s = self.scale.item()  # DW501
                return self.lin(x) * s
        """,
        {"scale"},
    ),
    ".data of a weight in F.linear": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.randn(4, 4))

            def forward(self, x):
                return F.linear(x, self.weight.data)  # DW501
        """,
        {"weight"},
    ),
    ".detach() of a parameter": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.gain = nn.Parameter(torch.ones(4))
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                g = self.gain.detach()  # DW501
                return self.lin(x) * g
        """,
        {"gain"},
    ),
    "helper method decorated with no_grad": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.norm = nn.LayerNorm(4)
                self.head = nn.Linear(4, 1)

            @torch.no_grad()  # DW501
            def _normalise(self, x):
                return self.norm(x)

            def forward(self, x):
                return self.head(self._normalise(x))
        """,
        {"norm.weight", "norm.bias"},
    ),
    "module-level function decorated with inference_mode": (
        """
        @torch.inference_mode()  # DW501
        def rms(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.g = nn.Parameter(torch.ones(4))
                self.head = nn.Linear(4, 1)

            def forward(self, x):
                return self.head(rms(x, self.g).clone())
        """,
        None,  # inference tensors cannot be saved for backward: not runnable as a reference
    ),
    "tensor rebuilt from .tolist()": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.offsets = nn.Parameter(torch.zeros(4))

            def forward(self, x):
                shift = torch.tensor(self.offsets.tolist())  # DW501
                return x * 2 + shift
        """,
        {"offsets"},
    ),
    "in-place detach_ of the hidden state": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc = nn.Linear(4, 4)
                self.head = nn.Linear(4, 1)

            def forward(self, x):
                h = self.enc(x)
                h.detach_()  # DW501
                return self.head(h)
        """,
        {"enc.weight", "enc.bias"},
    ),
    "set_grad_enabled(False) around a block of the same file": (
        """
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return torch.relu(self.fc(x))

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList([Block() for _ in range(2)])
                self.head = nn.Linear(4, 1)

            def forward(self, x):
                with torch.set_grad_enabled(False):  # DW501
                    for block in self.blocks:
                        x = block(x)
                return self.head(x)
        """,
        {"blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight", "blocks.1.fc.bias"},
    ),
    "one member of a ModuleList, by index": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 1)])

            def forward(self, x):
                h = self.layers[0](x).detach()  # DW501
                return self.layers[1](h)
        """,
        {"layers.0.weight", "layers.0.bias"},
    ),
    "one member of a Sequential under no_grad": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))

            def forward(self, x):
                with torch.no_grad():  # DW501
                    h = self.net[1](self.net[0](x))
                return self.net[2](h)
        """,
        {"net.0.weight", "net.0.bias"},
    ),
    "one head of a ModuleDict, by key": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.heads = nn.ModuleDict({"enc": nn.Linear(4, 4), "out": nn.Linear(4, 1)})

            def forward(self, x):
                h = self.heads["enc"](x)
                return self.heads["out"](h.detach())  # DW501
        """,
        {"heads.enc.weight", "heads.enc.bias"},
    ),
    "a ModuleDict of dict(...), nested containers and a loop over one": (
        """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = nn.ModuleDict(dict(
                    stem=nn.Linear(4, 4),
                    h=nn.ModuleList([nn.Linear(4, 4) for _ in range(2)]),
                    head=nn.Sequential(nn.GELU(), nn.Linear(4, 1)),
                ))

            def forward(self, x):
                x = self.body.stem(x)
                for layer in self.body.h:
                    x = layer(x)
                return self.body.head(x.detach())  # DW501
        """,
        {
            "body.stem.weight",
            "body.stem.bias",
            "body.h.0.weight",
            "body.h.0.bias",
            "body.h.1.weight",
            "body.h.1.bias",
        },
    ),
    "blocks in a Sequential built from a starred list (minGPT's first layout)": (
        """
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)

            def forward(self, x):
                return x + self.fc(x)

        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.Sequential(*[Block() for _ in range(2)])
                self.head = nn.Linear(4, 1)

            def forward(self, x):
                with torch.no_grad():  # DW501
                    x = self.blocks(x)
                return self.head(x)
        """,
        {"blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight", "blocks.1.fc.bias"},
    ),
}


@pytest.mark.parametrize("case", list(CUT_CASES))
def test_dw501_fires_where_autograd_really_loses_the_gradient(tmp_path: Path, case: str) -> None:
    body, truth = CUT_CASES[case]
    source = src(body)
    report = lint_source(tmp_path, source)
    assert lines_of(report, "DW501") == marked(source, "DW501")
    if truth is not None:
        module = load(tmp_path / "model.py")
        assert without_grad(module.M(), torch.randn(3, 4)) == truth


def test_dw501_position_message_and_function(tmp_path: Path) -> None:
    source = src(CUT_CASES["lookup table read under no_grad in a helper, passed as an argument"][0])
    report = lint_source(tmp_path, source)
    (finding,) = report.by_code("DW501")
    line = marked(source, "DW501")[0]
    # `torch.no_grad()` starts at column 14 of `        with torch.no_grad():`
    assert (finding.location.line, finding.location.column) == (line, 14)
    assert (finding.location.end_line, finding.location.end_column) == (line, 29)
    assert finding.location.function == "M._lookup"
    assert "`self.rel_bias` (nn.Linear) of M gets no gradient" in finding.message
    assert "torch.no_grad()" in finding.message
    assert finding.evidence["attributes"] == ["rel_bias"]


def test_dw501_columns_count_characters_not_bytes(tmp_path: Path) -> None:
    source = src("""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            échelle = "é"; s = self.w.item()  # DW501
            return x * s
    """)
    report = lint_source(tmp_path, source)
    assert positions(report, "DW501") == [(marked(source, "DW501")[0], 28)]


# ------------------------------------------------------------------ DW501: must not fire

HEALTHY = {
    "detach for logging and metrics": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc = nn.Linear(4, 4)
                self.head = nn.Linear(4, 1)

            def forward(self, x):
                h = self.enc(x)
                self.last_activation = h.detach()
                print("mean", h.detach().mean().item())
                stats = {"norm": self.head.weight.detach().norm().item()}
                return self.head(h)
    """,
    "item() to print the loss": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 1)

            def forward(self, x, y=None):
                out = self.lin(x)
                if y is not None:
                    loss = F.mse_loss(out, y)
                    print(f"loss {loss.item():.4f}")
                    if loss.item() > 10:
                        print("diverging")
                return out
    """,
    "no_grad in evaluate() and an EMA update": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = nn.Linear(4, 1)
                self.ema = nn.Linear(4, 1)
                self.ema.requires_grad_(False)

            def forward(self, x):
                with torch.no_grad():
                    for pe, p in zip(self.ema.parameters(), self.net.parameters()):
                        pe.mul_(0.99).add_(p, alpha=0.01)
                return self.net(x)

            @torch.no_grad()
            def evaluate(self, x):
                return self.ema(x)
    """,
    "straight-through estimator": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.codebook = nn.Embedding(8, 4)
                self.enc = nn.Linear(4, 4)

            def forward(self, x):
                z = self.enc(x)
                idx = torch.cdist(z, self.codebook.weight).argmin(-1)
                q = self.codebook(idx)
                commitment = ((q - z.detach()) ** 2).mean()
                out = z + (q - z).detach()
                return out, commitment
    """,
    "stop-gradient on one of two branches": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.enc = nn.Linear(4, 4)
                self.head = nn.Linear(4, 1)
                self.aux = nn.Linear(4, 1)

            def forward(self, x):
                h = self.enc(x)
                return self.head(h) + self.aux(h.detach())
    """,
    "backbone frozen on purpose": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.backbone = nn.Linear(4, 4)
                self.teacher = nn.Linear(4, 4)
                for p in self.teacher.parameters():
                    p.requires_grad = False
                self.backbone.requires_grad_(False)
                self.head = nn.Linear(4, 1)

            def forward(self, x):
                with torch.no_grad():
                    h = self.backbone(x) + self.teacher(x)
                return self.head(h)
    """,
    "index arithmetic and shapes under no_grad": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.randn(4, 4))
                self.drop = nn.Dropout(0.1)

            def forward(self, x):
                with torch.no_grad():
                    n = self.weight.data.shape[0]
                    mask = x.abs() > 0
                    pos = torch.arange(n)
                    y = self.drop(x)
                return (x @ self.weight)[..., pos] * mask + y
    """,
    "rotary embedding with buffers under a no_grad forward": """
        class Rotary(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("inv_freq", torch.ones(2))
                self.table = nn.Buffer(torch.ones(4, 2))

            @torch.no_grad()
            def forward(self, x):
                return x[..., :2] * self.inv_freq * self.table[0]
    """,
    "a flag decided at run time": """
        class M(nn.Module):
            def __init__(self, freeze=False):
                super().__init__()
                self.enc = nn.Linear(4, 4)
                self.head = nn.Linear(4, 1)
                self.freeze = freeze

            def forward(self, x):
                h = self.enc(x)
                if self.freeze:
                    h = h.detach()
                with torch.set_grad_enabled(self.training):
                    h = h * 2
                return self.head(h)
    """,
    "parameter created without requires_grad": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.table = nn.Parameter(torch.ones(4), requires_grad=False)
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                return self.lin(x) * self.table.detach()
    """,
    "reversible layer that runs its own backward": """
        class Reversible(nn.Module):
            def __init__(self):
                super().__init__()
                self.f = nn.Linear(4, 4)

            def forward(self, x):
                with torch.no_grad():
                    return x + self.f(x)

            def backward_pass(self, y, grad):
                with torch.enable_grad():
                    y = y.detach().requires_grad_()
                    out = self.f(y)
                    torch.autograd.backward(out, grad)
    """,
    "a scorer under no_grad that returns only top-k indices": """
        class Indexer(nn.Module):
            def __init__(self):
                super().__init__()
                self.wq = nn.Linear(4, 4)
                self.wk = nn.Linear(4, 4)

            @torch.no_grad()
            def forward(self, x):
                scores = self.wq(x) @ self.wk(x).transpose(-1, -2)
                chosen = scores.argmax(-1)
                return scores.topk(2, dim=-1).indices.to(torch.int32), chosen.long()
    """,
    "tied weights: the cut copy is the same tensor as a live one": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj_in = nn.Linear(4, 4, bias=False)
                self.proj_out = nn.Linear(4, 4, bias=False)
                self.proj_out.weight = self.proj_in.weight

            def forward(self, x):
                h = self.proj_in(x).detach()
                return self.proj_out(h)
    """,
    "a ModuleDict member picked by a key known only at run time": """
        class M(nn.Module):
            def __init__(self, task="enc"):
                super().__init__()
                self.heads = nn.ModuleDict({"enc": nn.Linear(4, 4), "dec": nn.Linear(4, 4)})
                self.task = task

            def forward(self, x):
                h = self.heads["enc"](x).detach()
                return self.heads[self.task](h)
    """,
    "a container changed after it is built": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Identity()})
                self.blocks["b"] = self.blocks["a"]  # its keys no longer say what they hold

            def forward(self, x):
                h = self.blocks["a"](x).detach()
                return self.blocks["b"](h)
    """,
    "a parameter replaced by a slice of itself (nanoGPT's crop_block_size)": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.parts = nn.ModuleDict(dict(wpe=nn.Embedding(8, 4), head=nn.Linear(4, 1)))

            def forward(self, x):
                return self.parts.head(x + self.parts.wpe.weight[: x.shape[0]])

            def crop(self, n):
                self.parts.wpe.weight = nn.Parameter(self.parts.wpe.weight[:n].detach())
    """,
    "scalar used in a condition and in math": """
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = nn.Parameter(torch.ones(1))

            def forward(self, x):
                if self.scale.item() > 1.0:
                    x = x * 2
                return x * self.scale
    """,
}


@pytest.mark.parametrize("case", list(HEALTHY))
def test_dw501_quiet_on_ordinary_code(tmp_path: Path, case: str) -> None:
    report = lint_source(tmp_path, src(HEALTHY[case]))
    assert report.by_code("DW501") == []


def test_dw501_quiet_cases_really_train(tmp_path: Path) -> None:
    """The healthy cases above that claim a gradient arrives: autograd agrees."""
    for case, expected in [
        ("straight-through estimator", set()),
        ("stop-gradient on one of two branches", set()),
        ("detach for logging and metrics", set()),
        ("tied weights: the cut copy is the same tensor as a live one", set()),
        ("a container changed after it is built", set()),
        ("a parameter replaced by a slice of itself (nanoGPT's crop_block_size)", set()),
    ]:
        path = write(tmp_path, src(HEALTHY[case]), f"{case.replace(' ', '_')}.py")
        assert without_grad(load(path).M(), torch.randn(3, 4)) == expected, case


# ------------------------------------------------------------------ DW502

MEGATRON = """
def get_param_groups(model, weight_decay):
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if len(param.shape) == 1:  # DW502
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
"""

NANOGPT = """
def configure_optimizers(self, weight_decay, learning_rate):
    param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]  # DW502
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]  # its partner
    optim_groups = [
        {"params": decay_params, "weight_decay": weight_decay},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(optim_groups, lr=learning_rate)
"""

OTHER_FORMS = """
def groups(model, wd):
    return [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": wd}]  # DW502


def per_parameter(model, wd):
    for name, p in model.named_parameters():
        p_wd = 0.0 if p.ndimension() == 1 else wd  # DW502


def flags(model):
    for name, p in model.named_parameters():
        no_decay = p.ndim < 2 or name.endswith(".bias")  # DW502


def skipping(model):
    decay = []
    for p in model.parameters():
        if len(p.size()) <= 1:  # DW502
            continue
        decay.append(p)
    return decay
"""

# One function, two rules: `>= 2`, `< 2` and `<= 1` draw the same line (one rule, written
# three times); `== 1` draws another (a rank-0 tensor is decayed by it).
ONE_FUNCTION = """
def groups(model, wd):
    out = [{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": wd}]  # DW502
    for name, p in model.named_parameters():
        p_wd = 0.0 if p.ndimension() == 1 else wd  # DW502
        no_decay = p.ndim < 2 or name.endswith(".bias")  # partner
    decay = []
    for p in model.parameters():
        if len(p.size()) <= 1:  # partner
            continue
        decay.append(p)
    return out, decay
"""

# The corrected version of the seed: groups by what a parameter is (name and module type).
NAME_BASED = """
def configure_optimizers(model, weight_decay):
    decay, no_decay = set(), set()
    whitelist = (torch.nn.Linear,)
    blacklist = (torch.nn.LayerNorm, torch.nn.Embedding)
    for mn, m in model.named_modules():
        for pn, p in m.named_parameters(recurse=False):
            fpn = f"{mn}.{pn}" if mn else pn
            if pn.endswith("bias"):
                no_decay.add(fpn)
            elif pn.endswith("weight") and isinstance(m, whitelist):
                decay.add(fpn)
            elif pn.endswith("weight") and isinstance(m, blacklist):
                no_decay.add(fpn)
            else:
                decay.add(fpn)
    return decay, no_decay


def with_deadweight(model, weight_decay):
    import deadweight

    return torch.optim.AdamW(deadweight.param_groups(model, weight_decay=weight_decay), lr=3e-4)
"""

SHAPE_CHECKS_NOT_ABOUT_DECAY = """
class M(nn.Module):
    def forward(self, x):
        if x.dim() == 3:
            x = x.unsqueeze(0)
        assert len(x.shape) == 4
        return x


def init_weights(model):
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)


def build(model, weight_decay):
    for p in model.parameters():
        if p.ndim >= 2:
            nn.init.normal_(p, std=0.02)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=weight_decay)
"""


@pytest.mark.parametrize(
    "source", [MEGATRON, NANOGPT, OTHER_FORMS], ids=["megatron", "nanogpt", "forms"]
)
def test_dw502_fires_at_the_rank_test(tmp_path: Path, source: str) -> None:
    source = HEADER + source
    report = lint_source(tmp_path, source)
    assert lines_of(report, "DW502") == marked(source, "DW502")


def test_dw502_reports_one_rule_once_with_its_partners(tmp_path: Path) -> None:
    source = HEADER + NANOGPT
    (finding,) = lint_source(tmp_path, source).by_code("DW502")
    (line,) = marked(source, "its partner")
    assert finding.location.line == marked(source, "DW502")[0]
    column = textwrap.dedent(source).lstrip("\n").splitlines()[line - 1].index("p.dim() < 2") + 1
    assert finding.evidence["partners"] == [
        {"line": line, "column": column, "expression": "p.dim() < 2"}
    ]
    assert "(with its partner `p.dim() < 2`)" in finding.message
    source = HEADER + ONE_FUNCTION
    report = lint_source(tmp_path, source)
    assert lines_of(report, "DW502") == marked(source, "DW502")
    first, second = report.by_code("DW502")
    assert [p["line"] for p in first.evidence["partners"]] == marked(source, "partner")
    assert [p["expression"] for p in first.evidence["partners"]] == ["p.ndim < 2",
                                                                      "len(p.size()) <= 1"]  # fmt: skip
    assert second.evidence["partners"] == []


def test_dw502_seed_position_and_fix(tmp_path: Path) -> None:
    source = HEADER + MEGATRON
    (finding,) = lint_source(tmp_path, source).by_code("DW502")
    assert (finding.location.line, finding.location.column) == (marked(source, "DW502")[0], 12)
    assert finding.location.function == "get_param_groups"
    assert "`len(param.shape) == 1`" in finding.message
    assert "deadweight.param_groups" in finding.message + finding.fix


@pytest.mark.parametrize(
    "source", [NAME_BASED, SHAPE_CHECKS_NOT_ABOUT_DECAY], ids=["names", "shapes"]
)
def test_dw502_quiet_on_name_based_groups_and_other_shape_checks(
    tmp_path: Path, source: str
) -> None:
    assert lint_source(tmp_path, HEADER + source).by_code("DW502") == []


# ------------------------------------------------------------------ DW503

AUTOGRAD_GAPS = """
class ScaledMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scale):
        ctx.save_for_backward(x, weight)
        return x @ weight * scale

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight.T, None, None  # DW503


class Mix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        return x * w

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # DW503


def mixed(layer, x):
    return Mix.apply(x, layer.weight)


class StopEverything(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return None  # DW503


class Rounded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = torch.round(x)
        ctx.mark_non_differentiable(out)  # DW503
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


@torch.library.custom_op("mylib::fused_norm", mutates_args=())  # DW503
def fused_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


lib = torch.library.Library("mylib2", "DEF")
lib.define("gelu_fast(Tensor x) -> Tensor")  # DW503
lib.impl("gelu_fast", lambda x: torch.from_numpy(x.detach().numpy() * 0.5), "CPU")  # a native kernel
"""

AUTOGRAD_HEALTHY = """
class Clamp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, low, high, inplace=False):
        ctx.save_for_backward(x)
        ctx.low, ctx.high = low, high
        return x.clamp(low, high)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ((x > ctx.low) & (x < ctx.high)), None, None, None


class TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        values, indices = x.topk(k)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        return values, indices

    @staticmethod
    def backward(ctx, grad_values, grad_indices):
        return grad_values, None


@torch.library.custom_op("mylib::norm", mutates_args=())
def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


def _norm_backward(ctx, grad):
    return grad, grad


norm.register_autograd(_norm_backward)


@torch.library.custom_op("mylib::fill", mutates_args=("out",))
def fill(out: torch.Tensor, value: float) -> None:
    out.fill_(value)


lib = torch.library.Library("mylib3", "DEF")
lib.define("square(Tensor x) -> Tensor")
lib.impl("square", lambda x: x * x, "CompositeImplicitAutograd")
lib.define("count(Tensor x) -> int")
"""


def test_dw503_fires_on_each_kind_of_gap(tmp_path: Path) -> None:
    source = HEADER + AUTOGRAD_GAPS
    report = lint_source(tmp_path, source)
    assert lines_of(report, "DW503") == marked(source, "DW503")
    messages = [f.message for f in report.by_code("DW503")]
    assert "input 2 ('weight')" in messages[0]
    assert "Mix.apply receives layer.weight" in messages[1]
    assert "no gradient for any of its inputs" in messages[2]
    assert "marked non-differentiable" in messages[3]
    assert "'fused_norm'" in messages[4] and "custom_op" in messages[4]
    assert "'gelu_fast'" in messages[5]


def test_dw503_gaps_are_real(tmp_path: Path) -> None:
    """What DW503 says, autograd does: weight gets no gradient, the custom op cannot backward."""
    module = load(write(tmp_path, HEADER + AUTOGRAD_GAPS))
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3, requires_grad=True)
    module.ScaledMatmul.apply(x, w, 2.0).sum().backward()
    assert x.grad is not None and w.grad is None
    y = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        module.fused_norm(y, torch.ones(3)).sum().backward()
    z = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="autograd kernel was not registered"):
        (torch.ops.mylib2.gelu_fast(z) * 2).sum().backward()
    assert z.grad is None


def test_dw503_quiet_on_flags_indices_and_registered_ops(tmp_path: Path) -> None:
    assert lint_source(tmp_path, HEADER + AUTOGRAD_HEALTHY).by_code("DW503") == []


# ------------------------------------------------------------------ DW504

CHECKPOINTS = """
import functools
import torch.utils.checkpoint as cp
from torch.utils.checkpoint import checkpoint as ckpt, checkpoint_sequential


def run(block, blocks, x):
    a = torch.utils.checkpoint.checkpoint(block, x)  # DW504
    b = cp.checkpoint(block, x, use_reentrant=True)  # DW504
    c = ckpt(block, x)  # DW504
    d = checkpoint_sequential(blocks, 2, x)  # DW504
    f = functools.partial(ckpt, preserve_rng_state=False)  # DW504
    return a, b, c, d, f


def later(block, x):
    from torch.utils import checkpoint

    return checkpoint.checkpoint(block, x)  # DW504
"""

CHECKPOINTS_HEALTHY = """
import functools
from torch.utils.checkpoint import checkpoint


def checkpoint_model(model):  # a function of one's own that happens to be called so
    return model


def run(block, x, flag, **kwargs):
    a = checkpoint(block, x, use_reentrant=False)
    b = checkpoint(block, x, **kwargs)
    c = checkpoint(block, x, use_reentrant=flag)
    d = functools.partial(checkpoint, use_reentrant=False)
    e = checkpoint_model(block)
    block.checkpoint()
    return a, b, c, d, e
"""


def test_dw504_fires_under_every_import_name(tmp_path: Path) -> None:
    source = HEADER + CHECKPOINTS
    report = lint_source(tmp_path, source)
    assert lines_of(report, "DW504") == marked(source, "DW504")
    first = report.by_code("DW504")[0]
    assert first.location.column == 9 and "use_reentrant=False" in first.message


def test_dw504_quiet_when_use_reentrant_false_or_forwarded(tmp_path: Path) -> None:
    assert lint_source(tmp_path, HEADER + CHECKPOINTS_HEALTHY).by_code("DW504") == []


def test_dw504_reentrant_really_drops_gradients_without_inputs_requiring_grad() -> None:
    """The failure DW504 warns about, on this torch."""
    block = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)  # raw input: requires no grad
    with pytest.warns(UserWarning):
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
    assert not out.requires_grad and block.weight.grad is None
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    out.sum().backward()
    assert block.weight.grad is not None


def test_dw501_agrees_with_autograd_on_transformers_layoutlmv3(tmp_path: Path) -> None:
    """Real model code: the attributes DW501 names are exactly the parameters left without a
    gradient by one backward through a tiny LayoutLMv3 (whatever this transformers has)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.layoutlmv3 import modeling_layoutlmv3

    import deadweight

    report = deadweight.lint_paths([modeling_layoutlmv3.__file__], config=None)
    flagged = {
        f"encoder.{a}.weight"
        for f in report.by_code("DW501")
        if f.evidence["class"] == "LayoutLMv3Encoder"
        for a in f.evidence["attributes"]
    }
    config = transformers.LayoutLMv3Config(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, max_2d_position_embeddings=128,
        coordinate_size=6, shape_size=4, has_relative_attention_bias=True,
        has_spatial_attention_bias=True, visual_embed=False,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    model = transformers.LayoutLMv3Model(config)
    ids = torch.randint(0, 100, (2, 8), generator=gen)
    bbox = torch.randint(0, 60, (2, 8, 4), generator=gen)
    bbox[..., 2:] += bbox[..., :2]
    model(input_ids=ids, bbox=bbox).last_hidden_state.sum().backward()
    missing = {n for n, p in model.named_parameters() if p.grad is None}
    assert flagged == missing


QUANTIZED = """
class QuantMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, scales, bias):
        return x @ (weight.float() * scales).T + bias

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None  # DW503


class QuantLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
        self.register_buffer("scales", torch.ones(4))
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        return QuantMatmul.apply(x, self.weight, self.scales, self.bias)
"""


def test_dw503_frozen_quantized_weight_is_fine_but_its_trainable_bias_is_not(
    tmp_path: Path,
) -> None:
    source = src(QUANTIZED)
    report = lint_source(tmp_path, source)
    (finding,) = report.by_code("DW503")
    assert finding.location.line == marked(source, "DW503")[0]
    assert finding.location.column == 34  # the fourth None, for `bias`
    assert "input 4 ('bias')" in finding.message and "receives self.bias" in finding.message
