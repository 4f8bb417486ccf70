"""`deadweight demo`: the seed incidents, reproduced and caught, in a few seconds."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from deadweight.report.text import render

HELP = "run the seed incidents and show what deadweight reports for them"
# fused_rmsnorm.STEPS, named here so that building the parser imports no torch (a
# test keeps the two equal).
SEED_STEPS = 1000


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("demo", help=HELP, description=HELP + ".")
    parser.add_argument(
        "--steps",
        type=int,
        default=SEED_STEPS,
        help=f"training steps per path (default: {SEED_STEPS})",
    )
    parser.add_argument(
        "--drift-steps",
        type=int,
        default=1200,
        help="training steps per run of the second incident (default: 1200; "
        "examples/layer_scalar_drift.py runs the full story)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from deadweight.checking.api import check
    from deadweight.demos import fused_rmsnorm, layer_scalar_drift
    from deadweight.watching.watcher import watch

    console = Console()
    console.rule("[bold]Seed incident 1: a fused RMSNorm that records no backward")
    console.print(
        "Linear(8→8) → RMSNorm → Linear(8→1), SGD lr 0.1, teacher with a different first "
        "layer. RMSNorm.forward takes a fused kernel (torch.no_grad) on contiguous input; "
        "forward_diff is differentiable. Both start from the same weights.\n"
    )
    for diff, title in ((False, "RMSNorm.forward (fused)"), (True, "RMSNorm.forward_diff")):
        setup = fused_rmsnorm.make(diff)
        report = check(setup.model, setup.loss, setup.optimizer)
        with watch(setup.model, setup.optimizer, every=10) as watched:
            result = fused_rmsnorm.train(setup, steps=args.steps)
        console.print(f"[bold]{title}[/]")
        present = " ".join(f"{k} {str(v).lower()}" for k, v in result.grads_present.items())
        console.print(f"  grads present: {present}")
        for step, loss in result.losses.items():
            console.print(f"  step {step:>4}: loss {loss:.5f}")
        console.print(f"  w1 max |change| after {args.steps} steps: {result.max_change['w1']:.6g}")
        console.print(f"\n  deadweight.check at step 0, before training ({title}):")
        render(report, console)
        console.print(f"\n  deadweight.watch during those {args.steps} steps ({title}):")
        render(watched.report(), console)
        console.print()

    console.rule("[bold]Seed incident 2: a layer scalar that only pretends to learn")
    console.print(
        f"{layer_scalar_drift.LAYERS} residual blocks, each with a shape-[1] scalar; the last one "
        "scales the hidden state right before the final RMSNorm, which cancels it. AdamW "
        "(lr 8.5e-4, b2 0.95) with the rule `len(p.shape) == 1 -> no weight decay`.\n"
    )
    story = layer_scalar_drift.run_story(steps=args.drift_steps, resets=3)
    console.print("1. deadweight.check at step 0:")
    render(story.report, console)
    for line in layer_scalar_drift.describe(story):
        console.print(line, highlight=False)

    drifting = layer_scalar_drift.make_watchable()
    console.print(
        f"6. deadweight.watch on a run with noise above Adam's eps, as in the incident (lr "
        f"{layer_scalar_drift.WATCH_LR:g}, eps {layer_scalar_drift.WATCH_EPS:g}): "
        f"{args.drift_steps} steps, an optimizer-state reset, 300 more steps"
    )
    with watch(drifting.model, drifting.optimizer, every=20) as watched:
        layer_scalar_drift.train(drifting, args.drift_steps, every=args.drift_steps)
        drifting.optimizer.state.clear()
        layer_scalar_drift.train(drifting, 300, every=300)
    values = ", ".join(f"{s.item():.3f}" for s in drifting.scalars)
    console.print(f"   layer scalars at the end: {values}")
    render(watched.report(), console)
    return 0
