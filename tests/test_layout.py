"""The package's layout holds: four capabilities (checking, watching, checkpoints,
linting) and the distributed plumbing, over a shared core; no import cycle; no
capability reaching into another's internals; and every public name where the
documentation says it is. docs/architecture.md describes the layout."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import deadweight

SRC = Path(deadweight.__file__).parent
CAPABILITIES = ("checking", "watching", "checkpoints", "linting", "distributed")
# What one capability may use of another: its entry point (`api`), the statistics it
# publishes for the cross-rank rules, and the distributed plumbing every one uses.
PUBLISHED = {"deadweight.watching.watch_stats"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts).removesuffix(".__init__")] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports, anywhere in it (lazy imports too), but
    not under `if TYPE_CHECKING:`, which never runs."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules}


def _capability(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in CAPABILITIES else None


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """Every module's reach, by depth-first search; a module that reaches itself is on
    a circle."""
    circles = []
    for start in graph:
        stack, seen = list(graph[start]), set()
        while stack:
            m = stack.pop()
            if m == start:
                circles.append(start)
                break
            if m not in seen:
                seen.add(m)
                stack.extend(graph[m])
    return circles


def test_no_module_imports_itself_back_through_others() -> None:
    modules = _modules()
    assert _circles({m: _imports(p, modules) - {m} for m, p in modules.items()}) == []


def _imports_for_typing_too(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports, `if TYPE_CHECKING:` blocks included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in modules}


def test_the_check_has_no_circle_even_through_imports_for_typing() -> None:
    """A type two modules share lives in a module of its own, not in one of them
    (sharded_flow once imported the flow measurement's private `_Flow` for typing,
    while the measurement imported sharded_flow)."""
    modules = {m: p for m, p in _modules().items() if m.startswith("deadweight.checking")}
    graph = {m: _imports_for_typing_too(p, modules) - {m} for m, p in modules.items()}
    assert _circles(graph) == []


# File names several modules may share: packages, the capabilities' entry points, and
# cli/ modules named after their subcommand (`deadweight config` beside config.py).
SHARED_FILE_NAMES = {"__init__.py", "api.py"}


def test_no_two_modules_share_a_file_name() -> None:
    """A name says which module it is (checking/grad_flow.py measured gradient flow
    beside checking/rules/grad_flow.py, which judges it)."""
    by_name: dict[str, list[str]] = {}
    for path in SRC.rglob("*.py"):
        if path.name in SHARED_FILE_NAMES or path.parent.name == "cli":
            continue
        by_name.setdefault(path.name, []).append(str(path.relative_to(SRC)))
    assert {n: ps for n, ps in by_name.items() if len(ps) > 1} == {}


def test_a_capability_uses_another_only_through_its_entry_point() -> None:
    modules = _modules()
    crossing = []
    for module, path in modules.items():
        mine = _capability(module)
        if mine is None:
            continue
        for target in _imports(path, modules):
            theirs = _capability(target)
            if theirs in (None, mine, "distributed"):
                continue
            if target.endswith(".api") or target in PUBLISHED:
                continue
            crossing.append(f"{module} -> {target}")
    assert crossing == []


# Modules that only hold what was measured, beyond those named `*_stats` / `*_facts`.
STATISTICS = {
    "deadweight.linting.source_files",  # Span, a source position (and the file reader's limits)
}


def _is_statistics(module: str) -> bool:
    leaf = module.rsplit(".", 1)[-1]
    return leaf.endswith(("_stats", "_facts")) or module in STATISTICS


def test_rules_judge_statistics_and_never_import_tracers_or_scanners() -> None:
    """A rule module imports findings, the registry, thresholds and statistics: not
    the code that measures (which would let a rule re-measure)."""
    modules = _modules()
    reaching = [
        f"{module} -> {target}"
        for module, path in modules.items()
        if ".rules." in module
        for target in _imports(path, modules)
        if _capability(target) is not None
        and ".rules." not in target + "."
        and not _is_statistics(target)
    ]
    assert reaching == []


def test_the_measuring_modules_are_caught() -> None:
    """The statistics test above would pass vacuously if it classed tracers as
    statistics; the modules that measure are not."""
    for measuring in (
        "deadweight.checking.flow_measurement",
        "deadweight.checking.cancellation",
        "deadweight.checking.invariance",
        "deadweight.checking.optimizer_groups",
        "deadweight.checking.sites",
        "deadweight.checking.state",
        "deadweight.checking.op_trace",
        "deadweight.watching.step_monitor",
        "deadweight.checkpoints.checkpoint_scan",
        "deadweight.checkpoints.tensor_pass",
        "deadweight.linting.source_python",
        "deadweight.linting.source_python_decay",
        "deadweight.linting.source_rust",
    ):
        assert measuring in _modules() and not _is_statistics(measuring)


PUBLIC = {
    "deadweight": deadweight.__all__,
    "deadweight.testing": ["assert_all_learn"],
    "deadweight.integrations.transformers": ["DeadweightCallback"],
    "deadweight.integrations.lightning": ["DeadweightCallback"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_is_where_the_documentation_says(module: str) -> None:
    if module.startswith("deadweight.integrations."):
        pytest.importorskip(module.rsplit(".", 1)[1])  # the framework it integrates
    loaded = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(loaded, name)]
    assert missing == []
    if module == "deadweight":  # the functions, not the capability packages of like name
        assert callable(deadweight.check) and callable(deadweight.watch)
        importlib.import_module("deadweight.checking.flow_measurement")
        importlib.import_module("deadweight.watching.step_monitor")
        assert callable(deadweight.check) and callable(deadweight.watch)


def test_the_architecture_document_names_every_capability() -> None:
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    for capability in CAPABILITIES:
        assert f"{capability}/" in doc
    assert "docs/architecture.md" in (SRC.parents[1] / "README.md").read_text()


def _report_reaches(modules: dict[str, Path], paths: dict[str, Path]) -> list[str]:
    """What the modules in `paths` import from a capability beyond its statistics
    (`*_stats`) and findings."""
    return [
        f"{module} -> {target}"
        for module, path in paths.items()
        for target in _imports(path, modules)
        if _capability(target) is not None
        and not target.rsplit(".", 1)[-1].endswith(("_stats", "findings"))
    ]


def test_the_report_sees_only_findings_and_the_statistics_handed_to_it() -> None:
    """report/ renders: it reads findings and the statistics a capability publishes
    (`watch_stats`, `check_stats`, ...), never a tracer, a log reader or a rule."""
    modules = _modules()
    report = {m: p for m, p in modules.items() if m.startswith("deadweight.report")}
    assert len(report) > 5
    assert _report_reaches(modules, report) == []


def test_the_report_test_catches_a_reach_into_watch_internals(tmp_path: Path) -> None:
    modules = _modules()
    reaching = tmp_path / "reaching.py"
    reaching.write_text(
        "from deadweight.watching.event_log import LOG_SCHEMA_VERSION\n"
        "from deadweight.watching.watch_stats import WatchStats\n"
        "def later():\n    from deadweight.watching.rules import dynamics\n"
    )
    found = _report_reaches(modules, {"deadweight.report.reaching": reaching})
    assert sorted(found) == [
        "deadweight.report.reaching -> deadweight.watching.event_log",
        "deadweight.report.reaching -> deadweight.watching.rules.dynamics",
    ]


_RULE_CODE = re.compile(r"\bDW\d{3}\b")


def _code_literals(path: Path) -> list[str]:
    """Rule codes written as string literals in a module's code (docstrings aside): what
    `finding.code == "DW302"` or a label naming one rule looks like."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and ast.get_docstring(node, clean=False) is not None
    }
    return [
        f"{path.name}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and _RULE_CODE.search(node.value)
    ]


def test_the_renderers_choose_what_to_draw_from_data_not_from_rule_codes(tmp_path: Path) -> None:
    """A renderer picks a figure from what a finding's evidence carries (`values`,
    `drift_per_step`, ...) or its rule declares (`plots`), never by comparing its code
    with one rule's: whoever changes that rule would break a plot in another folder."""
    renderers = [*(SRC / "report").glob("*.py"), SRC / "cli" / "report.py"]
    assert [hit for path in renderers for hit in _code_literals(path)] == []
    branching = tmp_path / "branching.py"
    branching.write_text(
        '"""Draws DW302 (a docstring may name it)."""\n'
        'def pick(f):\n    return f.code == "DW302" or f"({f.code}: DW301)"\n'
    )
    assert len(_code_literals(branching)) == 2
