"""Errors deadweight raises when it cannot do its job (as opposed to findings about the model)."""

from __future__ import annotations


class DeadweightError(Exception):
    """Base class: something stopped deadweight from checking. The CLI exits with 2."""


class InputError(DeadweightError):
    """The model, loss function or file handed to deadweight cannot be checked as given."""


class LossFnError(DeadweightError):
    """The user's loss function raised; the original exception is chained as `__cause__`."""


class ConfigError(InputError):
    """`[tool.deadweight]` in pyproject.toml is malformed; the message lists every problem."""


class CollectiveError(DeadweightError):
    """A collective deadweight runs across ranks failed or timed out (a rank died or hung)."""
