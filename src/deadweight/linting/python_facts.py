"""What a Python source file was found to contain: the facts `source_python` and
`source_python_cuts` gather and `rules/lint_python.py` judges, and the parsed file they
are gathered from (`Source`). Data only: no search lives here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from deadweight.linting.source_files import Span, character_column
from deadweight.linting.suppressions import Suppressions


@dataclass(frozen=True)
class TrainableAttribute:
    """A parameter or submodule a class creates (`self.name = nn.Linear(...)`)."""

    name: str
    constructor: str  # "nn.Linear", "nn.Parameter", or a class of the same file
    live: bool  # some value of it reaches a method's output with its gradient intact
    frozen: bool  # the class turns its gradient off itself (requires_grad_(False))


@dataclass(frozen=True)
class GradientCut:
    """A place in a forward path past which values carry no gradient."""

    span: Span
    function: str  # qualified name of the function holding the cut
    kind: str  # no_grad, inference_mode, set_grad_enabled, detach, data, item, ...
    construct: str  # the source text of the cut, shortened
    attributes: tuple[str, ...]  # trainable attributes whose values cross it into forward's output


@dataclass(frozen=True)
class ModuleCuts:
    owner: str  # the class
    attributes: dict[str, TrainableAttribute]
    cuts: tuple[GradientCut, ...]


@dataclass(frozen=True)
class RankTest:
    """One comparison of a tensor's rank (`p.dim() < 2`)."""

    span: Span
    expression: str


@dataclass(frozen=True)
class RankDecayChoice:
    """A comparison of a tensor's rank that decides weight-decay groups, with the other
    comparisons of the same function that draw the same line (nanoGPT's `p.dim() >= 2`
    for the decayed group and `p.dim() < 2` for the rest are one choice)."""

    span: Span
    function: str
    expression: str  # e.g. "len(param.shape) == 1"
    decay_words: tuple[str, ...]  # the names and strings that tie it to weight decay
    partners: tuple[RankTest, ...] = ()


@dataclass(frozen=True)
class ScalarParameter:
    """A parameter created with a scalar or shape-[1] tensor (`nn.Parameter(torch.ones(1))`):
    what a rank-based decay rule exempts by accident."""

    span: Span
    target: str | None  # what it is stored in (`self.scale`), when the source says
    construct: str


@dataclass(frozen=True)
class AutogradGap:
    """An autograd Function or custom op that leaves some input without a gradient."""

    span: Span
    function: str
    kind: str  # backward-none, all-backward-none, custom-op, library-op, non-differentiable
    subject: str  # the Function class or the op name
    detail: str  # which input, and the evidence it needs a gradient


@dataclass(frozen=True)
class CheckpointCall:
    span: Span
    function: str
    callee: str  # torch.utils.checkpoint.checkpoint or checkpoint_sequential
    use_reentrant: str  # "missing" or "True"


@dataclass(frozen=True)
class PythonSourceFacts:
    path: str
    modules: tuple[ModuleCuts, ...] = ()
    rank_decay: tuple[RankDecayChoice, ...] = ()
    autograd_gaps: tuple[AutogradGap, ...] = ()
    checkpoints: tuple[CheckpointCall, ...] = ()
    scalar_parameters: tuple[ScalarParameter, ...] = ()
    imports: tuple[str, ...] = ()  # modules imported at module level (".model" if relative)
    suppressions: Suppressions = field(default_factory=dict)


@dataclass(frozen=True)
class PythonRunFacts:
    """What the rules that look across files need from the Python files of one lint
    run: a decay rule in train.py exempts the layer scalar that model.py creates."""

    files: tuple[PythonSourceFacts, ...] = ()
    # path -> the linted files in sight of it: itself, the files that import it and
    # everything those import, directly or not (see `import_graph`)
    in_sight: dict[str, frozenset[str]] = field(default_factory=dict)


class Source:
    """Parsed text with what every search needs: positions in characters, import names."""

    def __init__(self, text: str, path: str, tree: ast.Module) -> None:
        self.text = text
        self.path = path
        self.tree = tree
        self._lines: list[str] | None = None
        self.imports = module_imports(tree.body)

    def line_text(self, line: int) -> str:
        if self._lines is None:
            self._lines = self.text.splitlines()
        return self._lines[line - 1] if 0 < line <= len(self._lines) else ""

    def column(self, line: int, byte_offset: int) -> int:
        """ast offsets count UTF-8 bytes; editors and SARIF count characters (1-based)."""
        return character_column(self.line_text(line), byte_offset)

    def span(self, node: ast.AST) -> Span:
        line, col = node.lineno, node.col_offset  # type: ignore[attr-defined]
        end_line = getattr(node, "end_lineno", None) or line
        end_col = getattr(node, "end_col_offset", None)
        end_col = col if end_col is None else end_col
        return Span(line, self.column(line, col), end_line, self.column(end_line, end_col))

    def resolve(self, node: ast.AST) -> str | None:
        """Dotted name of an expression with import aliases expanded: `nn.Linear` ->
        `torch.nn.Linear` after `from torch import nn`; None for anything else."""
        if isinstance(node, ast.Name):
            return self.imports.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None


def functions_with_names(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """Every node paired with the qualified name of the function (or class) around it."""
    stack: list[tuple[str, ast.AST]] = [("<module>", tree)]
    while stack:
        scope, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = child.name if scope == "<module>" else f"{scope}.{child.name}"
                yield name, child
                stack.append((name, child))
            else:
                yield scope, child
                stack.append((scope, child))


def snippet(node: ast.AST, limit: int = 60) -> str:
    text = ast.unparse(node)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def imported_modules(body: list[ast.stmt]) -> tuple[str, ...]:
    """The modules a file imports at module level (also under if/try/with): `import a.b`
    -> "a.b"; `from .model import GPT` -> ".model" and ".model.GPT" (GPT may be a module)."""
    found: list[str] = []
    for stmt in _module_level(body):
        if isinstance(stmt, ast.Import):
            found.extend(alias.name for alias in stmt.names)
        elif isinstance(stmt, ast.ImportFrom):
            base = "." * stmt.level + (stmt.module or "")
            if stmt.module:
                found.append(base)
            for alias in stmt.names:
                if alias.name != "*":
                    found.append(f"{base}.{alias.name}" if stmt.module else base + alias.name)
    return tuple(dict.fromkeys(found))


def module_imports(body: list[ast.stmt]) -> dict[str, str]:
    """Local name -> dotted path for the imports at module level (also under if/try)."""
    names: dict[str, str] = {}
    for stmt in _module_level(body):
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    names[head] = head
        elif isinstance(stmt, ast.ImportFrom):
            base = "." * stmt.level + (stmt.module or "")
            for alias in stmt.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
    return names


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run at import: `body`, and those under its if/try/with
    blocks (in the order the two import readers have always visited them)."""
    stack = list(body)
    while stack:
        stmt = stack.pop()
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With)):
            stack.extend(stmt.body)
            stack.extend(getattr(stmt, "orelse", []))
            stack.extend(getattr(stmt, "finalbody", []))
            for handler in getattr(stmt, "handlers", []):
                stack.extend(handler.body)
