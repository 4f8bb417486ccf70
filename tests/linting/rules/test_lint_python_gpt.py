"""DW501 and DW502 on the code users write: nanoGPT's model.py and train.py (vendored
unmodified in tests/e2e/nanogpt, MIT licence) and minGPT's layout (rebuilt below).

Both keep their submodules in containers (`self.transformer = nn.ModuleDict(dict(wte=...,
h=nn.ModuleList([...]), ln_f=...))`), so a cut is only found if lint follows
`self.transformer.ln_f`, `self.transformer.h` and `for block in self.transformer.h`
to the submodules they are. Each bug is the real file with one line changed, and what
lint says is checked against what autograd does with the edited model.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import deadweight
from deadweight.findings import Severity
from tests.cli_runner import deadweight_cli
from tests.linting.helpers import load

NANOGPT = Path(__file__).parents[2] / "e2e" / "nanogpt"

# The module tree and forward paths of minGPT's mingpt/model.py (github.com/karpathy/minGPT,
# Copyright (c) 2020 Andrej Karpathy, MIT licence), rebuilt small in our own code: the
# embeddings, the blocks and the final norm in one ModuleDict, and a block whose MLP is a
# ModuleDict run through a lambda stored in __init__. Its optimizer groups are chosen by
# module type and name, not by shape.
MINGPT = """
import math

import torch
import torch.nn as nn
from torch.nn import functional as F


class NewGELU(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        causal = torch.tril(torch.ones(block_size, block_size))
        self.register_buffer("bias", causal.view(1, 1, block_size, block_size))
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(n_embd, 4 * n_embd),
            c_proj=nn.Linear(4 * n_embd, n_embd),
            act=NewGELU(),
            dropout=nn.Dropout(0.0),
        ))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer=2, n_head=2, n_embd=16):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head, block_size) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        decay, no_decay = set(), set()
        for mn, m in self.named_modules():
            for pn, p in m.named_parameters():
                fpn = f"{mn}.{pn}" if mn else pn
                if pn.endswith("bias"):
                    no_decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, torch.nn.Linear):
                    decay.add(fpn)
                elif pn.endswith("weight") and isinstance(m, (torch.nn.LayerNorm, torch.nn.Embedding)):
                    no_decay.add(fpn)
        params = dict(self.named_parameters())
        groups = [
            {"params": [params[n] for n in sorted(decay)], "weight_decay": weight_decay},
            {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.block_size else idx[:, -self.block_size:]
            logits, _ = self(idx_cond)
            logits = logits[:, -1, :] / temperature
            if top_k is not None:
                v, _ = torch.topk(logits, top_k)
                logits[logits < v[:, [-1]]] = -float("Inf")
            idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return idx
"""

# (name, line as written, the same line with the bug, the cut construct in it, the class,
# the attributes lint must name). nanoGPT ties wte to lm_head, so wte still learns there.
NANOGPT_CUTS = [
    (
        "detached input of ln_f",
        "        x = self.transformer.ln_f(x)\n",
        "        x = self.transformer.ln_f(x.detach())\n",
        "x.detach()",
        "GPT",
        ["transformer.h", "transformer.wpe"],
    ),
    (
        "ln_f under no_grad",
        "        x = self.transformer.ln_f(x)\n",
        "        with torch.no_grad():\n            x = self.transformer.ln_f(x)\n",
        "torch.no_grad()",
        "GPT",
        ["transformer.h", "transformer.ln_f", "transformer.wpe"],
    ),
    (
        "detached position embedding",
        "        x = self.transformer.drop(tok_emb + pos_emb)\n",
        "        x = self.transformer.drop(tok_emb + pos_emb.detach())\n",
        "pos_emb.detach()",
        "GPT",
        ["transformer.wpe"],
    ),
    (
        "detached attention",  # tests/e2e/test_nanogpt.py's seeded bug, a direct attribute
        "        x = x + self.attn(self.ln_1(x))\n",
        "        x = x + self.attn(self.ln_1(x)).detach()\n",
        "self.attn(self.ln_1(x)).detach()",
        "Block",
        ["attn", "ln_1"],
    ),
]

MINGPT_CUTS = [
    (
        "detached output of the MLP lambda",
        "        x = x + self.mlpf(self.ln_2(x))\n",
        "        x = x + self.mlpf(self.ln_2(x)).detach()\n",
        "self.mlpf(self.ln_2(x)).detach()",
        "Block",
        ["ln_2", "mlp.c_fc", "mlp.c_proj"],
    ),
    (
        "a cut inside the MLP lambda",
        "        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))\n",
        "        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x)).detach()))\n",
        "m.act(m.c_fc(x)).detach()",
        "Block",
        ["ln_2", "mlp.c_fc"],  # ln_2 feeds only the MLP: cut with it
    ),
    (
        "detached output of ln_f",
        "        x = self.transformer.ln_f(x)\n",
        "        x = self.transformer.ln_f(x).detach()\n",
        "self.transformer.ln_f(x).detach()",
        "GPT",
        ["transformer.h", "transformer.ln_f", "transformer.wpe", "transformer.wte"],
    ),
]


def _edit(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def _nanogpt_copy(tmp_path: Path, edit: tuple[str, str] | None = None) -> Path:
    work = tmp_path / "nanogpt"
    shutil.copytree(NANOGPT, work)
    if edit is not None:
        model = work / "model.py"
        model.write_text(_edit(model.read_text(), *edit))
    return work


def _where(text: str, new: str, construct: str) -> tuple[int, int]:
    """1-based line and column of the cut construct in the edited lines."""
    first = text.count("\n", 0, text.index(new)) + 1
    for offset, line in enumerate(new.splitlines()):
        if construct in line:
            return first + offset, line.index(construct) + 1
    raise AssertionError(construct)


def _parameters_without_gradient(model: torch.nn.Module, vocab: int, block: int) -> set[str]:
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab, (2, block), generator=gen)
    _, loss = model(idx, torch.randint(0, vocab, (2, block), generator=gen))
    loss.backward()
    return {n for n, p in model.named_parameters() if p.grad is None}


def _named_by(names: set[str], owner: str, attributes: list[str]) -> set[str]:
    """The parameters the lint attributes of `owner` stand for (Block lives in h.<i>)."""
    out = set()
    for name in names:
        inner = name
        if owner == "Block":
            match = re.fullmatch(r"transformer\.h\.\d+\.(.*)", name)
            if match is None:
                continue
            inner = match.group(1)
        if any(inner.startswith(a + ".") for a in attributes):
            out.add(name)
    return out


@pytest.mark.parametrize("case", NANOGPT_CUTS, ids=[c[0] for c in NANOGPT_CUTS])
def test_dw501_finds_nanogpt_cuts_through_its_module_dict(tmp_path: Path, case: tuple) -> None:
    _, old, new, construct, owner, attributes = case
    work = _nanogpt_copy(tmp_path, (old, new))
    text = (work / "model.py").read_text()
    report = deadweight.lint_paths([work / "model.py"], config=None)
    (finding,) = report.by_code("DW501")
    assert (finding.location.line, finding.location.column) == _where(text, new, construct)
    assert finding.evidence["class"] == owner
    assert finding.evidence["attributes"] == attributes
    # What autograd does with the edited model: exactly those parameters get no gradient.
    module = load(work / "model.py")
    config = module.GPTConfig(block_size=8, vocab_size=32, n_layer=2, n_head=2, n_embd=16)
    model = module.GPT(config)
    missing = _parameters_without_gradient(model, 32, 8)
    assert missing and missing == _named_by({n for n, _ in model.named_parameters()}, owner,
                                            attributes)  # fmt: skip


@pytest.mark.parametrize("case", MINGPT_CUTS, ids=[c[0] for c in MINGPT_CUTS])
def test_dw501_finds_mingpt_cuts_through_module_dicts_and_its_mlp_lambda(
    tmp_path: Path, case: tuple
) -> None:
    _, old, new, construct, owner, attributes = case
    text = _edit(MINGPT.lstrip("\n"), old, new)
    path = tmp_path / "mingpt_model.py"
    path.write_text(text)
    report = deadweight.lint_paths([path], config=None)
    (finding,) = report.by_code("DW501")
    assert (finding.location.line, finding.location.column) == _where(text, new, construct)
    assert finding.evidence["class"] == owner
    assert finding.evidence["attributes"] == attributes
    model = load(path).GPT(vocab_size=32, block_size=8)
    missing = _parameters_without_gradient(model, 32, 8)
    assert missing and missing == _named_by({n for n, _ in model.named_parameters()}, owner,
                                            attributes)  # fmt: skip


def test_dw501_names_submodules_as_the_source_spells_them(tmp_path: Path) -> None:
    work = _nanogpt_copy(tmp_path, NANOGPT_CUTS[1][1:3])
    (finding,) = deadweight.lint_paths([work / "model.py"], config=None).by_code("DW501")
    assert finding.message.startswith(
        "`self.transformer.h`, `self.transformer.ln_f` and `self.transformer.wpe` "
    )
    assert finding.location.function == "GPT.forward"


def test_lint_reports_the_users_line_for_each_nanogpt_cut(tmp_path: Path) -> None:
    """`deadweight lint` at the terminal: file:line:col of every cut, exit 1."""
    expected = []
    paths = []
    for k, (_, old, new, construct, _owner, _attrs) in enumerate(NANOGPT_CUTS[:3]):
        text = _edit((NANOGPT / "model.py").read_text(), old, new)
        path = tmp_path / f"model_{k}.py"
        path.write_text(text)
        paths.append(path)
        line, column = _where(text, new, construct)
        expected.append(f"{path}:{line}:{column}: DW501 forward-gradient-cut:")
    proc = deadweight_cli("lint", "--isolated", "--select", "DW501", *paths)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    found = [ln for ln in proc.stdout.splitlines() if ": DW501 " in ln]
    assert [ln[: len(e)] for ln, e in zip(found, expected, strict=True)] == expected


def test_stock_mingpt_layout_lints_clean(tmp_path: Path) -> None:
    path = tmp_path / "mingpt_model.py"
    path.write_text(MINGPT.lstrip("\n"))
    assert deadweight.lint_paths([path], config=None).findings == ()
    model = load(path).GPT(vocab_size=32, block_size=8)
    assert _parameters_without_gradient(model, 32, 8) == set()  # and it really trains


# ------------------------------------------------------------------ stock nanoGPT


def test_stock_nanogpt_lints_to_one_dw502_info_and_exit_0(tmp_path: Path) -> None:
    """model.py and train.py as shipped: no cut, and the one shape rule reported once,
    as info: nanoGPT has no scalar or shape-[1] parameter for it to exempt."""
    work = _nanogpt_copy(tmp_path)
    report = deadweight.lint_paths([work], config=None)
    assert report.by_code("DW501") == []
    (finding,) = report.findings
    model = (work / "model.py").read_text().splitlines()
    first = next(n for n, t in enumerate(model, 1) if "p.dim() >= 2]" in t)
    assert finding.code == "DW502" and finding.severity is Severity.INFO
    assert (finding.location.file, finding.location.line) == (str(work / "model.py"), first)
    assert finding.evidence["expression"] == "p.dim() >= 2"
    assert finding.evidence["partners"] == [
        {"line": first + 1, "column": model[first].index("p.dim() < 2") + 1,
         "expression": "p.dim() < 2"}
    ]  # fmt: skip
    assert finding.evidence["scalar_parameters"] == []
    proc = deadweight_cli("lint", "--isolated", work / "model.py", work / "train.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": DW502 ") == 1


def test_nanogpt_with_a_layer_scalar_makes_dw502_a_warning(tmp_path: Path) -> None:
    """tests/e2e/test_nanogpt.py's second seeded bug: a shape-[1] scalar in front of
    ln_f, which the `p.dim() < 2` group exempts from decay (check's DW203 sees it drift)."""
    init = "ln_f = LayerNorm(config.n_embd, bias=config.bias),\n        ))\n"
    scalar = "        self.scale = nn.Parameter(torch.ones(1))\n"
    work = _nanogpt_copy(tmp_path, (init, init + scalar))
    proc = deadweight_cli("lint", "--isolated", "--format", "json", work)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = deadweight.lint_paths([work], config=None)
    (finding,) = report.by_code("DW502")
    assert finding.severity is Severity.WARNING
    line = (work / "model.py").read_text().splitlines().index(scalar.rstrip("\n")) + 1
    assert finding.evidence["scalar_parameters"] == [
        {"file": str(work / "model.py"), "line": line, "parameter": "self.scale",
         "construct": "nn.Parameter(torch.ones(1))"}
    ]  # fmt: skip
    assert "self.scale" in finding.message
