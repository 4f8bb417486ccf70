"""Shared by the lint tests: write a source, lint it, and check it against real autograd."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import deadweight
from deadweight.report import Report

# A model whose encoder runs under no_grad: the lint tests' one cut (DW501).
CUT = """
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            h = self.enc(x)
        return h * 2
"""


def write(tmp_path: Path, source: str, name: str = "model.py") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source).lstrip("\n"), encoding="utf-8")
    return path


def lint_source(tmp_path: Path, source: str, name: str = "model.py", **kwargs: Any) -> Report:
    path = write(tmp_path, source, name)
    kwargs.setdefault("config", None)
    return deadweight.lint_paths([path], **kwargs)


def marked(source: str, marker: str) -> list[int]:
    """1-based numbers of the lines of the (dedented) source that end in `# marker` or `// marker`."""
    lines = textwrap.dedent(source).lstrip("\n").splitlines()
    return [
        n
        for n, line in enumerate(lines, start=1)
        if line.rstrip().endswith((f"# {marker}", f"// {marker}"))
    ]


def lines_of(report: Report, code: str) -> list[int]:
    return [f.location.line for f in report.findings if f.code == code and f.location]


def positions(report: Report, code: str) -> list[tuple[int, int]]:
    return [
        (f.location.line, f.location.column)  # type: ignore[misc]
        for f in report.findings
        if f.code == code and f.location
    ]


def load(path: Path) -> ModuleType:
    name = f"_dw_lint_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def without_grad(model: torch.nn.Module, *inputs: torch.Tensor) -> set[str]:
    """Reference: names of trainable parameters left without a gradient by one backward."""
    out = model(*inputs)
    outputs = out if isinstance(out, tuple) else (out,)
    loss = sum(o.float().sum() for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    return {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
