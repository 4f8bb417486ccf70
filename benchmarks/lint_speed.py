"""What `deadweight lint` costs next to only parsing the same Python files with `ast.parse`.

The tree is the installed transformers package's `models/` directory (about 2,600
files, 46 MB of real model code). "parse" reads every file and calls `ast.parse`
on it; "lint" is `deadweight.lint_paths` on the directory: finding the files,
reading and decoding them, parsing, every DW5xx search, the rules, suppressions
and the sorted report (no output is printed). Both run in this process, warm (one
untimed round of each first), interleaved (parse, lint, parse, lint, ...) so that
noise on a shared machine hits both alike; the ratio is the median of the per-pair
ratios. The goal is at most 2x.

    python benchmarks/lint_speed.py [--pairs 5] [--path DIR]
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import time
from pathlib import Path

import deadweight


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if p.is_file())


def parse_all(files: list[Path]) -> int:
    for path in files:
        ast.parse(path.read_bytes(), filename=str(path))
    return len(files)


def lint_all(root: Path) -> int:
    report = deadweight.lint_paths([root], config=None)
    return len(report.findings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--path", type=Path, default=None, help="default: transformers/models")
    args = parser.parse_args()
    if args.path is None:
        import transformers

        args.path = Path(os.path.dirname(transformers.__file__)) / "models"
    files = python_files(args.path)
    size = sum(p.stat().st_size for p in files)
    print(f"{len(files)} Python files, {size / 1e6:.1f} MB under {args.path}")
    parse_all(files), lint_all(args.path)  # warm the page cache and the imports

    parse_times, lint_times, ratios = [], [], []
    findings = 0
    for k in range(args.pairs):
        t0 = time.perf_counter()
        parse_all(files)
        t1 = time.perf_counter()
        findings = lint_all(args.path)
        t2 = time.perf_counter()
        parse_times.append(t1 - t0)
        lint_times.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
        print(f"pair {k + 1}: parse {t1 - t0:.2f} s, lint {t2 - t1:.2f} s, ratio {ratios[-1]:.2f}")
    parse_s, lint_s = statistics.median(parse_times), statistics.median(lint_times)
    print(f"parse only: {len(files) / parse_s:,.0f} files/s ({parse_s:.2f} s)")
    print(f"lint:       {len(files) / lint_s:,.0f} files/s ({lint_s:.2f} s), {findings} findings")
    print(
        f"lint / parse: {statistics.median(ratios):.2f}x median of {len(ratios)} pairs "
        f"(range {min(ratios):.2f}x-{max(ratios):.2f}x; goal <= 2x)"
    )


if __name__ == "__main__":
    main()
