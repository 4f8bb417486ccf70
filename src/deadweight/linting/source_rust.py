"""Facts about one Rust source file: calls of candle kernels that record no backward.

Parsed with tree-sitter (the `rust` extra: `pip install "deadweight[rust]"`).
`probe_rust(data, path)` returns `RustSourceFacts` listing, with their positions:

- calls of candle_nn's fused functions that build their result with
  `apply_op*_no_bwd` (`ops::softmax_last_dim`, `ops::rms_norm`, `ops::layer_norm`,
  `ops::sdpa`, `rotary_emb::rope` / `rope_i` / `rope_thd`), however they were
  imported (`use candle_nn::ops;`, `use candle_nn::ops::rms_norm as rn;`, globs,
  `use candle_nn as nn;`) or fully qualified;
- `forward` of a candle_nn `RmsNorm` or `LayerNorm` through the `Module` trait
  (`norm.forward(&x)`, `x.apply(&self.norm)`, `Module::forward(&norm, &x)`), where
  the receiver's type is known from a parameter, a `let` (its annotation, or
  `candle_nn::rms_norm(...)`, `RmsNorm::new(...)`, `candle_nn::layer_norm(...)`,
  `LayerNorm::new(...)`) or a field of the struct whose `impl` holds the call;
- any `.apply_op1_no_bwd` / `apply_op2_no_bwd` / `apply_op3_no_bwd`.

A type or function of the file's own with the same name (a local `struct RmsNorm`)
is not candle's. Names it cannot resolve are left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from deadweight.linting import suppressions
from deadweight.linting.rust_facts import FusedCall, RustSourceFacts
from deadweight.linting.source_files import Span, character_column
from deadweight.linting.suppressions import Suppressions

EXTRA = "rust"
INSTALL_HINT = f'pip install "deadweight[{EXTRA}]" (tree-sitter and tree-sitter-rust)'

CANDLE = "candle_nn"

# candle_nn function -> (short name, the differentiable replacement). Each of these
# ends in `apply_op*_no_bwd` in candle-nn 0.11: the result records no backward op.
FUSED_FUNCTIONS = {
    "candle_nn::ops::softmax_last_dim": (
        "ops::softmax_last_dim", "candle_nn::ops::softmax(&xs, D::Minus1)"),
    "candle_nn::ops::rms_norm": (
        "ops::rms_norm", "candle_nn::ops::rms_norm_slow(&xs, &alpha, eps)"),
    "candle_nn::ops::layer_norm": (
        "ops::layer_norm", "candle_nn::ops::layer_norm_slow(&xs, &alpha, &beta, eps)"),
    "candle_nn::ops::sdpa": (
        "ops::sdpa",
        "attention written out: (q.matmul(&k.t()?)? * scale)?, candle_nn::ops::softmax over "
        "D::Minus1, then .matmul(&v)"),
    "candle_nn::rotary_emb::rope": ("rotary_emb::rope", "candle_nn::rotary_emb::rope_slow"),
    "candle_nn::rotary_emb::rope_i": ("rotary_emb::rope_i", "candle_nn::rotary_emb::rope_i_slow"),
    "candle_nn::rotary_emb::rope_thd": (
        "rotary_emb::rope_thd",
        "candle_nn::rotary_emb::rope_slow on xs.transpose(1, 2)? (rope_thd has no slow "
        "variant), transposed back"),
}  # fmt: skip
MODULE_REPLACEMENTS = {
    "RmsNorm": "norm.forward_diff(&xs) (RmsNorm's differentiable path)",
    "LayerNorm": (
        "candle_nn::ops::layer_norm_slow(&xs, ln.weight(), bias, eps) (LayerNorm has no "
        "forward_diff)"
    ),
}
# candle_nn constructors and what they return
CONSTRUCTORS = {
    "candle_nn::rms_norm": "RmsNorm",
    "candle_nn::layer_norm::rms_norm": "RmsNorm",
    "candle_nn::RmsNorm::new": "RmsNorm",
    "candle_nn::layer_norm::RmsNorm::new": "RmsNorm",
    "candle_nn::layer_norm": "LayerNorm",
    "candle_nn::layer_norm::layer_norm": "LayerNorm",
    "candle_nn::LayerNorm::new": "LayerNorm",
    "candle_nn::layer_norm::LayerNorm::new": "LayerNorm",
}
NO_BWD_METHODS = ("apply_op1_no_bwd", "apply_op2_no_bwd", "apply_op3_no_bwd")
_WORDS = ("softmax_last_dim", "rms_norm", "layer_norm", "rope", "sdpa", "_no_bwd", "RmsNorm",
          "LayerNorm")  # fmt: skip


class MissingParser(ImportError):
    """tree-sitter or its Rust grammar is not installed."""


_PARSER: Any = None


def parser() -> Any:
    global _PARSER
    if _PARSER is None:
        try:
            import tree_sitter
            import tree_sitter_rust
        except ImportError as exc:
            raise MissingParser(f"linting Rust needs the '{EXTRA}' extra: {INSTALL_HINT}") from exc
        _PARSER = tree_sitter.Parser(tree_sitter.Language(tree_sitter_rust.language()))
    return _PARSER


def probe_rust(data: bytes, path: str) -> RustSourceFacts:
    """Facts of one file (UTF-8 bytes). Raises MissingParser without the extra."""
    tree = parser().parse(data)
    text = data.decode("utf-8")
    file = _File(text, tree.root_node)
    calls: list[FusedCall] = []
    if any(word in text for word in _WORDS):
        calls = list(file.fused_calls())
    errors = tuple(file.errors()) if tree.root_node.has_error else ()
    return RustSourceFacts(path, tuple(calls), errors, file.suppressions())


class _File:
    def __init__(self, text: str, root: Any) -> None:
        self.text = text
        self.root = root
        self._lines = text.splitlines()
        self.uses: dict[str, str] = {}
        self.globs: list[str] = []
        self.local_types: set[str] = set()
        self.structs: dict[str, dict[str, str]] = {}  # struct -> field -> type text
        for node in root.children:
            self._top_level(node)

    # -- names

    def _top_level(self, node: Any) -> None:
        kind = node.type
        if kind == "use_declaration":
            argument = node.child_by_field_name("argument")
            if argument is not None:
                self._use(argument, [])
        elif kind in ("struct_item", "enum_item", "type_item", "union_item", "trait_item"):
            name = node.child_by_field_name("name")
            if name is not None:
                self.local_types.add(_text(name))
            if kind == "struct_item" and name is not None:
                self.structs[_text(name)] = self._fields(node)
        elif kind == "mod_item":
            body = node.child_by_field_name("body")
            if body is not None:
                for child in body.children:
                    self._top_level(child)

    def _fields(self, struct: Any) -> dict[str, str]:
        fields: dict[str, str] = {}
        body = struct.child_by_field_name("body")
        if body is None:
            return fields
        if body.type == "field_declaration_list":
            for decl in body.children:
                if decl.type == "field_declaration":
                    name, kind = decl.child_by_field_name("name"), decl.child_by_field_name("type")
                    if name is not None and kind is not None:
                        fields[_text(name)] = _text(kind)
        elif body.type == "ordered_field_declaration_list":
            index = 0
            for decl in body.children:
                if decl.is_named and decl.type not in ("attribute_item", "visibility_modifier"):
                    fields[str(index)] = _text(decl)
                    index += 1
        return fields

    def _use(self, node: Any, prefix: list[str]) -> None:
        kind = node.type
        if kind in ("identifier", "crate", "super", "self", "scoped_identifier", "metavariable"):
            parts = prefix + _path_parts(_text(node))
            if parts and parts[-1] == "self":
                parts = parts[:-1]
            if parts:
                self.uses[parts[-1]] = "::".join(parts)
        elif kind == "use_as_clause":
            path, alias = node.child_by_field_name("path"), node.child_by_field_name("alias")
            if path is not None and alias is not None:
                self.uses[_text(alias)] = "::".join(prefix + _path_parts(_text(path)))
        elif kind == "scoped_use_list":
            path = node.child_by_field_name("path")
            inner = prefix + (_path_parts(_text(path)) if path is not None else [])
            listing = node.child_by_field_name("list")
            if listing is not None:
                self._use(listing, inner)
        elif kind == "use_list":
            for child in node.named_children:
                self._use(child, prefix)
        elif kind == "use_wildcard":
            parts = prefix + _path_parts(_text(node).removesuffix("*").rstrip(":"))
            self.globs.append("::".join(p for p in parts if p))

    def resolve(self, path_text: str) -> str:
        """A path with its first segment expanded through the file's `use` declarations."""
        parts = _path_parts(path_text)
        if not parts:
            return path_text
        head = parts[0]
        if head in self.uses:
            return "::".join([self.uses[head], *parts[1:]])
        if head == CANDLE or head in ("crate", "self", "super", "std", "candle", "core"):
            return "::".join(parts)
        for glob in self.globs:
            if glob.startswith(CANDLE) and head not in self.local_types:
                candidate = "::".join([glob, *parts])
                if candidate in FUSED_FUNCTIONS or candidate in CONSTRUCTORS:
                    return candidate
                if len(parts) == 1 and head in MODULE_REPLACEMENTS:
                    return f"{CANDLE}::{head}"
        return "::".join(parts)

    def candle_type(self, type_text: str) -> str | None:
        """ "RmsNorm" / "LayerNorm" when the type is candle_nn's, else None."""
        text = type_text.replace(" ", "").lstrip("&").removeprefix("mut")
        name = text.split("<")[0]
        if "::" not in name and name in self.local_types:
            return None
        full = self.resolve(name)
        last = full.rsplit("::", 1)[-1]
        if last in MODULE_REPLACEMENTS and full.startswith(CANDLE):
            return last
        return None

    # -- the calls

    def fused_calls(self) -> Iterator[FusedCall]:
        for call in _descendants(self.root, "call_expression"):
            function = call.child_by_field_name("function")
            if function is None:
                continue
            if function.type in ("scoped_identifier", "identifier"):
                yield from self._path_call(call, function)
            elif function.type == "field_expression":
                yield from self._method_call(call, function)
            elif function.type == "generic_function":
                inner = function.child_by_field_name("function")
                if inner is not None and inner.type in ("scoped_identifier", "identifier"):
                    yield from self._path_call(call, inner)

    def _path_call(self, call: Any, function: Any) -> Iterator[FusedCall]:
        full = self.resolve(_text(function))
        if full in FUSED_FUNCTIONS:
            short, replacement = FUSED_FUNCTIONS[full]
            yield FusedCall(self.span(function, call), _owner(call), short, replacement)
            return
        parts = full.split("::")
        if parts[-1] == "forward" and len(parts) >= 2:
            # RmsNorm::forward(&norm, &x) / Module::forward(&norm, &x)
            kind = self.candle_type("::".join(parts[:-1]))
            args = _arguments(call)
            if kind is None and parts[-2] == "Module" and args:
                kind = self.expression_type(args[0], call)
            if kind is not None:
                receiver = _text(args[0]) if args else None
                yield FusedCall(self.span(function, call), _owner(call), f"{kind}::forward",
                                MODULE_REPLACEMENTS[kind], receiver)  # fmt: skip

    def _method_call(self, call: Any, function: Any) -> Iterator[FusedCall]:
        name_node = function.child_by_field_name("field")
        receiver = function.child_by_field_name("value")
        if name_node is None or receiver is None:
            return
        method = _text(name_node)
        if method in NO_BWD_METHODS:
            yield FusedCall(
                self.span(name_node, call), _owner(call), method,
                f"{method.removesuffix('_no_bwd')} with a CustomOp that implements bwd",
            )  # fmt: skip
        elif method == "forward":
            kind = self.expression_type(receiver, call)
            if kind is not None:
                yield FusedCall(self.span(name_node, call), _owner(call), f"{kind}::forward",
                                MODULE_REPLACEMENTS[kind], _text(receiver))  # fmt: skip
        elif method == "apply":
            args = _arguments(call)
            kind = self.expression_type(args[0], call) if args else None
            if kind is not None:
                yield FusedCall(self.span(name_node, call), _owner(call), f"{kind}::forward",
                                MODULE_REPLACEMENTS[kind], _text(args[0]))  # fmt: skip

    # -- types of receivers

    def expression_type(self, expr: Any, at: Any) -> str | None:
        expr = _strip(expr)
        if expr.type == "identifier":
            return self._binding_type(_text(expr), at)
        if expr.type == "field_expression":
            value, field_node = expr.child_by_field_name("value"), expr.child_by_field_name("field")
            if value is not None and field_node is not None and _text(value) == "self":
                owner = _impl_type(at)
                fields = self.structs.get(owner or "", {})
                type_text = fields.get(_text(field_node))
                if type_text is not None:
                    return self.candle_type(type_text)
        if expr.type == "call_expression":
            return self._constructed_type(expr)
        return None

    def _constructed_type(self, expr: Any) -> str | None:
        expr = _strip(expr)
        if expr.type != "call_expression":
            return None
        function = expr.child_by_field_name("function")
        if function is None:
            return None
        if function.type == "field_expression":  # x.unwrap(), x.expect("..")
            inner = function.child_by_field_name("value")
            field_node = function.child_by_field_name("field")
            if field_node is not None and _text(field_node) in ("unwrap", "expect") and inner:
                return self._constructed_type(inner)
            return None
        full = self.resolve(_text(function))
        if full in CONSTRUCTORS:
            return CONSTRUCTORS[full]
        parts = full.split("::")
        if len(parts) >= 2 and parts[-1] == "new":
            kind = self.candle_type("::".join(parts[:-1]))
            return kind
        return None

    def _binding_type(self, name: str, at: Any) -> str | None:
        function = _enclosing(at, ("function_item", "closure_expression"))
        while function is not None:
            found: str | None = None
            best = -1
            for node in _descendants(function, "let_declaration"):
                if node.start_byte >= at.start_byte:
                    continue
                pattern = node.child_by_field_name("pattern")
                if pattern is None or _text(pattern).removeprefix("mut ").strip() != name:
                    continue
                if node.start_byte > best:
                    best = node.start_byte
                    annotation = node.child_by_field_name("type")
                    value = node.child_by_field_name("value")
                    if annotation is not None:
                        found = self.candle_type(_text(annotation))
                    elif value is not None:
                        found = self._constructed_type(value)
                    else:
                        found = None
            if best >= 0:
                return found
            params = function.child_by_field_name("parameters")
            if params is not None:
                for param in params.named_children:
                    pattern, annotation = (param.child_by_field_name("pattern"),
                                           param.child_by_field_name("type"))  # fmt: skip
                    if (
                        pattern is not None
                        and annotation is not None
                        and _text(pattern).removeprefix("mut ").strip() == name
                    ):
                        return self.candle_type(_text(annotation))
            function = _enclosing(function, ("function_item", "closure_expression"))
        return None

    # -- positions, comments, errors

    def span(self, start: Any, end: Any) -> Span:
        (line, col), (end_line, end_col) = start.start_point, end.end_point
        return Span(
            line + 1,
            character_column(self._line(line), col),
            end_line + 1,
            character_column(self._line(end_line), end_col),
        )

    def _line(self, row: int) -> str:
        return self._lines[row] if 0 <= row < len(self._lines) else ""

    def suppressions(self) -> Suppressions:
        table: Suppressions = {}
        if suppressions.MARKER not in self.text:
            return table
        for kind in ("line_comment", "block_comment"):
            for node in _descendants(self.root, kind):
                comment = _text(node)
                if suppressions.MARKER in comment:
                    suppressions.add(table, node.start_point[0] + 1, comment)
        return table

    def errors(self) -> Iterator[Span]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.has_error:
                continue
            if node.type == "ERROR" or node.is_missing:
                yield self.span(node, node)
                continue
            stack.extend(reversed(node.children))


def _text(node: Any) -> str:
    return node.text.decode("utf-8", "replace")


def _path_parts(text: str) -> list[str]:
    return [p.strip() for p in text.replace(" ", "").split("::") if p.strip()]


def _descendants(node: Any, kind: str) -> Iterator[Any]:
    cursor = node.walk()
    reached_root = False
    while not reached_root:
        if cursor.node.type == kind:
            yield cursor.node
        if cursor.goto_first_child():
            continue
        if cursor.goto_next_sibling():
            continue
        while True:
            if not cursor.goto_parent() or cursor.node == node:
                reached_root = True
                break
            if cursor.goto_next_sibling():
                break


def _strip(expr: Any) -> Any:
    """`&x`, `(x)`, `x?` -> `x`."""
    while expr.type in ("reference_expression", "parenthesized_expression", "try_expression"):
        inner = expr.child_by_field_name("value") or (
            expr.named_children[0] if expr.named_children else None
        )
        if inner is None:
            break
        expr = inner
    return expr


def _arguments(call: Any) -> list[Any]:
    args = call.child_by_field_name("arguments")
    return (
        [a for a in args.named_children if a.type not in ("line_comment", "block_comment")]
        if args
        else []
    )


def _enclosing(node: Any, kinds: tuple[str, ...]) -> Any:
    current = node.parent
    while current is not None and current.type not in kinds:
        current = current.parent
    return current


def _impl_type(node: Any) -> str | None:
    impl = _enclosing(node, ("impl_item",))
    if impl is None:
        return None
    kind = impl.child_by_field_name("type")
    return _text(kind).split("<")[0].rsplit("::", 1)[-1] if kind is not None else None


def _owner(node: Any) -> str | None:
    function = _enclosing(node, ("function_item",))
    if function is None:
        return None
    name = function.child_by_field_name("name")
    fn = _text(name) if name is not None else "?"
    owner = _impl_type(function)
    return f"{owner}::{fn}" if owner else fn
