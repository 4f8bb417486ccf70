"""Seed incident 1: gradients that never arrive.

A fused RMSNorm kernel records no backward op (candle's `apply_op2_no_bwd`; in
PyTorch, a kernel run under torch.no_grad). Every parameter before it, and its own
weight, get no gradient; SGD skips them silently; the loss falls, then plateaus.

    python examples/fused_rmsnorm_no_grad.py

prints the seed's table for the fused and the differentiable path, then what
`deadweight.check` reports for each at step 0, before any training.
The model code is in deadweight/demos/fused_rmsnorm.py.
"""

from __future__ import annotations

import deadweight
from deadweight.demos import fused_rmsnorm


def main() -> None:
    for diff in (False, True):
        title = "RMSNorm::forward_diff" if diff else "RMSNorm::forward (fused)"
        setup = fused_rmsnorm.make(diff)

        # The check: one forward and backward, nothing stepped, nothing changed.
        report = deadweight.check(setup.model, setup.loss, setup.optimizer)

        result = fused_rmsnorm.train(setup)
        print(title)
        print("  grads present:", " ".join(f"{k} {v}" for k, v in result.grads_present.items()))
        for step, loss in result.losses.items():
            print(f"  step {step:>4}: loss {loss:.5f}")
        print(f"  w1 max |change| after {fused_rmsnorm.STEPS} steps: {result.max_change['w1']:.8g}")
        print(report)


if __name__ == "__main__":
    main()
