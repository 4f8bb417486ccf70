"""`deadweight lint`, end to end in subprocesses: diagnostics an editor can jump to, JSON and
SARIF, exit codes 0/1/2, configuration errors, and bad files among good ones."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.linting.helpers import CUT, write

TIMEOUT = 300  # generous: shared CI machines
ENV = {**os.environ, "COLUMNS": "200"}

CLEAN = "import torch\n\n\ndef f(x):\n    return x.detach().cpu().numpy()\n"
RUST = """
use candle_nn::ops;

fn attend(x: &candle::Tensor) -> candle::Result<candle::Tensor> {
    ops::softmax_last_dim(x)
}
"""


def dw(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deadweight", "lint", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=ENV,
        cwd=cwd,
    )


def test_findings_print_as_diagnostics_and_exit_1(tmp_path: Path) -> None:
    write(tmp_path, CUT, "model.py")
    write(tmp_path, RUST, "attend.rs")
    write(tmp_path, CLEAN, "clean.py")
    result = dw(".", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    lines = [line for line in result.stdout.splitlines() if re.match(r"^\S+:\d+:\d+: DW5", line)]
    assert lines == [
        "attend.rs:4:5: DW511 fused-op-no-backward: `ops::softmax_last_dim` records no backward "
        "op: nothing before it gets a gradient when this runs in training. Use "
        "candle_nn::ops::softmax(&xs, D::Minus1).",
        lines[1],
    ]
    assert lines[1].startswith("model.py:11:14: DW501 forward-gradient-cut: `self.enc` (nn.Linear)")
    assert "2 warnings" in result.stdout and "3 files" in result.stdout
    assert result.stderr == ""


def test_clean_exits_0_and_fail_on(tmp_path: Path) -> None:
    write(tmp_path, CLEAN, "clean.py")
    assert dw(tmp_path).returncode == 0
    write(tmp_path, CUT, "model.py")
    assert dw(tmp_path, "--fail-on", "error").returncode == 0
    assert dw(tmp_path, "--fail-on", "never").returncode == 0
    assert dw(tmp_path, "--ignore", "DW501").returncode == 0
    assert dw(tmp_path, "--select", "DW502,DW504").returncode == 0


def test_json_output(tmp_path: Path) -> None:
    write(tmp_path, CUT, "model.py")
    result = dw(tmp_path / "model.py", "--format", "json")
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["kind"] == "lint" and data["subject"]["files"] == 1
    (finding,) = data["findings"]
    assert finding["code"] == "DW501" and finding["location"]["column"] == 14


def test_sarif_written_to_a_file(tmp_path: Path) -> None:
    write(tmp_path, CUT, "src/model.py")
    out = tmp_path / "deadweight.sarif"
    result = dw("src", "--format", "sarif", "--output", out, cwd=tmp_path)
    assert result.returncode == 1 and result.stdout == ""
    log = json.loads(out.read_text())
    (res,) = log["runs"][0]["results"]
    artifact = res["locations"][0]["physicalLocation"]["artifactLocation"]
    assert artifact == {"uri": "src/model.py", "uriBaseId": "%SRCROOT%"}


def test_bad_files_among_good_ones(tmp_path: Path) -> None:
    write(tmp_path, CUT, "model.py")
    write(tmp_path, "def broken(:\n", "broken.py")
    (tmp_path / "latin.py").write_bytes(b"x = '\xe9'\n")
    os.symlink(tmp_path, tmp_path / "loop")
    result = dw(".", cwd=tmp_path)
    assert result.returncode == 2  # not all of it could be linted: more than a finding
    errors = sorted(result.stderr.splitlines())
    assert errors[0].startswith("broken.py:1:") and ": error: syntax error" in errors[0]
    assert errors[1].startswith("latin.py:1:6: error: not valid UTF-8")
    assert errors[2].startswith("loop: error: symbolic link loop")
    assert "model.py:11:14: DW501" in result.stdout


def test_exit_2_when_nothing_could_be_read(tmp_path: Path) -> None:
    write(tmp_path, "def broken(:\n", "broken.py")
    result = dw(tmp_path / "broken.py")
    assert result.returncode == 2 and "syntax error" in result.stderr
    assert dw(tmp_path / "missing.py").returncode == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = dw(empty)
    assert nothing.returncode == 0 and "no Python (.py) or Rust (.rs) files found" in nothing.stderr


def test_usage_and_configuration_errors_exit_2(tmp_path: Path) -> None:
    write(tmp_path, CLEAN, "clean.py")
    bad_rule = dw(tmp_path, "--select", "DW599")
    assert bad_rule.returncode == 2 and "unknown rule" in bad_rule.stderr
    (tmp_path / "pyproject.toml").write_text('[tool.deadweight]\nignor = ["DW501"]\n')
    bad_config = dw(tmp_path)
    assert bad_config.returncode == 2
    assert "unknown key 'ignor' (did you mean 'ignore'?)" in bad_config.stderr
    assert dw(tmp_path, "--isolated").returncode == 0


def test_configuration_from_pyproject(tmp_path: Path) -> None:
    write(tmp_path, CUT, "pkg/model.py")
    write(tmp_path, RUST, "pkg/serve.rs")
    (tmp_path / "pyproject.toml").write_text(
        '[tool.deadweight]\ninference-only = ["pkg/serve.rs"]\n\n'
        '[tool.deadweight.per-file-ignores]\n"pkg/model.py" = ["forward-gradient-cut"]\n'
    )
    result = dw("pkg", cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    assert "no findings" in result.stdout


def test_exit_2_when_any_input_was_skipped_and_the_rest_still_linted(tmp_path: Path) -> None:
    write(tmp_path, CLEAN, "clean.py")
    write(tmp_path, "def broken(:\n", "broken.py")
    os.mkfifo(tmp_path / "x.py")  # must be neither opened for reading nor waited on
    result = dw(".", "--format", "json", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    report = json.loads(result.stdout)
    assert report["subject"]["files"] == 1 and report["findings"] == []
    assert sorted(result.stderr.splitlines()) == [
        "broken.py:1:12: error: syntax error: invalid syntax; not linted",
        "x.py: error: not a regular file; not linted",
    ]


def test_a_fifo_named_on_the_command_line_does_not_hang(tmp_path: Path) -> None:
    write(tmp_path, CUT, "model.py")
    os.mkfifo(tmp_path / "x.py")
    result = dw("x.py", "model.py", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == "x.py: error: not a regular file; not linted\n"
    assert "model.py:11:14: DW501" in result.stdout  # findings are still reported


# Measures the peak memory of one `deadweight lint` run (the largest child of a fresh
# parent, so no other test's subprocess can count).
PEAK_RSS = """
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(done.returncode)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)  # KiB on Linux
sys.stderr.write(done.stderr)
"""


def test_memory_is_bounded_on_a_large_dense_file(tmp_path: Path) -> None:
    """Parsing costs memory per token, not per byte: a 6 MiB list of integers took 3 GB
    (about 500 bytes a token) with the size limit raised. Such a file is reported."""
    big = tmp_path / "table.py"
    big.write_text("x = [" + "1," * (3 * 2**20) + "]\n")
    write(tmp_path, CUT, "model.py")
    command = [sys.executable, "-m", "deadweight", "lint", "--max-file-size", "100"]
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *command, str(big), str(tmp_path / "model.py")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=ENV,
    )
    code, peak_kib = map(int, done.stdout.split())
    assert code == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"{big}: error: about 6.3 million tokens")
    # deadweight itself (torch imported) takes about 0.25 GiB; parsing the file 3 GiB
    assert peak_kib < 1.25 * 2**20, f"{peak_kib / 2**20:.2f} GiB"
