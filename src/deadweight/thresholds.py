"""The numbers the rules judge by, each with its default and where that default comes from.

One `Thresholds` object holds them. The library never reads a file to get one: pass
`thresholds=` (a `Thresholds` or a mapping of some keys) or `config=` to `check`,
`watch`, `inspect_checkpoints`, ...; the command line reads them from
`[tool.deadweight.thresholds]` (or `[thresholds]` in deadweight.toml).

While a check, a watch report or a checkpoint analysis judges, its thresholds are
the *active* ones (`current()`), set with `using(...)`; rules read them there, so a
rule's judge function keeps its one argument.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from deadweight.errors import ConfigError


def _threshold(default: Any, rules: tuple[str, ...], meaning: str, why: str) -> Any:
    return field(default=default, metadata={"rules": rules, "meaning": meaning, "why": why})


@dataclass(frozen=True)
class Thresholds:
    """Every configurable threshold; the field name with `-` for `_` is its config key."""

    noise_floor_ulps: float = _threshold(
        16.0,
        ("DW103", "DW104", "DW105", "DW203", "DW204"),
        "A gradient is numerical noise when moving the parameter by its own size (by 1 "
        "for an all-zero one) would, to first order, change the loss by at most this "
        "many ulps of the loss: |g| * max(|theta|, 1) <= ulps * eps * |loss|, eps of the "
        "loss's dtype.",
        "Rounding in a float32 forward leaves a few ulps of noise in any loss; 16 keeps "
        "clear of that while the incident's cancelled scalar (|g| = 2.8e-10 at loss ~3) "
        "sits far below it.",
    )
    drift_horizon_steps: int = _threshold(
        10_000,
        ("DW104", "DW105", "DW204"),
        "Optimizer steps over which check predicts how far the optimizer moves a "
        "parameter a normalization cancels; a material move within them makes the "
        "finding a warning.",
        "Fine-tuning runs last a few thousand steps and pre-training far longer; within "
        "10k steps the incident's scalar (0.18 lr per step at lr 8.5e-4) moves by 1.5, "
        "150% of its size, while an fp32 key bias (noise 100-10^4x under Adam's eps) "
        "moves by a hundredth of a learning rate per step.",
    )
    material_drift: float = _threshold(
        0.1,
        ("DW104", "DW105", "DW204"),
        "The move within the horizon, as a fraction of the parameter's RMS, that counts "
        "as material: from noise-driven steps or from weight decay shrinking it.",
        "A gain or scalar 10% off its value changes the activations, and the range a "
        "quantizer must cover, by as much; below that it is noise.",
    )
    never_moved_steps: int = _threshold(
        50,
        ("DW301",),
        "Optimizer steps after which a trainable parameter that is still bitwise what it "
        "was is reported as never moved.",
        "Adam moves every parameter with a gradient on step 1, and SGD with any non-zero "
        "gradient changes some bit almost surely; 50 steps leave room for a warm-up.",
    )
    no_gradient_steps: int = _threshold(
        10,
        ("DW310", "DW313"),
        "Optimizer steps after which a parameter of a stepping optimizer whose gradient was "
        "None (DW313) or exactly zero (DW310) on every one of them is reported.",
        "A parameter the loss reaches gets a non-zero gradient on the first step in which "
        "it is used; a zero-initialised gate or a warm-up from lr 0 delays that by a step "
        "or two. 10 steps leave room for both and still report inside a smoke test.",
    )
    drift_noise_floor_ratio: float = _threshold(
        1e-3,
        ("DW302", "DW303"),
        "A parameter's gradient is at the noise floor when its mean per-element size is at "
        "most this fraction of its homologous siblings' (or of the other small parameters "
        "of its optimizer).",
        "The incident's scalar had a gradient of ~1e-10 and a toy port's 7.8e-7 next to "
        "siblings of 4e-3 to 2e-2 (ratios 1e-4 and below); legitimately weak parameters "
        "sit within a factor of 10-100 of their siblings. 1e-3 keeps a margin on both sides.",
    )
    drift_min_steps: int = _threshold(
        100,
        ("DW302", "DW303"),
        "Watched optimizer steps a small parameter needs before its drift is judged.",
        "Fewer steps say nothing about a direction.",
    )
    drift_min_relative: float = _threshold(
        0.01,
        ("DW302", "DW303"),
        "The least net drift, as a fraction of the parameter's starting norm, that counts "
        "as drifting.",
        "A parameter that moved by less than 1% of its size has not drifted in any way "
        "that matters downstream.",
    )
    skipped_steps_share: float = _threshold(
        0.05,
        ("DW304",),
        "Share of optimizer steps that may leave parameters with gradients unchanged "
        "before it is reported (together with skipped-steps-min).",
        "A few skipped steps are normal: a GradScaler calibrating its scale, lr = 0 on the "
        "first warm-up step.",
    )
    skipped_steps_min: int = _threshold(
        5,
        ("DW304",),
        "Skipped steps needed, at the least, before DW304 is reported.",
        "Below 5, a GradScaler's first calibration steps alone would trigger it.",
    )
    intermittent_warn_below: float = _threshold(
        0.5,
        ("DW306",),
        "A parameter that gets a gradient on fewer than this share of the steps is a "
        "warning; more often than that, information.",
        "A parameter with a gradient on fewer than half of the steps learns at half speed "
        "or less (a rarely routed expert).",
    )
    outlier_z: float = _threshold(
        5.0,
        ("DW307", "DW402"),
        "Robust z-score (0.6745 (x - median) / MAD) above which one layer's parameter "
        "stands out from the same parameter in the other layers.",
        "Iglewicz & Hoaglin suggest 3.5 for a single test; 5 allows for testing every "
        "parameter of every layer. The incident's 56.25 next to 0.2-1.3 is 55 medians away.",
    )
    outlier_min_factor: float = _threshold(
        2.0,
        ("DW307", "DW402"),
        "An outlier must also differ in magnitude from the layers' median by at "
        "least this factor (x2 or x1/2 by default).",
        "With tightly clustered layers (a small MAD) a 20% difference already has a large "
        "z-score; a factor of 2 is what makes a layer stand out in practice. With an "
        "exact 0 among the values, the outlier must instead lie one median's size away.",
    )
    trend_min_saves: int = _threshold(
        4,
        ("DW405",),
        "Checkpoints a single-element tensor must be found in before a trend is judged.",
        "Learning scalars wander both ways between saves; n random values are monotone "
        "with probability 2/n!, one in three for 3 saves, one in twelve for 4.",
    )
    trend_min_relative: float = _threshold(
        0.1,
        ("DW405",),
        "The least total change, relative to the first value, that counts as a trend.",
        "The incident's scalar went from 1.0 to 56.25; a tenth of its starting size leaves "
        "room for a learning scalar that creeps while it settles.",
    )
    quantization_scheme: str = _threshold(
        "int4-group128",
        ("DW403",),
        "The quantization scheme `inspect` judges the risk under (int4, int8-channel, "
        "int4-group128, int8-tensor-asym, ...; 'none' skips DW403).",
        "What on-device INT4 deployment (GPTQ/AWQ) commonly uses.",
    )

    @classmethod
    def of(cls, value: Thresholds | Mapping[str, Any] | None) -> Thresholds:
        """Defaults, a Thresholds as it is, or defaults updated by a mapping of some keys."""
        if value is None:
            return DEFAULT
        if isinstance(value, Thresholds):
            return value
        return DEFAULT.updated(value)

    def updated(self, values: Mapping[str, Any], *, where: str = "thresholds") -> Thresholds:
        """A copy with some values changed; keys as in config (`outlier-z`) or Python
        (`outlier_z`). Raises ConfigError naming every bad key (and the nearest good
        one) and every bad value."""
        problems: list[str] = []
        changes: dict[str, Any] = {}
        for key, value in values.items():
            name = str(key).replace("-", "_")
            if name not in FIELDS:
                problems.append(f"unknown key {key!r}{did_you_mean(str(key), KEYS)}")
                continue
            problem = _value_problem(name, value)
            if problem:
                problems.append(f"{key} {problem}")
            else:
                changes[name] = value
        if problems:
            raise ConfigError(f"{where}: " + "; ".join(problems))
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Config key -> value."""
        return {key_of(n): getattr(self, n) for n in FIELDS}


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Thresholds)}
DEFAULT = Thresholds()


def key_of(name: str) -> str:
    """The config key of a field: `outlier_z` -> `outlier-z`."""
    return name.replace("_", "-")


KEYS = [key_of(n) for n in FIELDS]


def for_rule(code: str) -> list[tuple[str, Any, str, str]]:
    """(key, default, meaning, why) of every threshold rule `code` judges by."""
    return [
        (key_of(n), f.default, f.metadata["meaning"], f.metadata["why"])
        for n, f in FIELDS.items()
        if code in f.metadata["rules"]
    ]


def rules_of(key: str) -> tuple[str, ...]:
    return tuple(FIELDS[key.replace("-", "_")].metadata["rules"])


def did_you_mean(word: str, choices: Any) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _value_problem(name: str, value: Any) -> str | None:
    default = FIELDS[name].default
    if isinstance(default, str):
        if not isinstance(value, str):
            return f"must be a string, got {value!r}"
        if name == "quantization_scheme" and value != "none":
            from deadweight.checkpoints.quantization import Scheme

            try:
                Scheme.parse(value)
            except ValueError as exc:
                return f"is not a quantization scheme: {exc}"
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"must be a number, got {value!r}"
    if isinstance(default, int) and not isinstance(value, int):
        return f"must be a whole number, got {value!r}"
    if not value > 0:
        return f"must be positive, got {value!r}"
    if name in ("skipped_steps_share", "intermittent_warn_below") and value > 1:
        return f"is a share of the steps, at most 1, got {value!r}"
    return None


_ACTIVE: contextvars.ContextVar[Thresholds] = contextvars.ContextVar(
    "deadweight_thresholds", default=DEFAULT
)


def current() -> Thresholds:
    """The thresholds the rules judge by right now."""
    return _ACTIVE.get()


@contextlib.contextmanager
def using(thresholds: Thresholds | Mapping[str, Any] | None) -> Iterator[Thresholds]:
    """Make `thresholds` the active ones inside the block (None: leave them as they are)."""
    if thresholds is None:
        yield current()
        return
    active = Thresholds.of(thresholds)
    token = _ACTIVE.set(active)
    try:
        yield active
    finally:
        _ACTIVE.reset(token)
