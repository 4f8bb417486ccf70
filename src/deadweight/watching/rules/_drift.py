"""Which small parameters move like learners while their gradient sits at the noise floor.

Shared by DW302 (the drift itself) and DW303 (a reset amplifies it). The decision
uses only the exact per-step statistics of small parameters (`SmallStats`):

* the gradient is at the noise floor: its mean per-element size is at most
  `drift-noise-floor-ratio` of its homologous siblings' (the same name up to a layer
  index), or, without siblings, of the other small parameters of its optimizer;
* it still moves like a learner: updates of at least `MIN_UPDATE_LR` of the learning
  rate per element and step (Adam-family steps do not shrink with the gradient), in a
  consistent direction (`MIN_SAME_SIGN` of the steps radially the same way, or a net
  drift of at least `MIN_NET_SHARE` of the distance travelled, either of them beyond
  what a random walk of as many steps gives by chance), and it has drifted by
  at least `drift-min-relative` of its size, after `drift-min-steps` steps.
"""

from __future__ import annotations

import enum
import math
import statistics
from dataclasses import dataclass

from deadweight.homologous import homologous_groups, layer_key
from deadweight.thresholds import current
from deadweight.watching.watch_stats import ParamTrack, WatchStats

# `drift-noise-floor-ratio`, `drift-min-steps` and `drift-min-relative` are
# configurable (deadweight.thresholds, where their defaults are explained).
MIN_UPDATE_LR = 0.05  # SGD turns a noise-level gradient into noise-level steps: ~0 lr
MIN_SAME_SIGN = 0.6  # 82% in the incident, 66% over 20k steps in the toy port
MIN_NET_SHARE = 0.1


# A random walk is not a drift. Over n steps of random sign the share of steps one way
# is 0.5 +- 0.5/sqrt(n), and the net distance is about sqrt(n) steps of a path of n:
# a net share of 1/sqrt(n), which reaches MIN_NET_SHARE by chance at n = 100. Both
# tests therefore also ask for SIGNIFICANCE standard deviations beyond a random walk.
SIGNIFICANCE = 3.0


def directed(same_sign: float, moves: float, net_share: float, steps: int) -> bool:
    """Whether the updates keep a direction, beyond what a random walk does by chance."""
    by_sign = same_sign >= MIN_SAME_SIGN and (2 * same_sign - 1) * math.sqrt(moves) >= SIGNIFICANCE
    by_net = net_share >= max(MIN_NET_SHARE, SIGNIFICANCE / math.sqrt(max(steps, 1)))
    return by_sign or by_net


class Reference(enum.Enum):
    """What a small parameter's gradient is compared with, in order of preference."""

    SIBLINGS = "siblings"  # the same name up to a layer index: `blocks.{}.scale`
    OPTIMIZER = "optimizer"  # without siblings: the other small parameters of its optimizer

    def describe(self, template: str | None) -> str:
        """The set as a noun phrase, for `... of the median of {phrase}`."""
        if self is Reference.SIBLINGS:
            return f"its siblings {template}" if template else "its siblings"
        if self is Reference.OPTIMIZER:
            return "the other small parameters of its optimizer"
        raise AssertionError(f"no wording for {self}")


@dataclass(frozen=True)
class Drift:
    name: str
    steps: int
    grad_rms: float  # mean per-element |grad| per step
    reference_grad_rms: float  # the median over the reference set
    reference_kind: Reference
    reference_template: str | None  # `blocks.{}.scale` for siblings
    update_rms: float  # mean per-element |update| per step
    reference_update_rms: float
    mean_lr: float
    same_sign: float
    total_drift: float
    start_norm: float | None
    net_share: float
    values: tuple[float, float] | None = None  # first and last logged value (scalars)
    numel: int = 1

    @property
    def mean_update_lr(self) -> float:
        """Its mean per-element update, in learning rates."""
        return self.update_rms / self.mean_lr

    @property
    def predicted_per_step(self) -> float | None:
        """The drift per step, in norm, that Adam on a gradient of pure noise predicts;
        None when a number it needs is not finite.

        Adam on noise takes steps of a fixed size whatever the gradient's size (about
        lr: `mean_update_lr` of it), and with a share p of its steps the same way it
        nets (2p - 1) of a step each step: after t steps, t * mean_update_lr * lr *
        (2p - 1) per element, sqrt(numel) times that in norm. A measured drift on this
        line is the noise-driven walk DW302 says it is.
        """
        update, lr, p = self.mean_update_lr, self.mean_lr, self.same_sign
        if not all(math.isfinite(v) for v in (update, lr, p)):
            return None
        return update * lr * (2 * p - 1) * math.sqrt(max(1, self.numel))

    @property
    def predicted_by(self) -> str:
        """What the prediction assumes, in words (the legend of its line in a plot)."""
        return (
            f"Adam on noise, steps of {self.mean_update_lr:.2g} lr, "
            f"{self.same_sign:.0%} the same way"
        )

    @property
    def reference(self) -> str:
        """The set its gradient is compared with, in words."""
        return self.reference_kind.describe(self.reference_template)

    @property
    def grad_ratio(self) -> float:
        return self.grad_rms / self.reference_grad_rms if self.reference_grad_rms else math.inf

    @property
    def update_vs_signal(self) -> float:
        """How much more it moves per unit of gradient than its reference set does."""
        if not self.reference_update_rms or not self.grad_ratio:
            return math.inf
        return (self.update_rms / self.reference_update_rms) / self.grad_ratio


def _per_element(track: ParamTrack) -> tuple[float, float] | None:
    s = track.small_stats
    if s is None or s.steps == 0:
        return None
    scale = s.steps * math.sqrt(max(1, track.numel))
    return s.grad_sum / scale, s.path / scale


def noise_driven(stats: WatchStats) -> list[Drift]:
    limits = current()
    tracks = {n: t for n, t in stats.params.items() if t.small_stats is not None}
    per = {n: _per_element(t) for n, t in tracks.items()}
    siblings: dict[str, list[str]] = {}
    for members in homologous_groups(tracks).values():
        names = [n for _, n in members]
        for n in names:
            siblings[n] = [m for m in names if m != n]
    out = []
    for name, track in tracks.items():
        s = track.small_stats
        measured = per[name]
        if s is None or measured is None or track.pinned or s.steps < limits.drift_min_steps:
            continue
        grad_rms, update_rms = measured
        lr = track.mean_lr
        if not lr or update_rms < MIN_UPDATE_LR * lr:
            continue
        moves = s.radial_pos + s.radial_neg
        same_sign = max(s.radial_pos, s.radial_neg) / moves if moves else 0.0
        net_share = s.drift / s.path if s.path else 0.0
        if not directed(same_sign, moves, net_share, s.steps):
            continue
        start = next((v for v in track.series.param_norm if v is not None), None)
        if start is not None and start > 0 and s.drift < limits.drift_min_relative * start:
            continue
        kind, template, refs = _reference(name, track, tracks, siblings)
        ref_values = [per[r] for r in refs if per[r] is not None]
        if len(ref_values) < 2:
            continue  # nothing to compare with: no verdict
        ref_grad = statistics.median(v[0] for v in ref_values if v is not None)
        ref_update = statistics.median(v[1] for v in ref_values if v is not None)
        if ref_grad <= 0 or grad_rms > limits.drift_noise_floor_ratio * ref_grad:
            continue
        out.append(
            Drift(
                name=name,
                steps=s.steps,
                grad_rms=grad_rms,
                reference_grad_rms=ref_grad,
                reference_kind=kind,
                reference_template=template,
                update_rms=update_rms,
                reference_update_rms=ref_update,
                mean_lr=lr,
                same_sign=same_sign,
                total_drift=s.drift,
                start_norm=start,
                net_share=net_share,
                values=(track.series.value[0][0], track.series.value[-1][0])
                if track.numel == 1 and track.series.value and track.series.value[-1]
                else None,
                numel=track.numel,
            )
        )
    return out


def _reference(
    name: str,
    track: ParamTrack,
    tracks: dict[str, ParamTrack],
    siblings: dict[str, list[str]],
) -> tuple[Reference, str | None, list[str]]:
    mine = [n for n in siblings.get(name, []) if not tracks[n].pinned]
    if len(mine) >= 2:
        key = layer_key(name)
        return Reference.SIBLINGS, key[0] if key else name, mine
    others = [
        n
        for n, t in tracks.items()
        if n != name and t.optimizer == track.optimizer and not t.pinned
    ]
    return Reference.OPTIMIZER, None, others
