"""Aggregate watch events into `WatchStats`, the measurement the DW3xx rules judge.

The live watcher and `deadweight report run.jsonl` feed the very same events through
`WatchStats.apply`, so a report rebuilt from a log is the report the run would have
printed at that point.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from deadweight.errors import CollectiveError
from deadweight.findings import Finding

# The version of the events `WatchStats.apply` reads, written at the head of every log.
# Bumped when a log carries what an older reader would miss without a word: new keys
# in an existing event keep the number. A reader accepts every version up to its own
# and notes a newer one (reading what it can). 2: `loss` events; a version-1 log has
# none, and the report then says the loss was not recorded.
LOG_SCHEMA_VERSION = 2

# How `deadweight run`'s step-0 check ran, most complete first: replayed with the real
# loss, replayed with a stand-in loss, only what the script's own first backward
# proves, not at all.
STEP0_MODES = ("replayed", "structure-only", "from-backward", "unavailable")


def _step0_rank(mode: str) -> int:
    return STEP0_MODES.index(mode) if mode in STEP0_MODES else len(STEP0_MODES)


@dataclass
class Series:
    """A parameter's trajectory at watched steps."""

    steps: list[int] = field(default_factory=list)
    param_norm: list[float | None] = field(default_factory=list)
    grad_rms: list[float | None] = field(default_factory=list)
    update_norm: list[float | None] = field(default_factory=list)
    value: list[list[float]] = field(default_factory=list)  # only for tiny parameters


@dataclass
class SmallStats:
    """Exact cumulative update statistics of a small parameter (every step)."""

    steps: int = 0
    path: float = 0.0  # sum of ||update||
    radial_pos: float = 0.0  # steps moving away from 0
    radial_neg: float = 0.0
    sens: float = 0.0  # sum of |<grad, theta>|: how much the loss cares about its scale
    grad_sum: float = 0.0  # sum of ||grad||
    zero_updates: float = 0.0  # steps with a non-zero grad and no change at all
    drift: float = 0.0  # ||theta - theta at the start|| (at most, across optimizers)

    def __add__(self, other: SmallStats) -> SmallStats:
        return SmallStats(
            *(
                a + b
                for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
            )
        )


@dataclass
class ParamTrack:
    name: str
    shape: tuple[int, ...]
    dtype: str
    optimizer: int
    group: int | None  # None: trainable but in no watched optimizer
    pinned: bool
    small: bool
    numel: int
    steps: int = 0  # optimizer steps while watched
    grad_present: int = 0  # of those, steps with a gradient
    lr0_steps: int = 0  # steps with a gradient in a group whose lr was 0
    lr_sum: float = 0.0  # sum of the group's lr over the steps
    moved: bool | None = None  # bitwise changed since watching began
    series: Series = field(default_factory=Series)
    small_stats: SmallStats | None = None
    nonfinite: dict[str, int] = field(default_factory=dict)  # "grad"/"value" -> first step
    skipped: int = 0  # GradScaler skips of its optimizer
    skipped_nonfinite: int = 0  # of those, skips where this gradient held inf/NaN
    # Counts carried over from an earlier optimizer that held this parameter.
    base: tuple[int, int, int, float] = (0, 0, 0, 0.0)
    small_base: SmallStats | None = None
    # (steps, cumulative ||update|| path) of a small parameter at each record
    path_history: list[tuple[int, float]] = field(default_factory=list)

    @property
    def mean_lr(self) -> float | None:
        return self.lr_sum / self.steps if self.steps else None


@dataclass
class OptimizerTrack:
    index: int
    cls: str
    groups: list[dict[str, Any]]
    params: list[str]  # names, in the order of the event arrays
    small: list[int]
    values: list[int]
    steps: int = 0
    start_step: int = 0  # step numbers continue those of an earlier monitor of it
    scaler_skips: list[int] = field(default_factory=list)  # step counts at each skip
    skips_among_steps: int = 0  # skips a fused optimizer made inside a step() call
    skipper: str = "a GradScaler"  # who skipped them: DeepSpeed skips steps itself


@dataclass
class ResetTrack:
    optimizer: int
    step: int
    params: list[str]
    predicted: float | None
    cause: str = ""
    # name -> (mean |update| before, first update, mean over the burst), small params only
    effect: dict[str, tuple[float, float, float]] | None = None
    before_steps: int = 0
    after_steps: int = 0
    # name -> mean ||update|| per step between the two records before the reset
    before_from_records: dict[str, float] = field(default_factory=dict)


@dataclass
class StaleGradients:
    """A step that consumed the gradient an earlier step had used (zero_grad missing)."""

    optimizer: int
    step: int
    params: list[str]


@dataclass
class EvalEpisode:
    """Optimizer steps taken with mode-dependent modules in eval mode."""

    optimizer: int
    start: int  # the first step it was seen at
    modules: list[str]
    module_count: int
    kinds: list[str]
    end: int | None = None  # the step at which they all trained again; None: to the end


@dataclass
class WatchStats:
    config: dict[str, Any] = field(default_factory=dict)
    start: dict[str, Any] = field(default_factory=dict)
    optimizers: dict[int, OptimizerTrack] = field(default_factory=dict)
    params: dict[str, ParamTrack] = field(default_factory=dict)
    resets: list[ResetTrack] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    problems: list[str] = field(default_factory=list)  # from reading a log
    # Under torch.distributed: this rank's place, parameters whose copies differ
    # across ranks (name -> what was seen), and which ranks' optimizers hold what.
    ranks: dict[str, Any] | None = None
    replicas: dict[str, dict[str, Any]] = field(default_factory=dict)
    rank_params: dict[str, Any] | None = None
    # The training loss, when the run recorded it (log schema 2): one entry per
    # recorded value, several per step under gradient accumulation; None: non-finite.
    loss_steps: list[int] = field(default_factory=list)
    loss_values: list[float | None] = field(default_factory=list)
    # Backward passes the watch counted (None: not known, a log from before they were).
    backwards: int | None = None
    # `deadweight run`'s step-0 check: its findings, how it ran (one of STEP0_MODES)
    # and why it could not do more.
    step0: list[Finding] = field(default_factory=list)
    step0_mode: str | None = None
    step0_note: str | None = None
    stale_grads: list[StaleGradients] = field(default_factory=list)
    eval_episodes: list[EvalEpisode] = field(default_factory=list)
    _step0_checks: list[tuple[str, str | None, Any]] = field(default_factory=list, repr=False)

    @property
    def loss_recorded(self) -> bool:
        return bool(self.loss_steps)

    @property
    def steps(self) -> int:
        return max((o.steps for o in self.optimizers.values()), default=0)

    @property
    def complete(self) -> bool:
        return self.end is not None

    def apply(self, event: dict[str, Any]) -> None:
        handler = getattr(self, f"_on_{event.get('event')}", None)
        if handler is not None:
            handler(event)

    # -- handlers ------------------------------------------------------------------------

    def _on_start(self, event: dict[str, Any]) -> None:
        self.start = {k: v for k, v in event.items() if k != "config"}
        self.config = dict(event.get("config") or {})

    def _on_optimizer(self, event: dict[str, Any]) -> None:
        index = int(event["optimizer"])
        names = [p["name"] for p in event["params"]]
        small = set(event.get("small", []))
        self.optimizers[index] = OptimizerTrack(
            index,
            event.get("class", "?"),
            event.get("groups", []),
            names,
            list(event.get("small", [])),
            list(event.get("values", [])),
            start_step=int(event.get("start_step", 0)),
        )
        for pos, p in enumerate(event["params"]):
            shape = tuple(p["shape"])
            numel = 1
            for d in shape:
                numel *= d
            previous = self.params.get(p["name"])
            track = ParamTrack(
                name=p["name"],
                shape=shape,
                dtype=p.get("dtype", "?"),
                optimizer=index,
                group=p.get("group"),
                pinned=bool(p.get("pinned")),
                small=pos in small,
                numel=numel,
            )
            if previous is not None:  # a new optimizer took it over: keep its history
                track.series = previous.series
                track.steps, track.grad_present = previous.steps, previous.grad_present
                track.lr0_steps, track.lr_sum = previous.lr0_steps, previous.lr_sum
                track.moved, track.nonfinite = previous.moved, previous.nonfinite
                track.skipped = previous.skipped
                track.skipped_nonfinite = previous.skipped_nonfinite
                track.small_base = previous.small_stats
                track.path_history = previous.path_history
                track.base = (
                    previous.steps,
                    previous.grad_present,
                    previous.lr0_steps,
                    previous.lr_sum,
                )
            self.params[p["name"]] = track

    def _tracks(self, event: dict[str, Any]) -> tuple[OptimizerTrack, list[ParamTrack]] | None:
        opt = self.optimizers.get(int(event.get("optimizer", -1)))
        if opt is None:
            self.problems.append(f"a {event.get('event')} event names an unknown optimizer")
            return None
        tracks = [self.params[n] for n in opt.params]
        return opt, [t if t.optimizer == opt.index else _Detached() for t in tracks]

    def _on_step(self, event: dict[str, Any]) -> None:
        found = self._tracks(event)
        if found is None:
            return
        opt, tracks = found
        step = int(event["step"])
        opt.steps = step
        lr_sum = event.get("lr_sum") or []
        for pos, track in enumerate(tracks):
            base = track.base
            track.steps = base[0] + step - opt.start_step
            track.grad_present = base[1] + event["grad_present"][pos]
            track.lr0_steps = base[2] + event["lr0_steps"][pos]
            if track.group is not None and track.group < len(lr_sum):
                track.lr_sum = base[3] + (lr_sum[track.group] or 0.0)
            moved = event["moved"][pos]
            if moved is not None:
                track.moved = bool(moved) or bool(track.moved)
            s = track.series
            s.steps.append(step)
            s.param_norm.append(event["param_norm"][pos])
            s.grad_rms.append(event["grad_rms"][pos])
            s.update_norm.append(event["update_norm"][pos])
        small_steps = int(event.get("small_steps", 0))
        for k, pos in enumerate(opt.small):
            track = tracks[pos]
            small = SmallStats(
                steps=small_steps,
                path=event["small_path"][k],
                radial_pos=event["small_rpos"][k],
                radial_neg=event["small_rneg"][k],
                sens=event["small_sens"][k],
                grad_sum=event["small_gsum"][k],
                zero_updates=event["small_zero_upd"][k],
                drift=event["small_drift"][k],
            )
            if track.small_base is not None:  # continues an earlier optimizer's statistics
                small = track.small_base + small
            track.small_stats = small
            track.path_history.append((small.steps, small.path))
        cursor = 0
        values = event.get("values", [])
        for pos in opt.values:
            track = tracks[pos]
            n = track.numel
            track.series.value.append(values[cursor : cursor + n])
            cursor += n

    def _on_nonfinite(self, event: dict[str, Any]) -> None:
        found = self._tracks(event)
        if found is None:
            return
        track = found[1][int(event["param"])]
        track.nonfinite.setdefault(event["what"], int(event["step"]))

    def _on_reset(self, event: dict[str, Any]) -> None:
        found = self._tracks(event)
        if found is None:
            return
        opt, _ = found
        names = [opt.params[i] for i in event["params"]]
        self.resets.append(
            ResetTrack(
                optimizer=opt.index,
                step=int(event["step"]),
                params=names,
                predicted=event.get("predicted_amplification"),
                cause=event.get("cause", ""),
                before_from_records={
                    n: rate for n in names if (rate := self._recent_update(n)) is not None
                },
            )
        )

    def _recent_update(self, name: str) -> float | None:
        """Mean ||update|| per step between the last two records of a small parameter."""
        history = self.params[name].path_history
        if len(history) < 2 or history[-1][0] <= history[-2][0]:
            return None
        (s1, p1), (s2, p2) = history[-2], history[-1]
        return (p2 - p1) / (s2 - s1)

    def _on_reset_effect(self, event: dict[str, Any]) -> None:
        found = self._tracks(event)
        if found is None:
            return
        opt, _ = found
        for reset in self.resets:
            if reset.optimizer == opt.index and reset.step == int(event["step"]):
                reset.before_steps = int(event.get("before_steps", 0))
                reset.after_steps = int(event.get("after_steps", 0))
                reset.effect = {}
                for i, b, f, a in zip(
                    event["params"], event["before"], event["first"], event["after"], strict=True
                ):
                    name = opt.params[i]
                    if b is None or not math.isfinite(b):
                        # No steps of this optimizer before the reset (a new optimizer
                        # took over): the rate between the previous records instead.
                        b = reset.before_from_records.get(name)
                    if b is not None and f is not None and a is not None:
                        reset.effect[name] = (b, f, a)

    def _on_skip(self, event: dict[str, Any]) -> None:
        found = self._tracks(event)
        if found is None:
            return
        opt, tracks = found
        opt.scaler_skips.append(int(event["step"]))
        if str(event.get("cause", "")).startswith("DeepSpeed"):
            opt.skipper = "DeepSpeed"
        if event.get("counted_as_step"):
            opt.skips_among_steps += 1
        for track in tracks:
            track.skipped += 1
        for pos in set(event.get("nonfinite", ())):  # a parameter counts once per skip
            if 0 <= pos < len(tracks):
                tracks[pos].skipped_nonfinite += 1

    def _on_stale_grad(self, event: dict[str, Any]) -> None:
        found = self._tracks(event)
        if found is None:
            return
        opt, _ = found
        names = [opt.params[i] for i in event["params"]]
        self.stale_grads.append(StaleGradients(opt.index, int(event["step"]), names))

    def _on_eval_mode(self, event: dict[str, Any]) -> None:
        modules = list(event["modules"])
        self.eval_episodes.append(
            EvalEpisode(
                optimizer=int(event.get("optimizer", -1)),
                start=int(event["step"]),
                modules=modules,
                module_count=int(event.get("module_count", len(modules))),
                kinds=list(event.get("kinds", [])),
            )
        )

    def _on_train_mode(self, event: dict[str, Any]) -> None:
        optimizer = int(event.get("optimizer", -1))
        for episode in reversed(self.eval_episodes):
            if episode.optimizer == optimizer and episode.end is None:
                episode.end = int(event["step"])
                return

    def _on_check(self, event: dict[str, Any]) -> None:
        """One optimizer's step-0 check (`deadweight run` checks each optimizer's first
        step): the findings add up, one finding seen by two checks counts once, and the
        mode is the least complete of the checks that ran."""
        mode = str(event["mode"])
        note = event.get("note")
        optimizer = event.get("optimizer")
        self._step0_checks.append((mode, note if isinstance(note, str) else None, optimizer))
        ran = [c for c in self._step0_checks if c[0] != "unavailable"] or self._step0_checks
        self.step0_mode = max((c[0] for c in ran), key=_step0_rank)
        notes = list(dict.fromkeys(n for _, n, _ in ran if n))
        if len(notes) > 1:  # the checks differ: each says which optimizer it is about
            self.step0_note = "; ".join(f"{o or '?'}: {n}" for _, n, o in ran if n) or None
        else:
            self.step0_note = notes[0] if notes else None
        seen = {(f.code, f.params, str(f.location)) for f in self.step0}
        for data in event["findings"]:
            try:
                finding = Finding.from_dict(data, phase="step 0")
            except ValueError as exc:
                self.problems.append(f"a step-0 finding was left out: {exc}")
                continue
            key = (finding.code, finding.params, str(finding.location))
            if key not in seen:
                seen.add(key)
                self.step0.append(finding)

    def _on_error(self, event: dict[str, Any]) -> None:
        self.errors.append({k: event.get(k) for k in ("optimizer", "step", "detector", "message")})

    def _on_end(self, event: dict[str, Any]) -> None:
        self.end = dict(event)
        if "backwards" in event:
            self.backwards = int(event["backwards"])

    def _on_ranks(self, event: dict[str, Any]) -> None:
        self.ranks = {k: v for k, v in event.items() if k != "event"}

    def _on_replicas(self, event: dict[str, Any]) -> None:
        for k, name in enumerate(event["params"]):
            seen = self.replicas.get(name)
            if seen is None:
                seen = self.replicas[name] = {"first_step": event["step"], "norm_spread": 0.0}
            seen.update(
                last_step=event["step"],
                norm_min=event["norm_min"][k],
                norm_max=event["norm_max"][k],
                groups=event["groups"][k],
                world_size=event["world_size"],
            )
            seen["norm_spread"] = max(
                seen["norm_spread"], event["norm_max"][k] - event["norm_min"][k]
            )

    def _on_loss(self, event: dict[str, Any]) -> None:
        steps, values = event["steps"], event["values"]
        if len(steps) != len(values):
            raise ValueError(f"{len(steps)} steps for {len(values)} loss values")
        self.loss_steps += [int(s) for s in steps]
        self.loss_values += [None if v is None else float(v) for v in values]

    def _on_rank_params(self, event: dict[str, Any]) -> None:
        self.rank_params = dict(event)

    @property
    def ranks_complete(self) -> bool:
        """False once a cross-rank exchange failed (a rank died or stopped answering):
        the replica check's, or any detector's collective, such as the one that
        combines FSDP2 shards (its error message names the CollectiveError)."""
        return not any(
            e.get("detector") == "ranks"
            or str(e.get("message") or "").startswith(f"{CollectiveError.__name__}:")
            for e in self.errors
        )


class _Detached(ParamTrack):
    """A parameter now owned by a newer optimizer: the old one's events no longer count."""

    def __init__(self) -> None:
        super().__init__("", (), "", -1, None, False, False, 0)


def stats_from_events(
    events: list[dict[str, Any]], problems: list[str] | None = None
) -> WatchStats:
    stats = WatchStats(problems=list(problems or []))
    for event in events:
        stats.apply(event)
    return stats
