"""Reading lint inputs that could hang or exhaust memory: a FIFO swapped in after the
check, and files whose syntax tree would take gigabytes (issue 20)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

from deadweight.linting import source_files
from deadweight.linting.source_files import MAX_TOKENS, SourceProblem, count_tokens

# Opens a FIFO while os.stat, as any check before the open would, says it is a regular
# file (the file was swapped between the check and the open): reading must not wait.
SWAPPED = """
import os, stat, sys
from deadweight.linting import source_files

real = os.stat


def regular(path, *args, **kwargs):
    info = real(path, *args, **kwargs)
    fields = list(info)
    fields[stat.ST_MODE] = stat.S_IFREG | 0o644
    return os.stat_result(fields)


os.stat = regular
print(source_files.read_bytes(sys.argv[1]))
"""


def test_a_fifo_swapped_in_after_the_check_is_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "x.py"
    os.mkfifo(fifo)
    done = subprocess.run(
        [sys.executable, "-c", SWAPPED, str(fifo)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{fifo}: not a regular file; not linted\n"


SAMPLES = {
    "model": textwrap.dedent(
        '''
        import torch
        from torch import nn


        class Block(nn.Module):
            """A docstring: words, (punctuation) and 'quotes'."""

            def __init__(self, width: int = 64) -> None:
                super().__init__()
                self.proj = nn.Linear(width, width * 4, bias=False)  # a comment

            def forward(self, x):
                y = self.proj(x) ** 2 - 1.5e-3
                return f"{y!r:>10}" if x.ndim >= 2 else y[..., ::2]
        '''
    ),
    "dense table": "x = [" + "1, -2.5, 0x1F, 'a'," * 50 + "]\n",
    "statements": "pass\nx\ny;z\n\n\n" * 20,
    "unicode": "größe = 1  # ü\nπ = größe + 1\n",
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_the_token_count_never_undercounts_the_tokenizer(name: str) -> None:
    """Compared with Python's own tokenizer (the slow reference): the estimate may count
    more, never fewer, so it never lets a file past the limit that the parser would
    find over it."""
    text = SAMPLES[name]
    real = sum(
        1
        for token in tokenize.generate_tokens(io.StringIO(text).readline)
        if token.type not in (tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    )
    estimate = count_tokens(text.encode())
    assert real <= estimate <= 2 * real + 10


def test_a_file_with_too_many_tokens_is_a_problem_and_a_small_one_is_not() -> None:
    assert source_files.too_many_tokens("small.py", b"x = 1\n" * 1000) is None
    # Long but sparse (one long string) is fine: few tokens, a small syntax tree.
    assert source_files.too_many_tokens("s.py", b"x = '" + b"a" * (2 * MAX_TOKENS) + b"'\n") is None
    dense = b"x = [" + b"1," * MAX_TOKENS + b"]\n"
    problem = source_files.too_many_tokens("dense.py", dense)
    assert isinstance(problem, SourceProblem) and problem.path == "dense.py"
    assert problem.message.startswith("about 6.0 million tokens")
    assert problem.message.endswith("; not linted")
