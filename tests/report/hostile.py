"""Names that are markup or terminal control sequences, and the checkpoints and reports
that carry them: every renderer must show them as text."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from deadweight.findings import Finding, Location, Severity
from deadweight.report import Report

# rich markup, a rich link, plotly's mini-HTML (a link, bold), an OSC 52 clipboard write
# and a clear-screen sequence.
HOSTILE = [
    "[bold]x[/]",
    "w[/bold]",
    "[link=https://evil.example]x[/link]",
    '<a href="https://evil.example/x">y</a>',
    "<b>z</b>",
    "\x1b]52;c;aGk=\x07",
    "\x1b[2J",
]
# How the terminal shows them: control characters as visible escapes, the rest as is.
SHOWN = {name: name.replace("\x1b", r"\x1b").replace("\x07", r"\x07") for name in HOSTILE}
GAINS = [1.0, 1.05, 0.95, 40.0]  # the last layer's gain stands out (DW402)

# What styling or a live link would leave in a terminal's byte stream.
OSC = "\x1b]"  # OSC 8 hyperlinks, OSC 52 clipboard writes
CLEAR = "\x1b[2J"
SGR = re.compile(r"\x1b\[[0-9;]*m")  # colours and bold, which --color may add


def save_hostile(path: Path, scale: float = 1.0, *, extra: str) -> str:
    """Per hostile name: a 4x4 matrix, four layer gains (the last an outlier) and one
    tensor only this file has (`extra`)."""
    tensors: dict[str, torch.Tensor] = {}
    for k, name in enumerate(HOSTILE):
        tensors[name] = torch.full((4, 4), scale * (k + 1)) + torch.arange(16.0).reshape(4, 4)
        for i, gain in enumerate(GAINS):
            tensors[f"{name}.{i}.gain"] = torch.tensor([gain * scale])
        tensors[f"{name}.{extra}"] = torch.ones(2)
    save_file(tensors, str(path))
    return str(path)


def hostile_report() -> Report:
    """A saved report from elsewhere whose every string field carries the hostile names."""
    joined = " ".join(HOSTILE)
    finding = Finding(
        code="DW402",
        name="layer-outlier",
        severity=Severity.WARNING,
        message=f"{joined} stands out",
        params=tuple(HOSTILE),
        location=Location(module=HOSTILE[3], function=HOSTILE[5]),
        evidence={
            "template": joined,
            "values": {f"{n}.{i}": float(i + 1) for i, n in enumerate(HOSTILE)},
        },
        fix=f"look at {joined}",
    )
    return Report.of("check", [finding], {"model": joined, "parameters": 7})


def strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *strings(v)]]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return []


def figures(page: str) -> list[Any]:
    """The data and layout of every plotly figure of a page."""
    decoder = json.JSONDecoder()
    out = []
    for match in re.finditer(r'Plotly\.newPlot\(\s*"[^"]+",\s*', page):
        data, end = decoder.raw_decode(page, match.end())
        layout, _ = decoder.raw_decode(page, page.index("{", end))
        out.append([data, layout])
    return out
