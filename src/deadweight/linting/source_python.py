"""Facts about one Python source file, read from its syntax tree (the `ast` module).

`probe_python(text, path)` parses the text once and returns `PythonSourceFacts`:
where forward paths cut the gradient of a module's own parameters or submodules
(`source_python_cuts`), weight-decay groups chosen by tensor rank, autograd
Functions and custom ops that leave gradients out, reentrant activation
checkpointing, and the inline suppression comments. It knows nothing about rules:
`deadweight.linting.rules.lint_python` judges the facts.

Each search runs only on files whose text contains the words it needs (a cut needs
`def forward` and `detach`, `no_grad`, ...), so most files cost one `ast.parse`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator

__all__ = ["PythonSourceFacts", "Span", "probe_python"]
from deadweight.linting import suppressions
from deadweight.linting.python_facts import (
    AutogradGap,
    CheckpointCall,
    ModuleCuts,
    PythonSourceFacts,
    ScalarParameter,
    Source,
    functions_with_names,
    imported_modules,
    module_imports,
    snippet,
)
from deadweight.linting.source_files import Span
from deadweight.linting.source_python_cuts import find_module_cuts
from deadweight.linting.source_python_decay import find_rank_decay, may_decide_decay_by_rank
from deadweight.linting.suppressions import Suppressions


def probe_python(text: str, path: str) -> PythonSourceFacts:
    """Facts of one file; raises SyntaxError (or ValueError, RecursionError) if it does not parse."""
    tree = ast.parse(text, filename=path)
    source = Source(text, path, tree)
    modules: tuple[ModuleCuts, ...] = ()
    if "def forward" in text:
        modules = tuple(find_module_cuts(source))
    rank_decay = tuple(find_rank_decay(source)) if may_decide_decay_by_rank(text) else ()
    gaps = tuple(find_autograd_gaps(source)) if any(w in text for w in _AUTOGRAD_WORDS) else ()
    checkpoints: tuple[CheckpointCall, ...] = ()
    if "utils.checkpoint" in text or "utils import checkpoint" in text:
        checkpoints = tuple(find_checkpoints(source))
    scalars = tuple(find_scalar_parameters(source)) if _may_create_scalar(text) else ()
    return PythonSourceFacts(
        path=path,
        modules=modules,
        rank_decay=rank_decay,
        autograd_gaps=gaps,
        checkpoints=checkpoints,
        scalar_parameters=scalars,
        imports=imported_modules(tree.body),
        suppressions=find_suppressions(text),
    )


# An autograd Function's base class is reached through `torch.autograd` (or an import
# from it); custom ops through `torch.library`.
_AUTOGRAD_WORDS = ("autograd", "custom_op", "torch.library", "Library(")


def find_suppressions(text: str) -> Suppressions:
    """`# deadweight: ignore[...]` comments, found with the tokenizer so strings do not count."""
    table: Suppressions = {}
    if suppressions.MARKER not in text:
        return table
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT and suppressions.MARKER in token.string:
                suppressions.add(table, token.start[0], token.string)
    except (tokenize.TokenError, SyntaxError):  # the ast parsed it; keep what was read
        pass
    return table


# ---------------------------------------------------------------- parameters of shape [] / [1]

_FACTORIES = {"ones", "zeros", "empty", "randn", "rand", "full"}
_SCALAR_WRAPPERS = {"tensor", "as_tensor", "scalar_tensor"}
_SAME_SHAPE_METHODS = {"fill_", "to", "float", "double", "half", "bfloat16", "clone", "cuda",
                       "cpu", "zero_", "normal_", "uniform_", "mul_", "add_", "detach",
                       "requires_grad_", "contiguous"}  # fmt: skip


# A textual screen for `Parameter(` followed by a tensor of shape [] or [1]: `torch.ones(1`,
# `zeros(()`, `randn([]`, `full((1,`, `tensor(0.5`, `tensor([1.`, `init * torch.ones(1`.
# It only decides whether the syntax tree is searched; the tree decides what counts.
_MAY_BE_SCALAR = re.compile(
    r"Parameter\(\s*(?:data\s*=\s*)?(?:[\w.]+\s*\*\s*)?(?:\w+\.)*(?:"
    r"(?:ones|zeros|empty|randn|rand|full)\(\s*(?:1\s*[,)]|\(\s*(?:1\s*,?\s*)?\)|\[\s*1?\s*\])"
    r"|(?:tensor|as_tensor|scalar_tensor)\(\s*\[?\s*[-+]?\s*[\d.])"
)


def _may_create_scalar(text: str) -> bool:
    return "Parameter(" in text and _MAY_BE_SCALAR.search(text) is not None


def find_scalar_parameters(source: Source) -> Iterator[ScalarParameter]:
    """`nn.Parameter(...)` of a scalar or shape-[1] tensor, wherever it is created. Only
    the statements around the textual screen's matches are searched."""
    lines = {source.text.count("\n", 0, m.start()) + 1
             for m in _MAY_BE_SCALAR.finditer(source.text)}  # fmt: skip
    targets: dict[ast.AST, str] = {}
    calls: list[ast.Call] = []
    stack: list[ast.AST] = [source.tree]
    while stack:
        node = stack.pop()
        first = getattr(node, "lineno", None)
        if first is not None:
            last = getattr(node, "end_lineno", None) or first
            if not any(first <= line <= last for line in lines):
                continue
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, (ast.Name, ast.Attribute, ast.Subscript)):
                targets[node.value] = snippet(target)
        elif isinstance(node, ast.Call):
            if (
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_parameter"
                and len(node.args) == 2
                and isinstance(node.args[0], ast.Constant)
            ):
                targets[node.args[1]] = repr(node.args[0].value)
            calls.append(node)
        stack.extend(ast.iter_child_nodes(node))
    for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
        dotted = source.resolve(call.func) or ""
        if not (dotted.endswith("nn.Parameter") or dotted.endswith("nn.parameter.Parameter")
                or dotted == "Parameter"):  # fmt: skip
            continue
        if any(k.arg == "requires_grad" and _is_false(k.value) for k in call.keywords):
            continue
        data = (
            call.args[0]
            if call.args
            else next((k.value for k in call.keywords if k.arg == "data"), None)
        )
        if data is not None and _scalar_tensor(source, data):
            yield ScalarParameter(source.span(call), targets.get(call), snippet(call))


def _scalar_tensor(source: Source, node: ast.AST) -> bool:
    """`torch.ones(1)`, `torch.zeros(())`, `torch.tensor(1.0)`, `torch.tensor([0.5])`,
    `init * torch.ones(1)`, `torch.full((1,), v)`, `torch.ones(1).fill_(v)`."""
    if isinstance(node, ast.BinOp):
        for side, other in ((node.left, node.right), (node.right, node.left)):
            if _scalar_tensor(source, side) and _number_like(other):
                return True
        return False
    if not isinstance(node, ast.Call):
        return False
    if (
        isinstance(node.func, ast.Attribute)
        and node.func.attr in _SAME_SHAPE_METHODS
        and _scalar_tensor(source, node.func.value)
    ):
        return True
    dotted = source.resolve(node.func) or ""
    if not dotted.startswith("torch."):
        return False
    name = dotted[len("torch.") :]
    if name in _SCALAR_WRAPPERS:
        if len(node.args) != 1:
            return False
        arg = node.args[0]
        if isinstance(arg, (ast.List, ast.Tuple)):
            return len(arg.elts) == 1 and _number(arg.elts[0])
        return _number(arg)
    if name not in _FACTORIES:
        return False
    shape_args = node.args[:1] if name == "full" else list(node.args)
    if len(shape_args) == 1 and isinstance(shape_args[0], (ast.Tuple, ast.List)):
        shape_args = list(shape_args[0].elts)
    return len(shape_args) <= 1 and all(
        isinstance(a, ast.Constant) and a.value == 1 and not isinstance(a.value, bool)
        for a in shape_args
    )


def _number(node: ast.AST) -> bool:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        node = node.operand
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    )


def _number_like(node: ast.AST) -> bool:
    """A constant or a plain name (`init_value * torch.ones(1)`): not a tensor of its own shape."""
    return _number(node) or isinstance(node, (ast.Name, ast.Attribute))


def _is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


# ---------------------------------------------------------------- DW503 autograd gaps

_FUNCTION_BASES = {"torch.autograd.Function", "torch.autograd.function.Function",
                   "torch.autograd.function.InplaceFunction"}  # fmt: skip
_TRAINABLE_INPUT_NAMES = {"weight", "bias", "weights", "gamma", "beta"}
_AUTOGRAD_KEYS = ("Autograd", "CompositeImplicitAutograd")


def find_autograd_gaps(source: Source) -> Iterator[AutogradGap]:
    functions: list[tuple[str, ast.ClassDef]] = []
    apply_args: dict[str, list[tuple[str, list[ast.expr]]]] = {}  # Function -> (class, args)
    calls: list[tuple[str, ast.Call]] = []
    decorated: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    untrainable: set[tuple[str, str]] = set()  # (class, attribute) that never needs a gradient
    for scope, node in functions_with_names(source.tree):
        if isinstance(node, ast.ClassDef) and any(
            source.resolve(b) in _FUNCTION_BASES for b in node.bases
        ):
            functions.append((scope, node))
        elif isinstance(node, ast.Call):
            calls.append((scope, node))
            if isinstance(node.func, ast.Attribute) and node.func.attr == "apply":
                owner = source.resolve(node.func.value)
                if owner:
                    apply_args.setdefault(owner.rsplit(".", 1)[-1], []).append(
                        (scope.split(".")[0], list(node.args))
                    )
            elif (
                isinstance(node.func, ast.Attribute)
                and node.func.attr == "register_buffer"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                untrainable.add((scope.split(".")[0], str(node.args[0].value)))
        elif isinstance(node, ast.Assign) and _untrainable_value(source, node.value):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    untrainable.add((scope.split(".")[0], target.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.decorator_list:
            decorated.append((scope, node))
    for qualname, cls in functions:
        applies = [
            [None if _self_attribute(a, owner) in untrainable else a for a in args]
            for owner, args in apply_args.get(cls.name, [])
        ]
        yield from _function_gaps(source, qualname, cls, applies)
    yield from _custom_op_gaps(source, calls, decorated)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == name:
            return stmt
    return None


def _returns(fn: ast.FunctionDef) -> Iterator[ast.Return]:
    stack: list[ast.AST] = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                   ast.ClassDef)):  # fmt: skip
            stack.extend(ast.iter_child_nodes(node))


def _is_none(node: ast.AST | None) -> bool:
    return node is None or (isinstance(node, ast.Constant) and node.value is None)


def _untrainable_value(source: Source, value: ast.AST) -> bool:
    """`nn.Parameter(..., requires_grad=False)` or `nn.Buffer(...)`: frozen by construction."""
    if not isinstance(value, ast.Call):
        return False
    dotted = source.resolve(value.func) or ""
    if dotted.endswith("Buffer"):
        return True
    return dotted.endswith("Parameter") and any(
        k.arg == "requires_grad" and isinstance(k.value, ast.Constant) and k.value.value is False
        for k in value.keywords
    )


def _self_attribute(arg: ast.expr, owner: str) -> tuple[str, str] | None:
    if (
        isinstance(arg, ast.Attribute)
        and isinstance(arg.value, ast.Name)
        and arg.value.id == "self"
    ):
        return (owner, arg.attr)
    return None


def _parameter_like(arg: ast.expr | None) -> str | None:
    """Why a call argument looks like a trainable tensor (`self.weight`, `layer.bias`)."""
    if isinstance(arg, ast.Attribute) and (
        arg.attr in _TRAINABLE_INPUT_NAMES or arg.attr.endswith(("_weight", "_bias"))
    ):
        return snippet(arg)
    return None


def _function_gaps(
    source: Source, qualname: str, cls: ast.ClassDef, applies: list[list[ast.expr | None]]
) -> Iterator[AutogradGap]:
    forward, backward = _method(cls, "forward"), _method(cls, "backward")
    if forward is None or backward is None:
        return
    setup = _method(cls, "setup_context")
    params = [a.arg for a in (*forward.args.posonlyargs, *forward.args.args)]
    inputs = params if setup is not None else params[1:]  # drop ctx
    if not inputs:
        return
    returns = list(_returns(backward))
    if not returns:
        return
    grads: list[list[ast.expr | None]] = [
        list(r.value.elts) if isinstance(r.value, ast.Tuple) else [r.value] for r in returns
    ]
    where = f"{qualname}.backward"
    if all(_is_none(g) for row in grads for g in row):
        yield AutogradGap(
            source.span(returns[0]), where, "all-backward-none", cls.name,
            f"backward returns no gradient for any of its inputs ({', '.join(inputs)})",
        )  # fmt: skip
        return
    reported: set[int] = set()
    for row, ret in zip(grads, returns, strict=True):
        if len(row) != len(inputs):
            continue
        for k, (grad, name) in enumerate(zip(row, inputs, strict=True)):
            if k in reported or not _is_none(grad):
                continue
            evidence = None
            at_k = [args[k] for args in applies if len(args) > k]
            passed = [p for p in map(_parameter_like, at_k) if p]
            if passed:
                evidence = f"{cls.name}.apply receives {passed[0]} there"
            elif None in at_k:
                continue  # a frozen parameter or a buffer is passed there: no gradient needed
            elif name in _TRAINABLE_INPUT_NAMES or name.endswith(("_weight", "_bias")):
                evidence = f"the input is named {name!r}"
            if evidence:
                reported.add(k)
                node = grad if grad is not None else ret
                yield AutogradGap(
                    source.span(node), where, "backward-none", cls.name,
                    f"backward returns None for input {k + 1} ({name!r}); {evidence}",
                )  # fmt: skip
    yield from _non_differentiable_outputs(source, qualname, cls, forward, setup, grads)


def _non_differentiable_outputs(
    source: Source,
    qualname: str,
    cls: ast.ClassDef,
    forward: ast.FunctionDef,
    setup: ast.FunctionDef | None,
    grads: list[list[ast.expr | None]],
) -> Iterator[AutogradGap]:
    marker = setup or forward
    marked: set[str] = set()
    mark_node: ast.Call | None = None
    for node in ast.walk(marker):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "mark_non_differentiable"
        ):
            mark_node = mark_node or node
            marked.update(a.id for a in node.args if isinstance(a, ast.Name))
    if mark_node is None:
        return
    if setup is not None:
        out_name = setup.args.args[-1].arg if setup.args.args else None
        everything = out_name in marked
    else:
        outputs: list[str | None] = []
        for ret in _returns(forward):
            elts = ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]
            outputs.extend(e.id if isinstance(e, ast.Name) else None for e in elts)
        everything = bool(outputs) and all(o in marked for o in outputs)
    computes = any(not _is_none(g) for row in grads for g in row)
    if everything and computes:
        yield AutogradGap(
            source.span(mark_node), f"{qualname}.{marker.name}", "non-differentiable", cls.name,
            "every output is marked non-differentiable, so the backward it defines never runs",
        )  # fmt: skip


def _op_name(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.split("(")[0].strip()
    return None


def _custom_op_gaps(
    source: Source,
    calls: list[tuple[str, ast.Call]],
    decorated: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]],
) -> Iterator[AutogradGap]:
    registered: set[str] = set()  # op and function names that have an autograd formula
    defined: list[tuple[str, str, tuple[str, ...], ast.AST]] = []  # scope, kind, names, node
    for scope, call in calls:
        dotted = source.resolve(call.func) or ""
        attr = call.func.attr if isinstance(call.func, ast.Attribute) else dotted
        if attr == "register_autograd":
            if isinstance(call.func, ast.Attribute) and not dotted.startswith("torch.library"):
                registered.add((source.resolve(call.func.value) or "").rsplit(".", 1)[-1])
            for arg in call.args[:1]:
                op = _op_name(arg) or (source.resolve(arg) or "").rsplit(".", 1)[-1]
                registered.add(op.rsplit("::", 1)[-1])
        elif attr == "impl":
            keys = [a.value for a in call.args if isinstance(a, ast.Constant)]
            keys += [k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)]
            if any(isinstance(k, str) and k.startswith(_AUTOGRAD_KEYS) for k in keys):
                for arg in call.args[:2]:
                    key = _op_name(arg)
                    if key:
                        registered.add(key.rsplit("::", 1)[-1])
        elif attr == "define" and call.args and isinstance(call.func, ast.Attribute):
            first = call.args[0]
            schema = first.value if isinstance(first, ast.Constant) else None
            if dotted == "torch.library.define" and len(call.args) > 1:
                second = call.args[1]
                schema = second.value if isinstance(second, ast.Constant) else None
            declared = _op_name(first)
            # only ops that return a tensor can need a gradient
            if declared and isinstance(schema, str) and "Tensor" in schema.split("->")[-1]:
                defined.append((scope, "library-op", (declared.rsplit("::", 1)[-1],), call))
    for scope, fn in decorated:
        for dec in fn.decorator_list:
            target = dec.func if isinstance(dec, ast.Call) else dec
            dotted = source.resolve(target) or ""
            if not (dotted.endswith("library.custom_op") or dotted == "custom_op"):
                continue
            keywords = dec.keywords if isinstance(dec, ast.Call) else []
            mutates = next((k.value for k in keywords if k.arg == "mutates_args"), None)
            if isinstance(mutates, (ast.Tuple, ast.List)) and mutates.elts:
                continue  # an op that mutates its inputs cannot have an autograd formula
            if isinstance(mutates, ast.Constant) and mutates.value == "unknown":
                continue
            declared = _op_name(dec.args[0]) if isinstance(dec, ast.Call) and dec.args else None
            names: tuple[str, ...] = (fn.name,)
            if declared is not None:
                names = (declared.rsplit("::", 1)[-1], fn.name)
            defined.append((scope, "custom-op", names, dec))
    for scope, kind, names, node in defined:
        if any(n in registered for n in names):
            continue
        yield AutogradGap(
            source.span(node), scope, kind, names[0],
            "no autograd formula registered in this file",
        )  # fmt: skip


# ---------------------------------------------------------------- DW504 reentrant checkpoint

_CHECKPOINT_FUNCS = {
    "torch.utils.checkpoint.checkpoint",
    "torch.utils.checkpoint.checkpoint_sequential",
}
_PARTIAL = {"functools.partial", "partial"}


def find_checkpoints(source: Source) -> Iterator[CheckpointCall]:
    imports = dict(source.imports)
    calls: list[tuple[str, ast.Call]] = []
    for scope, node in functions_with_names(source.tree):
        if isinstance(node, ast.Import | ast.ImportFrom):  # local imports count too
            imports.update(module_imports([node]))
        elif isinstance(node, ast.Call):
            calls.append((scope, node))
    saved, source.imports = source.imports, imports
    try:
        for scope, call in calls:
            callee = source.resolve(call.func)
            keywords = call.keywords
            if callee in _PARTIAL and call.args:
                callee = source.resolve(call.args[0])
            if callee not in _CHECKPOINT_FUNCS:
                continue
            if any(k.arg is None for k in keywords):  # **kwargs may carry use_reentrant
                continue
            flag = next((k.value for k in keywords if k.arg == "use_reentrant"), None)
            if flag is None:
                state = "missing"
            elif isinstance(flag, ast.Constant) and flag.value is True:
                state = "True"
            else:
                continue  # False, or decided at run time
            yield CheckpointCall(source.span(call), scope, str(callee), state)
    finally:
        source.imports = saved
