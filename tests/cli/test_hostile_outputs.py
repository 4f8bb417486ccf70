"""No user file is lost or overwritten by what deadweight writes (issue 33, cases 3-5).

Every output (`-o`, `--output`, `--html`, `--write-docs` pages, `run --log`) refuses an
input of the same command, a symbolic link, a FIFO, a directory and an empty path, and is
written whole or not at all. End to end, in subprocesses, as a careless user would type it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from deadweight.errors import InputError
from deadweight.output_files import OutputFile, write_whole
from tests.cli_runner import deadweight_cli

MODEL = """
import torch
def make():
    m = torch.nn.Linear(2, 1)
    return m, lambda: m(torch.ones(1, 2)).sum()
"""

TRAIN = """
import torch
m = torch.nn.Linear(2, 1)
o = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(3):
    o.zero_grad(); m(torch.ones(1, 2)).sum().backward(); o.step()
"""

needs_plotly = pytest.mark.skipif(
    __import__("importlib").util.find_spec("plotly") is None, reason="needs deadweight[html]"
)


def _refused(result: subprocess.CompletedProcess[str], why: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert why in result.stderr, result.stderr


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("outputs")
    save_file({"layers.0.w": torch.ones(4), "layers.1.w": torch.ones(4)}, d / "a.safetensors")
    (d / "model.py").write_text(MODEL)
    (d / "train.py").write_text(TRAIN)
    run = deadweight_cli("run", "--log", d / "r.jsonl", "--", sys.executable, d / "train.py")
    assert run.returncode in (0, 1), run.stderr
    saved = deadweight_cli("inspect", d / "a.safetensors", "--format", "json")
    (d / "r.json").write_text(saved.stdout)
    return d


def _fingerprints(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and not p.is_symlink()}


# -- case 4: an output that is an input, a link, a FIFO, a directory, an empty path --------


@needs_plotly
@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["report", "r.jsonl", "-o", "r.jsonl"], "is an input of this command"),
        (["report", "r.json", "--output", "r.json"], "is an input of this command"),
        (["inspect", "a.safetensors", "--html", "a.safetensors"], "is an input"),
        (["inspect", ".", "--html", "a.safetensors"], "is an input"),  # read from the folder
        (["diff", "a.safetensors", "a.safetensors", "--html", "a.safetensors"], "is an input"),
        (["trend", "a.safetensors", "--html", "a.safetensors"], "is an input"),
        (["check", "model.py:make", "--html", "model.py"], "is an input"),
        (["lint", "model.py", "-o", "model.py"], "is an input"),
        (["lint", ".", "-o", "train.py"], "is an input"),
        (["run", "--html", "train.py", "--", sys.executable, "train.py"], "is an input"),
        (["run", "--log", "r.jsonl", "--html", "r.jsonl", "--", sys.executable, "train.py"],
         "is an input"),
        (["report", "r.json", "-o", ""], "an empty path names no file"),
        (["inspect", "a.safetensors", "--html", ""], "an empty path names no file"),
        (["report", "r.json", "-o", "."], "is a directory"),
        (["lint", "model.py", "-o", "sub/"], "is a directory"),
    ],
)  # fmt: skip
def test_an_output_that_would_destroy_an_input_is_refused(folder, args, why, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(folder, work)
    before = _fingerprints(work)
    _refused(deadweight_cli(*args, cwd=work), why)
    assert _fingerprints(work) == before, "a file was changed"


@needs_plotly
@pytest.mark.parametrize(
    "args",
    [
        ["report", "r.json", "-o"],
        ["inspect", "a.safetensors", "--html"],
        ["lint", "model.py", "-o"],
    ],
    ids=["report", "inspect", "lint"],
)
def test_an_output_through_a_link_or_into_a_fifo_is_refused(folder, args, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(folder, work)
    (work / "mine.json").write_text('{"important": 1}')
    os.symlink("mine.json", work / "link.html")
    _refused(deadweight_cli(*args, "link.html", cwd=work), "is a symbolic link")
    assert (work / "mine.json").read_text() == '{"important": 1}'
    assert (work / "link.html").is_symlink()
    os.mkfifo(work / "fifo.html")
    # A writer would wait for a reader forever: refused at once (a hang times out).
    _refused(deadweight_cli(*args, "fifo.html", cwd=work, timeout=60), "not a regular file")


def test_a_failed_write_leaves_the_existing_file_as_it_was(tmp_path, monkeypatch):
    target = tmp_path / "report.html"
    target.write_text("the earlier report")
    os.chmod(target, 0o640)
    real = os.replace

    def full_disk(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(InputError, match=r"No space left on device\); nothing there was changed"):
        OutputFile.claim(str(target), "-o").write_text("<html>new</html>")
    monkeypatch.setattr(os, "replace", real)
    assert target.read_text() == "the earlier report"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"], "a temporary file was left"
    write_whole(str(target), b"new")  # and once complete, in place, with its permissions
    assert target.read_bytes() == b"new" and (target.stat().st_mode & 0o777) == 0o640


# -- case 3: --write-docs removes only the pages it wrote -----------------------------------


def test_write_docs_into_a_folder_of_the_users_touches_only_its_own_pages(tmp_path):
    (tmp_path / "README.md").write_text("mine")
    (tmp_path / "NOTES.md").write_text("notes")
    (tmp_path / "DW9.md").write_text("# DW9 my own notes on a code\n")
    first = deadweight_cli("rules", "--write-docs", tmp_path)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "README.md").read_text() == "mine"
    assert (tmp_path / "NOTES.md").read_text() == "notes"
    assert (tmp_path / "DW9.md").exists()
    assert (tmp_path / "DW101.md").read_text().startswith("# DW101 ")
    # A page of a rule that is gone, as an earlier version wrote it: removed.
    page = (tmp_path / "DW101.md").read_text().replace("DW101", "DW199")
    (tmp_path / "DW199.md").write_text(page)
    again = deadweight_cli("rules", "--write-docs", tmp_path)
    assert again.returncode == 0, again.stderr
    assert not (tmp_path / "DW199.md").exists()
    assert (tmp_path / "README.md").read_text() == "mine"


def test_write_docs_refuses_to_replace_a_file_it_did_not_write(tmp_path):
    (tmp_path / "index.md").write_text("# My index\n")
    result = deadweight_cli("rules", "--write-docs", tmp_path)
    _refused(result, "did not write them; nothing was written")
    assert [p.name for p in tmp_path.iterdir()] == ["index.md"]
    assert (tmp_path / "index.md").read_text() == "# My index\n"


# -- case 5: run touches no earlier log before its script has started ------------------------


def test_a_script_that_does_not_start_leaves_the_earlier_log(folder, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(folder, work)
    shutil.copy(work / "r.jsonl", work / "deadweight-run.jsonl")
    earlier = (work / "deadweight-run.jsonl").read_bytes()
    result = deadweight_cli("run", "--", sys.executable, "trian.py", cwd=work)  # a typo
    assert result.returncode == 2 and "Traceback" not in result.stderr  # python's own 2
    assert "left as it was" in result.stderr
    assert (work / "deadweight-run.jsonl").read_bytes() == earlier


def test_a_log_through_a_link_is_refused_and_its_target_kept(folder, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(folder, work)
    earlier = (work / "r.jsonl").read_bytes()
    os.symlink("r.jsonl", work / "link.jsonl")
    result = deadweight_cli(
        "run", "--log", "link.jsonl", "--", sys.executable, "trian.py", cwd=work
    )
    _refused(result, "is a symbolic link")
    assert (work / "r.jsonl").read_bytes() == earlier and (work / "link.jsonl").is_symlink()


def test_a_script_that_steps_replaces_the_earlier_log(folder, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(folder, work)
    earlier = (work / "r.jsonl").read_text()
    result = deadweight_cli("run", "--log", "r.jsonl", "--", sys.executable, "train.py", cwd=work)
    assert result.returncode in (0, 1), result.stderr
    now = (work / "r.jsonl").read_text()
    assert now != earlier and now.count('"event":"start"') == 1
