"""What the author of a job spec reads when a key is wrong: an unknown key with the closest known
ones, a value of the wrong type in TOML's words (what the key takes), each with the file and the
line.

`unknown_keys(data, schema)` walks the decoded TOML against the spec's Structs before msgspec sees
it; `explain_validation(error, data, schema)` turns msgspec's `... - at $.client.concurrency` into
the TOML key, what it takes and what it got; `key_line(text, path)` finds the line a key is written
on.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import msgspec
from msgspec import inspect as mi

from toolkit.errors import BadInputError


class SpecError(BadInputError):
    """A job spec that cannot be run. The message names the file and the key."""


__all__ = [
    "KeyProblem",
    "closest",
    "did_you_mean",
    "explain_validation",
    "key_line",
    "table_name",
    "unknown_keys",
    "value_at",
    "where",
]

KeyPath = tuple  # of str (table keys) and int (the index in an array of tables)


class KeyProblem(msgspec.Struct, frozen=True):
    """One wrong key: where it is (its path in the TOML document) and what to say."""

    path: tuple
    message: str


def closest(word: str, known) -> list[str]:
    """The known names nearest to `word` (a typo, a missing or extra letter, another case), best
    first."""
    known = sorted(known)
    by_case = [k for k in known if k.lower() == word.lower()]
    if by_case:
        return by_case
    scored = sorted(
        ((difflib.SequenceMatcher(None, word, k).ratio(), k) for k in known), reverse=True
    )
    best = scored[0][0] if scored else 0.0
    return [k for score, k in scored[:3] if score >= 0.6 and score >= best - 0.1]


def did_you_mean(word: str, known) -> str:
    near = closest(word, known)
    if not near:
        return ""
    return "; did you mean " + " or ".join(f"`{k}`" for k in near) + "?"


def table_name(path: KeyPath, data: Any = None) -> str:
    """The TOML table a path is in, as its author wrote it: [client], [engine.stub], [[datasets]] #2
    ('math')."""
    parts: list[str] = []
    node = data
    out = ""
    for p in path:
        if isinstance(p, int):
            name = (
                node[p].get("name")
                if isinstance(node, list) and p < len(node) and isinstance(node[p], dict)
                else None
            )
            out = f"[[{'.'.join(parts)}]] #{p + 1}" + (
                f" ({name!r})" if isinstance(name, str) else ""
            )
            parts = []
        else:
            parts.append(p)
        node = node[p] if node is not None and _has(node, p) else None
    if parts:
        inner = ".".join(parts)
        return f"{out} {inner}".strip() if out else f"[{inner}]"
    return out or "the top level"


def where(path: KeyPath, data: Any = None) -> str:
    """`in [client]`, `in [[datasets]] #2 ('math') sampling`, or `at the top level`."""
    name = table_name(path, data)
    return "at the top level" if name == "the top level" else f"in {name}"


def _has(node: Any, p) -> bool:
    return (isinstance(node, dict) and p in node) or (
        isinstance(node, list) and isinstance(p, int) and p < len(node)
    )


def _struct_of(t: mi.Type) -> mi.StructType | None:
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, mi.UnionType):
        for u in t.types:
            if isinstance(u, mi.StructType):
                return u
    return None


def unknown_keys(data: Any, schema: type) -> list[KeyProblem]:
    """Every key of `data` (decoded TOML) that `schema` (a Struct) has no field for, with the
    closest known keys."""
    return _unknown(data, mi.type_info(schema), (), data)


def _unknown(data: Any, t: mi.Type, path: KeyPath, doc: Any) -> list[KeyProblem]:
    st = _struct_of(t)
    if st is not None and isinstance(data, dict):
        fields = {f.encode_name: f for f in st.fields}
        problems = []
        for key, value in data.items():
            if key not in fields:
                problems.append(
                    KeyProblem(
                        (*path, key),
                        f"unknown key `{key}` {where(path, doc)}{did_you_mean(key, fields)}",
                    )
                )
            else:
                problems += _unknown(value, fields[key].type, (*path, key), doc)
        return problems
    if isinstance(t, mi.ListType) and isinstance(data, list):
        return [
            p for i, item in enumerate(data) for p in _unknown(item, t.item_type, (*path, i), doc)
        ]
    return []


def takes(t: mi.Type) -> str:
    """What a value of type `t` is, in TOML's words."""
    if isinstance(t, mi.UnionType):
        kinds = [takes(u) for u in t.types if not isinstance(u, mi.NoneType)]
        return " or ".join(dict.fromkeys(kinds))
    if isinstance(t, mi.LiteralType):
        return (
            "one of " + ", ".join(_toml(v) for v in t.values)
            if len(t.values) > 1
            else _toml(t.values[0])
        )
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, mi.IntType):
        return "an integer"
    if isinstance(t, mi.FloatType):
        return "a number"
    if isinstance(t, mi.StrType):
        return "a string"
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        return f"a list of {_plural(takes(t.item_type))}"
    if isinstance(t, (mi.DictType, mi.StructType)):
        return "a table"
    return "a value of another type"


def _plural(kind: str) -> str:
    return {
        "an integer": "integers",
        "a number": "numbers",
        "a string": "strings",
        "a table": "tables",
        "true or false": "booleans",
    }.get(kind, kind)


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)


# A TOML value's type, as a message says it (bool before int: a boolean is an int in Python)
_TOML_TYPES = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (list, "a list"),
    (dict, "a table"),
)


def _toml_type(v: Any) -> str:
    return next((said for t, said in _TOML_TYPES if isinstance(v, t)), type(v).__name__)


_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$", re.S)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\[(\d+)\]")


def _parse_path(text: str) -> KeyPath:
    return tuple(
        m.group(1) if m.group(1) is not None else int(m.group(2)) for m in _STEP.finditer(text)
    )


def explain_validation(error: msgspec.ValidationError, data: Any, schema: type) -> KeyProblem:
    """msgspec's message of a value that does not fit the schema, said in TOML terms: which key, in
    which table, takes what, and what it got."""
    m = _AT.match(str(error))  # none at the top level: msgspec names no path there
    what, path = (m.group("what"), _parse_path(m.group("path"))) if m else (str(error), ())
    missing = re.match(r"Object missing required field `([^`]+)`", what)
    if missing:
        key = missing.group(1)
        t = _field_type(schema, (*path, key))
        return KeyProblem(
            path, f"{table_name(path, data)} needs `{key}`" + (f" ({takes(t)})" if t else "")
        )
    if not path:
        return KeyProblem(path, what)
    t = _field_type(schema, path)
    got = value_at(data, path)
    key = path[-1] if isinstance(path[-1], str) else f"item {path[-1] + 1}"
    table = where(path[:-1], data)
    shown = _toml(got) if isinstance(got, (str, int, float, bool)) else _toml_type(got)
    message = f"`{key}` {table} takes {takes(t) if t else what}, got {shown}"
    if isinstance(got, (str, int, float, bool)):
        message += f" ({_toml_type(got)})"
    choices = [
        v
        for u in _alternatives(t)
        if isinstance(u, mi.LiteralType)
        for v in u.values
        if isinstance(v, str)
    ]
    near = closest(got, choices) if isinstance(got, str) and choices else []
    if near:
        message += "; did you mean " + " or ".join(f'"{v}"' for v in near) + "?"
    return KeyProblem(path, message)


def _alternatives(t: mi.Type | None) -> list[mi.Type]:
    if t is None:
        return []
    return list(t.types) if isinstance(t, mi.UnionType) else [t]


def value_at(data: Any, path: KeyPath) -> Any:
    """The value at `path` in decoded TOML, or None."""
    node = data
    for p in path:
        if not _has(node, p):
            return None
        node = node[p]
    return node


def _field_type(schema: type, path: KeyPath) -> mi.Type | None:
    t: mi.Type | None = mi.type_info(schema)
    for p in path:
        if isinstance(p, int):
            t = t.item_type if isinstance(t, (mi.ListType, mi.VarTupleType)) else None
        else:
            st = _struct_of(t) if t is not None else None
            if st is not None:
                t = next((f.type for f in st.fields if f.encode_name == p), None)
            elif isinstance(t, mi.DictType):
                t = t.value_type
            else:
                t = None
        if t is None:
            return None
    return t


_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")


def _sections(text: str) -> list[tuple[str, int | None, int, list[tuple[int, str]]]]:
    """(table name, index in its array of tables or None, header line, [(line number, line)]) per
    table."""
    out: list[tuple[str, int | None, int, list[tuple[int, str]]]] = [("", None, 0, [])]
    counts: dict[str, int] = {}
    array, index = "", None
    for no, line in enumerate(text.splitlines(), 1):
        h = _HEADER.match(line)
        if h:
            name = h.group(2).replace(" ", "")
            if h.group(1) == "[[":
                counts[name] = counts.get(name, -1) + 1
                array, index = name, counts[name]
                out.append((name, index, no, []))
            else:
                out.append(
                    (name, index if array and name.startswith(array + ".") else None, no, [])
                )
            continue
        out[-1][3].append((no, line))
    return out


def key_line(text: str, path: KeyPath) -> int | None:
    """The 1-based line of `text` (a TOML document) where the key at `path` is written (in its
    table, in an inline table, or as a dotted key), else the line of the table it belongs to; None
    when neither can be found."""
    fallback = None
    for j in range(len(path), -1, -1):
        head, chain = path[:j], path[j:]
        if any(isinstance(p, int) for p in chain):
            continue
        name = ".".join(p for p in head if isinstance(p, str))
        index = next((p for p in reversed(head) if isinstance(p, int)), None)
        for sname, sindex, header, lines in _sections(text):
            if sname != name or (index is not None and sindex != index):
                continue
            if not chain:
                return header or None
            fallback = fallback or header or None
            first, last = re.escape(chain[0]), re.escape(chain[-1])
            for no, line in lines:
                if len(chain) == 1 and re.match(rf"^\s*[\"']?{first}[\"']?\s*=", line):
                    return no
                if len(chain) > 1 and (
                    re.match(rf"^\s*{first}\s*=\s*\{{.*(^|[{{,\s]){last}\s*=", line)
                    or re.match(rf"^\s*{re.escape('.'.join(chain))}\s*=", line)
                ):
                    return no
    return fallback
