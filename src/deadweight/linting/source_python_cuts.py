"""Where a module's forward path cuts the gradient of its own parameters and submodules.

For every class with a `forward`, the trainable attributes it creates
(`self.w = nn.Parameter(...)`, `self.proj = nn.Linear(...)`, an instance of a
trainable class of the same file, and the members of containers built in place,
`self.transformer.ln_f`: see `source_python_layout`) are followed through `forward`
and the methods, module-level functions and stored lambdas of the file that it
calls, with a small data-flow
analysis: each value carries tags saying which attributes it came from and whether
its gradient was cut on the way (`torch.no_grad()` / `inference_mode()` blocks and
decorators, `.detach()`, `.data`, `.item()`, `.tolist()`, `.numpy()`, `float()`,
`torch.tensor(...)`). Calls are summarised once per function, with the parameters
as symbolic inputs, so a cut inside a helper is seen where the helper is called.

Metadata (`.shape`, `.dtype`, `.size()`, `len()`, comparisons, conditions) carries
no gradient and no tag. Assignments replace a name's tags; branches and loops
merge them. An attribute is *live* when an uncut value of it reaches the output of
forward, or of another method of the class that is not clearly inference-only, or
is stored on the module (storing into a parameter itself, nanoGPT's
`self.transformer.wpe.weight = nn.Parameter(...)`, is not a use of it), or is tied
to a live one (`self.transformer.wte.weight = self.lm_head.weight`). A cut is
reported with the attributes whose values cross it into forward's output.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from deadweight.linting.python_facts import (
    GradientCut,
    ModuleCuts,
    Source,
    TrainableAttribute,
    snippet,
)
from deadweight.linting.source_python_layout import (
    Layout,
    Layouts,
    Path,
    is_false,
    is_self,
    self_chains,
    self_path,
    statements,
)

Tag = tuple  # ("L", attr) | ("C", attr, site) | ("P", param) | ("Q", param, site)
Tags = frozenset

EMPTY: Tags = frozenset()

GRAD_OFF = {
    "torch.no_grad": "no_grad",
    "torch.autograd.no_grad": "no_grad",
    "torch.autograd.grad_mode.no_grad": "no_grad",
    "torch.inference_mode": "inference_mode",
    "torch.autograd.inference_mode": "inference_mode",
    "torch.autograd.grad_mode.inference_mode": "inference_mode",
}
GRAD_SWITCH = {"torch.set_grad_enabled", "torch.autograd.set_grad_enabled",
               "torch.autograd.grad_mode.set_grad_enabled"}  # fmt: skip
GRAD_ON = {
    "torch.enable_grad",
    "torch.autograd.enable_grad",
    "torch.autograd.grad_mode.enable_grad",
}

CUT_METHODS = {"detach": "detach", "detach_": "detach", "item": "item", "tolist": "tolist",
               "numpy": "numpy"}  # fmt: skip
REBUILDS = {"torch.tensor", "torch.Tensor", "torch.from_numpy", "torch.FloatTensor",
            "numpy.array", "numpy.asarray", "np.array", "np.asarray"}  # fmt: skip
METADATA_ATTRS = frozenset({
    "shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout", "is_sparse",
    "is_quantized", "is_meta", "names", "itemsize", "nbytes", "grad", "grad_fn", "is_leaf",
    "training",
})  # fmt: skip
METADATA_METHODS = frozenset({
    "size", "dim", "ndimension", "numel", "nelement", "stride", "data_ptr", "element_size",
    "is_contiguous", "is_floating_point", "is_complex", "get_device", "storage_offset",
    "untyped_storage", "parameters", "named_parameters", "buffers", "named_buffers",
    "modules", "named_modules", "children", "state_dict", "extra_repr", "__len__",
    "register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
})  # fmt: skip
# Integer and boolean results carry no gradient, so nothing upstream of them is cut by
# a later no_grad: top-k indices, argmax routing, masks, casts to integer types.
INTEGER_METHODS = frozenset({
    "argmax", "argmin", "argsort", "argwhere", "nonzero", "long", "int", "short", "byte", "bool",
    "eq", "ne", "gt", "ge", "lt", "le", "isnan", "isinf", "isfinite", "logical_and",
    "logical_or", "logical_not", "logical_xor", "bucketize", "searchsorted", "sign",
})  # fmt: skip
INTEGER_ATTRS = frozenset({"indices"})
INTEGER_DTYPES = frozenset({"long", "int", "int8", "int16", "int32", "int64", "uint8", "bool",
                            "short", "uint16", "uint32", "uint64"})  # fmt: skip
NO_VALUE_FUNCS = frozenset({"len", "isinstance", "issubclass", "type", "id", "hasattr", "callable",
                            "print", "repr", "str", "format", "int", "bool", "range", "getattr",
                            "enumerate_", "hash", "dir", "vars"})  # fmt: skip
MUTATORS = frozenset({"append", "extend", "insert", "update", "add", "appendleft", "setdefault"})

# Methods that do not train: uses there neither count as live nor hold cuts.
INFERENCE_PREFIXES = ("generate", "predict", "infer", "sample", "eval", "validation_", "test_",
                      "_init", "init_", "reset_parameters", "extra_repr", "__")  # fmt: skip


CUT_WORDS = ("no_grad", "inference_mode", "set_grad_enabled", "detach", ".data", ".item(",
             ".tolist(", ".numpy(", "tensor(", "from_numpy", "float(", "array(")  # fmt: skip


def find_module_cuts(source: Source) -> Iterator[ModuleCuts]:
    module = _Module(source)
    for cls in module.classes.values():
        if _own_method(cls, "forward") is None or not module.may_cut(cls):
            continue
        found = _ClassFlow(module, cls).result()
        if found is not None:
            yield found


def _own_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            return stmt
    return None


def _grad_off_decorator(
    source: Source, fn: ast.FunctionDef | ast.AsyncFunctionDef
) -> ast.AST | None:
    for dec in fn.decorator_list:
        target = dec.func if isinstance(dec, ast.Call) else dec
        dotted = source.resolve(target)
        if dotted in GRAD_OFF:
            if isinstance(dec, ast.Call) and dec.args and is_false(dec.args[0]):
                continue  # inference_mode(False)
            return dec
    return None


class _Module:
    """What every class analysis of one file shares: classes, functions, summaries."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.classes: dict[str, ast.ClassDef] = {}
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        stack: list[ast.stmt] = list(source.tree.body)
        while stack:
            stmt = stack.pop()
            if isinstance(stmt, ast.ClassDef):
                self.classes.setdefault(stmt.name, stmt)
                stack.extend(s for s in stmt.body if isinstance(s, ast.ClassDef))
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(stmt.name, stmt)
            elif isinstance(stmt, (ast.If, ast.Try)):
                stack.extend(stmt.body)
                stack.extend(stmt.orelse)
                stack.extend(getattr(stmt, "finalbody", []))
        self.layouts = Layouts(source, self.classes)
        self._line_starts: list[int] | None = None
        # Names under which a cut can appear in this file: the words themselves and
        # any import alias of a grad-off context or tensor rebuild.
        aliases = [name for name, dotted in source.imports.items()
                   if dotted in GRAD_OFF or dotted in GRAD_SWITCH or dotted in REBUILDS]  # fmt: skip
        self.cut_words = (*CUT_WORDS, *(f"{a}(" for a in aliases))
        self.cutting_functions = [
            name for name, fn in self.functions.items() if self._has_cut_words(fn)
        ]
        self.function_summaries: dict[str, Tags] = {}
        self.in_progress: set[str] = set()

    # -- a cheap textual screen: no cut word in a class (or in a function of the file it
    # calls, or in a base class of the file) means no cut in its forward path

    def _text(self, node: ast.AST) -> str:
        text = self.source.text
        if self._line_starts is None:
            starts, offset = [0], 0
            for line in text.splitlines(keepends=True):
                offset += len(line)
                starts.append(offset)
            self._line_starts = starts
        starts = self._line_starts
        decorators = getattr(node, "decorator_list", None) or [node]
        first = max(min(getattr(d, "lineno", 1) for d in decorators) - 1, 0)
        last = min(getattr(node, "end_lineno", None) or len(starts) - 1, len(starts) - 1)
        return text[starts[first] : starts[last]]

    def _has_cut_words(self, node: ast.AST) -> bool:
        text = self._text(node)
        return any(word in text for word in self.cut_words)

    def may_cut(self, cls: ast.ClassDef, seen: frozenset[str] = frozenset()) -> bool:
        if self._has_cut_words(cls):
            return True
        text = self._text(cls)
        if any(f"{name}(" in text for name in self.cutting_functions):
            return True
        for base in cls.bases:
            local = self.classes.get(base.id) if isinstance(base, ast.Name) else None
            if (
                local is not None
                and local.name not in seen
                and local is not cls
                and self.may_cut(local, seen | {cls.name})
            ):
                return True
        return False


@dataclass(frozen=True)
class _Callable:
    body: ast.Lambda
    where: ast.FunctionDef | ast.AsyncFunctionDef
    self_name: str
    aliases: dict[str, ast.expr]


@dataclass
class _Summary:
    returns: Tags = EMPTY
    state: Tags = EMPTY  # tags stored on the module (self.x = ...)


@dataclass
class _ClassFlow:
    module: _Module
    cls: ast.ClassDef
    layout: Layout = field(init=False)
    attrs: dict[str, str] = field(init=False)
    methods: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = field(init=False)
    summaries: dict[str, _Summary] = field(default_factory=dict)
    in_progress: set[str] = field(default_factory=set)
    site_function: dict[ast.AST, str] = field(default_factory=dict)
    site_kind: dict[ast.AST, str] = field(default_factory=dict)
    _callables: dict[str, _Callable] | None = None

    def __post_init__(self) -> None:
        self.layout = self.module.layouts.layout(self.cls)
        self.attrs = self.layout.attrs
        self.methods = {}
        self._collect_methods(self.cls, set())

    @property
    def callables(self) -> dict[str, _Callable]:
        """`self.mlpf = lambda x: m.c_proj(m.c_fc(x))` (minGPT): the lambda, where it was
        written, and the method's local names for submodules (`m = self.mlp`)."""
        if self._callables is None:
            self._callables = self._collect_callables()
        return self._callables

    def leaves(
        self,
        node: ast.AST,
        self_name: str | None,
        *,
        exact: bool = True,
        aliases: dict[str, Path] | None = None,
    ) -> frozenset[str] | None:
        """The trainable leaves an access of `self` (or of a local name for a submodule,
        `aliases`) reaches; see `Layout.resolve`."""
        path = self_path(node, self_name, aliases) if self_name is not None else None
        return None if path is None else self.layout.resolve(path, exact=exact)

    def _collect_callables(self) -> dict[str, _Callable]:
        found: dict[str, _Callable] = {}
        for fn in self.methods.values():
            args = [*fn.args.posonlyargs, *fn.args.args]
            me = args[0].arg if args else "self"
            aliases: dict[str, ast.expr] = {}
            for stmt in statements(fn.body):
                if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
                    continue
                target, value = stmt.targets[0], stmt.value
                if isinstance(target, ast.Name) and self_path(value, me) is not None:
                    aliases[target.id] = value
                elif (
                    isinstance(target, ast.Attribute)
                    and is_self(target.value, me)
                    and isinstance(value, ast.Lambda)
                    and target.attr not in self.attrs
                    and target.attr not in self.methods
                ):
                    found.setdefault(target.attr, _Callable(value, fn, me, dict(aliases)))
        return found

    def _ties(self) -> list[tuple[frozenset[str], frozenset[str]]]:
        """`self.transformer.wte.weight = self.lm_head.weight`: one tensor under two names,
        so either one's gradient reaches both."""
        ties = []
        for fn in self.methods.values():
            args = [*fn.args.posonlyargs, *fn.args.args]
            me = args[0].arg if args else "self"
            for node in statements(fn.body):
                if isinstance(node, ast.Assign):
                    value = self.leaves(node.value, me, exact=False)
                    for target in node.targets:
                        held = self.leaves(target, me, exact=False)
                        if value and held and value != held:
                            ties.append((held, value))
        return ties

    def _collect_methods(self, cls: ast.ClassDef, seen: set[str]) -> None:
        seen.add(cls.name)
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.methods.setdefault(stmt.name, stmt)
        for base in cls.bases:  # methods inherited from classes of the same file
            local = self.module.classes.get(base.id) if isinstance(base, ast.Name) else None
            if local is not None and local.name not in seen:
                self._collect_methods(local, seen)

    def result(self) -> ModuleCuts | None:
        if not self.attrs:
            return None
        forward = self.summary("forward")
        crossing: dict[ast.AST, set[str]] = {}
        for tag in forward.returns:
            if tag[0] == "C":
                crossing.setdefault(tag[2], set()).add(tag[1])
        if not crossing or self._computes_own_gradients():
            return None
        live = {t[1] for t in (*forward.returns, *forward.state) if t[0] == "L"}
        for name, _fn in self.methods.items():
            if name.startswith(INFERENCE_PREFIXES) and name != "__call__":
                continue
            other = self.summary(name)
            live.update(t[1] for t in (*other.returns, *other.state) if t[0] == "L")
        for summary in list(self.summaries.values()):
            live.update(t[1] for t in summary.state if t[0] == "L")
        ties = self._ties()
        spread = True
        while spread:  # a tied weight learns if either name of it does
            spread = False
            for held, value in ties:
                if (live & held or live & value) and not (held | value) <= live:
                    live |= held | value
                    spread = True
        frozen = self._frozen()
        involved = {a for names in crossing.values() for a in names}
        attributes = {
            a: TrainableAttribute(a, self.attrs[a], a in live, "*" in frozen or a in frozen)
            for a in sorted(involved)
        }
        source = self.module.source
        cuts = tuple(
            GradientCut(
                span=source.span(site),
                function=self.site_function.get(site, f"{self.cls.name}.forward"),
                kind=self.site_kind.get(site, "cut"),
                construct=snippet(site),
                attributes=tuple(sorted(names)),
            )
            for site, names in sorted(crossing.items(), key=lambda kv: _position(kv[0]))
        )
        return ModuleCuts(self.cls.name, attributes, cuts)

    # -- summaries

    def summary(self, name: str) -> _Summary:
        if name in self.summaries:
            return self.summaries[name]
        fn = self.methods.get(name)
        if fn is None or name in self.in_progress:
            return _Summary()
        self.in_progress.add(name)
        try:
            flow = _FunctionFlow(self, fn, f"{self.cls.name}.{name}", method=True)
            result = flow.run()
        finally:
            self.in_progress.discard(name)
        self.summaries[name] = result
        return result

    def function_summary(self, name: str) -> _Summary:
        key = f"<function>{name}"
        if key in self.summaries:
            return self.summaries[key]
        fn = self.module.functions.get(name)
        if fn is None or key in self.in_progress:
            return _Summary()
        self.in_progress.add(key)
        try:
            result = _FunctionFlow(self, fn, name, method=False).run()
        finally:
            self.in_progress.discard(key)
        self.summaries[key] = result
        return result

    def _computes_own_gradients(self) -> bool:
        """A class that runs backward itself (reversible layers recompute activations
        under no_grad in forward and differentiate them in their own backward pass)."""
        for fn in self.methods.values():
            for node in ast.walk(fn):
                if isinstance(node, ast.Call):
                    dotted = self.module.source.resolve(node.func)
                    if dotted in ("torch.autograd.backward", "torch.autograd.grad"):
                        return True
                    if isinstance(node.func, ast.Attribute) and node.func.attr == "backward":
                        return True
        return False

    def _frozen(self) -> set[str]:
        """Attributes whose gradient the class switches off itself ("*": all of them)."""
        frozen: set[str] = set()
        for fn in self.methods.values():
            for node in ast.walk(fn):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "requires_grad_"
                    and (
                        any(is_false(a) for a in node.args)
                        or any(
                            k.arg == "requires_grad" and is_false(k.value) for k in node.keywords
                        )
                    )
                ):
                    frozen.update(self._roots(node.func.value))
                elif isinstance(node, ast.Assign) and is_false(node.value):
                    for target in node.targets:
                        if isinstance(target, ast.Attribute) and target.attr == "requires_grad":
                            frozen.update(self._roots(target.value))
                elif isinstance(node, ast.For) and _freezes_loop_variable(node):
                    frozen.update(self._roots(node.iter))
        return frozen

    def _roots(self, node: ast.AST) -> set[str]:
        """`self.enc.layer` -> {"enc"}; `self.transformer.wte` -> {"transformer.wte"};
        `self` itself and `self.parameters()` -> {"*"}."""
        out: set[str] = set()
        for path in self_chains(node):
            if not path or path[0] in ("parameters", "named_parameters"):
                out.add("*")
                continue
            leaves = self.layout.resolve(path, exact=False)
            if leaves is None:
                out.add(str(path[0]))
            else:
                out.update(leaves)
        return out


def _freezes_loop_variable(loop: ast.For) -> bool:
    if not isinstance(loop.target, (ast.Name, ast.Tuple)):
        return False
    names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    for node in ast.walk(loop):
        if isinstance(node, ast.Assign) and is_false(node.value):
            for t in node.targets:
                if (
                    isinstance(t, ast.Attribute)
                    and t.attr == "requires_grad"
                    and (isinstance(t.value, ast.Name) and t.value.id in names)
                ):
                    return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "requires_grad_"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in names
            and any(is_false(a) for a in node.args)
        ):
            return True
    return False


def _position(node: ast.AST) -> tuple[int, int]:
    return (getattr(node, "lineno", 0), getattr(node, "col_offset", 0))


def _cut(tags: Iterable[Tag], site: ast.AST | None) -> Tags:
    if site is None:
        return frozenset(tags)
    out = set()
    for tag in tags:
        if tag[0] == "L":
            out.add(("C", tag[1], site))
        elif tag[0] == "P":
            out.add(("Q", tag[1], site))
        else:
            out.add(tag)
    return frozenset(out)


class _FunctionFlow:
    """The tags reaching one function's return value, with its parameters symbolic."""

    def __init__(
        self,
        owner: _ClassFlow,
        fn: ast.FunctionDef | ast.AsyncFunctionDef,
        qualname: str,
        *,
        method: bool,
    ) -> None:
        self.owner = owner
        self.source = owner.module.source
        self.fn = fn
        self.qualname = qualname
        args = fn.args
        positional = [a.arg for a in (*args.posonlyargs, *args.args)]
        is_static = any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list
        )
        self.self_name = positional[0] if method and positional and not is_static else None
        self.params = [p for p in positional if p != self.self_name]
        self.kwonly = [a.arg for a in args.kwonlyargs]
        self.vararg = args.vararg.arg if args.vararg else None
        self.kwarg = args.kwarg.arg if args.kwarg else None
        self.returns: set[Tag] = set()
        self.state: set[Tag] = set()
        self.aliases: dict[str, Path] = {}  # local names that stand for a submodule

    def run(self) -> _Summary:
        env: dict[str, Tags] = {}
        for name in (*self.params, *self.kwonly, self.vararg, self.kwarg):
            if name:
                env[name] = frozenset({("P", name)})
        site = _grad_off_decorator(self.source, self.fn)
        if site is not None:
            self._note(site, "no_grad decorator")
        self.block(self.fn.body, env, site)
        return _Summary(frozenset(self.returns), frozenset(self.state))

    def _note(self, site: ast.AST, kind: str) -> None:
        self.owner.site_function.setdefault(site, self.qualname)
        self.owner.site_kind.setdefault(site, kind)

    # -- statements

    def block(self, body: list[ast.stmt], env: dict[str, Tags], site: ast.AST | None) -> None:
        for stmt in body:
            self.stmt(stmt, env, site)

    def stmt(self, node: ast.stmt, env: dict[str, Tags], site: ast.AST | None) -> None:
        if isinstance(node, ast.Assign):
            tags = self.expr(node.value, env, site)
            for target in node.targets:
                self.bind(target, tags, env)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.bind(node.target, self.expr(node.value, env, site), env)
        elif isinstance(node, ast.AugAssign):
            tags = self.expr(node.value, env, site) | self.expr(node.target, env, site)
            self.bind(node.target, tags, env)
        elif isinstance(node, ast.Return):
            if node.value is not None:
                self.returns.update(self.expr(node.value, env, site))
        elif isinstance(node, ast.Expr):
            self.expression_statement(node.value, env, site)
        elif isinstance(node, ast.If):
            self.branches([node.body, node.orelse], env, site)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self.bind(node.target, self.expr(node.iter, env, site), env)
            self.loop(node.body, env, site)
            self.block(node.orelse, env, site)
        elif isinstance(node, ast.While):
            self.loop(node.body, env, site)
            self.block(node.orelse, env, site)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            inner = site
            for item in node.items:
                inner = self.context(item.context_expr, inner)
                if item.optional_vars is not None:
                    self.bind(item.optional_vars, self.expr(item.context_expr, env, site), env)
            self.block(node.body, env, inner)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            before = dict(env)
            self.block(node.body, env, site)  # type: ignore[attr-defined]
            outcomes = [env]
            for handler in node.handlers:  # type: ignore[attr-defined]
                branch = _merge([before, env])
                self.block(handler.body, branch, site)
                outcomes.append(branch)
            merged = _merge(outcomes)
            env.clear()
            env.update(merged)
            self.block(node.orelse, env, site)  # type: ignore[attr-defined]
            self.block(node.finalbody, env, site)  # type: ignore[attr-defined]
        elif isinstance(node, ast.Match):
            self.branches([case.body for case in node.cases] + [[]], env, site)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            # A nested function sees the enclosing names (self included); calling it
            # yields whatever its body returns.
            nested = _FunctionFlow(self.owner, node, f"{self.qualname}.{node.name}", method=False)
            nested.self_name = self.self_name
            nested_site = _grad_off_decorator(self.source, node) or site
            nested.block(node.body, dict(env), nested_site)
            self.state.update(nested.state)
            env[node.name] = frozenset(nested.returns)
        # Delete, Raise, Assert, Import, Global, Pass, ... carry no values

    def branches(
        self, bodies: list[list[ast.stmt]], env: dict[str, Tags], site: ast.AST | None
    ) -> None:
        outcomes = []
        for body in bodies:
            branch = dict(env)
            self.block(body, branch, site)
            outcomes.append(branch)
        merged = _merge(outcomes)
        env.clear()
        env.update(merged)

    def loop(self, body: list[ast.stmt], env: dict[str, Tags], site: ast.AST | None) -> None:
        for _ in range(2):  # the second pass sees what the first carried around the loop
            branch = dict(env)
            self.block(body, branch, site)
            merged = _merge([env, branch])
            env.clear()
            env.update(merged)

    def context(self, expr: ast.expr, site: ast.AST | None) -> ast.AST | None:
        target = expr.func if isinstance(expr, ast.Call) else expr
        dotted = self.source.resolve(target)
        if dotted in GRAD_OFF:
            if isinstance(expr, ast.Call) and expr.args and is_false(expr.args[0]):
                return site
            self._note(expr, GRAD_OFF[dotted])
            return expr
        if dotted in GRAD_SWITCH and isinstance(expr, ast.Call) and expr.args:
            if is_false(expr.args[0]):
                self._note(expr, "set_grad_enabled(False)")
                return expr
            return site  # decided at run time (often `self.training`): not a known cut
        if dotted in GRAD_ON:
            return None
        return site

    def expression_statement(
        self, value: ast.expr, env: dict[str, Tags], site: ast.AST | None
    ) -> None:
        if isinstance(value, (ast.Yield, ast.YieldFrom)):
            if value.value is not None:
                self.returns.update(self.expr(value.value, env, site))
            return
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute):
            receiver, attr = value.func.value, value.func.attr
            if attr == "detach_" and isinstance(receiver, ast.Name):
                self._note(value, "detach")
                env[receiver.id] = _cut(env.get(receiver.id, EMPTY), value)
                return
            if attr in MUTATORS or (attr.endswith("_") and not attr.startswith("_")):
                tags = frozenset().union(
                    *(self.expr(a, env, site) for a in value.args),
                    *(self.expr(k.value, env, site) for k in value.keywords),
                )
                self.merge_into(receiver, tags, env)
                return
        self.expr(value, env, site)

    def bind(self, target: ast.expr, tags: Tags, env: dict[str, Tags]) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = tags
        elif isinstance(target, (ast.Tuple, ast.List)):
            for elt in target.elts:
                self.bind(elt, tags, env)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, tags, env)
        elif isinstance(target, (ast.Attribute, ast.Subscript)):
            # Storing into a parameter of the module (`self.wpe.weight = nn.Parameter(
            # self.wpe.weight[:n])`) replaces it: its own value is not thereby used.
            own = self.owner.leaves(target, self.self_name, exact=False, aliases=self.aliases)
            if own:
                tags = frozenset(t for t in tags if not (t[0] == "L" and t[1] in own))
            self.merge_into(target.value, tags, env)

    def merge_into(self, target: ast.expr, tags: Tags, env: dict[str, Tags]) -> None:
        """A store into part of a value (`out[k] = v`, `out.append(v)`, `self.cache = v`)."""
        root = target
        while isinstance(root, (ast.Attribute, ast.Subscript)):
            root = root.value
        if isinstance(root, ast.Name):
            if root.id == self.self_name:
                self.state.update(tags)
            else:
                env[root.id] = env.get(root.id, EMPTY) | tags

    # -- expressions

    def expr(self, node: ast.AST | None, env: dict[str, Tags], site: ast.AST | None) -> Tags:
        if node is None or isinstance(node, (ast.Constant, ast.JoinedStr, ast.Compare, ast.Slice)):
            return EMPTY
        if isinstance(node, ast.Name):
            return _cut(env.get(node.id, EMPTY), site)
        if isinstance(node, ast.Attribute):
            return self.attribute(node, env, site)
        if isinstance(node, ast.Call):
            return self.call(node, env, site)
        if isinstance(node, ast.Subscript):
            leaves = self.owner.leaves(node, self.self_name, aliases=self.aliases)
            if leaves is not None:  # self.transformer.h[0], self.heads["q"]
                return _cut({("L", a) for a in leaves}, site)
            return self.expr(node.value, env, site)
        if isinstance(node, ast.IfExp):
            return self.expr(node.body, env, site) | self.expr(node.orelse, env, site)
        if isinstance(node, ast.NamedExpr):
            tags = self.expr(node.value, env, site)
            self.bind(node.target, tags, env)
            return tags
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = dict(env)
            for gen in node.generators:
                self.bind(gen.target, self.expr(gen.iter, inner, site), inner)
            if isinstance(node, ast.DictComp):
                return self.expr(node.value, inner, site)
            return self.expr(node.elt, inner, site)
        if isinstance(node, ast.Lambda):
            return self.expr(node.body, dict(env), site)
        if isinstance(node, ast.Dict):
            return frozenset().union(*(self.expr(v, env, site) for v in node.values))
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            if node.value is not None:
                self.returns.update(self.expr(node.value, env, site))
            return EMPTY
        if isinstance(node, (ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Tuple, ast.List, ast.Set,
                             ast.Starred, ast.Await, ast.FormattedValue)):  # fmt: skip
            return frozenset().union(
                *(self.expr(c, env, site) for c in ast.iter_child_nodes(node)
                  if isinstance(c, ast.expr))
            )  # fmt: skip
        return EMPTY

    def attribute(self, node: ast.Attribute, env: dict[str, Tags], site: ast.AST | None) -> Tags:
        if node.attr in METADATA_ATTRS or node.attr in INTEGER_ATTRS:
            return EMPTY
        if node.attr == "data" and isinstance(node.ctx, ast.Load):
            self._note(node, ".data")
            return self.expr(node.value, env, node)
        leaves = self.owner.leaves(node, self.self_name, aliases=self.aliases)
        if leaves is not None:  # self.proj, self.transformer.ln_f, self.transformer (all of it)
            return _cut({("L", a) for a in leaves}, site)
        if self.self_name is not None and is_self(node.value, self.self_name):
            method = self.owner.methods.get(node.attr)
            if method is not None:  # a property, or a bound method passed along
                summary = self.owner.summary(node.attr)
                return _cut((t for t in summary.returns if t[0] in "LC"), site)
            return EMPTY
        return self.expr(node.value, env, site)

    def call(self, node: ast.Call, env: dict[str, Tags], site: ast.AST | None) -> Tags:
        func = node.func
        if isinstance(func, ast.Attribute):
            attr = func.attr
            if attr in METADATA_METHODS or attr in INTEGER_METHODS or self._integer_cast(node):
                return EMPTY
            if attr in CUT_METHODS:
                self._note(node, CUT_METHODS[attr])
                return self.expr(func.value, env, node)
            if attr == "new_tensor":
                self._note(node, "new_tensor")
                return self._args(node, env, node)
            if (
                self.self_name is not None
                and is_self(func.value, self.self_name)
                and attr in self.owner.callables
                and f"<lambda>{attr}" not in self.owner.in_progress
            ):
                key = f"<lambda>{attr}"
                self.owner.in_progress.add(key)
                try:
                    return self._call_lambda(self.owner.callables[attr], node, env, site)
                finally:
                    self.owner.in_progress.discard(key)
            if (
                self.self_name is not None
                and is_self(func.value, self.self_name)
                and attr in self.owner.methods
                and attr not in self.owner.attrs
            ):
                return self._apply(self.owner.summary(attr), self.owner.methods[attr],
                                   node, env, site, method=True)  # fmt: skip
            if (
                attr in self.owner.methods
                and isinstance(func.value, ast.Call)
                and isinstance(func.value.func, ast.Name)
                and func.value.func.id == "super"
            ):
                return self._apply(self.owner.summary(attr), self.owner.methods[attr],
                                   node, env, site, method=True)  # fmt: skip
        dotted = self.source.resolve(func)
        if dotted and dotted.startswith("torch.") and dotted[6:] in INTEGER_METHODS:
            return EMPTY
        if isinstance(func, ast.Name):
            if func.id in NO_VALUE_FUNCS:
                return EMPTY
            if func.id == "float":
                self._note(node, "float()")
                return self._args(node, env, node)
            if func.id in self.owner.module.functions and func.id not in env:
                fn = self.owner.module.functions[func.id]
                return self._apply(self.owner.function_summary(func.id), fn, node, env, site,
                                   method=False)  # fmt: skip
        if dotted in REBUILDS:
            self._note(node, "tensor rebuild")
            return self._args(node, env, node)
        return self.expr(func, env, site) | self._args(node, env, site)

    def _call_lambda(
        self, fn: _Callable, node: ast.Call, env: dict[str, Tags], site: ast.AST | None
    ) -> Tags:
        """A lambda stored on the module, run where it was written: its parameters take
        the call's arguments, the names it closes over their submodules."""
        flow = _FunctionFlow(self.owner, fn.where, f"{self.owner.cls.name}.{fn.where.name}",
                             method=True)  # fmt: skip
        inner: dict[str, Tags] = {}
        for name, value in fn.aliases.items():
            path = self_path(value, fn.self_name)
            if path is not None:
                flow.aliases[name] = path
            inner[name] = flow.expr(value, {}, None)
        params = [a.arg for a in (*fn.body.args.posonlyargs, *fn.body.args.args)]
        for name, arg in zip(params, node.args, strict=False):
            inner[name] = self.expr(arg, env, site)
        for keyword in node.keywords:
            if keyword.arg in params:
                inner[keyword.arg] = self.expr(keyword.value, env, site)
        return _cut(flow.expr(fn.body.body, inner, None), site)

    def _integer_cast(self, node: ast.Call) -> bool:
        """`x.to(torch.long)`, `x.to(dtype=torch.int32)`, `x.type(torch.bool)`."""
        assert isinstance(node.func, ast.Attribute)
        if node.func.attr not in ("to", "type"):
            return False
        for arg in [*node.args, *(k.value for k in node.keywords if k.arg == "dtype")]:
            dotted = self.source.resolve(arg) or ""
            if dotted.startswith("torch.") and dotted[6:] in INTEGER_DTYPES:
                return True
        return False

    def _args(self, node: ast.Call, env: dict[str, Tags], site: ast.AST | None) -> Tags:
        return frozenset().union(
            *(self.expr(a, env, site) for a in node.args),
            *(self.expr(k.value, env, site) for k in node.keywords),
        )

    def _apply(
        self,
        summary: _Summary,
        fn: ast.FunctionDef | ast.AsyncFunctionDef,
        node: ast.Call,
        env: dict[str, Tags],
        site: ast.AST | None,
        *,
        method: bool,
    ) -> Tags:
        """The tags of a call to a summarised function: its own, plus each argument's
        tags wherever the summary mentions the matching parameter."""
        args = fn.args
        positional = [a.arg for a in (*args.posonlyargs, *args.args)]
        is_static = any(
            isinstance(d, ast.Name) and d.id == "staticmethod" for d in fn.decorator_list
        )
        if method and not is_static and positional:
            positional = positional[1:]
        given: dict[str, Tags] = {}
        spread = EMPTY  # *args / **kwargs at the call: could be any parameter
        for k, arg in enumerate(node.args):
            tags = self.expr(arg, env, site)
            if isinstance(arg, ast.Starred):
                spread |= tags
            elif k < len(positional):
                given[positional[k]] = given.get(positional[k], EMPTY) | tags
            elif args.vararg is not None:
                given[args.vararg.arg] = given.get(args.vararg.arg, EMPTY) | tags
        for keyword in node.keywords:
            tags = self.expr(keyword.value, env, site)
            if keyword.arg is None:
                spread |= tags
            elif keyword.arg in positional or keyword.arg in [a.arg for a in args.kwonlyargs]:
                given[keyword.arg] = given.get(keyword.arg, EMPTY) | tags
            elif args.kwarg is not None:
                given[args.kwarg.arg] = given.get(args.kwarg.arg, EMPTY) | tags
        out: set[Tag] = set()
        for tag in summary.returns:
            if tag[0] in "LC":
                out.add(tag)
            elif tag[0] == "P":
                out.update(given.get(tag[1], EMPTY) | spread)
            else:  # "Q": the parameter's value was cut inside the callee
                out.update(_cut(given.get(tag[1], EMPTY) | spread, tag[2]))
        return _cut(out, site)


def _merge(envs: list[dict[str, Tags]]) -> dict[str, Tags]:
    merged: dict[str, Tags] = {}
    for env in envs:
        for name, tags in env.items():
            merged[name] = merged.get(name, EMPTY) | tags
    return merged
