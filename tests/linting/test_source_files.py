"""Finding and reading lint inputs: link loops, broken links, duplicates, excluded
directories, non-regular and oversized files, undecodable bytes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from deadweight.linting import source_files
from deadweight.linting.source_files import SourceProblem, character_column, discover
from tests.cli_runner import measured_cli


def touch(path: Path, text: str = "x = 1\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_walk_is_sorted_depth_first_and_skips_other_languages(tmp_path: Path) -> None:
    for name in ["b/z.py", "a/y.rs", "a/x.py", "c.txt", "top.py"]:
        touch(tmp_path / name)
    found, problems = discover([tmp_path])
    # a directory's own files first, then its subdirectories, each in name order
    assert [Path(f.path).relative_to(tmp_path).as_posix() for f in found] == [
        "top.py",
        "a/x.py",
        "a/y.rs",
        "b/z.py",
    ]
    assert [f.language for f in found if f.path.endswith(".rs")] == ["rust"]
    assert problems == []


def test_link_loops_broken_links_and_duplicates(tmp_path: Path) -> None:
    touch(tmp_path / "pkg" / "m.py")
    os.symlink(tmp_path / "pkg", tmp_path / "pkg" / "again")  # a directory loop
    os.symlink(tmp_path / "pkg" / "m.py", tmp_path / "alias.py")  # the same file twice
    os.symlink(tmp_path / "nowhere.py", tmp_path / "broken.py")
    os.symlink("self.py", tmp_path / "self.py")  # a link to itself
    found, problems = discover([tmp_path])
    assert len(found) == 1 and Path(found[0].path).name in ("m.py", "alias.py")
    reasons = {Path(p.path).name: p.message for p in problems}
    assert "symbolic link loop" in reasons["again"]
    assert "broken symbolic link" in reasons["broken.py"]
    assert "leads back to itself" in reasons["self.py"]


def test_default_and_configured_excludes(tmp_path: Path) -> None:
    touch(tmp_path / ".venv" / "lib.py")
    touch(tmp_path / "node_modules" / "x.py")
    touch(tmp_path / "target" / "debug" / "build.rs")
    touch(tmp_path / "vendor" / "v.py")
    touch(tmp_path / "src" / "m.py")
    found, _ = discover([tmp_path], excluded=lambda p: p.name == "vendor")
    assert [Path(f.path).name for f in found] == ["m.py"]
    # a path named explicitly is linted even inside an excluded directory
    found, _ = discover([tmp_path / ".venv" / "lib.py"])
    assert len(found) == 1


def test_explicit_inputs_that_lead_nowhere(tmp_path: Path) -> None:
    touch(tmp_path / "notes.txt")
    found, problems = discover([tmp_path / "missing.py", tmp_path / "notes.txt"])
    assert found == []
    assert [p.message for p in problems] == [
        "no such file or directory",
        "not a Python (.py) or Rust (.rs) file",
    ]


def test_fifo_is_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.py"
    os.mkfifo(fifo)
    found, problems = discover([tmp_path])
    assert found == [] and "not a regular file" in problems[0].message
    result = source_files.read_bytes(str(fifo))
    assert isinstance(result, SourceProblem)


def test_size_limit(tmp_path: Path) -> None:
    big = touch(tmp_path / "big.py", "x = 1\n" * 1000)
    assert isinstance(source_files.read_bytes(str(big), max_bytes=10_000), bytes)
    problem = source_files.read_bytes(str(big), max_bytes=1000)
    assert isinstance(problem, SourceProblem) and "limit" in problem.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(tmp_path: Path) -> None:
    path = touch(tmp_path / "secret.py")
    path.chmod(0)
    try:
        problem = source_files.read_bytes(str(path))
    finally:
        path.chmod(0o644)
    assert isinstance(problem, SourceProblem) and "permission denied" in problem.message


def test_undecodable_bytes_name_the_line(tmp_path: Path) -> None:
    problem = source_files.decode_utf8("m.py", b"a = 1\nb = '\xff'\n")
    assert isinstance(problem, SourceProblem)
    assert (problem.line, problem.column) == (2, 6) and "0xff" in problem.message
    assert source_files.decode_utf8("m.py", b"\xef\xbb\xbfx = 1\n") == "x = 1\n"  # BOM dropped


def test_character_columns() -> None:
    assert character_column("abc", 2) == 3
    assert character_column("é = x", len("é = ".encode())) == 5


def _deeper_than_path_max(root: Path, name: str) -> int:
    """Folders `name/name/...` until the path passes PATH_MAX, a Python file at the bottom;
    made through descriptors, as no path that long can be opened. Returns the depth."""
    fd = os.open(root, os.O_RDONLY)
    depth = 0
    try:
        while depth * (len(name) + 1) < 4200:
            os.mkdir(name, dir_fd=fd)
            below = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd, depth = below, depth + 1
        out = os.open("deep.py", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(out, b"import torch\nx = 1\n")
        os.close(out)
    finally:
        os.close(fd)
    return depth


@pytest.mark.parametrize("name", ["d", "d" * 200], ids=["2100-deep", "21-deep"])
def test_a_file_deeper_than_path_max_is_named_not_skipped(tmp_path: Path, name: str) -> None:
    """Issue 33, case 14: lint said "no Python files found", rc 0, after 29 s (minutes
    for 2100 one-letter folders: every path resolved whole, for every file)."""
    _deeper_than_path_max(tmp_path, name)
    try:
        run = measured_cli("lint", ".", cwd=tmp_path, timeout=120)
        assert run.result.returncode == 2, run.result.stderr[-500:]
        assert "longer than the system opens (PATH_MAX)" in run.result.stderr
        assert "Traceback" not in run.result.stderr
        assert run.within_bounds, (run.seconds, run.peak_mb)
    finally:
        # rm walks by descriptors; shutil.rmtree recurses once per folder, past Python's limit.
        subprocess.run(["rm", "-rf", str(tmp_path / name)], check=False)
