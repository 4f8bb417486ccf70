"""pytest plugin (registered through the `pytest11` entry point): a `deadweight` fixture
and a `deadweight` marker, so a model test suite can check every model it builds.

    @pytest.mark.deadweight(allow=["DW104"])
    @pytest.mark.parametrize("factory", MODEL_FACTORIES)
    def test_every_parameter_learns(deadweight, factory):
        model, batch = factory()
        deadweight.assert_all_learn(model, deadweight.loss_from_batch(model, batch, F.mse_loss))

Marker keywords (a class or module marker applies to each test in it; lists add up,
the nearest marker's other values win): `allow` (rule codes or names, parameter names
or globs), `ignore` / `select` (rules), `fail_on` ("error", "warning", "info"),
`thresholds` (a mapping, e.g. ``{"noise-floor-ulps": 32}``). The project's
configuration (deadweight.toml or `[tool.deadweight]` next to the tests' rootdir, or
above it) applies under them.

pytest loads this module in every run of an environment where deadweight is
installed, so it imports nothing but pytest: torch and deadweight's checks are
imported when a test first uses the fixture.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from deadweight.report import Report

MARKER = "deadweight"
_LIST_KEYS = ("allow", "ignore", "select")
_KEYS = (*_LIST_KEYS, "fail_on", "thresholds")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(allow=(), ignore=(), select=(), fail_on='warning', thresholds=None): "
        "options of the deadweight fixture's checks in this test",
    )


class DeadweightFixture:
    """What the `deadweight` fixture gives a test: the assertions of deadweight.testing
    with the options of the test's `@pytest.mark.deadweight` markers."""

    def __init__(self, options: dict[str, Any], rootpath: Any) -> None:
        self.options = options
        self._rootpath = rootpath

    def assert_all_learn(
        self, model: Any, loss_fn: Any, optimizer: Any = None, **overrides: Any
    ) -> Report:
        """`deadweight.testing.assert_all_learn` with the marker's options (keywords
        given here win); returns the report."""
        __tracebackhide__ = True  # pytest shows the caller's line, not ours
        from deadweight import testing

        return testing.assert_all_learn(model, loss_fn, optimizer, **self._merged(overrides))

    __call__ = assert_all_learn

    def check(self, model: Any, loss_fn: Any, optimizer: Any = None, **overrides: Any) -> Report:
        """`deadweight.check` under the project configuration and the marker's rules and
        thresholds, without asserting anything."""
        from deadweight.checking.api import check

        merged = self._merged(overrides)
        merged.pop("fail_on", None)
        allow = merged.pop("allow", ())
        merged["ignore"] = (*merged.get("ignore", ()), *allow)
        return check(model, loss_fn, optimizer, **merged)

    def assert_no_findings(self, report: Report, **overrides: Any) -> None:
        __tracebackhide__ = True  # pytest shows the caller's line, not ours
        from deadweight import testing

        merged = self._merged(overrides)
        kwargs = {k: merged[k] for k in ("select", "ignore", "fail_on") if k in merged}
        kwargs["ignore"] = (*kwargs.get("ignore", ()), *merged.get("allow", ()))
        testing.assert_no_findings(report, **kwargs)

    def loss_from_batch(self, model: Any, batch: Any, criterion: Any = None, **kwargs: Any) -> Any:
        from deadweight import testing

        return testing.loss_from_batch(model, batch, criterion, **kwargs)

    def _merged(self, overrides: dict[str, Any]) -> dict[str, Any]:
        from deadweight.config import for_path

        merged = {**self.options, **overrides}
        merged.setdefault("config", for_path(self._rootpath))
        return merged


def _options(node: pytest.Item) -> dict[str, Any]:
    options: dict[str, Any] = {}
    # iter_markers yields the nearest first: the test's own, then its class, module
    for marker in node.iter_markers(MARKER):
        if marker.args:
            raise pytest.UsageError(
                f"{node.nodeid}: @pytest.mark.{MARKER} takes keywords only ({', '.join(_KEYS)})"
            )
        unknown = sorted(set(marker.kwargs) - set(_KEYS))
        if unknown:
            raise pytest.UsageError(
                f"{node.nodeid}: unknown @pytest.mark.{MARKER} keyword(s) {', '.join(unknown)}; "
                f"known: {', '.join(_KEYS)}"
            )
        for key, value in marker.kwargs.items():
            if key in _LIST_KEYS:
                entries = [value] if isinstance(value, str) else list(value)
                options[key] = [*options.get(key, []), *entries]
            else:
                options.setdefault(key, value)
    return options


@pytest.fixture
def deadweight(request: pytest.FixtureRequest) -> DeadweightFixture:
    """deadweight's model checks with this test's `@pytest.mark.deadweight` options."""
    return DeadweightFixture(_options(request.node), request.config.rootpath)
