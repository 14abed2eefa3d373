#!/usr/bin/env python3
"""Regenerate toolkit/engines/sglang_contract/sglang_flags.json: the command-line flags of SGLang's server, per release.

    python scripts/sglang_flags.py                      # the default releases, downloaded from PyPI
    python scripts/sglang_flags.py 0.5.23 0.5.9         # these releases
    python scripts/sglang_flags.py --wheel DIR/sglang-0.5.23-...whl   # a wheel already on disk

The login node has no sglang, so the toolkit cannot ask SGLang's own parser whether a job's
`[engine] extra_args` will be accepted. This script reads the parser's definition out of the wheel
*without importing it* (importing sglang pulls in torch and CUDA): it parses the source with `ast` and
records every option `ServerArgs.add_cli_args(parser)` registers:

* `parser.add_argument(...)` calls in `add_cli_args` itself (dynamic-choice flags, `--config`, the
  deprecated flags), and in helper functions of the same module it passes `parser` to;
* in 0.5.2x, `add_cli_args_from_dataclass(parser, ServerArgs)`: one option per `A[T, "help"]` or
  `A[T, Arg(...)]` field of the namespace classes in `sglang/srt/arg_groups/fields/` that `ServerArgs`
  collects (`_INPUT_NAMESPACES`), following the rules of `sglang/srt/arg_groups/arg_utils.py`
  (`--field-name`, `cli_name`, `aliases`, `no_cli`, bool -> store_true, Literal -> choices, list -> nargs '+');
* argparse's own `-h/--help`.

For each option it records the option strings, the destination, whether it takes a value (`nargs`: 0 for
store_true/store_false/BooleanOptionalAction/deprecated switches, null for exactly one value, or '?', '*',
'+'), the value type when it is int or float, and the choices. Choices are evaluated from the source as SGLang
computes them at import in its default environment (no plugin loaded, environment variables unset; `Source`
says what it follows): literals, constants and what they import from other modules of the wheel, class
attributes (`ReasoningParser.DetectorMap`), Enum members, helper functions (`_reasoning_parser_choices()`)
and local variables of add_cli_args. Choices it cannot evaluate are recorded as `choices_unknown` with the
reason (and printed), never dropped. Anything else the script does not understand stops it with an error, so
a new SGLang release cannot silently lose flags. Run it with network access (it calls `pip download
sglang==V --no-deps`); commit the JSON it writes.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_VERSIONS = ("0.5.23", "0.5.9")
OUT = (
    Path(__file__).resolve().parents[1]
    / "toolkit"
    / "engines"
    / "sglang_contract"
    / "sglang_flags.json"
)
SERVER_ARGS = "sglang/srt/server_args.py"
FIELDS_DIR = "sglang/srt/arg_groups/fields/"

# Actions by name -> the nargs they default to (0: a switch). Anything else stops the script.
ACTIONS = {
    "store": None,
    "append": None,
    "extend": "+",
    "store_true": 0,
    "store_false": 0,
    "store_const": 0,
    "append_const": 0,
    "count": 0,
    "help": 0,
    "version": 0,
    "BooleanOptionalAction": 0,  # also registers --no-<flag>
    "DeprecatedAction": 0,  # warns (or, with error_message, stops the launch)
    "DeprecatedStoreTrueAction": 0,
    "DeprecatedStoreConstAction": 0,  # nargs=None given explicitly when it retires a valued flag
    "DeprecatedAliasStoreAction": None,
    "LoRAPathAction": None,
}


class Unsupported(Exception):
    pass


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    raise Unsupported(f"cannot name {ast.unparse(node)!r}")


# ---------------------------------------------------------------------------------------------------
# Choices: evaluated from the wheel's source, never imported
# ---------------------------------------------------------------------------------------------------
class Unresolved(Exception):
    """Choices the source computes in a way this script cannot follow: recorded as unknown, never guessed."""


@dataclass(frozen=True)
class Module:
    name: str


@dataclass(frozen=True)
class Class:
    module: str
    node: ast.ClassDef


@dataclass(frozen=True)
class Function:
    module: str
    node: ast.FunctionDef


@dataclass(frozen=True)
class Instance:
    cls: Class
    args: tuple
    kwargs: tuple


@dataclass(frozen=True)
class Member:
    """An Enum member (iterating an Enum class gives these)."""

    name: str
    value: object


@dataclass
class Scope:
    module: str
    names: dict = field(
        default_factory=dict
    )  # local bindings; an Unresolved value is raised when read


@dataclass(frozen=True)
class Returned:
    value: object


OPAQUE = object()  # a value nothing may read (a dict's values: its keys are what choices take)
MUTATORS = {"append", "extend", "add", "update"}
ITERABLES = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "sorted": sorted}
ENUM_BASES = {"Enum", "IntEnum", "StrEnum", "Flag", "IntFlag"}


def _module_name(path: str) -> str:
    return path[: -len(".py")].replace("/", ".").removesuffix(".__init__")


class Source:
    """The wheel's modules, evaluated just far enough to give a flag's choices as SGLang's default environment
    computes them when `add_cli_args` runs: module constants and what they import, class attributes, Enum
    members, helper functions without arguments, `envs.NAME.get()` as its declared default (the variable is
    unset), `sys.modules.get(...)` as None (no plugin has imported a parser module), and the local variables
    of `add_cli_args` up to the call. Anything else raises Unresolved."""

    def __init__(self, z: zipfile.ZipFile):
        self.z, self.names = z, set(z.namelist())
        self.trees: dict[str, ast.Module] = {}
        self.globals: dict[tuple[str, str], object] = {}
        self.classes: dict[Class, dict] = {}
        self.running: set[Function] = set()

    def tree(self, module: str) -> ast.Module:
        if module not in self.trees:
            base = module.replace(".", "/")
            path = next((p for p in (base + ".py", base + "/__init__.py") if p in self.names), None)
            if path is None:
                raise Unresolved(f"module {module} is not in the wheel")
            self.trees[module] = ast.parse(self.z.read(path).decode("utf-8"))
        return self.trees[module]

    # -- names ------------------------------------------------------------------------------------------
    def global_(self, module: str, name: str):
        key = (module, name)
        if key not in self.globals:
            self.globals[key] = Unresolved(f"{module}.{name} refers to itself")
            try:
                self.globals[key] = self._module_binding(module, name)
            except Unresolved as e:
                self.globals[key] = e
        value = self.globals[key]
        if isinstance(value, Unresolved):
            raise value
        return value

    def _module_binding(self, module: str, name: str):
        """`name` after the module's top level has run: each statement that binds or changes it, in order."""
        scope, found = Scope(module), False
        for stmt in self.tree(module).body:
            if name in _bound_names(stmt, top=True):
                self.step(stmt, scope, only={name})
                found = True
            elif name in _bound_names(stmt, top=False):
                raise Unresolved(f"{module}.{name} is bound conditionally (line {stmt.lineno})")
        if not found:
            if name in ITERABLES:
                return ITERABLES[name]
            submodule = f"{module}.{name}"
            try:
                self.tree(submodule)
            except Unresolved:
                raise Unresolved(f"{module} has no top-level {name}") from None
            return Module(submodule)
        return self.read(scope, name)

    def read(self, scope: Scope, name: str):
        if name in scope.names:
            value = scope.names[name]
            if isinstance(value, Unresolved):
                raise value
            return value
        return self.global_(scope.module, name)

    def imported(self, module: str, stmt: ast.ImportFrom, name: str):
        package = module.split(".")
        if stmt.level:
            package = package[: len(package) - stmt.level + (1 if self._is_package(module) else 0)]
        source = (
            ".".join(package + ([stmt.module] if stmt.module else []))
            if stmt.level
            else stmt.module
        )
        if source != "sglang" and not source.startswith("sglang."):
            raise Unresolved(f"{name} comes from {source}, outside the wheel")
        return self.global_(source, name)

    def _is_package(self, module: str) -> bool:
        return module.replace(".", "/") + "/__init__.py" in self.names

    # -- statements -------------------------------------------------------------------------------------
    def step(self, stmt: ast.stmt, scope: Scope, only: set[str] | None = None):
        """Run one statement on `scope` (returns a Returned for `return`). `only`: at module level, bind just
        these names (the rest of the module is never run)."""
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return None
        if isinstance(stmt, ast.Pass) or isinstance(stmt, ast.AnnAssign) and stmt.value is None:
            return None
        if isinstance(stmt, ast.Return):
            return Returned(None if stmt.value is None else self.value(stmt.value, scope))
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if not all(isinstance(t, ast.Name) for t in targets):
                raise Unresolved(f"line {stmt.lineno}: assignment to {ast.unparse(targets[0])}")
            value = self._lenient(stmt.value, scope)
            for t in targets:
                scope.names[t.id] = value
            return None
        if (
            isinstance(stmt, ast.AugAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(stmt.op, ast.Add)
        ):
            scope.names[stmt.target.id] = self._lenient(
                ast.BinOp(stmt.target, ast.Add(), stmt.value), scope
            )
            return None
        if isinstance(stmt, ast.ImportFrom):
            for alias in stmt.names:
                if only is None or (alias.asname or alias.name) in only:
                    scope.names[alias.asname or alias.name] = self._lenient_call(
                        lambda a=alias: self.imported(scope.module, stmt, a.name)
                    )
            return None
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                scope.names[alias.asname or alias.name.split(".")[0]] = Module(
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
            return None
        if isinstance(stmt, ast.ClassDef):
            scope.names[stmt.name] = Class(scope.module, stmt)
            return None
        if isinstance(stmt, ast.FunctionDef):
            scope.names[stmt.name] = Function(scope.module, stmt)
            return None
        if isinstance(stmt, ast.If):
            for inner in stmt.body if self.value(stmt.test, scope) else stmt.orelse:
                result = self.step(inner, scope)
                if result is not None:
                    return result
            return None
        if isinstance(stmt, ast.Expr) and _mutation(stmt):
            target, method = stmt.value.func.value.id, stmt.value.func.attr
            scope.names[target] = self._lenient_call(
                lambda: self._mutate(scope, target, method, stmt.value)
            )
            return None
        raise Unresolved(
            f"line {stmt.lineno}: {type(stmt).__name__} statement {ast.unparse(stmt)[:60]!r}"
        )

    def step_leniently(self, stmt: ast.stmt, scope: Scope) -> None:
        """A statement of add_cli_args: run it if possible, else every local it binds or changes is unknown."""
        try:
            self.step(stmt, scope)
        except Unresolved as e:
            for name in _bound_names(stmt, top=False):
                scope.names[name] = e

    def _mutate(self, scope: Scope, target: str, method: str, call: ast.Call):
        old = self.read(scope, target)
        args = [self.value(a, scope) for a in call.args]
        if len(args) == 1 and (
            isinstance(old, list)
            and method in ("append", "extend")
            or isinstance(old, set)
            and method in ("add", "update")
        ):
            new = [args[0]] if method in ("append", "add") else self.iterate(args[0])
            return old + new if isinstance(old, list) else old | set(new)
        raise Unresolved(f"line {call.lineno}: {ast.unparse(call)}")

    def _lenient(self, node: ast.AST, scope: Scope):
        return self._lenient_call(lambda: self.value(node, scope))

    @staticmethod
    def _lenient_call(fn):
        try:
            return fn()
        except Unresolved as e:
            return e

    # -- expressions ------------------------------------------------------------------------------------
    def value(self, node: ast.AST, scope: Scope):
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = []
            for e in node.elts:
                items += (
                    self.iterate(self.value(e.value, scope))
                    if isinstance(e, ast.Starred)
                    else [self.value(e, scope)]
                )
            return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise Unresolved(f"line {node.lineno}: ** in a dict")
            return {self.value(k, scope): OPAQUE for k in node.keys}
        if isinstance(node, ast.Name):
            return self.read(scope, node.id)
        if isinstance(node, ast.Attribute):
            return self.attribute(self.value(node.value, scope), node.attr)
        if isinstance(node, ast.Call):
            return self.call(node, scope)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.BitOr)):
            left, right = self.value(node.left, scope), self.value(node.right, scope)
            try:
                return left + right if isinstance(node.op, ast.Add) else left | right
            except TypeError:
                raise Unresolved(f"line {node.lineno}: {ast.unparse(node)}") from None
        if isinstance(node, (ast.ListComp, ast.SetComp)):
            return self.comprehension(node, scope)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            return _compare(
                node.ops[0], self.value(node.left, scope), self.value(node.comparators[0], scope)
            )
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return not self.value(node.operand, scope)
        raise Unresolved(
            f"line {getattr(node, 'lineno', '?')}: cannot evaluate {ast.unparse(node)!r}"
        )

    def attribute(self, obj, attr: str):
        if isinstance(obj, Module):
            return self.global_(obj.name, attr)
        if isinstance(obj, Class):
            return self.class_attr(obj, attr)
        if isinstance(obj, Instance):
            return self.class_attr(obj.cls, attr)
        if isinstance(obj, Member) and attr in ("name", "value"):
            value = getattr(obj, attr)
            if isinstance(value, Unresolved):
                raise value
            return value
        raise Unresolved(f"cannot read .{attr} of {_describe(obj)}")

    def class_attr(self, cls: Class, attr: str):
        names = self._class_body(cls)
        if attr in names:
            value = names[attr]
            if isinstance(value, Unresolved):
                raise value
            return value
        for base in cls.node.bases:
            try:
                parent = self.value(base, Scope(cls.module))
            except Unresolved:
                continue
            if isinstance(parent, Class):
                return self.class_attr(parent, attr)
        raise Unresolved(f"class {cls.node.name} has no attribute {attr} this script can read")

    def _class_body(self, cls: Class) -> dict:
        if cls not in self.classes:
            scope = Scope(cls.module)
            for stmt in cls.node.body:
                if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    self.step_leniently(stmt, scope)
            if _is_enum(cls.node):
                scope.names = {
                    k: Member(k, v) if not k.startswith("_") else v for k, v in scope.names.items()
                }
            self.classes[cls] = scope.names
        return self.classes[cls]

    def call(self, node: ast.Call, scope: Scope):
        f = node.func
        if ast.unparse(f) == "sys.modules.get":
            return None  # the default environment: no plugin has imported the module yet
        if isinstance(f, ast.Attribute):
            obj = self.value(f.value, scope)
            if _is_env_field(obj) and f.attr == "get" and not node.args:
                return _env_default(obj)
            if isinstance(obj, dict) and f.attr == "keys" and not node.args:
                return list(obj)
            if isinstance(obj, str) and f.attr in ("lower", "upper") and not node.args:
                return getattr(obj, f.attr)()
            callee = self.attribute(obj, f.attr)
        else:
            callee = self.value(f, scope)
        if callee in ITERABLES.values() and len(node.args) == 1 and not node.keywords:
            return callee(self.iterate(self.value(node.args[0], scope)))
        if isinstance(callee, Function) and not node.args and not node.keywords:
            return self.run(callee)
        if isinstance(callee, Class):
            return Instance(
                callee,
                tuple(self._lenient(a, scope) for a in node.args),
                tuple((k.arg, self._lenient(k.value, scope)) for k in node.keywords),
            )
        raise Unresolved(f"line {node.lineno}: cannot evaluate the call {ast.unparse(node)[:80]!r}")

    def run(self, fn: Function):
        if fn in self.running:
            raise Unresolved(f"{fn.module}.{fn.node.name}() calls itself")
        self.running.add(fn)
        try:
            scope = Scope(fn.module)
            for stmt in fn.node.body:
                result = self.step(stmt, scope)
                if result is not None:
                    return result.value
        finally:
            self.running.discard(fn)
        raise Unresolved(f"{fn.module}.{fn.node.name}() returns nothing")

    def comprehension(self, node: ast.ListComp | ast.SetComp, scope: Scope):
        if len(node.generators) != 1 or not isinstance(node.generators[0].target, ast.Name):
            raise Unresolved(f"line {node.lineno}: comprehension {ast.unparse(node)[:60]!r}")
        gen, out = node.generators[0], []
        for item in self.iterate(self.value(gen.iter, scope)):
            inner = Scope(scope.module, {**scope.names, gen.target.id: item})
            if all(self.value(cond, inner) for cond in gen.ifs):
                out.append(self.value(node.elt, inner))
        return out if isinstance(node, ast.ListComp) else set(out)

    def iterate(self, value) -> list:
        if isinstance(value, (list, tuple, set, frozenset, dict)):
            return list(value)
        if isinstance(value, Class) and _is_enum(value.node):
            return [v for v in self._class_body(value).values() if isinstance(v, Member)]
        raise Unresolved(f"cannot iterate over {_describe(value)}")

    def choices(self, node: ast.AST, scope: Scope) -> list:
        """The choices argparse is given: plain values, a set's in sorted order."""
        value = self.value(node, scope)
        items = (
            sorted(value, key=str) if isinstance(value, (set, frozenset)) else self.iterate(value)
        )
        if not all(isinstance(v, (str, int, float)) for v in items):
            raise Unresolved(f"choices {ast.unparse(node)!r} are not plain strings or numbers")
        return items


NEW_SCOPES = (
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Lambda,
    ast.ListComp,
    ast.SetComp,
    ast.DictComp,
    ast.GeneratorExp,
)


def _same_scope(node: ast.AST):
    """The nodes under `node` that run in its scope (a def or class is named there, its body is not)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, NEW_SCOPES):
            yield from _same_scope(child)


def _bound_names(stmt: ast.stmt, top: bool) -> set[str]:
    """The names a statement binds or changes: by itself (`top`), or anywhere inside it (then a compound
    statement's names count too: bound conditionally)."""
    if isinstance(stmt, (ast.If, ast.Try, ast.For, ast.While, ast.With)) and top:
        return set()
    names = set()
    for n in [stmt, *_same_scope(stmt)] if not isinstance(stmt, NEW_SCOPES) else [stmt]:
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.Expr) and _mutation(n):
            names.add(n.value.func.value.id)
        elif (
            isinstance(n, (ast.Subscript, ast.Attribute))
            and isinstance(n.ctx, ast.Store)
            and isinstance(n.value, ast.Name)
        ):
            names.add(n.value.id)  # X[k] = v, X.a = v: X changes (and stops being known)
    return names


def _mutation(stmt: ast.Expr) -> bool:
    call = stmt.value
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in MUTATORS
        and isinstance(call.func.value, ast.Name)
    )


def _compare(op: ast.cmpop, left, right) -> bool:
    ops = {
        ast.Is: lambda: left is right,
        ast.IsNot: lambda: left is not right,
        ast.Eq: lambda: left == right,
        ast.NotEq: lambda: left != right,
        ast.In: lambda: left in right,
        ast.NotIn: lambda: left not in right,
    }
    if type(op) not in ops:
        raise Unresolved(f"comparison {type(op).__name__}")
    return ops[type(op)]()


def _is_enum(node: ast.ClassDef) -> bool:
    return any(_type_name(b) in ENUM_BASES for b in node.bases)


def _is_env_field(obj) -> bool:
    return (
        isinstance(obj, Instance)
        and obj.cls.node.name.startswith("Env")
        and obj.cls.module == "sglang.srt.environ"
    )


def _env_default(obj: Instance):
    default = (
        obj.args[0]
        if obj.args
        else dict(obj.kwargs).get("default", Unresolved("an Env field without a default"))
    )
    if isinstance(default, Unresolved):
        raise default
    return default


def _describe(obj) -> str:
    return type(obj).__name__ if not isinstance(obj, (Module, Class, Function)) else repr(obj)[:80]


# ---------------------------------------------------------------------------------------------------
# One flag
# ---------------------------------------------------------------------------------------------------
def _flag(
    options: list[str],
    dest: str,
    nargs,
    type_: str | None,
    choices,
    action: str,
    deprecated: str | None = None,
):
    entry = {"options": options, "dest": dest, "nargs": nargs}
    if type_ in ("int", "float"):
        entry["type"] = type_
    if isinstance(choices, Unresolved):
        entry["choices_unknown"] = str(choices)
    elif choices is not None:
        entry["choices"] = choices
    if action not in ("store", "store_true"):
        entry["action"] = action
    if deprecated:
        entry["deprecated"] = deprecated
    return entry


def _dest(options: list[str]) -> str:
    long = [o for o in options if o.startswith("--")]
    return (long or options)[0].lstrip("-").replace("-", "_")


def _choices(node: ast.AST | None, source: Source, scope: Scope) -> list | Unresolved | None:
    """The choices `node` gives argparse, or why they cannot be known from source (None: no choices)."""
    if node is None:
        return None
    try:
        return source.choices(node, scope)
    except Unresolved as e:
        return Unresolved(f"choices={ast.unparse(node)}: {e}")


def _nargs_value(node: ast.AST | None, default):
    if node is None:
        return default
    value = ast.literal_eval(node)
    if value is not None and not isinstance(value, (int, str)):
        raise Unsupported(f"nargs={value!r}")
    return value


def from_add_argument(call: ast.Call, source: Source, scope: Scope) -> list[dict]:
    """One `parser.add_argument(...)` call -> its flag(s)."""
    options = []
    for a in call.args:
        if not (isinstance(a, ast.Constant) and isinstance(a.value, str)):
            raise Unsupported(
                f"line {call.lineno}: option string {ast.unparse(a)!r} is not a literal"
            )
        options.append(a.value)
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    if any(k.arg is None for k in call.keywords):
        raise Unsupported(f"line {call.lineno}: **kwargs in add_argument")
    action = _name(kw["action"]) if "action" in kw else "store"
    if action not in ACTIONS:
        raise Unsupported(
            f"line {call.lineno}: unknown action {action!r} for {options}: add it to ACTIONS"
        )
    nargs = _nargs_value(kw.get("nargs"), ACTIONS[action])
    type_ = _name(kw["type"]) if "type" in kw else None
    dest = ast.literal_eval(kw["dest"]) if "dest" in kw else _dest(options)
    deprecated = None
    if action.startswith("Deprecated"):
        deprecated = "deprecated"
        for key in ("new_flag", "error_message"):
            if key in kw:
                try:
                    deprecated += f"; {key}: {ast.literal_eval(kw[key])}"
                except ValueError:
                    pass
        if "error_message" in kw:
            action = "DeprecatedError"
    out = [
        _flag(
            options,
            dest,
            nargs,
            type_,
            _choices(kw.get("choices"), source, scope),
            action,
            deprecated,
        )
    ]
    if action == "BooleanOptionalAction":
        out[0]["options"] = options + ["--no-" + o[2:] for o in options if o.startswith("--")]
    return out


# ---------------------------------------------------------------------------------------------------
# 0.5.2x: flags derived from dataclass fields (arg_utils.add_cli_args_from_dataclass)
# ---------------------------------------------------------------------------------------------------
def _unwrap_optional(node: ast.AST) -> ast.AST:
    if isinstance(node, ast.Subscript) and _name(node.value) == "Optional":
        return node.slice
    if isinstance(node, ast.Subscript) and _name(node.value) == "Union":
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        rest = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)]
        return rest[0] if len(rest) == 1 else node
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        parts, stack = [], [node]
        while stack:
            n = stack.pop()
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.BitOr):
                stack += [n.right, n.left]
            else:
                parts.append(n)
        rest = [p for p in parts if not (isinstance(p, ast.Constant) and p.value is None)]
        return rest[0] if len(rest) == 1 else node
    return node


def _type_name(node: ast.AST) -> str:
    try:
        return _name(node)
    except Unsupported:
        return ast.unparse(node)


def from_field(
    name: str, annotation: ast.AST, source: Source, scope: Scope, where: str
) -> list[dict]:
    """One `name: A[T, ...]` namespace field -> its flag (none for fields without CLI metadata)."""
    if not (
        isinstance(annotation, ast.Subscript) and _type_name(annotation.value) in ("A", "Annotated")
    ):
        return []
    parts = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    raw_type, meta = parts[0], None
    for m in parts[1:]:
        if isinstance(m, ast.Constant) and isinstance(m.value, str):
            meta = {}
            break
        if isinstance(m, ast.Call) and _type_name(m.func) == "Arg":
            if m.args:
                meta = {"help": m.args[0]}
            meta = {**(meta or {}), **{k.arg: k.value for k in m.keywords}}
            break
    if meta is None:  # Derived(...), NS(...) only: not a CLI input
        return []
    if "no_cli" in meta and ast.literal_eval(meta["no_cli"]):
        return []
    cli_name = (
        ast.literal_eval(meta["cli_name"]) if "cli_name" in meta else "--" + name.replace("_", "-")
    )
    options = [cli_name] + (ast.literal_eval(meta["aliases"]) if "aliases" in meta else [])
    explicit_choices = (
        _choices(meta.get("choices"), source, scope) or None
    )  # arg_utils ignores choices=[]
    if "action" in meta:
        action = _name(meta["action"])
        if action not in ACTIONS:
            raise Unsupported(
                f"{where}: field {name}: unknown action {action!r}: add it to ACTIONS"
            )
        kwargs: dict[str, ast.AST] = {}
        if "action_kwargs" in meta:
            d = meta["action_kwargs"]
            if not isinstance(d, ast.Dict) or not all(isinstance(k, ast.Constant) for k in d.keys):
                raise Unsupported(f"{where}: field {name}: action_kwargs is not a literal dict")
            kwargs = {k.value: v for k, v in zip(d.keys, d.values)}
        nargs = _nargs_value(kwargs.get("nargs"), ACTIONS[action])
        type_ = _name(kwargs["type"]) if "type" in kwargs else None
        entry = _flag(
            options,
            name,
            nargs,
            type_,
            explicit_choices or _choices(kwargs.get("choices"), source, scope),
            action,
        )
        if action == "BooleanOptionalAction":
            entry["options"] = options + ["--no-" + o[2:] for o in options if o.startswith("--")]
        return [entry]
    inner = _unwrap_optional(raw_type)
    has_parser = "type_parser" in meta
    nargs_meta = _nargs_value(meta.get("nargs"), None)
    if isinstance(inner, ast.Subscript) and _type_name(inner.value) == "Literal":
        try:  # Literal[None, "a"] is allowed: argparse never matches a None choice, but arg_utils passes it
            values = list(
                source.value(inner.slice, scope)
                if isinstance(inner.slice, ast.Tuple)
                else [source.value(inner.slice, scope)]
            )
        except Unresolved as e:
            raise Unsupported(
                f"{where}: field {name}: Literal[{ast.unparse(inner.slice)}]: {e}"
            ) from None
        choices = explicit_choices or values
        type_ = None if has_parser else type(values[0]).__name__ if values else "str"
        return [_flag(options, name, None, type_, choices, "store")]
    if (
        isinstance(inner, ast.Subscript)
        and _type_name(inner.value) in ("list", "List")
        and not has_parser
    ):
        elem = _type_name(inner.slice)
        return [_flag(options, name, nargs_meta or "+", elem, explicit_choices, "store")]
    if _type_name(inner) == "bool":
        return [_flag(options, name, 0, None, None, "store_true")]
    type_ = None if has_parser else _type_name(inner)
    return [_flag(options, name, nargs_meta, type_, explicit_choices, "store")]


def _namespace_classes(source: Source) -> dict[str, tuple[str, ast.ClassDef]]:
    """Every class of the modules under FIELDS_DIR, by name -> (module, its definition)."""
    classes = {}
    for path in sorted(source.names):
        if path.startswith(FIELDS_DIR) and path.endswith(".py"):
            module = _module_name(path)
            for node in source.tree(module).body:
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = (module, node)
    return classes


def _field_flags(source: Source, module: str, node: ast.ClassDef, where: str) -> list[dict]:
    flags = []
    for stmt in node.body:
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and not stmt.target.id.startswith("_")
        ):
            flags += from_field(stmt.target.id, stmt.annotation, source, Scope(module), where)
    return flags


def dataclass_flags(source: Source, server_args: ast.Module) -> list[dict]:
    """The flags of the namespaces `ServerArgs` collects, in the order of `_INPUT_NAMESPACES`."""
    namespaces = None
    for node in server_args.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets
        ):
            namespaces = [_name(e) for e in node.value.elts]
    classes = _namespace_classes(source)
    own = [n for n in server_args.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"]
    server_module = _module_name(SERVER_ARGS)
    if namespaces is None:  # a release where ServerArgs declares its fields itself
        namespaces, classes["ServerArgs"] = ["ServerArgs"], (server_module, own[0])
    flags = []
    for cls in namespaces:
        if cls not in classes:
            raise Unsupported(
                f"namespace class {cls} of _INPUT_NAMESPACES not found under {FIELDS_DIR}"
            )
        module, node = classes[cls]
        flags += _field_flags(source, module, node, f"{module}: {cls}")
    if own and namespaces != ["ServerArgs"]:
        flags += _field_flags(source, server_module, own[0], SERVER_ARGS)
    return flags


# ---------------------------------------------------------------------------------------------------
# add_cli_args and the helpers it hands the parser to
# ---------------------------------------------------------------------------------------------------
def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out.setdefault(f"{node.name}.{item.name}", item)
    return out


def _calls(stmt: ast.stmt) -> list[ast.Call]:
    return sorted(
        (n for n in ast.walk(stmt) if isinstance(n, ast.Call)),
        key=lambda n: (n.lineno, n.col_offset),
    )


def parser_flags(
    func: ast.FunctionDef, source: Source, tree: ast.Module, seen: set[str]
) -> tuple[list[dict], list[str]]:
    """Every option `func(parser)` registers, following helper calls that receive the parser. Its statements
    are also run (leniently) in order, so choices held in a local variable are known at each call."""
    functions = _functions(tree)
    parser_name = func.args.args[0].arg if func.args.args else "parser"
    scope = Scope(_module_name(SERVER_ARGS))
    flags, notes = [], []
    for stmt in func.body:
        for call in _calls(stmt):
            more, more_notes = _call_flags(call, parser_name, functions, source, tree, scope, seen)
            flags += more
            notes += more_notes
        source.step_leniently(stmt, scope)
    return flags, notes


def _call_flags(
    call: ast.Call,
    parser_name: str,
    functions: dict,
    source: Source,
    tree: ast.Module,
    scope: Scope,
    seen: set[str],
) -> tuple[list[dict], list[str]]:
    """The flags one call in add_cli_args (or a helper) registers: add_argument, or a call handed the parser."""
    f = call.func
    if isinstance(f, ast.Attribute) and f.attr == "add_argument":
        return from_add_argument(call, source, scope), []
    if isinstance(f, ast.Attribute) and f.attr in (
        "add_argument_group",
        "add_mutually_exclusive_group",
    ):
        raise Unsupported(
            f"line {call.lineno}: argument groups are not handled yet ({ast.unparse(f)})"
        )
    if not any(isinstance(a, ast.Name) and a.id == parser_name for a in call.args):
        return [], []
    called = ast.unparse(f)
    if called.endswith("add_cli_args_from_dataclass"):
        return dataclass_flags(source, tree), [
            "add_cli_args_from_dataclass(parser, ServerArgs): the fields of sglang/srt/arg_groups/fields/"
        ]
    target = functions.get(called) or functions.get(called.split(".")[-1])
    if target is None or called in seen:
        raise Unsupported(
            f"line {call.lineno}: add_cli_args hands the parser to {called}(), which this script "
            "cannot follow; extend parser_flags()"
        )
    more, more_notes = parser_flags(target, source, tree, seen | {called})
    return more, [f"{called}(parser)"] + more_notes


def read_wheel(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        if SERVER_ARGS not in z.namelist():
            raise Unsupported(f"{wheel.name} has no {SERVER_ARGS}")
        source = Source(z)
        tree = source.tree(_module_name(SERVER_ARGS))
        func = _functions(tree).get("ServerArgs.add_cli_args")
        if func is None:
            raise Unsupported(f"{wheel.name}: no ServerArgs.add_cli_args in {SERVER_ARGS}")
        flags, notes = parser_flags(func, source, tree, {"ServerArgs.add_cli_args"})
    flags.insert(0, {"options": ["-h", "--help"], "dest": "help", "nargs": 0, "action": "help"})
    seen: dict[str, list[str]] = {}
    for f in flags:
        for o in f["options"]:
            if o in seen:
                raise Unsupported(
                    f"{wheel.name}: option {o} registered twice ({seen[o]} and {f['options']})"
                )
            seen[o] = f["options"]
    return {
        "version": wheel.name.split("-")[1],  # the wheel file name's version field (PEP 427)
        "source": f"{wheel.name}: {SERVER_ARGS} ServerArgs.add_cli_args"
        + "".join(f"; {n}" for n in notes),
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "flags": flags,
    }


def download(version: str, folder: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            f"sglang=={version}",
            "--no-deps",
            "--quiet",
            "-d",
            str(folder),
        ],
        check=True,
    )
    wheels = sorted(folder.glob(f"sglang-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download left no sglang-{version} wheel in {folder}")
    return wheels[0]


def write(data: dict, out: Path) -> None:
    """JSON with one flag per line, so a new release shows up as a readable diff."""
    lines = ["{", f'  "about": {json.dumps(data["about"])},', '  "versions": {']
    versions = list(data["versions"].items())
    for i, (v, d) in enumerate(versions):
        lines.append(f"    {json.dumps(v)}: {{")
        lines += [
            f'      "source": {json.dumps(d["source"])},',
            f'      "wheel_sha256": {json.dumps(d["wheel_sha256"])},',
            '      "flags": [',
        ]
        lines += [
            f"        {json.dumps(f)}" + ("," if j < len(d["flags"]) - 1 else "")
            for j, f in enumerate(d["flags"])
        ]
        lines += ["      ]", "    }" + ("," if i < len(versions) - 1 else "")]
    lines += ["  }", "}", ""]
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "versions",
        nargs="*",
        help=f"sglang releases to read (default: {' '.join(DEFAULT_VERSIONS)})",
    )
    p.add_argument(
        "--wheel",
        action="append",
        type=Path,
        default=[],
        help="read this wheel instead of downloading",
    )
    p.add_argument("-o", "--output", type=Path, default=OUT)
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        wheels = list(args.wheel) + [
            download(v, Path(tmp))
            for v in (args.versions or ([] if args.wheel else DEFAULT_VERSIONS))
        ]
        for wheel in wheels:
            try:
                d = read_wheel(wheel)
            except Unsupported as e:
                raise SystemExit(f"{wheel.name}: {e}") from None
            results[d.pop("version")] = d
            print(
                f"{wheel.name}: {len(d['flags'])} flags, {sum(len(f['options']) for f in d['flags'])} option strings"
            )
            for f in d["flags"]:
                if "choices_unknown" in f:
                    print(
                        f"  warning: {f['options'][0]}: choices unknown ({f['choices_unknown']})",
                        file=sys.stderr,
                    )
    ordered = dict(
        sorted(
            results.items(),
            key=lambda kv: tuple(int(x) for x in kv[0].split(".") if x.isdigit()),
            reverse=True,
        )
    )
    write(
        {
            "about": "SGLang server flags per release, read from each wheel's source (never imported) by "
            "scripts/sglang_flags.py; regenerate with it, do not edit by hand. nargs: 0 takes no value, "
            "null exactly one, '?', '*' or '+' as in argparse. choices: the values SGLang accepts, as its "
            "default environment computes them at import (no plugin loaded, environment variables unset; "
            "a set's in sorted order), including those computed by code (--reasoning-parser, "
            "--tool-call-parser). choices_unknown: SGLang computes the choices in a way the script cannot "
            "follow from source (the reason is given); the value is then not checked.",
            "versions": ordered,
        },
        args.output,
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
