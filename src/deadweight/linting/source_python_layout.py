"""What trainable state the classes of one Python file create, by attribute path.

A class's *layout* names each parameter and trainable submodule it builds in its
methods (`self.w = nn.Parameter(...)`, `self.proj = nn.Linear(...)`, an instance of
a trainable class of the same file), and opens the containers whose members are
written out where they are built:

    self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(...), h=nn.ModuleList([...])))
    self.mlp = nn.Sequential(nn.Linear(...), nn.GELU(), nn.Linear(...))

gives the leaves `transformer.wte`, `transformer.h`, `mlp.0` and `mlp.2` (the names
torch gives those submodules) and the containers `transformer` and `mlp` with the keys
they were built with (`mlp.1`, a GELU, is a known key that holds nothing trainable).
A container built from a comprehension or `*args`, or changed after it is built
(`append`, `update`, `self.blocks[k] = ...`), stays one leaf: its members are not
known. `resolve` maps an access (`self.transformer.ln_f`, `self.transformer.h[i]`,
`self.mlp[0]`) to the leaves it reaches. Data and lookups only: no data flow here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field

from deadweight.linting.python_facts import Source

# nn modules without parameters: cutting them loses nothing.
PARAMETER_FREE = frozenset({
    "Identity", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
    "FeatureAlphaDropout", "ReLU", "ReLU6", "GELU", "SiLU", "Mish", "Tanh", "Sigmoid",
    "Hardtanh", "Hardswish", "Hardsigmoid", "LeakyReLU", "ELU", "SELU", "CELU", "GLU",
    "Softplus", "Softsign", "Softmax", "Softmax2d", "LogSoftmax", "Softmin", "Tanhshrink",
    "Threshold", "LogSigmoid", "Softshrink", "Hardshrink", "Flatten", "Unflatten",
    "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
    "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "LPPool1d", "LPPool2d", "Upsample",
    "UpsamplingNearest2d", "UpsamplingBilinear2d", "PixelShuffle", "PixelUnshuffle",
    "ChannelShuffle", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d",
    "ConstantPad2d", "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d",
    "ReflectionPad3d", "ReplicationPad1d", "ReplicationPad2d", "ReplicationPad3d",
    "CircularPad1d", "CircularPad2d", "CircularPad3d", "Fold", "Unfold",
    "CosineSimilarity", "PairwiseDistance", "Module", "Buffer",
})  # fmt: skip
CONTAINERS = frozenset({"ModuleList", "ModuleDict", "Sequential", "ParameterList", "ParameterDict"})
PARAMETER_CONSTRUCTORS = {"torch.nn.Parameter", "torch.nn.parameter.Parameter", "Parameter"}
# Plain mappings a ModuleDict (or a Sequential) is built from.
MAPPINGS = {"dict", "collections.OrderedDict", "OrderedDict", "typing.OrderedDict"}
# Calls on a container that add or replace members after it is built.
CONTAINER_EDITS = frozenset({"append", "extend", "insert", "update", "add_module",
                             "register_module", "register_parameter", "__setitem__",
                             "setdefault", "pop", "popitem", "clear", "__delitem__"})  # fmt: skip

Path = tuple[str | None, ...]  # attribute names and container keys; None: decided at run time


@dataclass
class Layout:
    """A class's trainable state: leaf path -> constructor ("nn.Linear", "Block",
    "nn.ModuleList of Block"), and container path -> the keys it was built with."""

    attrs: dict[str, str] = field(default_factory=dict)
    containers: dict[str, frozenset[str]] = field(default_factory=dict)
    _built: dict[str, str] = field(default_factory=dict)  # container path -> its constructor

    def resolve(self, path: Path, *, exact: bool = True) -> frozenset[str] | None:
        """The leaves an access reaches: `("transformer", "ln_f")` -> {"transformer.ln_f"};
        a whole container, or one indexed by a key known only at run time, reaches every
        leaf in it; a known key built without parameters (a Dropout) reaches none. None
        when the path does not start at a trainable attribute, or (with `exact`) goes on
        past a leaf (`self.w.shape`: the caller looks at what follows)."""
        if not path or path[0] is None:
            return None
        prefix, i = path[0], 1
        while True:
            if prefix in self.attrs:
                return frozenset({prefix}) if i == len(path) or not exact else None
            keys = self.containers.get(prefix)
            if keys is None:
                return None if i == 1 else frozenset()
            if i == len(path) or path[i] is None or path[i] not in keys:
                rest_known = i == len(path) or (i + 1 == len(path) and path[i] is None)
                return self.leaves_under(prefix) if rest_known or not exact else None
            prefix, i = f"{prefix}.{path[i]}", i + 1

    def leaves_under(self, prefix: str) -> frozenset[str]:
        start = prefix + "."
        return frozenset(a for a in self.attrs if a == prefix or a.startswith(start))

    def top_level(self) -> set[str]:
        return {a.split(".", 1)[0] for a in (*self.attrs, *self.containers)}

    # -- building

    def place(self, name: str, ctor: str, members: list[tuple[str, ast.AST]] | None,
              layouts: Layouts) -> None:  # fmt: skip
        """Record `self.<name> = <value>`; a second assignment of a name keeps one leaf."""
        if name in self.top_level():
            previous = self.attrs.get(name) or self._built.get(name)
            self.collapse(name)
            self.attrs[name] = previous or ctor
            return
        self._expand(name, ctor, members, layouts)

    def _expand(self, name: str, ctor: str, members: list[tuple[str, ast.AST]] | None,
                layouts: Layouts) -> None:  # fmt: skip
        if members is None:
            self.attrs[name] = ctor
            return
        self.containers[name] = frozenset(key for key, _ in members)
        self._built[name] = ctor
        for key, value in members:
            inner = layouts.constructor(value)
            if inner is not None:
                self._expand(f"{name}.{key}", inner, layouts.members(value), layouts)
        if not self.leaves_under(name):  # nothing trainable after all: keep it whole
            self.collapse(name)
            self.attrs[name] = ctor

    def collapse(self, name: str) -> None:
        """Forget the members of `name` (its keys are no longer known): one leaf."""
        if name not in self.containers:
            return
        ctor = self._built.get(name)
        start = name + "."
        for table in (self.attrs, self.containers, self._built):
            for key in [k for k in table if k == name or k.startswith(start)]:
                del table[key]
        if ctor is not None:
            self.attrs[name] = ctor


class Layouts:
    """The layouts of one file's classes, computed once each."""

    def __init__(self, source: Source, classes: dict[str, ast.ClassDef]) -> None:
        self.source = source
        self.classes = classes
        self._layouts: dict[str, Layout] = {}
        self._trainable: dict[str, bool] = {}

    def layout(self, cls: ast.ClassDef) -> Layout:
        if cls.name in self._layouts:
            return self._layouts[cls.name]
        self._layouts[cls.name] = Layout()  # recursion guard
        layout = Layout()
        for fn in cls.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for stmt in statements(fn.body):
                    self._record(stmt, layout)
        for base in cls.bases:
            dotted = self.source.resolve(base) or ""
            if dotted.startswith("torch.nn.") and self._nn_trainable(dotted):
                short = dotted.replace("torch.nn.", "nn.")
                for name in ("weight", "bias"):
                    layout.attrs.setdefault(name, short)
            local = self.classes.get(base.id) if isinstance(base, ast.Name) else None
            if local is not None and local is not cls:
                inherited = self.layout(local)
                mine = layout.top_level()
                for name, ctor in inherited.attrs.items():
                    if name.split(".", 1)[0] not in mine:
                        layout.attrs[name] = ctor
                for name, keys in inherited.containers.items():
                    if name.split(".", 1)[0] not in mine:
                        layout.containers[name] = keys
                        layout._built[name] = inherited._built.get(name, "")
        self._layouts[cls.name] = layout
        return layout

    def _record(self, stmt: ast.stmt, layout: Layout) -> None:
        node: ast.AST = stmt.value if isinstance(stmt, ast.Expr) else stmt
        targets: list[ast.expr] = []
        value: ast.AST | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver, attr = node.func.value, node.func.attr
            if (
                is_self(receiver)
                and attr in ("register_parameter", "add_module", "register_module")
                and len(node.args) == 2
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                ctor = self.constructor(node.args[1])
                if ctor:
                    layout.place(node.args[0].value, ctor, self.members(node.args[1]), self)
                return
            edited = self_path(receiver)
            if attr in CONTAINER_EDITS and edited:
                self._edit(layout, edited)
            if (
                attr in ("append", "extend")
                and isinstance(receiver, ast.Attribute)
                and is_self(receiver.value)
                and node.args
            ):
                ctor = self.constructor(node.args[0])
                if ctor:
                    layout.attrs.setdefault(receiver.attr, ctor)
            return
        if value is None:
            return
        for target in targets:
            if isinstance(target, ast.Attribute) and is_self(target.value):
                ctor = self.constructor(value)
                if ctor:
                    layout.place(target.attr, ctor, self.members(value), self)
            elif isinstance(target, (ast.Attribute, ast.Subscript)):
                edited = self_path(target.value)  # self.blocks["k"] = ..., self.heads.k = ...
                if edited:
                    self._edit(layout, edited)

    @staticmethod
    def _edit(layout: Layout, path: Path) -> None:
        """A container changed after it was built: its members are no longer known."""
        parts: list[str] = []
        for part in path:
            if part is None:
                break
            parts.append(part)
            name = ".".join(parts)
            if name in layout.containers and len(parts) == len(path):
                layout.collapse(name)
                return

    def members(self, value: ast.AST) -> list[tuple[str, ast.AST]] | None:
        """The (key, value) pairs a container call spells out, or None when they are not
        all written there (a comprehension, `*layers`, a variable, `**extra`)."""
        if not isinstance(value, ast.Call):
            return None
        dotted = self.source.resolve(value.func) or ""
        if not dotted.startswith("torch.nn.") or dotted[len("torch.nn.") :] not in CONTAINERS:
            return None
        name = dotted[len("torch.nn.") :]
        args = list(value.args)
        if value.keywords:
            if args or len(value.keywords) != 1 or value.keywords[0].arg not in (
                "modules", "parameters", "values"
            ):  # fmt: skip
                return None
            args = [value.keywords[0].value]
        if name in ("ModuleDict", "ParameterDict"):
            return self._mapping(args[0]) if len(args) == 1 else None
        if name in ("ModuleList", "ParameterList"):
            if len(args) != 1 or not isinstance(args[0], (ast.List, ast.Tuple)):
                return None
            args = list(args[0].elts)
        elif len(args) == 1 and self._mapping(args[0]) is not None:  # Sequential(OrderedDict)
            return self._mapping(args[0])
        if any(isinstance(a, ast.Starred) for a in args):
            return None
        return [(str(i), a) for i, a in enumerate(args)]

    def _mapping(self, node: ast.AST) -> list[tuple[str, ast.AST]] | None:
        if isinstance(node, ast.Dict):
            keys = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
            if all(isinstance(k, str) for k in keys):
                return [(str(k), v) for k, v in zip(keys, node.values, strict=True)]
            return None
        if not isinstance(node, ast.Call) or self.source.resolve(node.func) not in MAPPINGS:
            return None
        items: list[tuple[str, ast.AST]] = []
        if len(node.args) > 1:
            return None
        if node.args:
            pairs = node.args[0]
            if not isinstance(pairs, (ast.List, ast.Tuple)):
                return None
            for pair in pairs.elts:
                if not (
                    isinstance(pair, ast.Tuple)
                    and len(pair.elts) == 2
                    and isinstance(pair.elts[0], ast.Constant)
                    and isinstance(pair.elts[0].value, str)
                ):
                    return None
                items.append((pair.elts[0].value, pair.elts[1]))
        for keyword in node.keywords:
            if keyword.arg is None:  # **extra
                return None
            items.append((keyword.arg, keyword.value))
        return items

    def constructor(self, value: ast.AST) -> str | None:
        """How `value` builds trainable state (e.g. "nn.Linear"), or None."""
        if isinstance(value, ast.IfExp):
            return self.constructor(value.body) or self.constructor(value.orelse)
        if isinstance(value, ast.Starred):
            return self.constructor(value.value)
        if isinstance(value, (ast.List, ast.Tuple)):
            return next((c for c in map(self.constructor, value.elts) if c), None)
        if isinstance(value, (ast.ListComp, ast.GeneratorExp)):
            return self.constructor(value.elt)
        if isinstance(value, ast.DictComp):
            return self.constructor(value.value)
        if isinstance(value, ast.Dict):
            return next((c for c in map(self.constructor, value.values) if c), None)
        if not isinstance(value, ast.Call):
            return None
        dotted = self.source.resolve(value.func) or ""
        if dotted in MAPPINGS:  # dict(wte=nn.Embedding(...), ...) inside a ModuleDict
            parts = [*value.args, *(k.value for k in value.keywords)]
            return next((c for c in map(self.constructor, parts) if c), None)
        if dotted in PARAMETER_CONSTRUCTORS or dotted.endswith("nn.Parameter"):
            if any(k.arg == "requires_grad" and is_false(k.value) for k in value.keywords):
                return None
            return "nn.Parameter"
        if dotted.startswith("torch.nn.utils."):
            return next((c for c in map(self.constructor, value.args) if c), None)
        if dotted.startswith("torch.nn.") and "." not in dotted[len("torch.nn.") :]:
            name = dotted[len("torch.nn.") :]
            if name in CONTAINERS:
                parts = [*value.args, *(k.value for k in value.keywords)]
                inner = next((c for c in map(self.constructor, parts) if c), None)
                return f"nn.{name} of {inner}" if inner else None
            if not self._nn_trainable(dotted):
                return None
            if any(
                k.arg in ("elementwise_affine", "affine") and is_false(k.value)
                for k in value.keywords
            ):
                return None
            return f"nn.{name}"
        if isinstance(value.func, ast.Name) and value.func.id in self.classes:
            cls = self.classes[value.func.id]
            if self.class_trainable(cls):
                return cls.name
        return None

    def _nn_trainable(self, dotted: str) -> bool:
        name = dotted.rsplit(".", 1)[-1]
        return not (name in PARAMETER_FREE or name.endswith("Loss") or name in CONTAINERS)

    def class_trainable(self, cls: ast.ClassDef) -> bool:
        if cls.name not in self._trainable:
            self._trainable[cls.name] = False  # recursion guard
            self._trainable[cls.name] = bool(self.layout(cls).attrs)
        return self._trainable[cls.name]


def self_path(
    node: ast.AST, self_name: str = "self", aliases: dict[str, Path] | None = None
) -> Path | None:
    """`self.transformer.h[0]` -> ("transformer", "h", "0"); `self.h[i]` -> ("h", None);
    None unless the chain of attributes and subscripts starts with `self.<name>`, or
    with a name in `aliases` (`m.c_fc` after `m = self.mlp` -> ("mlp", "c_fc"))."""
    parts: list[str | None] = []
    last_attribute = False
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            last_attribute = True
            node = node.value
        elif isinstance(node, ast.Subscript):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
            known = isinstance(key, (int, str)) and not isinstance(key, bool)
            parts.append(str(key) if known else None)
            last_attribute = False
            node = node.value
        elif isinstance(node, ast.Name) and node.id == self_name and parts and last_attribute:
            return tuple(reversed(parts))
        elif isinstance(node, ast.Name) and aliases and node.id in aliases and parts:
            return aliases[node.id] + tuple(reversed(parts))
        else:
            return None


def self_chains(node: ast.AST, self_name: str = "self") -> Iterator[Path]:
    """The outermost `self.<...>` chains in an expression (and `()` for `self` itself)."""
    stack = [node]
    while stack:
        current = stack.pop()
        path = self_path(current, self_name)
        if path is not None:
            yield path
        elif isinstance(current, ast.Name) and current.id == self_name:
            yield ()
        else:
            stack.extend(ast.iter_child_nodes(current))


def statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement in a body, nested ones included, but not inside nested functions."""
    stack = list(reversed(body))
    while stack:
        stmt = stack.pop()
        yield stmt
        for field_name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, field_name, None)
            if inner and not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef,
                                               ast.ClassDef, ast.Lambda)):  # fmt: skip
                stack.extend(reversed(inner))
        for handler in getattr(stmt, "handlers", []):
            stack.extend(reversed(handler.body))
        for case in getattr(stmt, "cases", []):
            stack.extend(reversed(case.body))


def is_self(node: ast.AST, name: str = "self") -> bool:
    return isinstance(node, ast.Name) and node.id == name


def is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is False
