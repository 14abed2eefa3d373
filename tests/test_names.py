"""Every module path the docs and the docstrings name is there: `toolkit.x.y`, or `x.y` of the package's own
subpackages (`worker.claims`, `formats.logline.parse_text`), resolves to a module or something in one; every
file the docs name as `formats/shardstate.py` or `worker/claims` is one."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [
    "cli",
    "errors",
    "pipeline",
    "worker",
    "cluster",
    "dataset",
    "job",
    "engines",
    "formats",
    "stub",
]
# `toolkit.job.plan`, `worker.claims`, `formats.logline.parse_text`: a name after no word, dot, slash or brace
NAMED = re.compile(
    r"(?<![\w./{\-])(?:toolkit\.)?((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)"
)


# `formats/shardstate.py`, `worker/claims`: a file of the package, as the README's figure and docs/ name them
FILE = re.compile(
    r"(?<![\w./-])((?:worker|cluster|dataset|job|engines|formats|stub)(?:/\w+)+)(?:\.py)?(?![\w/])"
)


def resolves(name: str) -> bool:
    """Whether `toolkit.<name>` is a module, or an attribute path inside the deepest module it starts with
    (`errors.py`, `cluster/status.py` named as a file: that file)."""
    if name.endswith(".py"):
        return (ROOT / "toolkit" / f"{name[:-3].replace('.', '/')}.py").exists()
    parts = ["toolkit", *name.split(".")]
    for i in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _prose_of(path: Path) -> str:
    """A module's docstrings and comments (its code names things that are not paths: `dataset.name`)."""
    text = path.read_text()
    docs = [
        ast.get_docstring(n, clean=False) or ""
        for n in ast.walk(ast.parse(text))
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    comments = [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT
    ]
    return "\n".join(docs + comments)


def test_resolves_can_fail():
    assert (
        resolves("formats.logline.parse_text")
        and resolves("worker.claims")
        and resolves("errors.ERROR_CLASS_BY_CODE")
    )
    assert not resolves("job.plan.no_such_thing") and not resolves("formats.no_such_module")
    assert resolves("errors.py") and not resolves("mistakes.py") and not resolves("formats.gone.py")


def test_every_module_path_named_in_docs_and_docstrings_exists():
    texts = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    texts |= {p: _prose_of(p) for p in sorted((ROOT / "toolkit").rglob("*.py"))}
    missing = sorted(
        {
            f"{p.relative_to(ROOT)}: {m.group(1)}"
            for p, text in texts.items()
            for m in NAMED.finditer(text)
            if not resolves(m.group(1).rstrip("."))
        }
    )
    missing += sorted(
        {
            f"{p.relative_to(ROOT)}: {m.group(1)}"
            for p, text in texts.items()
            if p.suffix == ".md"
            for m in FILE.finditer(text)
            if not (ROOT / "toolkit" / f"{m.group(1)}.py").exists()
            and not (ROOT / "toolkit" / m.group(1)).is_dir()
        }
    )
    assert not missing, "module paths that are not there (moved or renamed?):\n  " + "\n  ".join(
        missing
    )
