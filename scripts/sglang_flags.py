#!/usr/bin/env python3
"""Regenerate toolkit/engines/sglang_flags.json: the command-line flags of SGLang's server, per release.

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
'+'), the value type when it is int or float, and the choices when they are literal in the source (or a
module-level literal constant). Anything the script does not understand stops it with an error, so a new
SGLang release cannot silently lose flags. Run it with network access (it calls `pip download sglang==V
--no-deps`); commit the JSON it writes.
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
from pathlib import Path

DEFAULT_VERSIONS = ("0.5.23", "0.5.9")
OUT = Path(__file__).resolve().parents[1] / "toolkit" / "engines" / "sglang_flags.json"
SERVER_ARGS = "sglang/srt/server_args.py"
FIELDS_DIR = "sglang/srt/arg_groups/fields/"
CHOICES_MODULE = "sglang/srt/arg_groups/choices.py"

# Actions by name -> the nargs they default to (0: a switch). Anything else stops the script.
ACTIONS = {
    "store": None, "append": None, "extend": "+",
    "store_true": 0, "store_false": 0, "store_const": 0, "append_const": 0, "count": 0, "help": 0, "version": 0,
    "BooleanOptionalAction": 0,          # also registers --no-<flag>
    "DeprecatedAction": 0,               # warns (or, with error_message, stops the launch)
    "DeprecatedStoreTrueAction": 0,
    "DeprecatedStoreConstAction": 0,     # nargs=None given explicitly when it retires a valued flag
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


class Constants:
    """Module-level literal constants, for `choices=SOME_CHOICES` (same module or arg_groups/choices.py)."""

    def __init__(self, *trees: ast.Module):
        self.values: dict[str, object] = {}
        for tree in trees:
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) and node.value else []
                for t in targets:
                    if isinstance(t, ast.Name):
                        try:
                            self.values[t.id] = ast.literal_eval(node.value)
                        except ValueError:
                            pass

    def literal(self, node: ast.AST | None):
        """The literal value of `node`, or None when it is computed at run time (then it is not checked)."""
        if node is None:
            return None
        try:
            value = ast.literal_eval(node)
        except ValueError:
            if isinstance(node, ast.Name) and node.id in self.values:
                value = self.values[node.id]
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                left, right = self.literal(node.left), self.literal(node.right)
                if left is None or right is None:
                    return None
                value = list(left) + list(right)
            else:
                return None
        if isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(v, (str, int, float)) for v in value):
            return list(value)
        return None


def _flag(options: list[str], dest: str, nargs, type_: str | None, choices, action: str, deprecated: str | None = None):
    entry = {"options": options, "dest": dest, "nargs": nargs}
    if type_ in ("int", "float"):
        entry["type"] = type_
    if choices is not None:
        entry["choices"] = choices
    if action not in ("store", "store_true"):
        entry["action"] = action
    if deprecated:
        entry["deprecated"] = deprecated
    return entry


def _dest(options: list[str]) -> str:
    long = [o for o in options if o.startswith("--")]
    return (long or options)[0].lstrip("-").replace("-", "_")


def _nargs_value(node: ast.AST | None, default):
    if node is None:
        return default
    value = ast.literal_eval(node)
    if value is not None and not isinstance(value, (int, str)):
        raise Unsupported(f"nargs={value!r}")
    return value


def from_add_argument(call: ast.Call, consts: Constants) -> list[dict]:
    """One `parser.add_argument(...)` call -> its flag(s)."""
    options = []
    for a in call.args:
        if not (isinstance(a, ast.Constant) and isinstance(a.value, str)):
            raise Unsupported(f"line {call.lineno}: option string {ast.unparse(a)!r} is not a literal")
        options.append(a.value)
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    if any(k.arg is None for k in call.keywords):
        raise Unsupported(f"line {call.lineno}: **kwargs in add_argument")
    action = _name(kw["action"]) if "action" in kw else "store"
    if action not in ACTIONS:
        raise Unsupported(f"line {call.lineno}: unknown action {action!r} for {options}: add it to ACTIONS")
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
    out = [_flag(options, dest, nargs, type_, consts.literal(kw.get("choices")), action, deprecated)]
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


def from_field(name: str, annotation: ast.AST, consts: Constants, where: str) -> list[dict]:
    """One `name: A[T, ...]` namespace field -> its flag (none for fields without CLI metadata)."""
    if not (isinstance(annotation, ast.Subscript) and _type_name(annotation.value) in ("A", "Annotated")):
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
    cli_name = ast.literal_eval(meta["cli_name"]) if "cli_name" in meta else "--" + name.replace("_", "-")
    options = [cli_name] + (ast.literal_eval(meta["aliases"]) if "aliases" in meta else [])
    explicit_choices = consts.literal(meta.get("choices"))
    if "action" in meta:
        action = _name(meta["action"])
        if action not in ACTIONS:
            raise Unsupported(f"{where}: field {name}: unknown action {action!r}: add it to ACTIONS")
        kwargs: dict[str, ast.AST] = {}
        if "action_kwargs" in meta:
            d = meta["action_kwargs"]
            if not isinstance(d, ast.Dict) or not all(isinstance(k, ast.Constant) for k in d.keys):
                raise Unsupported(f"{where}: field {name}: action_kwargs is not a literal dict")
            kwargs = {k.value: v for k, v in zip(d.keys, d.values)}
        nargs = _nargs_value(kwargs.get("nargs"), ACTIONS[action])
        type_ = _name(kwargs["type"]) if "type" in kwargs else None
        entry = _flag(options, name, nargs, type_, explicit_choices or consts.literal(kwargs.get("choices")), action)
        if action == "BooleanOptionalAction":
            entry["options"] = options + ["--no-" + o[2:] for o in options if o.startswith("--")]
        return [entry]
    inner = _unwrap_optional(raw_type)
    has_parser = "type_parser" in meta
    nargs_meta = _nargs_value(meta.get("nargs"), None)
    if isinstance(inner, ast.Subscript) and _type_name(inner.value) == "Literal":
        values = consts.literal(inner.slice if isinstance(inner.slice, ast.Tuple) else ast.List([inner.slice]))
        choices = explicit_choices or values
        type_ = None if has_parser else type(values[0]).__name__ if values else "str"
        return [_flag(options, name, None, type_, choices, "store")]
    if isinstance(inner, ast.Subscript) and _type_name(inner.value) in ("list", "List") and not has_parser:
        elem = _type_name(inner.slice)
        return [_flag(options, name, nargs_meta or "+", elem, explicit_choices, "store")]
    if _type_name(inner) == "bool":
        return [_flag(options, name, 0, None, None, "store_true")]
    type_ = None if has_parser else _type_name(inner)
    return [_flag(options, name, nargs_meta, type_, explicit_choices, "store")]


def dataclass_flags(files: dict[str, str], server_args: ast.Module, consts_trees: list[ast.Module]) -> list[dict]:
    """The flags of the namespaces `ServerArgs` collects, in the order of `_INPUT_NAMESPACES`."""
    sources = None
    for node in server_args.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_INPUT_NAMESPACES" for t in node.targets):
            sources = [_name(e) for e in node.value.elts]
    classes: dict[str, tuple[str, ast.ClassDef, Constants]] = {}
    for path, text in files.items():
        if path.startswith(FIELDS_DIR) and path.endswith(".py"):
            tree = ast.parse(text)
            consts = Constants(tree, *consts_trees)
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    classes[node.name] = (path, node, consts)
    own = [n for n in server_args.body if isinstance(n, ast.ClassDef) and n.name == "ServerArgs"]
    if sources is None:  # a release where ServerArgs declares its fields itself
        sources, classes["ServerArgs"] = ["ServerArgs"], (SERVER_ARGS, own[0], Constants(server_args, *consts_trees))
    flags = []
    for cls in sources:
        if cls not in classes:
            raise Unsupported(f"namespace class {cls} of _INPUT_NAMESPACES not found under {FIELDS_DIR}")
        path, node, consts = classes[cls]
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not stmt.target.id.startswith("_"):
                flags += from_field(stmt.target.id, stmt.annotation, consts, f"{path}: {cls}")
    if own and sources != ["ServerArgs"]:
        for stmt in own[0].body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not stmt.target.id.startswith("_"):
                flags += from_field(stmt.target.id, stmt.annotation, Constants(server_args, *consts_trees), SERVER_ARGS)
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


def parser_flags(func: ast.FunctionDef, files: dict[str, str], tree: ast.Module, consts: Constants,
                 consts_trees: list[ast.Module], seen: set[str]) -> tuple[list[dict], list[str]]:
    """Every option `func(parser)` registers, following helper calls that receive the parser."""
    functions = _functions(tree)
    parser_name = func.args.args[0].arg if func.args.args else "parser"
    flags, notes = [], []
    for call in sorted((n for n in ast.walk(func) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
        f = call.func
        if isinstance(f, ast.Attribute) and f.attr == "add_argument":
            flags += from_add_argument(call, consts)
            continue
        if isinstance(f, ast.Attribute) and f.attr in ("add_argument_group", "add_mutually_exclusive_group"):
            raise Unsupported(f"line {call.lineno}: argument groups are not handled yet ({ast.unparse(f)})")
        if not any(isinstance(a, ast.Name) and a.id == parser_name for a in call.args):
            continue
        called = ast.unparse(f)
        if called.endswith("add_cli_args_from_dataclass"):
            flags += dataclass_flags(files, tree, consts_trees)
            notes.append("add_cli_args_from_dataclass(parser, ServerArgs): the fields of sglang/srt/arg_groups/fields/")
            continue
        target = functions.get(called) or functions.get(called.split(".")[-1])
        if target is None or called in seen:
            raise Unsupported(f"line {call.lineno}: add_cli_args hands the parser to {called}(), which this script "
                              "cannot follow; extend parser_flags()")
        more, more_notes = parser_flags(target, files, tree, consts, consts_trees, seen | {called})
        flags += more
        notes += [f"{called}(parser)"] + more_notes
    return flags, notes


def read_wheel(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        files = {n: z.read(n).decode("utf-8") for n in z.namelist()
                 if n == SERVER_ARGS or n == CHOICES_MODULE or (n.startswith(FIELDS_DIR) and n.endswith(".py"))
}
    if SERVER_ARGS not in files:
        raise Unsupported(f"{wheel.name} has no {SERVER_ARGS}")
    tree = ast.parse(files[SERVER_ARGS])
    consts_trees = [ast.parse(files[CHOICES_MODULE])] if CHOICES_MODULE in files else []
    consts = Constants(tree, *consts_trees)
    func = _functions(tree).get("ServerArgs.add_cli_args")
    if func is None:
        raise Unsupported(f"{wheel.name}: no ServerArgs.add_cli_args in {SERVER_ARGS}")
    flags, notes = parser_flags(func, files, tree, consts, consts_trees, {"ServerArgs.add_cli_args"})
    flags.insert(0, {"options": ["-h", "--help"], "dest": "help", "nargs": 0, "action": "help"})
    seen: dict[str, list[str]] = {}
    for f in flags:
        for o in f["options"]:
            if o in seen:
                raise Unsupported(f"{wheel.name}: option {o} registered twice ({seen[o]} and {f['options']})")
            seen[o] = f["options"]
    return {
        "version": wheel.name.split("-")[1],  # the wheel file name's version field (PEP 427)
        "source": f"{wheel.name}: {SERVER_ARGS} ServerArgs.add_cli_args" + "".join(f"; {n}" for n in notes),
        "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        "flags": flags,
    }


def download(version: str, folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", f"sglang=={version}", "--no-deps", "--quiet",
                    "-d", str(folder)], check=True)
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
        lines += [f'      "source": {json.dumps(d["source"])},', f'      "wheel_sha256": {json.dumps(d["wheel_sha256"])},',
                  '      "flags": [']
        lines += [f"        {json.dumps(f)}" + ("," if j < len(d["flags"]) - 1 else "") for j, f in enumerate(d["flags"])]
        lines += ["      ]", "    }" + ("," if i < len(versions) - 1 else "")]
    lines += ["  }", "}", ""]
    out.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="*", help=f"sglang releases to read (default: {' '.join(DEFAULT_VERSIONS)})")
    p.add_argument("--wheel", action="append", type=Path, default=[], help="read this wheel instead of downloading")
    p.add_argument("-o", "--output", type=Path, default=OUT)
    args = p.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        wheels = list(args.wheel) + [download(v, Path(tmp)) for v in (args.versions or ([] if args.wheel else DEFAULT_VERSIONS))]
        for wheel in wheels:
            try:
                d = read_wheel(wheel)
            except Unsupported as e:
                raise SystemExit(f"{wheel.name}: {e}") from None
            results[d.pop("version")] = d
            print(f"{wheel.name}: {len(d['flags'])} flags, {sum(len(f['options']) for f in d['flags'])} option strings")
    ordered = dict(sorted(results.items(), key=lambda kv: tuple(int(x) for x in kv[0].split(".") if x.isdigit()), reverse=True))
    write({"about": "SGLang server flags per release, read from each wheel's source (never imported) by "
                    "scripts/sglang_flags.py; regenerate with it, do not edit by hand. nargs: 0 takes no value, "
                    "null exactly one, '?', '*' or '+' as in argparse.",
           "versions": ordered}, args.output)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
