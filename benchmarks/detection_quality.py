"""How well `deadweight.check` finds parameters that a normalization cancels, and how often
it warns about healthy stock models.

Three parts, each printed as plain-text tables (``--json PATH`` also writes every raw
per-case result):

1. **recall**: small models, built in code from random initialisation, each with a
   planted parameter that an operation after it provably cancels (a scalar or
   per-channel gain before a normalization, a conv bias before BatchNorm, an attention
   key bias before softmax, a single bias on every logit before cross-entropy). The
   sweep crosses placement x norm kind x eps x width x loss form x dtype x seed.
   A case is *found* when some DW103/DW104/DW105 finding names the planted parameter,
   at any severity; the tables split the found cases by the severity they got. Read
   "recall" as found / (cases that ran); "at warning" is the share of those cases
   reported at warning or above, the level that fails a test or a CI run.
   "mechanism named" is, among found cases, the share whose finding names what cancels
   the parameter: its message, location or evidence contains a normalization's op or
   class (layer_norm, RMSNorm, GroupNorm, batch_norm, instance_norm, rsqrt, normalize,
   softmax, cross_entropy) or a ``file.py:line`` reference (a heuristic; the generic
   word "normalization" does not count). "DW204" is the share of found cases with a
   drift-risk warning on the planted parameter (they all sit in AdamW's zero-decay
   group). False positives of this part: in placement (c) the per-block branch scalars
   are healthy, so any warning naming one is counted; other parameters reported at
   warning are listed for review (they may be true, e.g. a weight whose norm is free).
2. **precision**: stock transformers architectures from tiny random configs (no hub),
   train mode, the model's own loss. For each: findings at warning or above other
   than DW101/DW102 (on a healthy stock model every one is a false alarm or a
   mislabelled severity), findings at info, and DW101 against the ground truth, the set
   of trainable parameters whose ``.grad`` is None after a plain ``loss.backward()`` on
   a deep copy with the same seed ("yes": equal sets). Then (2b) architectures whose
   first step is special, each checked over 10 random draws: LayerDrop on (wav2vec2,
   HuBERT, Whisper), gates that start at or near zero (ConvNeXt's LayerScale, DiT's
   adaLN-Zero, ReZero, tanh gates, PEFT LoRA), with 50 watched steps for the gated
   ones; and two seeded bugs inside such models that must still get a warning or
   error: a detached layer in a LayerDrop model, a scalar before ConvNeXt's final norm.
3. **seeds**: the two seed incidents from ``deadweight.demos``, with the codes they
   must get and the DW104/DW204 evidence for the layer scalar.

Each part is a module of ``detection_quality_parts/`` (recall, precision, first_step,
seeds), the transformers model builders they share in ``models``, the rest in
``common``; this script runs them and prints the tables.

Every case runs inside try/except: a library or model failure is an "error" row, not
a crash. Nothing is downloaded; all models are random.

    python benchmarks/detection_quality.py [--quick] [--part recall|precision|seeds|all]
                                           [--json PATH]

``--quick`` runs a deterministic, stratified subset of the recall sweep (about 150
cases, balanced over every dimension); the full sweep is several thousand cases.
Parts 2 and 3 are the same in both modes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
from detection_quality_parts.common import DTYPES, REPO_SRC, json_safe
from detection_quality_parts.first_step import FIRST_STEP, print_first_step, run_first_step
from detection_quality_parts.models import ARCHS
from detection_quality_parts.precision import print_precision, run_arch
from detection_quality_parts.recall import (
    all_cases,
    print_recall,
    quick_cases,
    run_recall_case,
)
from detection_quality_parts.seeds import print_seeds, run_seeds

import deadweight


def git_revision() -> str | None:
    try:
        repo = str(REPO_SRC.parent)
        out = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty src" if dirty else "")
    except Exception:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a stratified subset (~150 cases)")
    parser.add_argument(
        "--quick-cases", type=int, default=150, help="size of the --quick subset (default 150)"
    )
    parser.add_argument("--part", choices=("recall", "precision", "seeds", "all"), default="all")
    parser.add_argument("--json", metavar="PATH", help="write every raw per-case result here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtypes",
        default=",".join(DTYPES),
        help=f"recall cases in these dtypes only (comma-separated; default all: {','.join(DTYPES)})",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="FIELD=V1,V2",
        help="recall cases whose FIELD (placement, norm, eps, width, loss, seed) is one of the "
        "values; repeatable, e.g. --only norm=layernorm,llama_rmsnorm --only width=8,64",
    )
    args = parser.parse_args(argv)
    only: dict[str, set[str]] = {}
    for item in args.only:
        field_name, _, values = item.partition("=")
        if field_name not in ("placement", "norm", "eps", "width", "loss", "seed") or not values:
            parser.error(f"--only {item!r}: expected FIELD=V1,V2 with FIELD one of placement, "
                         "norm, eps, width, loss, seed")  # fmt: skip
        only[field_name] = set(values.split(","))
    dtypes = set(args.dtypes.split(","))
    if not dtypes <= set(DTYPES):
        parser.error(f"--dtypes: unknown {', '.join(sorted(dtypes - set(DTYPES)))}")

    torch.set_num_threads(args.threads)
    try:
        import transformers

        transformers.logging.set_verbosity_error()  # config chatter, not results
    except Exception:
        pass
    import warnings

    warnings.filterwarnings("ignore")

    started = time.perf_counter()
    library_path = str(getattr(deadweight, "__file__", None))
    meta: dict[str, Any] = {
        "deadweight": getattr(deadweight, "__version__", None),
        "git": git_revision() if library_path.startswith(str(REPO_SRC)) else "not this checkout",
        "library_path": library_path,
        "torch": torch.__version__,
        "threads": args.threads,
        "quick": args.quick,
        "part": args.part,
    }
    print(
        f"deadweight {meta['deadweight']} ({meta['git']}, imported from "
        f"{meta['library_path']}), torch {meta['torch']}, {args.threads} threads, "
        f"{'quick' if args.quick else 'full'} mode"
    )
    out: dict[str, Any] = {"meta": meta}

    if args.part in ("recall", "all"):
        t0 = time.perf_counter()
        cases = [
            c
            for c in all_cases()
            if c.dtype in dtypes
            and all(
                (f"{getattr(c, k):g}" if k == "eps" and getattr(c, k) is not None
                 else str(getattr(c, k))) in v
                for k, v in only.items()
            )
        ]  # fmt: skip
        chosen = quick_cases(cases, args.quick_cases) if args.quick else cases
        print(f"\nrecall: {len(chosen)} of {len(cases)} cases", file=sys.stderr)
        rows = []
        for k, case in enumerate(chosen, 1):
            rows.append(run_recall_case(case))
            if k % 25 == 0:
                print(f"  {k}/{len(chosen)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        out["recall"] = rows
        print_recall(rows)
        meta["recall_s"] = time.perf_counter() - t0
        print(f"\n(recall: {len(rows)} cases in {meta['recall_s']:.0f} s)")

    if args.part in ("precision", "all"):
        t0 = time.perf_counter()
        archs = ARCHS  # all of them in --quick too: at 2 layers even width 768 is quick
        rows = []
        for dtype in [d for d in DTYPES if d in dtypes]:
            for arch in archs:
                print(f"  precision: {arch.name} {dtype}", file=sys.stderr)
                rows.append(run_arch(arch, dtype))
        out["precision"] = rows
        print_precision(rows)
        first = []
        for case in FIRST_STEP:
            print(f"  first step: {case.name}", file=sys.stderr)
            first.append(run_first_step(case))
        out["first_step"] = first
        print_first_step(first)
        meta["precision_s"] = time.perf_counter() - t0
        print(
            f"\n(precision: {len(rows)} architectures and {len(first)} first-step cases in "
            f"{meta['precision_s']:.0f} s)"
        )

    if args.part in ("seeds", "all"):
        t0 = time.perf_counter()
        seeds = run_seeds()
        out["seeds"] = [asdict(s) for s in seeds]
        print_seeds(seeds)
        meta["seeds_s"] = time.perf_counter() - t0

    meta["total_s"] = time.perf_counter() - started
    print(f"\ntotal wall time {meta['total_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(json_safe(out), fh, indent=1)
        print(f"raw results: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
