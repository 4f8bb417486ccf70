"""Forward a watch's scalars and findings to TensorBoard or Weights & Biases.

    w = deadweight.watch(model, optimizer)
    forward_to_tensorboard(w, SummaryWriter("runs/exp"))   # or any add_scalar(tag, value, step)
    forward_to_wandb(w, wandb.run)                          # or any run with .log(dict)

Neither tracker is imported here: the caller hands over its own writer or run, and
each forwarder only calls that object's public methods. Both subscribe through
`Watch.add_listener`, so a forwarder that fails is dropped, shown in the report, and
never stops training.

At every watched step (every `every` optimizer steps) a bounded set of scalars:

    deadweight/value/<name>           value of a single-element parameter (a layer scalar);
                                      element i of a tiny vector is .../<name>/<i>
    deadweight/grad_rms/<name>        RMS over the window of the gradient's norm
    deadweight/update_ratio/<name>    mean update norm per step over the window / parameter norm
    deadweight/summary/unmoved        parameters still bitwise unchanged since watching began
    deadweight/summary/without_grad   parameters that had no gradient in the window

The per-parameter tags cover at most `max_params` parameters: the small ones (layer
scalars, norm gains, biases: deadweight measures those exactly every step), those
whose values are logged first. When the watch closes, the findings follow: one
`deadweight/findings/<severity>` count each and a table of them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from deadweight.report import Report
from deadweight.watching.watch_stats import WatchStats
from deadweight.watching.watcher import Watch

log = logging.getLogger(__name__)

# Per-parameter tags are forwarded for at most this many parameters: a model with 32
# layer scalars (the second incident) fits, and a dashboard stays readable.
MAX_PARAMS = 32
# Parameter names listed per finding in the table; the rest are counted.
TABLE_NAMES = 5


class ScalarWriter(Protocol):
    """What a TensorBoard forwarder needs: `torch.utils.tensorboard.SummaryWriter`,
    tensorboardX's, or anything else with this method."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...


class Run(Protocol):
    """What a W&B forwarder needs: a `wandb` run, or anything with `log(dict)`."""

    def log(self, data: dict[str, Any]) -> Any: ...


@dataclass
class _Optimizer:
    names: list[str]
    numels: list[int]
    small: list[int]  # positions, in the order of a step event's small_* arrays
    values: list[int]  # positions, in the order of a step event's `values`
    tracked: list[int] = field(default_factory=list)
    # Cumulative update path of the small parameters and steps, at the last watched step.
    last_path: list[float] = field(default_factory=list)
    last_small_steps: int = 0


class WatchScalars:
    """Turns watch events into `(step, {tag: value})`: the measurement side of forwarding."""

    def __init__(
        self, *, max_params: int = MAX_PARAMS, prefix: str = "deadweight", step_offset: int = 0
    ) -> None:
        self.prefix = prefix
        self.step_offset = step_offset
        self.last_step = step_offset
        self._budget = max_params
        self._optimizers: dict[int, _Optimizer] = {}

    def seed(self, stats: WatchStats) -> None:
        """Optimizers the watch introduced before this listener was added."""
        for index, opt in stats.optimizers.items():
            numels = [stats.params[n].numel if n in stats.params else 0 for n in opt.params]
            self._add(index, opt.params, numels, opt.small, opt.values)

    def on_optimizer(self, event: dict[str, Any]) -> None:
        names, numels = [], []
        for p in event["params"]:
            names.append(p["name"])
            numel = 1
            for d in p["shape"]:
                numel *= d
            numels.append(numel)
        self._add(int(event["optimizer"]), names, numels, event["small"], event["values"])

    def _add(
        self, index: int, names: list[str], numels: list[int], small: list[int], values: list[int]
    ) -> None:
        opt = _Optimizer(names, numels, list(small), list(values))
        opt.last_path = [0.0] * len(opt.small)
        # Tiny parameters (their values are logged) first: layer scalars are what drifts.
        ordered = list(dict.fromkeys([*opt.values, *opt.small]))
        opt.tracked = ordered[: max(self._budget, 0)]
        self._budget -= len(opt.tracked)
        self._optimizers[index] = opt

    def on_step(self, event: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
        opt = self._optimizers.get(int(event.get("optimizer", -1)))
        if opt is None:
            return None
        step = int(event["step"]) + self.step_offset
        self.last_step = max(self.last_step, step)
        p = self.prefix
        out: dict[str, float] = {}
        tracked = set(opt.tracked)

        values = event.get("values") or []
        cursor = 0
        for pos in opt.values:
            n = opt.numels[pos]
            if pos in tracked:
                chunk = values[cursor : cursor + n]
                if n == 1 and chunk:
                    _put(out, f"{p}/value/{opt.names[pos]}", chunk[0])
                else:
                    for i, v in enumerate(chunk):
                        _put(out, f"{p}/value/{opt.names[pos]}/{i}", v)
            cursor += n

        grad_rms = event.get("grad_rms") or []
        param_norm = event.get("param_norm") or []
        for pos in opt.tracked:
            if pos < len(grad_rms):
                _put(out, f"{p}/grad_rms/{opt.names[pos]}", grad_rms[pos])

        # Small parameters' update sizes are exact and cumulative (`small_path` sums
        # ||update|| over every step), so the window's mean is a difference of two records.
        path = event.get("small_path") or []
        small_steps = int(event.get("small_steps", 0))
        steps = small_steps - opt.last_small_steps
        for k, pos in enumerate(opt.small):
            if k >= len(path) or k >= len(opt.last_path):
                break
            if pos in tracked and steps > 0 and pos < len(param_norm):
                norm = param_norm[pos]
                if norm:
                    mean_update = (path[k] - opt.last_path[k]) / steps
                    _put(out, f"{p}/update_ratio/{opt.names[pos]}", mean_update / norm)
        if path:
            opt.last_path = list(path)
        opt.last_small_steps = small_steps

        suffix = f"/optimizer{event['optimizer']}" if int(event["optimizer"]) else ""
        moved = event.get("moved") or []
        out[f"{p}/summary/unmoved{suffix}"] = float(sum(1 for m in moved if m is False))
        out[f"{p}/summary/without_grad{suffix}"] = float(sum(1 for g in grad_rms if g is None))
        return step, out


def _put(out: dict[str, float], tag: str, value: Any) -> None:
    if isinstance(value, (int, float)):
        out[tag] = float(value)


def findings_table(report: Report) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the findings, for a W&B table or a Markdown one."""
    columns = ["code", "name", "severity", "params", "message"]
    rows = []
    for f in report.findings:
        names = ", ".join(f.params[:TABLE_NAMES])
        if len(f.params) > TABLE_NAMES:
            names += f" and {len(f.params) - TABLE_NAMES} more"
        rows.append([f.code, f.name, f.severity.value, names, f.message])
    return columns, rows


def findings_markdown(report: Report) -> str:
    columns, rows = findings_table(report)
    if not rows:
        return "no findings"

    def cells(values: list[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|").replace("\n", " ") for v in values) + " |"

    lines = [cells(columns), "|" + "---|" * len(columns)]
    lines += [cells(row) for row in rows]
    return "\n".join(lines)


class _Forwarder:
    """Listens to a watch; subclasses say how scalars and findings reach the tracker."""

    def __init__(
        self,
        watch: Watch,
        *,
        max_params: int = MAX_PARAMS,
        prefix: str = "deadweight",
        step_offset: int = 0,
    ) -> None:
        self.watch = watch
        self.prefix = prefix
        self.scalars = WatchScalars(max_params=max_params, prefix=prefix, step_offset=step_offset)
        self.scalars.seed(watch.stats)
        watch.add_listener(self)

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "optimizer":
            self.scalars.on_optimizer(event)
        elif kind == "step":
            measured = self.scalars.on_step(event)
            if measured is not None:
                self.write_scalars(*measured)
        elif kind == "end":
            self.write_findings(self.scalars.last_step, self.watch.report())

    def counts(self, report: Report) -> dict[str, float]:
        return {f"{self.prefix}/findings/{k}": float(v) for k, v in report.counts().items()}

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        raise NotImplementedError

    def write_findings(self, step: int, report: Report) -> None:
        raise NotImplementedError


class TensorBoardForwarder(_Forwarder):
    """Writes through `writer.add_scalar(tag, value, step)` (and `add_text` for the table).

    The step is the optimizer step (plus `step_offset`, e.g. the global step a resumed
    run starts from), the x axis frameworks use for their own scalars."""

    def __init__(self, watch: Watch, writer: ScalarWriter, **options: Any) -> None:
        self.writer = writer
        super().__init__(watch, **options)

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def write_findings(self, step: int, report: Report) -> None:
        # transformers' TensorBoardCallback closes its writer in its on_train_end, which
        # runs before ours; SummaryWriter then reopens a new event file on the next
        # write, and that one is ours to close.
        reopened = getattr(self.writer, "all_writers", ()) is None
        for tag, value in self.counts(report).items():
            self.writer.add_scalar(tag, value, step)
        add_text = getattr(self.writer, "add_text", None)
        if add_text is not None:
            add_text(f"{self.prefix}/findings", findings_markdown(report), step)
        finish = getattr(self.writer, "close" if reopened else "flush", None)
        if finish is not None:
            finish()


class WandbForwarder(_Forwarder):
    """Logs through `run.log({...})`, each row carrying `deadweight/step`.

    No `step=` argument: W&B drops any row whose explicit step is below the run's
    current step, and the user's own logging (or the Trainer's) owns that counter.
    Instead `deadweight/*` is defined to plot against `deadweight/step` (the optimizer
    step plus `step_offset`), the way transformers and Lightning give their own
    metrics their global step."""

    def __init__(self, watch: Watch, run: Run, **options: Any) -> None:
        self.run = run
        super().__init__(watch, **options)
        define = getattr(run, "define_metric", None)
        if define is not None:
            try:
                define(f"{self.prefix}/step")
                define(f"{self.prefix}/*", step_metric=f"{self.prefix}/step")
            except Exception as exc:  # an older or a stand-in run: plain rows still work
                log.debug("wandb define_metric failed: %s", exc)

    def write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, f"{self.prefix}/step": step})

    def write_findings(self, step: int, report: Report) -> None:
        data: dict[str, Any] = {**self.counts(report), f"{self.prefix}/step": step}
        data[f"{self.prefix}/findings"] = _wandb_table(report)
        self.run.log(data)


def _wandb_table(report: Report) -> Any:
    columns, rows = findings_table(report)
    try:
        import wandb
    except ImportError:  # a stand-in run without wandb installed: Markdown text instead
        return findings_markdown(report)
    header: list[Any] = list(columns)
    return wandb.Table(columns=header, data=rows)


def forward_to_tensorboard(
    watch: Watch, writer: ScalarWriter, **options: Any
) -> TensorBoardForwarder:
    """Forward `watch`'s scalars and, at close, its findings to a TensorBoard writer.
    Options: `max_params`, `prefix`, `step_offset`."""
    return TensorBoardForwarder(watch, writer, **options)


def forward_to_wandb(watch: Watch, run: Run, **options: Any) -> WandbForwarder:
    """Forward `watch`'s scalars and, at close, its findings to a W&B run.
    Options: `max_params`, `prefix`, `step_offset`."""
    return WandbForwarder(watch, run, **options)


def forward_to(watch: Watch, target: Any, **options: Any) -> _Forwarder:
    """A TensorBoard writer (has `add_scalar`) or a W&B run (has `log`)."""
    if hasattr(target, "add_scalar"):
        return TensorBoardForwarder(watch, target, **options)
    if callable(getattr(target, "log", None)):
        return WandbForwarder(watch, target, **options)
    raise TypeError(
        f"cannot forward to a {type(target).__name__}: expected a TensorBoard SummaryWriter "
        "(add_scalar) or a W&B run (log)"
    )
