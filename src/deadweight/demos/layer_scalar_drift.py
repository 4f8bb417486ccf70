"""Seed incident 2, small and on CPU: a layer scalar that only pretends to learn.

A residual stack whose blocks each carry a learnable shape-[1] scalar. In blocks
0..L-2 the scalar scales the block's branch (h + s * branch(h)); in the last block it
scales the whole hidden state, which goes straight into the final RMSNorm, and
RMSNorm(s * x) = RMSNorm(x): the loss cannot see it. Its gradient is numerical noise.
The optimizer is AdamW with the incident's weight-decay heuristic,
`len(p.shape) == 1 -> no weight decay`, so nothing pulls the scalar back while Adam
turns the noise into steady steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from deadweight.demos import fused_rmsnorm
from deadweight.report import Report

IN, WIDTH, OUT = 16, 64, 8
LAYERS = 4
BATCH = 64
LR = 8.5e-4  # the incident's learning rate
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
NOISE = 0.5


class RMSNorm(fused_rmsnorm.RMSNorm):
    """The first demo's RMSNorm, always on its differentiable path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_diff(x)


class Block(nn.Module):
    def __init__(self, last: bool) -> None:
        super().__init__()
        self.last = last
        self.norm = RMSNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        branch = self.fc2(F.gelu(self.fc1(self.norm(h))))
        if self.last:  # the last block's output goes straight into the final RMSNorm
            return self.layer_scalar * (h + branch)
        return h + self.layer_scalar * branch


class ScalarStack(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, WIDTH)
        self.blocks = nn.ModuleList([Block(last=i == layers - 1) for i in range(layers)])
        self.final_norm = RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.final_norm(h))


def shape_rule_groups(
    model: nn.Module,
    weight_decay: float = WEIGHT_DECAY,
    *,
    decay_anyway: nn.Parameter | None = None,
) -> list[dict]:
    """The incident's heuristic (Megatron): `len(param.shape) == 1` -> no weight decay.

    `decay_anyway` is put into the decay group regardless (the incident's attempt 2).
    """
    decay = [p for p in model.parameters() if len(p.shape) != 1 or p is decay_anyway]
    no_decay = [p for p in model.parameters() if len(p.shape) == 1 and p is not decay_anyway]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@dataclass
class Setup:
    model: ScalarStack
    optimizer: torch.optim.Optimizer
    x: torch.Tensor  # the dataset: a teacher's inputs and outputs
    y: torch.Tensor
    gen: torch.Generator = field(repr=False)
    batch: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def scalars(self) -> list[nn.Parameter]:
        return [cast(Block, b).layer_scalar for b in self.model.blocks]

    @property
    def last_scalar(self) -> nn.Parameter:
        return self.scalars[-1]

    def next_batch(self) -> None:
        idx = torch.randint(0, self.x.shape[0], (BATCH,), generator=self.gen)
        self.batch = (self.x[idx], self.y[idx])

    def loss(self) -> torch.Tensor:
        if self.batch is None:
            self.next_batch()
        assert self.batch is not None
        x, y = self.batch
        return F.mse_loss(self.model(x), y)


def make(
    seed: int = 0,
    layers: int = LAYERS,
    groups: Callable[[nn.Module], list[dict]] = shape_rule_groups,
) -> Setup:
    torch.manual_seed(seed)
    model = ScalarStack(layers)
    teacher = nn.Sequential(nn.Linear(IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        x = torch.randn(4096, IN, generator=gen)
        # Noisy targets keep the loss, and so the gradient noise, from vanishing, as in
        # language-model training, where the loss stays far from zero.
        y = teacher(x) + NOISE * torch.randn(4096, OUT, generator=gen)
    optimizer = torch.optim.AdamW(groups(model), lr=LR, betas=BETAS, eps=EPS)
    return Setup(model, optimizer, x, y, gen)


# Watching the drift in CI time. The toy's noise gradient (1e-8 to 1e-7) is the size
# of Adam's default eps, which damps its steps to ~0.2 lr; the incident's steps were
# ~lr. eps = 1e-12 puts the toy in the incident's regime, and lr = 2e-3 makes the drift
# stand out among the siblings within ~1000 steps instead of tens of thousands.
WATCH_LR = 2e-3
WATCH_EPS = 1e-12


def make_watchable(seed: int = 0) -> Setup:
    """The toy with noise well above Adam's eps, as in the incident."""
    setup = make(seed)
    for group in setup.optimizer.param_groups:
        group["lr"] = WATCH_LR
        group["eps"] = WATCH_EPS
    return setup


@dataclass
class Trace:
    """What training showed: the last scalar's value, its updates, the loss."""

    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)  # last scalar, every `every` steps
    losses: list[float] = field(default_factory=list)
    updates: list[float] = field(default_factory=list)  # last scalar's update, every step
    others: list[list[float]] = field(default_factory=list)  # the other scalars, every `every`


def train(setup: Setup, steps: int, every: int = 250, trace: Trace | None = None) -> Trace:
    trace = trace or Trace()
    start = len(trace.updates)
    scalars = setup.scalars
    for i in range(steps):
        setup.next_batch()
        setup.optimizer.zero_grad(set_to_none=True)
        loss = setup.loss()
        loss.backward()
        before = setup.last_scalar.item()
        setup.optimizer.step()
        trace.updates.append(setup.last_scalar.item() - before)
        step = start + i + 1
        if step % every == 0:
            trace.steps.append(step)
            trace.values.append(setup.last_scalar.item())
            trace.losses.append(loss.item())
            trace.others.append([s.item() for s in scalars[:-1]])
    return trace


FORCED_DECAY = 1.0  # the forced-decay run uses wd = 1 so it settles within ~2000 steps


def forced_decay_groups(model: nn.Module, weight_decay: float = FORCED_DECAY) -> list[dict]:
    """The incident's attempt 2: put the last scalar into a weight-decay group."""
    last = cast(Block, cast(ScalarStack, model).blocks[-1]).layer_scalar
    return shape_rule_groups(model, weight_decay, decay_anyway=last)


@dataclass
class Story:
    """Everything the seed-2 example shows, measured."""

    report: Report
    drift: Trace  # no decay, no pin
    predicted_step: float  # DW204's expected step per update
    predicted_max_step: float
    reset_ratios: list[float]  # first update after each reset / mean update before it
    reset_ratios_20: list[float]  # first 20 updates after each reset / mean before
    predicted_reset: float
    decayed: Trace  # the last scalar in a decay group with wd = FORCED_DECAY
    predicted_equilibrium: float  # expected step / (wd * lr)
    predicted_equilibrium_max: float
    pinned: Trace
    pinned_moved: float  # PinHandle.moved() at the end
    pinned_others_moved: float  # the largest change of the other scalars


def run_story(steps: int = 4000, resets: int = 5, every: int = 250) -> Story:
    from deadweight.checking.api import check
    from deadweight.fixes.pin import pin

    setup = make()
    report = check(setup.model, setup.loss, setup.optimizer)
    risks = [f for f in report.findings if f.code == "DW204"]
    risk = risks[0] if risks else None
    predicted = float(risk.evidence["expected_step"]) if risk else float("nan")
    predicted_max = float(risk.evidence["max_step"]) if risk else float("nan")
    predicted_reset = float(risk.evidence["reset_amplification"]) if risk else float("nan")

    drift = train(setup, steps, every)
    ratios, ratios_20 = [], []
    for _ in range(resets):  # --no-load-optim: Adam's moments start again from 0
        setup.optimizer.state.clear()
        before = [abs(u) for u in drift.updates[-200:]]
        n = len(drift.updates)
        drift = train(setup, 300, every, trace=drift)
        usual = sum(before) / len(before)
        ratios.append(abs(drift.updates[n]) / usual)
        ratios_20.append(sum(abs(u) for u in drift.updates[n : n + 20]) / 20 / usual)

    decayed_setup = make(groups=forced_decay_groups)
    decayed = train(decayed_setup, steps, every)

    pinned_setup = make()
    handle = pin(pinned_setup.model, f"blocks.{LAYERS - 1}.layer_scalar")
    start = [s.item() for s in pinned_setup.scalars[:-1]]
    pinned = train(pinned_setup, steps, every)
    others = max(abs(s.item() - v) for s, v in zip(pinned_setup.scalars[:-1], start, strict=True))
    return Story(
        report=report,
        drift=drift,
        predicted_step=predicted,
        predicted_max_step=predicted_max,
        reset_ratios=ratios,
        reset_ratios_20=ratios_20,
        predicted_reset=predicted_reset,
        decayed=decayed,
        predicted_equilibrium=predicted / (FORCED_DECAY * LR),
        predicted_equilibrium_max=predicted_max / (FORCED_DECAY * LR),
        pinned=pinned,
        pinned_moved=handle.moved(),
        pinned_others_moved=others,
    )


def describe(story: Story, every: int = 250) -> list[str]:
    """The story as lines of text: what was measured, next to what was predicted."""
    import statistics

    d = story.drift
    lines = [
        "2. Training with the shape rule (no decay on shape-[1]): the last scalar and the loss",
    ]
    for step, value, loss in list(zip(d.steps, d.values, d.losses, strict=True))[
        :: max(1, len(d.steps) // 8)
    ]:
        lines.append(f"   step {step:>5}: last scalar {value:.4f}   loss {loss:.4f}")
    n = len(d.updates)
    mean_abs = sum(abs(u) for u in d.updates) / n
    positive = sum(1 for u in d.updates if u > 0) / n
    lines += [
        f"   mean |update| {mean_abs:.3g} per step = {mean_abs / LR:.2f} lr; predicted "
        f"{story.predicted_step:.3g} ({story.predicted_step / LR:.2f} lr), at most "
        f"{story.predicted_max_step:.3g}",
        f"   {positive:.0%} of updates positive; net change {d.values[-1] - 1.0:+.3f} while the "
        f"other scalars learn and the loss goes {d.losses[0]:.3f} -> {d.losses[-1]:.3f}",
        "3. Optimizer-state reset (Adam moments cleared, as with --no-load-optim):",
        f"   first update after a reset / usual update: median {statistics.median(story.reset_ratios):.2f}x "
        f"over {len(story.reset_ratios)} resets ({', '.join(f'{r:.1f}' for r in story.reset_ratios)}); "
        f"predicted sqrt(1/(1-b2)) = {story.predicted_reset:.2f}x",
        f"   first 20 updates: {statistics.median(story.reset_ratios_20):.2f}x. The excess fades "
        "as v re-accumulates (about 1/(1-b2) = 20 steps); the first step's size depends on the "
        "noise of that one batch, so single resets scatter around the prediction.",
        f"4. Forced weight decay (wd = {FORCED_DECAY:g}, the incident's attempt 2):",
        "   last scalar "
        + " ".join(
            f"{v:.3f}" for v in story.decayed.values[:: max(1, len(story.decayed.values) // 8)]
        ),
        f"   at {story.decayed.values[-1]:.3f} after {len(story.decayed.updates)} steps: pulled "
        "away from its initial 1.0 towards an equilibrium; predicted "
        f"theta_eq = drift / (wd * lr) = {story.predicted_equilibrium:.3f} (at most "
        f"{story.predicted_equilibrium_max:.3f}). Near 0 the cancellation weakens and the noise "
        "turns into a real gradient, so the step-0 noise level only sizes it.",
        "5. deadweight.pin on the last scalar:",
        f"   moved {story.pinned_moved:.3g} in {len(story.pinned.updates)} steps (bit-exactly "
        f"{'still' if story.pinned_moved == 0 else 'NOT'} at 1.0); the other scalars moved up to "
        f"{story.pinned_others_moved:.3f}",
    ]
    return lines
