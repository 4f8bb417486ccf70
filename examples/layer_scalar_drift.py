"""Seed incident 2: parameters that only pretend to learn.

A shape-[1] layer scalar feeds straight into the final RMSNorm, which cancels it:
its gradient is noise. The weight-decay rule `len(p.shape) == 1 -> no decay` leaves
it without decay, and Adam turns the noise into steady steps. This script shows, on
CPU in about a minute:

1. what `deadweight.check` reports at step 0 (DW104, DW203, DW204 on that scalar only);
2. training: the scalar's value, its update size against the prediction, the loss;
3. optimizer-state resets: the measured acceleration next to sqrt(1/(1-b2));
4. forced weight decay: where the scalar settles, next to theta_eq;
5. `deadweight.pin`: the scalar stays bit-exactly at 1.0 while the others learn.

    python examples/layer_scalar_drift.py [--steps 4000]

The model and the training loop are in deadweight/demos/layer_scalar_drift.py.
"""

from __future__ import annotations

import argparse

from deadweight.demos import layer_scalar_drift


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--resets", type=int, default=5)
    args = parser.parse_args()

    story = layer_scalar_drift.run_story(steps=args.steps, resets=args.resets)
    print("1. deadweight.check at step 0:")
    print(story.report)
    for line in layer_scalar_drift.describe(story):
        print(line)

    # The fixes: pin the scalar, then build the weight-decay groups by meaning.
    import deadweight

    setup = layer_scalar_drift.make()
    last = f"blocks.{layer_scalar_drift.LAYERS - 1}.layer_scalar"
    deadweight.pin(setup.model, last)
    _, why = deadweight.param_groups(setup.model, 0.1, explain=True)
    for name in ("blocks.0.layer_scalar", last, "blocks.0.norm.weight", "blocks.0.fc1.bias"):
        print(f"deadweight.param_groups: {name} -> {why[name]}")


if __name__ == "__main__":
    main()
