"""Weight-decay groups chosen by tensor rank (what DW502 judges), read from a syntax tree.

A rank test (`len(p.shape) == 1`, `p.ndim <= 1`, `p.dim() < 2`, `len(p.size()) == 1`,
`p.ndimension() == 1`) counts when what it decides is about weight decay: the `if` it
tests, the statement it sits in, or, when neither says so, where its result goes. A
result is followed through the names a statement binds or fills (`vector =
ParamPredicate(fn=lambda p: len(p.shape) == 1)`, then `key = ParamKey(predicate=vector)`,
then `overrides[key] = ParamGroupOverride(wd_mult=0.0)`: Megatron-LM's form) and out of a
function through its return value to its callers (a helper `is_matrix(p)` and the
comprehension that calls it), for a few steps.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from deadweight.linting.python_facts import (
    RankDecayChoice,
    RankTest,
    Source,
    functions_with_names,
    snippet,
)

__all__ = ["find_rank_decay", "may_decide_decay_by_rank", "rank_subject"]

_RANK_ATTRS = {"ndim"}
_RANK_METHODS = {"dim", "ndimension"}
_SHAPE_ATTRS = {"shape"}
_SHAPE_METHODS = {"size"}


_WD = re.compile(r"(?<![A-Za-z0-9])wd(?![A-Za-z0-9])", re.IGNORECASE)
_RANK_WORDS = ("ndim", ".dim()", "ndimension", ".shape)", ".size())")

# How many steps a rank test's result is followed before giving up on tying it to decay.
# Megatron-LM's rule takes two (predicate -> key -> override); a helper passed to such a
# predicate takes three. Past four, a word about decay is more likely a coincidence of
# a long function than the fate of the test's result.
_FLOW_STEPS = 4
# A name read more often than this in its function is a hub (`state`, `group`), not the
# carrier of one test's result: its reads are not followed. Megatron's predicate and key
# are read once each; a helper is rarely called more than twice in one file.
_CARRIER_READS = 4
# Calls that pass an argument on inside their result, as a class does.
_CARRYING_CALLS = {"dict", "list", "set", "tuple", "frozenset", "sorted", "filter", "map",
                   "zip", "iter", "reversed", "enumerate", "chain", "partial"}  # fmt: skip
# Calls that fill the container they are called on: `no_decay.append(p)` binds `no_decay`.
_FILLING = {"append", "add", "extend", "update", "setdefault", "insert", "__setitem__"}


def may_decide_decay_by_rank(text: str) -> bool:
    """Both a rank test and a word about weight decay appear somewhere in the text."""
    if not any(word in text for word in _RANK_WORDS):
        return False
    return "decay" in text.lower() or _WD.search(text) is not None


def _decay_word(word: str) -> bool:
    lowered = word.lower()
    if "decay" in lowered:
        return True
    parts = lowered.replace("-", "_").split("_")
    return "wd" in parts


def rank_subject(node: ast.AST) -> ast.AST | None:
    """`X` when `node` is `len(X.shape)`, `len(X.size())`, `X.ndim`, `X.dim()` or `X.ndimension()`."""
    if isinstance(node, ast.Attribute) and node.attr in _RANK_ATTRS:
        return node.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and not node.args
        and node.func.attr in _RANK_METHODS
    ):
        return node.func.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "len"
        and len(node.args) == 1
    ):
        arg = node.args[0]
        if isinstance(arg, ast.Attribute) and arg.attr in _SHAPE_ATTRS:
            return arg.value
        if (
            isinstance(arg, ast.Call)
            and isinstance(arg.func, ast.Attribute)
            and arg.func.attr in _SHAPE_METHODS
            and not arg.args
        ):
            return arg.func.value
    return None


_COMPARE = {
    ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
}  # fmt: skip
# Ranks 0, 1, 2 and "3 or more": the thresholds tested are 0 to 2, so this is every case.
_RANKS = (0, 1, 2, 3)


def _ranks_passing(node: ast.Compare) -> frozenset[int] | None:
    """The tensor ranks for which a rank test holds: `p.dim() < 2` -> {0, 1}."""
    if len(node.ops) != 1 or type(node.ops[0]) not in _COMPARE:
        return None
    compare = _COMPARE[type(node.ops[0])]
    left, right = node.left, node.comparators[0]
    for side, other, flipped in ((left, right, False), (right, left, True)):
        if (
            rank_subject(side) is not None
            and isinstance(other, ast.Constant)
            and isinstance(other.value, int)
            and not isinstance(other.value, bool)
            and 0 <= other.value <= 2
        ):
            k = other.value
            return frozenset(r for r in _RANKS if (compare(k, r) if flipped else compare(r, k)))
    return None


def _decay_words_in(nodes: list[ast.AST]) -> list[str]:
    words: list[str] = []
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.Name):
                word = node.id
            elif isinstance(node, ast.Attribute):
                word = node.attr
            elif isinstance(node, ast.keyword) and node.arg:
                word = node.arg
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                word = node.value
            elif isinstance(node, ast.arg):
                word = node.arg
            else:
                continue
            if len(word) < 64 and _decay_word(word) and word not in words:
                words.append(word)
    return words


class _Tree:
    """The file's parent links and name uses, for following a test's result."""

    def __init__(self, source: Source) -> None:
        self.parents: dict[ast.AST, ast.AST] = {}
        self.tests: list[tuple[str, ast.Compare]] = []
        self.loads: dict[str, list[ast.AST]] = {}  # name -> Name loads and `x.name` reads
        self._headers: dict[ast.AST, ast.Assign] = {}  # for loop -> its header as an assignment
        for function, node in functions_with_names(source.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.Compare) and _ranks_passing(node) is not None:
                self.tests.append((function, node))
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                self.loads.setdefault(node.id, []).append(node)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                self.loads.setdefault(node.attr, []).append(node)

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        while node in self.parents:
            node = self.parents[node]
            yield node

    def scope(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The function around `node` (None at module level)."""
        for a in self.ancestors(node):
            if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return a
        return None

    def deciding_region(self, node: ast.AST) -> ast.AST:
        """What a value decides: the if statement it tests (or, for an early `continue`,
        the loop around it), else the statement it sits in."""
        child = node
        for parent in self.ancestors(node):
            if isinstance(parent, ast.If) and child is parent.test:
                if all(isinstance(s, (ast.Continue, ast.Pass, ast.Break)) for s in parent.body):
                    return next(
                        (a for a in self.ancestors(parent) if isinstance(a, (ast.For, ast.While))),
                        parent,
                    )
                return parent
            if isinstance(parent, ast.stmt):
                return parent
            child = parent
        return child

    def decay_words(self, test: ast.Compare) -> list[str]:
        """The words about decay in what the test decides, following its result through
        bound names and return values for up to `_FLOW_STEPS` steps."""
        regions = [self.deciding_region(test)]
        seen = set(regions)
        for _ in range(_FLOW_STEPS + 1):
            words = _decay_words_in(list(regions))
            if words or not regions:
                return words
            reached = [
                self._reached_region(use)
                for region in regions
                for use in self._uses(region)
                if not self._consumed(use)
            ]
            regions = [r for r in dict.fromkeys(reached) if r not in seen]
            seen.update(regions)
        return []

    def _reached_region(self, use: ast.AST) -> ast.AST:
        """What a read of the result decides. A loop over it (`for p in flat:`) assigns
        each item to the loop's variables: its header is that assignment, and the
        body is reached through them, not taken whole."""
        region = self.deciding_region(use)
        if isinstance(region, (ast.For, ast.AsyncFor)) and use in set(ast.walk(region.iter)):
            header = self._headers.get(region)
            if header is None:
                header = ast.Assign(
                    targets=[region.target], value=region.iter, lineno=region.lineno
                )
                self.parents[header] = self.parents[region]
                self._headers[region] = header
            return header
        return region

    def _uses(self, region: ast.AST) -> Iterator[ast.AST]:
        """Where the result of `region` is read next: the names it binds or fills, read in
        its function; and, when it returns from a function, that function's callers."""
        inside = set(ast.walk(region))
        scope = self.scope(region)
        for name in _bound_names(region):
            # read in the same function or a function nested in it (a closure)
            uses = [
                use
                for use in self.loads.get(name, [])
                if isinstance(use, ast.Name)
                and use not in inside
                and (scope is None or scope in self.ancestors(use))
            ]
            if len(uses) <= _CARRIER_READS:
                yield from uses
        if scope is not None and any(isinstance(n, ast.Return) for n in inside):
            yield from (u for u in self.loads.get(scope.name, []) if u not in inside)

    def _consumed(self, use: ast.AST) -> bool:
        """The value is handed to a function as an argument (`step(p, grad, wd,
        is_2d=is_2d)`): what it decides is inside that function, and the call's other
        arguments say nothing about it. Classes (`ParamKey(predicate=...)`), containers
        and their filling methods carry the value on instead."""
        child = use
        for parent in self.ancestors(use):
            if isinstance(parent, ast.stmt):
                return False
            if isinstance(parent, ast.Call) and child is not parent.func:
                func = parent.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if not (name[:1].isupper() or name in _CARRYING_CALLS or name in _FILLING):
                    return True
            child = parent
        return False

    def exclusive(self, a: ast.AST, b: ast.AST) -> bool:
        """`a` and `b` sit in different branches of one if statement: never both run."""
        branches = dict(self._branches(a))
        return any(branches.get(stmt, side) != side for stmt, side in self._branches(b))

    def _branches(self, node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
        child = node
        for parent in self.ancestors(node):
            if isinstance(parent, ast.If) and child is not parent.test:
                yield parent, "body" if child in parent.body else "orelse"
            child = parent


def _bound_names(region: ast.AST) -> list[str]:
    """Local names a statement assigns (not loop or comprehension variables) or fills
    (`groups.append(p)`, `groups[k] = v`)."""
    names: list[str] = []
    for node in ast.walk(region):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _FILLING
        ):
            targets = [node.func.value]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Subscript):
                    part = part.value
                if isinstance(part, ast.Name) and part.id not in names:
                    names.append(part.id)
    return names


def find_rank_decay(source: Source) -> Iterator[RankDecayChoice]:
    tree = _Tree(source)
    # One decay rule is often written twice, once per group (nanoGPT's `p.dim() >= 2` and
    # `p.dim() < 2`): tests of one function that draw the same line are one choice,
    # reported at the first, the others its partners. Tests in the two branches of an
    # if/else are two rules (Megatron-LM's, one per setting), each reported.
    groups: list[tuple[str, frozenset[int], ast.Compare, list[str], list[ast.Compare]]] = []
    for function, test in sorted(tree.tests, key=lambda ft: (ft[1].lineno, ft[1].col_offset)):
        words = tree.decay_words(test)
        if not words:
            continue
        ranks = _ranks_passing(test) or frozenset()
        line = {ranks, frozenset(_RANKS) - ranks}
        group = next(
            (g for g in groups
             if g[0] == function and g[1] in line and not tree.exclusive(g[2], test)),
            None,
        )  # fmt: skip
        if group is None:
            groups.append((function, ranks, test, words, []))
        else:
            group[4].append(test)
            group[3].extend(w for w in words if w not in group[3])
    for function, _, test, words, partners in groups:
        yield RankDecayChoice(
            source.span(test), function, snippet(test), tuple(words[:4]),
            tuple(RankTest(source.span(p), snippet(p)) for p in partners),
        )  # fmt: skip
