"""`deadweight demo`: the seed incidents, reproduced and caught, in a few seconds."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from deadweight.check_model import check
from deadweight.demos import fused_rmsnorm, layer_scalar_drift
from deadweight.report.text import render

HELP = "run the seed incidents and show what deadweight reports for them"


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("demo", help=HELP, description=HELP + ".")
    parser.add_argument(
        "--steps",
        type=int,
        default=fused_rmsnorm.STEPS,
        help=f"training steps per path (default: {fused_rmsnorm.STEPS})",
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
        result = fused_rmsnorm.train(setup, steps=args.steps)
        console.print(f"[bold]{title}[/]")
        present = " ".join(f"{k} {str(v).lower()}" for k, v in result.grads_present.items())
        console.print(f"  grads present: {present}")
        for step, loss in result.losses.items():
            console.print(f"  step {step:>4}: loss {loss:.5f}")
        console.print(f"  w1 max |change| after {args.steps} steps: {result.max_change['w1']:.6g}")
        console.print(f"\n  deadweight.check at step 0, before training ({title}):")
        render(report, console)
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
    return 0
