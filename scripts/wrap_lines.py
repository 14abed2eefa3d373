#!/usr/bin/env python3
"""Bring Python files to lines of at most 100 characters, changing layout only.

    python scripts/wrap_lines.py toolkit/cli.py toolkit/cluster/*.py ...

In this order: comments over the width are filled again (a trailing one goes on its own lines above
its code); docstrings are filled again paragraph by paragraph (a list item keeps its hanging indent;
a paragraph with no long line is left as it is); each statement with a long line is laid out by
`ruff format --range` (line length 100, quotes kept: only that statement changes); adjacent string
literals with a long line are packed again into literals that break at a space (the same constant:
implicit concatenation). Each file's syntax tree, docstrings compared word by word, is checked to be
the one it had. What is left over the width (a word or an f-string expression longer than a line,
text inside a multi-line string) is listed for a person to wrap.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import textwrap
import tokenize

WIDTH = 100
LIST_ITEM = re.compile(r"(\s*)([-*\u2022]|\d+[.)]) ")
STARTS_OTHER = re.compile(r"^\s*(?:[-*\u2022|>]|\d+[.)]|>>>|\$ )")  # a line that starts something else
TRIPLE = ('"' * 3, "'" * 3)
BACKSLASH = "\\"


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" "))]


def docstring_rows(src: str) -> list[tuple[int, int]]:
    """(first, last) row, 1-based, of every module, class and function docstring."""
    rows = []
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body:
            e = n.body[0]
            if isinstance(e, ast.Expr) and isinstance(e.value, ast.Constant) and isinstance(e.value.value, str):
                rows.append((e.lineno, e.end_lineno))
    return rows


def _fill_docstring(lines: list[str], start: int, end: int) -> None:
    """lines[start:end + 1] (0-based) are one docstring: each paragraph with a long line is filled again."""
    i = start
    while i <= end:
        first = lines[i]
        if not first.strip() or first.rstrip().endswith(BACKSLASH):
            i += 1
            continue
        m = LIST_ITEM.match(first)
        cont = _indent(first) + " " * (len(m.group(2)) + 1) if m else _indent(first)
        j = i
        while j + 1 <= end:
            nxt = lines[j + 1]
            if (not nxt.strip() or _indent(nxt) != cont or STARTS_OTHER.match(nxt) or nxt.strip().startswith(TRIPLE)
                    or nxt.rstrip().endswith(BACKSLASH)):
                break
            j += 1
        if any(len(x) > WIDTH for x in lines[i:j + 1]):
            text = " ".join(x.strip() for x in lines[i:j + 1])
            new = textwrap.wrap(text, WIDTH, initial_indent=_indent(first), subsequent_indent=cont,
                                break_long_words=False, break_on_hyphens=False)
            lines[i:j + 1] = new
            end += len(new) - (j + 1 - i)
            j = i + len(new) - 1
        i = j + 1


def _fill_comment(lines: list[str], row: int, col: int) -> None:
    """The comment at lines[row] (0-based) from `col`, filled again; a trailing one goes above its code."""
    line = lines[row]
    code, comment = line[:col].rstrip(), line[col:]
    text = comment.lstrip("#").strip()
    if re.fullmatch(r"-+", text):  # a rule: as long as the width allows
        lines[row] = (line[:col] + "# " + text)[:WIDTH]
        return
    if not code:
        hashes = re.match(r"#+", comment).group(0)
        new = textwrap.wrap(text, WIDTH - col - len(hashes) - 1, break_long_words=False, break_on_hyphens=False)
        lines[row:row + 1] = [f"{line[:col]}{hashes} {t}" for t in new] or [line]
        return
    ind = _indent(line)
    new = textwrap.wrap(text, WIDTH - len(ind) - 2, break_long_words=False, break_on_hyphens=False)
    lines[row:row + 1] = [f"{ind}# {t}" for t in new] + [code]


def prose(src: str) -> str:
    """Comments, then docstrings, filled again where a line is over the width."""
    lines = src.split("\n")
    toks = tokenize.generate_tokens(io.StringIO(src).readline)
    for row, col in sorted((t.start for t in toks if t.type == tokenize.COMMENT), reverse=True):
        line = lines[row - 1]
        if len(line) <= WIDTH or "noqa" in line or "type:" in line[col:]:
            continue
        if line[:col].strip() and row >= 2 and lines[row - 2].rstrip().endswith(BACKSLASH):
            continue  # a comment line cannot go inside a backslash continuation
        _fill_comment(lines, row - 1, col)
    src = "\n".join(lines)
    lines = src.split("\n")
    for first, last in sorted(docstring_rows(src), reverse=True):
        _fill_docstring(lines, first - 1, last - 1)
    return "\n".join(lines)


def code(path: str) -> None:
    """`ruff format --range` on each statement with a long line that is no docstring."""
    tried: set[str] = set()
    for _ in range(1000):
        src = open(path, encoding="utf-8").read()
        docs = {r for a, b in docstring_rows(src) for r in range(a, b + 1)}
        todo = [(i, line) for i, line in enumerate(src.split("\n"), 1)
                if len(line) > WIDTH and i not in docs and line not in tried]
        if not todo:
            return
        row, line = todo[0]
        tried.add(line)
        subprocess.run(["ruff", "format", "-q", "--line-length", str(WIDTH), "--config",
                        "format.quote-style='preserve'", "--range", f"{row}:1-{row}:{len(line) + 1}", path],
                       check=False)


def _pieces(body: str, fstring: bool) -> list[str]:
    """`body` cut after each space outside an f-string's {...}, never after a backslash."""
    out, depth, i, start = [], 0, 0, 0
    while i < len(body):
        c = body[i]
        if fstring and body[i:i + 2] in ("{{", "}}") and depth == 0:
            i += 2
            continue
        if fstring and c == "{":
            depth += 1
        elif fstring and c == "}":
            depth -= 1
        elif c == BACKSLASH:
            i += 2
            continue
        elif c == " " and depth == 0 and i + 1 < len(body) and body[i + 1] != " ":
            out.append(body[start:i + 1])
            start = i + 1
        i += 1
    out.append(body[start:])
    return [x for x in out if x]


def _literal(s: str) -> tuple[str, str, str] | None:
    """(prefix, quote, body) of a one-line literal, or None for a triple-quoted one."""
    m = re.match(r"([A-Za-z]*)('|\")", s)
    prefix, q = m.group(1).lower(), m.group(2)
    if s[len(prefix):].startswith(q * 3):
        return None
    return prefix, q, s[len(prefix) + 1:-1]


def _pack_once(src: str, tried: set) -> str | None:
    """`src` with one run of adjacent literals packed again, or None when none is left to do."""
    lines = src.split("\n")
    docs = {r for a, b in docstring_rows(src) for r in range(a, b + 1)}
    toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    depth, depths = 0, {}
    for n, t in enumerate(toks):
        depths[n] = depth
        if t.type == tokenize.OP and t.string in "([{":
            depth += 1
        elif t.type == tokenize.OP and t.string in ")]}":
            depth -= 1
    runs, cur = [], []
    for n, t in enumerate(toks):
        if t.type == tokenize.STRING and t.start[0] == t.end[0] and t.start[0] not in docs:
            cur.append(n)
        elif not (t.type == tokenize.NL and cur):
            if cur:
                runs.append(cur)
            cur = []
    for run in runs:
        first, last = toks[run[0]], toks[run[-1]]
        key = (first.start, last.end)
        if key in tried or not any(len(lines[r - 1]) > WIDTH for r in range(first.start[0], last.end[0] + 1)):
            continue
        tried.add(key)
        lits = [_literal(toks[n].string) for n in run]
        if len({toks[n].start[0] for n in run}) != len(run) or None in lits:
            continue  # two literals on one line, or a triple-quoted one: left as they are
        if len({p.replace("f", "") for p, _, _ in lits}) != 1 or len({q for _, q, _ in lits}) != 1:
            continue
        base, q = lits[0][0].replace("f", ""), lits[0][1]
        anyf = any("f" in p for p, _, _ in lits)
        if anyf and "r" in base:
            continue
        body = "".join(b if "f" in p or not anyf else b.replace("{", "{{").replace("}", "}}") for p, _, b in lits)
        single = len(run) == 1
        wrap = depths[run[0]] == 0 and single  # a lone literal outside brackets: put in parentheses
        if wrap and toks[run[0] - 1].type == tokenize.STRING:
            continue
        col0 = first.start[1]
        start = col0 + (1 if wrap else 0)
        cont = toks[run[1]].start[1] if not single else start
        tail = len(lines[last.end[0] - 1]) - last.end[1]
        packed, line = [], ""
        for piece in _pieces(body, anyf):
            room = WIDTH - (start if not packed else cont) - len(base) - 2
            if line and len(line) + len(piece) > room - 1:
                packed.append(line)
                line = piece
            else:
                line += piece
        packed.append(line)
        col = start if len(packed) == 1 else cont
        if col + len(base) + 3 + len(packed[-1]) + tail + (1 if wrap else 0) > WIDTH:
            last_pieces = _pieces(packed[-1], anyf)
            if len(last_pieces) > 1:
                packed[-1:] = ["".join(last_pieces[:-1]), last_pieces[-1]]
        if wrap and len(packed) == 1:
            continue

        def lit(part: str) -> str:
            return f"{'f' if anyf and ('{' in part or '}' in part) else ''}{base}{q}{part}{q}"

        new = ("\n" + " " * cont).join(lit(p) for p in packed)
        if wrap:
            new = "(" + new + ")"
        head, rest = lines[first.start[0] - 1][:col0], lines[last.end[0] - 1][last.end[1]:]
        out = "\n".join(lines[: first.start[0] - 1] + (head + new + rest).split("\n") + lines[last.end[0]:])
        if out != src:
            return out
    return None


def strings(src: str) -> str:
    tried: set = set()
    for _ in range(3000):
        out = _pack_once(src, tried)
        if out is None:
            break
        ast.parse(out)
        src, tried = out, set()
    return src


def _same_tree(a: str, b: str) -> bool:
    def dump(src: str) -> str:
        tree = ast.parse(src)
        for n in ast.walk(tree):
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body:
                e = n.body[0]
                if isinstance(e, ast.Expr) and isinstance(e.value, ast.Constant) and isinstance(e.value.value, str):
                    e.value.value = " ".join(e.value.value.split())
        return ast.dump(tree)
    return dump(a) == dump(b)


def main(paths: list[str]) -> int:
    left = []
    for path in paths:
        before = open(path, encoding="utf-8").read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(prose(before))
        code(path)
        with open(path, encoding="utf-8") as f:
            after = strings(f.read())
        with open(path, "w", encoding="utf-8") as f:
            f.write(after)
        if not _same_tree(before, after):
            with open(path, "w", encoding="utf-8") as f:
                f.write(before)
            print(f"{path}: its syntax tree would change; left as it was", file=sys.stderr)
            continue
        left += [f"{path}:{i}: {len(x)}" for i, x in enumerate(after.split("\n"), 1) if len(x) > WIDTH]
    for line in left:
        print(line)
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
