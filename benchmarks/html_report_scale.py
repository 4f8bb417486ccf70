"""The HTML report of a long, wide run: its size, and how long Chromium takes to open it.

A synthetic watch event log in the layout `deadweight.watch` writes: 100,000 optimizer
steps recorded every 20 steps (the `deadweight run` default), 500 watched parameters
(450 matrices, 50 single-element layer scalars whose values are logged). Some of it is
wrong on purpose, so the report has something to show: 40 matrices never get a
gradient, one layer scalar drifts steadily on a gradient of pure noise, and the
optimizer's state is emptied at step 50,000. The loss of every step is logged (as
`Watch.log_loss` writes it, one `loss` event per record): a noisy fall over the first
30% of the run, then a plateau, which the report marks since parameters never moved.

The report is built with `deadweight report LOG -o report.html` in-process (timed),
then opened in headless Chromium (Debian's package, driven by playwright), every
request but the file refused. Load time = `page.goto(..., wait_until="load")` until the
next animation frame, in a fresh tab each time; an empty HTML page is opened the same
way, interleaved (empty, report, empty, report, ...), and the figure is the median of
the paired ratios, next to the absolute seconds that the 5-second goal is about.

    python benchmarks/html_report_scale.py [--pairs 5] [--steps 100000] [--params 500]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from deadweight.cli import main as deadweight_main
from deadweight.watching.event_log import LOG_SCHEMA_VERSION

EVERY = 20
SCALARS = 50
NEVER_MOVED = 40
LR = 2e-3
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def write_log(path: Path, steps: int, params: int, seed: int = 0) -> int:
    """The synthetic log; returns the number of step records."""
    rng = np.random.default_rng(seed)
    matrices = params - SCALARS
    names = [f"layers.{i // 9}.w{i % 9}.weight" for i in range(matrices)]
    names += [f"layers.{i}.layer_scalar" for i in range(SCALARS)]
    shapes = [[256, 256]] * matrices + [[1]] * SCALARS
    small = list(range(matrices, params))
    reset_at = steps // 2
    records = [1, *range(EVERY, steps + 1, EVERY)]
    frozen = np.zeros(params, dtype=bool)
    frozen[:NEVER_MOVED] = True
    norms0 = rng.uniform(5, 15, params)
    norms0[matrices:] = 1.0
    with open(path, "w", encoding="utf-8") as f:

        def put(event: dict) -> None:
            f.write(json.dumps(event, separators=(",", ":")) + "\n")

        put({"event": "start", "schema_version": LOG_SCHEMA_VERSION,
             "tool": {"name": "deadweight", "version": "bench"}, "time": time.time(),
             "pid": os.getpid(), "argv": None,
             "config": {"every": EVERY, "small": 4096, "full": False, "copy_fraction": 0.1,
                        "burst": 20}})  # fmt: skip
        put({"event": "optimizer", "optimizer": 0, "start_step": 0, "class": "AdamW",
             "groups": [{"lr": LR, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8,
                         "predicted_reset_amplification": 4.47}],
             "params": [{"name": n, "shape": s, "dtype": "float32", "device": "cpu",
                         "group": 0, "pinned": False} for n, s in zip(names, shapes, strict=True)],
             "small": small, "values": small})  # fmt: skip
        values = np.ones(SCALARS)
        path_sum = np.zeros(SCALARS)
        rpos = np.zeros(SCALARS)
        rneg = np.zeros(SCALARS)
        gsum = np.zeros(SCALARS)
        sens = np.zeros(SCALARS)
        last = 0
        for step in records:
            span = step - last
            loss_steps = np.arange(last + 1, step + 1)
            last = step
            # The loss: from 4 down to 2 over the first 30% of the steps, then flat;
            # 3% minibatch noise.
            level = 2.0 + 2.0 * np.clip(1.0 - loss_steps / (0.3 * steps), 0.0, None)
            loss = level * (1.0 + 0.03 * rng.standard_normal(len(loss_steps)))
            put({"event": "loss", "steps": loss_steps.tolist(),
                 "values": [float(f"{v:.7g}") for v in loss]})  # fmt: skip
            # Siblings: random-signed updates of about lr on a real gradient; the drifting
            # scalar: 0.3 lr per step, one way, on a gradient of 1e-9.
            moves = rng.standard_normal(SCALARS) * LR * math.sqrt(span) * 0.3
            moves[-1] = 0.3 * LR * span * (3.0 if reset_at < step <= reset_at + 400 else 1.0)
            values += moves
            path_sum += np.abs(moves) + 0.3 * LR * span
            # Siblings move away from 0 and back about equally often; the drifting one
            # always away (its value grows from 1).
            rpos += span * 0.5
            rneg += span * 0.5
            rpos[-1] += span * 0.5
            rneg[-1] -= span * 0.5
            grads = np.full(SCALARS, 3e-3)
            grads[-1] = 1e-9
            gsum += grads * span
            sens += grads * span * np.abs(values)
            grad_rms = rng.uniform(1e-4, 1e-3, params)
            grad_rms[frozen] = 0.0
            grad_rms[matrices:] = grads
            param_norm = norms0 + np.where(frozen, 0.0, rng.normal(0, 0.01, params) + step * 1e-5)
            param_norm[matrices:] = np.abs(values)
            update = np.where(frozen, 0.0, rng.uniform(1e-4, 1e-3, params))
            put({"event": "step", "optimizer": 0, "step": step, "window": span,
                 "lr": [LR], "lr_sum": [LR * step],
                 "grad_present": np.where(frozen, 0, step).tolist(),
                 "lr0_steps": [0] * params,
                 "grad_rms": np.round(grad_rms, 7).tolist(),
                 "param_norm": np.round(param_norm, 7).tolist(),
                 "update_norm": [None if i % 10 else round(float(update[i]), 7)
                                 for i in range(params)],
                 "moved": (~frozen).tolist(),
                 "small_steps": step,
                 "small_path": path_sum.tolist(), "small_rpos": rpos.tolist(),
                 "small_rneg": rneg.tolist(), "small_sens": sens.tolist(),
                 "small_gsum": gsum.tolist(), "small_zero_upd": [0.0] * SCALARS,
                 "small_drift": np.abs(values - 1.0).tolist(),
                 "values": values.tolist()})  # fmt: skip
            if step == reset_at:
                put({"event": "reset", "optimizer": 0, "step": reset_at + 1,
                     "params": list(range(params)), "predicted_amplification": 4.47,
                     "cause": "the optimizer's state was emptied (cleared, or loaded without "
                              "state)"})  # fmt: skip
        put({"event": "end", "reason": "closed", "step": steps})
    return len(records)


def load_seconds(context: object, url: str) -> float:
    page = context.new_page()  # type: ignore[attr-defined]
    refused: list[str] = []

    def route(r: object) -> None:
        if r.request.url == url:  # type: ignore[attr-defined]
            r.continue_()  # type: ignore[attr-defined]
        else:
            refused.append(r.request.url)  # type: ignore[attr-defined]
            r.abort()  # type: ignore[attr-defined]

    page.route("**/*", route)
    start = time.perf_counter()
    page.goto(url, wait_until="load", timeout=120_000)
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => r(null)))")
    seconds = time.perf_counter() - start
    drawn = page.evaluate("document.querySelectorAll('div.js-plotly-plot svg.main-svg').length")
    expected = page.evaluate("document.querySelectorAll('div.js-plotly-plot').length")
    page.close()
    assert not refused, refused
    assert expected == 0 or drawn >= expected, (drawn, expected)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--params", type=int, default=500)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("needs Debian's chromium (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        log, out, empty = d / "run.jsonl", d / "report.html", d / "empty.html"
        t0 = time.perf_counter()
        records = write_log(log, args.steps, args.params)
        t1 = time.perf_counter()
        code = deadweight_main(["report", str(log), "-o", str(out), "--fail-on", "never"])
        t2 = time.perf_counter()
        assert code == 0 and out.exists()
        empty.write_text(
            "<!DOCTYPE html><html><head><meta charset='utf-8'></head><body></body></html>"
        )
        text = out.read_text()
        plots = text.count('class="plot"')
        rows = text.count("<tr data-severity=")
        assert "plateau from step" in text  # the loss curve, with the plateau marked
        print(f"log: {records} step records x {args.params} parameters, "
              f"{log.stat().st_size / 1e6:.1f} MB, written in {t1 - t0:.1f} s")  # fmt: skip
        print(f"report: {out.stat().st_size / 1e6:.2f} MB, {plots} plots, {rows} findings, "
              f"built in {t2 - t1:.1f} s")  # fmt: skip
        report_s: list[float] = []
        empty_s: list[float] = []
        with sync_playwright() as p, tempfile.TemporaryDirectory() as profile:
            context = p.chromium.launch_persistent_context(
                profile, executable_path=chromium, args=CHROMIUM_ARGS, headless=True,
                viewport={"width": 1280, "height": 900},
            )  # fmt: skip
            load_seconds(context, empty.as_uri())  # warm the browser up once
            for _ in range(args.pairs):
                empty_s.append(load_seconds(context, empty.as_uri()))
                report_s.append(load_seconds(context, out.as_uri()))
            context.close()
    ratios = [r / e for r, e in zip(report_s, empty_s, strict=True)]
    print(f"chromium {platform.machine()}, {args.pairs} interleaved pairs")
    print(f"empty page: median {statistics.median(empty_s):.3f} s")
    print(f"report:     median {statistics.median(report_s):.2f} s, "
          f"max {max(report_s):.2f} s (goal: < 5 s)")  # fmt: skip
    print(f"report / empty page: median {statistics.median(ratios):.1f}x "
          f"(range {min(ratios):.1f}x-{max(ratios):.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
