"""What each event of a watch log must hold, checked as the log is read.

A log is input like any other: hand-edited, damaged, written by a newer deadweight, or
made to break the reader. `EventChecker.check` takes one parsed line and either passes
it on, passes it on without the fields of the wrong type (noted), or rejects it (noted)
when a field the report needs is missing or wrong. It also checks what one event says
against the optimizer event before it (how many parameters, which are small), so that
the statistics never index past an array.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_NUMBER: frozenset[type] = frozenset({int, float})
_NUMBER_OR_NULL: frozenset[type] = frozenset({int, float, type(None)})
_FLAG_OR_NULL: frozenset[type] = frozenset({bool, type(None)})

# No tensor holds more elements than this (2^62, far above any memory): a shape whose
# product is larger is not a shape, and would make the reader slice without end.
MAX_NUMEL = 2**62


@dataclass(frozen=True)
class Kind:
    """A field's type: `check(value)` -> the value to keep (maybe repaired), or _BAD."""

    what: str  # for the note: "a list of numbers or nulls"
    check: Callable[[Any], Any]


class _Bad:
    pass


_BAD: Any = _Bad()


# No step count, index or size reaches 2^63 (int64, what torch counts in).
MAX_COUNT = 2**63


def _count(v: Any) -> Any:
    return v if type(v) is int and 0 <= v < MAX_COUNT else _BAD  # bool is not a count


def _number(v: Any) -> Any:
    return v if type(v) in _NUMBER else _BAD


def _text(v: Any) -> Any:
    return v if isinstance(v, str) else _BAD


def _flag(v: Any) -> Any:
    return v if type(v) is bool else _BAD


def _table(v: Any) -> Any:
    return v if isinstance(v, dict) else _BAD


def _or_null(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else check(v)


def _counts(v: Any) -> Any:
    # set(map(type, ...)) and min() run in C: a step event of a large model holds
    # thousands of entries per array, on every line.
    if not isinstance(v, list) or not set(map(type, v)) <= {int}:
        return _BAD
    if v and (min(v) < 0 or max(v) >= MAX_COUNT):
        return _BAD
    return v


def _texts(v: Any) -> Any:
    return v if isinstance(v, list) and set(map(type, v)) <= {str} else _BAD


def _nullable_list(allowed: frozenset[type]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if not isinstance(v, list):
            return _BAD
        if set(map(type, v)) <= allowed:
            return v
        # Entries of another type read as "not measured", which every reader handles.
        return _Repaired([x if type(x) in allowed else None for x in v])

    return check


def _floats(v: Any) -> Any:
    if not isinstance(v, list):
        return _BAD
    if set(map(type, v)) <= {float, int}:
        return v
    # The writer turns a NaN sum into null (strict JSON): read it back, without a note,
    # as the NaN the live run had, which the rules judge; another type reads the same.
    quiet = set(map(type, v)) <= {float, int, type(None)}
    return _Repaired([x if type(x) in _NUMBER else math.nan for x in v], noted=not quiet)


@dataclass(frozen=True)
class _Repaired:
    value: list[Any]
    noted: bool = True


COUNT = Kind("a non-negative integer", _count)
COUNT_OR_NULL = Kind("a non-negative integer or null", _or_null(_count))
NUMBER = Kind("a number", _number)
NUMBER_OR_NULL = Kind("a number or null", _or_null(_number))
TEXT = Kind("a string", _text)
TEXT_OR_NULL = Kind("a string or null", _or_null(_text))
FLAG = Kind("true or false", _flag)
TABLE = Kind("an object", _table)
TABLE_OR_NULL = Kind("an object or null", _or_null(_table))
COUNTS = Kind("a list of non-negative integers", _counts)
TEXTS = Kind("a list of strings", _texts)
TEXTS_OR_NULL = Kind("a list of strings or null", _or_null(_texts))
NUMBERS = Kind("a list of numbers or nulls", _nullable_list(_NUMBER_OR_NULL))
FLAGS = Kind("a list of true, false or null", _nullable_list(_FLAG_OR_NULL))
LIST = Kind("a list", lambda v: v if isinstance(v, list) else _BAD)
FLOATS = Kind("a list of numbers", _floats)
NUMBERS_OR_NULL = Kind("a list of numbers or null", _or_null(_nullable_list(_NUMBER_OR_NULL)))

# event -> field -> (kind, required). A required field that is missing or wrong rejects
# the event (the statistics cannot use it without); an optional one of the wrong type
# is dropped and the rest of the event is used. Fields not named here pass unchecked:
# a newer schema may add some.
SMALL_KEYS = tuple(
    f"small_{k}" for k in ("path", "rpos", "rneg", "sens", "gsum", "zero_upd", "drift")
)
_PER_STEP = {"optimizer": (COUNT, False), "step": (COUNT, True)}
SCHEMA: dict[str, dict[str, tuple[Kind, bool]]] = {
    "start": {
        "schema_version": (COUNT, False),
        "time": (NUMBER, False),
        "pid": (COUNT, False),
        "argv": (TEXTS_OR_NULL, False),
        "config": (TABLE_OR_NULL, False),
        "tool": (TABLE, False),
    },
    "optimizer": {
        "optimizer": (COUNT, True),
        "start_step": (COUNT, False),
        "class": (TEXT, False),
        "groups": (LIST, False),
        "params": (LIST, True),
        "small": (COUNTS, False),
        "values": (COUNTS, False),
    },
    "step": {
        **_PER_STEP,
        "window": (COUNT, False),
        "lr": (NUMBERS, False),
        "lr_sum": (NUMBERS, False),
        "grad_present": (COUNTS, True),
        "lr0_steps": (COUNTS, True),
        "grad_rms": (NUMBERS, True),
        "param_norm": (NUMBERS, True),
        "update_norm": (NUMBERS, True),
        "moved": (FLAGS, True),
        "small_steps": (COUNT, False),
        # required when the optimizer has small parameters (checked against its event)
        **{key: (FLOATS, False) for key in SMALL_KEYS},
        "values": (NUMBERS, False),
    },
    "reset": {
        **_PER_STEP,
        "params": (COUNTS, True),
        "predicted_amplification": (NUMBER_OR_NULL, False),
        "cause": (TEXT, False),
    },
    "reset_effect": {
        **_PER_STEP,
        "before_steps": (COUNT, False),
        "after_steps": (COUNT, False),
        "params": (COUNTS, True),
        "before": (NUMBERS, True),
        "first": (NUMBERS, True),
        "after": (NUMBERS, True),
    },
    "nonfinite": {**_PER_STEP, "param": (COUNT, True), "what": (TEXT, True)},
    "skip": {
        **_PER_STEP,
        "cause": (TEXT, False),
        "counted_as_step": (FLAG, False),
        "nonfinite": (COUNTS, False),
        "nonfinite_count": (COUNT, False),
    },
    "loss": {"steps": (COUNTS, True), "values": (NUMBERS, True)},
    # a step consumed a gradient the previous step had already used (zero_grad missing)
    "stale_grad": {**_PER_STEP, "params": (COUNTS, True)},
    # steps taken with mode-dependent modules in eval mode, from `step` on
    "eval_mode": {
        **_PER_STEP,
        "seen_at": (COUNT, False),
        "modules": (TEXTS, True),
        "module_count": (COUNT, False),
        "kinds": (TEXTS, False),
    },
    "train_mode": {**_PER_STEP},
    "error": {
        "optimizer": (COUNT_OR_NULL, False),
        "step": (COUNT_OR_NULL, False),
        "detector": (TEXT_OR_NULL, False),
        "message": (TEXT_OR_NULL, False),
    },
    "end": {
        "reason": (TEXT_OR_NULL, False),
        "steps": (COUNT, False),
        "backwards": (COUNT, False),
    },
    "ranks": {
        "rank": (COUNT, False),
        "world_size": (COUNT, False),
        "backend": (TEXT_OR_NULL, False),
        "timeout_s": (NUMBER_OR_NULL, False),
    },
    "replicas": {
        **_PER_STEP,
        "world_size": (COUNT, True),
        "params": (TEXTS, True),
        "norm_max": (NUMBERS, True),
        "norm_min": (NUMBERS, True),
        "groups": (LIST, True),
    },
    "rank_params": {**_PER_STEP, "names": (TEXTS, False), "held": (LIST, False)},
    # `deadweight run`'s step-0 check: deadweight.check's findings, as to_dict wrote them
    "check": {
        "step": (COUNT, False),
        "mode": (TEXT, True),
        "findings": (LIST, True),
        "note": (TEXT_OR_NULL, False),
        "model": (TEXT_OR_NULL, False),
        "optimizer": (TEXT, False),
    },
}
# per-parameter arrays of a step event, in the order of the optimizer's parameters
_PER_PARAM = ("grad_present", "lr0_steps", "grad_rms", "param_norm", "update_norm", "moved")
_GROUP_KEYS = {
    "lr": NUMBER_OR_NULL,
    "weight_decay": NUMBER_OR_NULL,
    "betas": NUMBERS_OR_NULL,
    "eps": NUMBER_OR_NULL,
    "predicted_reset_amplification": NUMBER_OR_NULL,
}
_PARAM_KEYS = {
    "name": (TEXT, True),
    "shape": (COUNTS, True),
    "dtype": (TEXT, False),
    "device": (TEXT, False),
    "group": (COUNT_OR_NULL, False),
    "pinned": (FLAG, False),
}


class Rejected(Exception):
    """The event cannot be used; the message says why (without the line number)."""


@dataclass
class _Layout:
    """What an optimizer event said: the sizes later events of it must have."""

    params: int
    small: int
    values: int  # elements of the parameters whose values are logged


class EventChecker:
    """Checks the events of one log in order; `notes` of what was dropped or repaired."""

    def __init__(self) -> None:
        self.layouts: dict[int, _Layout] = {}

    def check(self, event: dict[str, Any]) -> list[str]:
        """Validate (and repair) `event` in place; the notes of what was dropped.
        Raises Rejected when the event cannot be used."""
        kind = event["event"]
        if not isinstance(kind, str):
            raise Rejected("an event whose 'event' is not a string")
        spec = SCHEMA.get(kind)
        if spec is None:
            return []  # a kind this version does not know: the statistics ignore it
        notes = _fields(event, spec, f"a {kind!r} event")
        if kind == "optimizer":
            notes += self._optimizer(event)
        elif kind in ("step", "reset", "reset_effect", "nonfinite", "stale_grad"):
            self._fits(event)
        return notes

    def _optimizer(self, event: dict[str, Any]) -> list[str]:
        notes: list[str] = []
        groups = event.get("groups")
        if groups is not None:
            for k, group in enumerate(groups):
                if not isinstance(group, dict):
                    groups[k] = {}
                    notes.append("an 'optimizer' event's group is not an object; read as empty")
                    continue
                for key, kind in _GROUP_KEYS.items():
                    if key in group and (done := _kept(group, key, kind)) is not None:
                        notes.append(f"an 'optimizer' event's group {key!r} {done[1]}")
        n = len(event["params"])
        numel: list[int] = []
        for p in event["params"]:
            if not isinstance(p, dict):
                raise Rejected("an 'optimizer' event lists a parameter that is not an object")
            notes += _fields(p, _PARAM_KEYS, "an 'optimizer' event's parameter")
            size = 1
            for d in p["shape"]:
                size *= d
                if size > MAX_NUMEL:
                    raise Rejected(f"an 'optimizer' event gives {p['name']!r} an impossible shape")
            numel.append(size)
            group = p.get("group")
            if group is not None and groups is not None and group >= len(groups):
                del p["group"]
                notes.append("an 'optimizer' event names a group it does not list; dropped")
        for key in ("small", "values"):
            positions = event.get(key, [])
            if any(i >= n for i in positions) or len(set(positions)) != len(positions):
                raise Rejected(f"an 'optimizer' event whose {key!r} does not index its parameters")
        small = event.get("small", [])
        if not set(event.get("values", [])) <= set(small):
            raise Rejected("an 'optimizer' event logs the values of a parameter that is not small")
        self.layouts[event["optimizer"]] = _Layout(
            n, len(small), sum(numel[i] for i in event.get("values", []))
        )
        return notes

    def _fits(self, event: dict[str, Any]) -> None:
        """Sizes and indices that must agree with the optimizer's event."""
        kind = event["event"]
        layout = self.layouts.get(event.get("optimizer", -1))
        if layout is None:
            return  # the statistics note an unknown optimizer themselves
        if kind == "step":
            for key in _PER_PARAM:
                _length(event, key, layout.params, "parameters")
            for key in SMALL_KEYS:
                if layout.small or key in event:
                    _length(event, key, layout.small, "small parameters")
            if "values" in event and len(event["values"]) != layout.values:
                raise Rejected(
                    f"a 'step' event whose 'values' holds {len(event['values'])} entries for "
                    f"{layout.values} logged values"
                )
            return
        positions = [event["param"]] if kind == "nonfinite" else event["params"]
        if any(i >= layout.params for i in positions):
            raise Rejected(f"a {kind!r} event names a parameter its optimizer lacks")
        if kind == "reset_effect":
            for key in ("before", "first", "after"):
                _length(event, key, len(positions), "parameters")


def _length(event: dict[str, Any], key: str, size: int, of: str) -> None:
    if key not in event:
        raise Rejected(f"a {event['event']!r} event without {key!r}")
    if len(event[key]) != size:
        raise Rejected(
            f"a {event['event']!r} event whose {key!r} holds {len(event[key])} entries for "
            f"{size} {of}"
        )


def _fields(obj: dict[str, Any], spec: dict[str, tuple[Kind, bool]], what: str) -> list[str]:
    notes = []
    for key, (kind, required) in spec.items():
        if key not in obj:
            if required:
                raise Rejected(f"{what} without {key!r}")
            continue
        done = _kept(obj, key, kind)
        if done is None:
            continue
        if required and done[0] == "dropped":
            raise Rejected(f"{what} whose {key!r} is not {kind.what}")
        notes.append(f"{what}'s {key!r} {done[1]}")
    return notes


def _kept(obj: dict[str, Any], key: str, kind: Kind) -> tuple[str, str] | None:
    """Check obj[key], dropping or repairing it in place: ("dropped" or "repaired", what
    was done), or None when it was fine."""
    value = kind.check(obj[key])
    if value is _BAD:
        del obj[key]
        return "dropped", f"is not {kind.what}; dropped"
    if isinstance(value, _Repaired):
        obj[key] = value.value
        if not value.noted:
            return None
        read_as = "NaN" if kind is FLOATS else "null"
        return "repaired", (
            f"holds entries that are not {kind.what.removeprefix('a list of ')}; read as {read_as}"
        )
    return None
