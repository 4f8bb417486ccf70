"""A log of everything the structure pass concludes, to compare two trees of deadweight.

A change meant to make the structure pass faster must leave its conclusions as they
were. This script runs `deadweight.check` over the detection-quality benchmark's
models and writes, per case, one JSON line with:

- every carrier the pass gave a tensor, in call order (lost and partial bit sets, and
  each pure facet: kind, dims, uniform, degree, approx, and its shift tag renamed by
  first appearance, since tags are fresh numbers);
- what the pass recorded at the end: each effect's cancellation records (op, call,
  site, dims, rounding), the free means, the opaque parameters, the rounding per
  effect, a failure if any, and the `StructureResult`;
- the findings (code, severity, parameters, message, location).

The cases: the precision part's stock transformers architectures (tiny random
configs, the model's own loss) in float32, bfloat16 parameters and bfloat16 autocast,
and a balanced subset of the recall part's planted cancellations (`--quick`: float32
architectures and 60 recall cases, ~10 s). Then `--compare` names the cases whose
lines differ, and where. Run it on both trees, the one before from a worktree:

    git worktree add /tmp/before HEAD~1
    PYTHONPATH=/tmp/before/src python benchmarks/structure_log.py /tmp/before.jsonl
    python benchmarks/structure_log.py /tmp/after.jsonl
    python benchmarks/structure_log.py --compare /tmp/before.jsonl /tmp/after.jsonl

Every random generator (Python's, numpy's, torch's) is seeded before each case, so
two runs of one tree write the same log. `--compare ... --verdicts` compares only
what the pass concluded and the findings, for a change to what it follows; its
cases are not the whole of the tests (tests/checking/test_cancellation.py has
cases it does not).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from detection_quality_parts import models, precision, recall
from detection_quality_parts.common import finding_record, seed_everything

import deadweight
from deadweight.checking import cancellation
from deadweight.checking.carrier_algebra import Carrier, Facet

QUICK_RECALL = 60
FULL_RECALL = 300


def plain(x: Any) -> Any:
    """JSON-ready, with sets sorted so that hash order does not show."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return sorted([str(k), plain(v)] for k, v in x.items())
    if isinstance(x, (set, frozenset)):
        return sorted((plain(v) for v in x), key=repr)
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return repr(x)


class Log:
    """The entries of one case; shift tags renamed in order of first appearance."""

    def __init__(self) -> None:
        self.entries: list[Any] = []
        self._tags: dict[int, int] = {}

    def facet(self, f: Facet) -> list[Any]:
        tag = self._tags.setdefault(f.tag, len(self._tags) + 1) if f.tag else 0
        full = None if f.full is None else sorted(f.full)
        return [f.kind, full, f.uniform, str(f.degree), f.approx, tag]

    def carrier(self, c: Carrier) -> None:
        # tags renamed in entity order: the order in which a call drew them is no
        # conclusion of the pass
        pure = [[e, self.facet(f)] for e, f in sorted(c.pure.items())]
        self.entries.append([hex(c.lost), hex(c.partial), pure])

    def verdict(self, tracker: cancellation.StructureTracker, result: Any) -> None:
        records = {
            e: [[r.call, r.ordinal, r.op, plain(r.where), sorted(r.dims), r.full, r.approx,
                 r.rounding] for r in rs]
            for e, rs in tracker.absorbed.items()
        }  # fmt: skip
        self.entries.append(["absorbed", plain(records)])
        self.entries.append(
            [
                "free means", sorted(tracker._free_means), "opaque", sorted(tracker.opaque),
                "failed", tracker.failed, "rounding", sorted(tracker._rounding.items()),
            ]
        )  # fmt: skip
        self.entries.append(["result", plain(result)])


@contextmanager
def logged(log: Log) -> Iterator[None]:
    """The tracker's carriers and verdict go to `log` while the block runs."""
    tracker_cls = cancellation.StructureTracker
    set_carrier, result = tracker_cls._set, tracker_cls.result

    def logging_set(self: Any, out: object, c: Carrier) -> None:
        if isinstance(out, torch.Tensor):
            log.carrier(c)
        set_carrier(self, out, c)

    def logging_result(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = result(self, *args, **kwargs)
        log.verdict(self, found)
        return found

    tracker_cls._set = logging_set  # type: ignore[method-assign]
    tracker_cls.result = logging_result  # type: ignore[method-assign]
    try:
        yield
    finally:
        tracker_cls._set = set_carrier  # type: ignore[method-assign]
        tracker_cls.result = result  # type: ignore[method-assign]


def findings_of(report: Any) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in finding_record(f).items() if k != "evidence"} for f in report.findings
    ]


def arch_case(arch: models.Arch, dtype: str) -> Callable[[], list[dict[str, Any]]]:
    def run() -> list[dict[str, Any]]:
        model, _ = models.build_arch(arch)
        inputs = models.hf_inputs(arch, model, torch.Generator().manual_seed(0))
        model, inputs = models.arch_in_dtype(model, inputs, dtype)

        def loss_fn() -> torch.Tensor:
            if dtype == "bf16_autocast":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return model(**inputs).loss.float()
            return model(**inputs).loss

        seed_everything(1234)  # as the precision part seeds its checks
        return findings_of(deadweight.check(model, loss_fn, precision.make_optimizer(model)))

    return run


def recall_case(case: recall.Case) -> Callable[[], list[dict[str, Any]]]:
    def run() -> list[dict[str, Any]]:
        built = recall.build_case(case)
        seed_everything(1234)  # as the precision part seeds its checks
        return findings_of(deadweight.check(built.model, built.loss_fn))

    return run


def cases(quick: bool) -> Iterator[tuple[str, Callable[[], list[dict[str, Any]]]]]:
    archs = [a for a in models.ARCHS if not a.real_width]
    for dtype in ("fp32",) if quick else ("fp32", "bf16", "bf16_autocast"):
        for arch in archs:
            yield f"{arch.name}/{dtype}", arch_case(arch, dtype)
    chosen = recall.quick_cases(recall.all_cases(), QUICK_RECALL if quick else FULL_RECALL)
    for case in chosen:
        if case.dtype != "fsdp2_bf16":  # needs a process group
            yield case.id, recall_case(case)


def write(path: Path, selected: Iterable[tuple[str, Callable[[], Any]]]) -> int:
    """One line per case; returns how many."""
    n = 0
    with path.open("w") as out:
        for label, run in selected:
            log = Log()
            seed_everything(0)
            with logged(log):
                try:
                    found: Any = run()
                except Exception as exc:  # a case that fails must fail alike on both trees
                    found = ["error", type(exc).__name__, str(exc)[:200]]
            line = {"case": label, "log": log.entries, "findings": found}
            out.write(json.dumps(line, default=str) + "\n")
            n += 1
    return n


def read_log(path: Path) -> dict[str, dict[str, Any]]:
    """A log this script wrote, by case; a clear stop for anything else."""
    cases: dict[str, dict[str, Any]] = {}
    with path.open() as lines:
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
                cases[row["case"]] = row
            except (ValueError, KeyError, TypeError):
                sys.exit(f"{path}:{number}: not a line of a structure log")
    return cases


def verdicts(line: dict[str, Any]) -> dict[str, Any]:
    """A case's line without its carriers: what the pass concluded and the findings.
    Of the effects whose mean a call freed (which `result` never reports), the shifts'
    records and roundings are left out too: the pass may stop following them."""
    entries = {entry[0]: entry for entry in line["log"] if isinstance(entry[0], str)}
    free = set(entries["free means"][1]) if "free means" in entries else set()

    def kept(e: Any) -> bool:
        return not (int(e) % 2 == 1 and int(e) in free)

    out: dict[str, Any] = {"findings": line["findings"]}
    if "absorbed" in entries:
        out["absorbed"] = [[e, r] for e, r in entries["absorbed"][1] if kept(e)]
    if "free means" in entries:
        info = list(entries["free means"])
        info[-1] = [item for item in info[-1] if kept(item[0])]  # the roundings
        out["free means"] = info
    if "result" in entries:
        out["result"] = entries["result"]
    return out


def compare(before: Path, after: Path, only_verdicts: bool = False) -> int:
    """Prints the cases whose lines differ (with `only_verdicts`, whose `verdicts`
    differ); returns how many."""
    a, b = read_log(before), read_log(after)
    differing = 0
    for label in sorted(set(a) | set(b)):
        x, y = a.get(label), b.get(label)
        if x == y:
            continue
        if only_verdicts and x is not None and y is not None:
            vx, vy = verdicts(x), verdicts(y)
            if vx == vy:
                continue
            differing += 1
            for key in vx:
                if vx[key] != vy.get(key):
                    print(
                        f"{label}: {key} differs:\n  {str(vx[key])[:300]}\n  {str(vy.get(key))[:300]}"
                    )
            continue
        differing += 1
        if x is None or y is None:
            print(f"{label}: only in {'after' if x is None else 'before'}")
            continue
        for i, (p, q) in enumerate(zip(x["log"], y["log"], strict=False)):
            if p != q:
                print(f"{label}: log entry {i} differs:\n  {str(p)[:300]}\n  {str(q)[:300]}")
                break
        else:
            if len(x["log"]) != len(y["log"]):
                print(f"{label}: {len(x['log'])} log entries before, {len(y['log'])} after")
        if x["findings"] != y["findings"]:
            print(f"{label}: findings differ:\n  {x['findings']}\n  {y['findings']}")
    print(f"{len(set(a) | set(b))} cases, {differing} differ")
    return differing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, help="where to write the log (JSON lines)")
    parser.add_argument(
        "--quick", action="store_true", help="float32 architectures, 60 recall cases"
    )
    parser.add_argument("--only", help="only the cases whose label contains this")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument(
        "--verdicts",
        action="store_true",
        help="with --compare: compare what the pass concluded and the findings, not the "
        "carriers (for a change to what the pass follows)",
    )
    args = parser.parse_args()
    if args.compare:
        sys.exit(1 if compare(*args.compare, only_verdicts=args.verdicts) else 0)
    if args.out is None:
        parser.error("give the log's path, or --compare BEFORE AFTER")
    import transformers

    transformers.logging.set_verbosity_error()  # config chatter, not results
    start = time.perf_counter()
    selected = ((label, run) for label, run in cases(args.quick) if (args.only or "") in label)
    n = write(args.out, selected)
    print(f"{n} cases logged to {args.out} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
