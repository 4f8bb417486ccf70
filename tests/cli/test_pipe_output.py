"""Output in a pipe or a log (stdout no terminal, no $COLUMNS): rich would lay it out in
80 columns; names and keys must come out whole, and no column may be dropped."""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from deadweight import rule_docs, thresholds
from deadweight.cli._console import print_whole
from deadweight.cli.rules import RulePage
from deadweight.registry import all_rules
from tests.cli_runner import deadweight_cli

# What rich reads to decide on a width or a terminal: none of it set, as in a CI job
# that pipes the output to a file.
PIPE = {
    k: v
    for k, v in os.environ.items()
    if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
}
LONG_NAME = "encoder.layers.0.self_attention.rotary_embedding.inverse_frequencies"


def test_inspect_in_a_pipe_keeps_every_column_and_every_name(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model.register_buffer(LONG_NAME.replace(".", "_"), torch.zeros(3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)

    result = deadweight_cli("inspect", path, env=PIPE)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if "name" in line and "dtype" in line)
    for column in ("shape", "min", "max", "mean", "std", "zeros", "nan/inf"):
        assert column in header, header
    assert any(f"model.{LONG_NAME.replace('.', '_')} " in line for line in lines)
    optimizer_row = next(line for line in lines if "ckpt.pt" in line)
    for cell in ("optimizer", "exp_avg, exp_avg_sq", "0.9, 0.999", "1e-08"):
        assert cell in optimizer_row, optimizer_row
    assert "…" not in result.stdout


def test_a_rule_page_in_a_pipe_shows_its_threshold_keys_whole() -> None:
    result = deadweight_cli("rules", "DW302", env=PIPE)
    assert result.returncode == 0, result.stderr
    keys = [key for key, *_ in thresholds.for_rule("DW302")]
    assert "drift-noise-floor-ratio" in keys
    for key in keys:
        assert f" {key} " in result.stdout, key
    assert "…" not in result.stdout


def test_every_rule_page_keeps_its_keys_whole_in_80_columns() -> None:
    """The page's thresholds table wraps its other columns around the keys, pipe or
    terminal alike."""
    for rule in all_rules():
        buffer = io.StringIO()
        Console(file=buffer, width=80).print(RulePage(rule_docs.rule_page(rule)))
        for key, *_ in thresholds.for_rule(rule.code):
            assert f" {key} " in buffer.getvalue(), (rule.code, key)


def test_the_rule_list_in_a_pipe_has_one_whole_line_per_rule() -> None:
    result = deadweight_cli("rules", env=PIPE)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for rule in all_rules():
        (line,) = [line for line in lines if line.split()[:1] == [rule.code]]
        assert f" {rule.name} " in line and rule.summary in line, line


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_at_a_terminal_a_table_still_fits_the_terminal() -> None:
    table = Table("name", "value")
    table.add_row("x" * 150, "1")
    terminal = _Terminal()
    print_whole(table, file=terminal, width=80, color_system=None)
    assert max(map(len, terminal.getvalue().splitlines())) <= 80
    pipe = io.StringIO()
    print_whole(table, file=pipe, width=80)
    assert any("x" * 150 in line for line in pipe.getvalue().splitlines())
