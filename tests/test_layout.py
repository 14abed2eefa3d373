"""The package's layout is one-way: no import cycle between toolkit modules.

Every `import` and `from ... import` of a toolkit module counts, at module level or inside a function (a
function-level import hides a cycle, it does not remove it), and so do the `__init__`s of the packages that hold
the imported module, when they import anything themselves: Python runs them first.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "toolkit"


def _module_name(path: Path) -> str:
    parts = ["toolkit", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: toolkit modules it imports}; a package counts as its `__init__`."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    runs: dict[str, set[str]] = {
        m: set() for m in files
    }  # package __init__s an import runs on the way
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    base = ".".join(base + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from . import audit` imports the module toolkit.dataset.audit; `from .merge import X` imports toolkit.dataset.merge
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            for t in targets:
                while (
                    t and t not in files
                ):  # `import toolkit.x.y` -> the innermost toolkit module it names
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
                runs[mod].update(_packages_run(t, mod, files))
    for (
        mod,
        packages,
    ) in runs.items():  # an __init__ that imports no toolkit module loads nothing more
        graph[mod].update(p for p in packages if graph[p])
    return graph


def _packages_run(target: str, mod: str, files: dict) -> set[str]:
    """The packages whose `__init__` importing `target` runs, leaving out those that hold `mod` (already run)."""
    run = set()
    parent = target.rpartition(".")[0]
    while parent:
        if parent in files and not (mod == parent or mod.startswith(parent + ".")):
            run.add(parent)
        parent = parent.rpartition(".")[0]
    return run


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = import_graph()
    assert {"toolkit.cli", "toolkit.dataset.merge", "toolkit.engines.base"} <= graph.keys()
    assert (
        "toolkit.formats.records" in graph["toolkit.dataset.merge"]
    )  # the graph sees imports at all
    assert _packages_run(
        "toolkit.engines.sglang_contract.flags", "toolkit.job.spec", {"toolkit", "toolkit.engines"}
    ) == {"toolkit.engines"}, "importing a module runs the __init__ of its package"
    found = cycles(graph)
    shown = "\n".join(
        "  "
        + " <-> ".join(c)
        + "\n    "
        + "; ".join(f"{a} imports {b}" for a in c for b in sorted(graph[a]) if b in c)
        for c in found
    )
    assert not found, f"import cycles between toolkit modules:\n{shown}"


# The packages, in layers top to bottom: a module may import its own layer or any layer below it, never one above.
# A module is placed by the longest name here that is it or a package holding it. The layers follow where code
# runs: the command line; what runs a job (on Slurm, or here); what runs on a GPU node (worker) and what makes a
# dataset of its shards (dataset); what a job is (job); the engines and their HTTP client; the on-disk formats.
LAYERS = [
    ("command line", ["toolkit.cli", "toolkit.__main__"]),
    ("running", ["toolkit.cluster", "toolkit.pipeline"]),
    ("stages", ["toolkit.worker", "toolkit.dataset", "toolkit"]),
    ("job", ["toolkit.job"]),
    ("engines", ["toolkit.engines", "toolkit.stub"]),
    ("formats", ["toolkit.formats", "toolkit.errors"]),
]
# Rooms of one layer that do not use each other: the worker never reads a merged dataset and the dataset never
# generates; Slurm and a run here are two ways of running the same steps; the stub is a program of its own, which
# the engines start by name (`python -m toolkit.stub`) and nothing imports.
APART = [("toolkit.worker", "toolkit.dataset"), ("toolkit.cluster", "toolkit.pipeline")]
NOT_IMPORTED = ["toolkit.stub"]


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_of(module: str) -> int | None:
    best, found = -1, None
    for i, (_, names) in enumerate(LAYERS):
        for name in names:
            inside = (
                module.startswith(name + ".") and name != "toolkit"
            )  # `toolkit` is the package's __init__ only
            if (module == name or inside) and len(name) > best:
                best, found = len(name), i
    return found


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not unplaced, f"modules with no layer in tests/test_layout.py LAYERS: {unplaced}"


def test_imports_run_one_way():
    graph = import_graph()
    upward = [
        f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
        for a in sorted(graph)
        for b in sorted(graph[a])
        if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) < layer_of(a)
    ]
    assert not upward, (
        "imports against the layers, top to bottom "
        + " > ".join(n for n, _ in LAYERS)
        + ":\n  "
        + "\n  ".join(upward)
    )


def test_rooms_of_a_layer_keep_apart_and_nothing_imports_the_stub():
    graph = import_graph()
    crossing = [
        f"{a} imports {b}"
        for a in sorted(graph)
        for b in sorted(graph[a])
        for x, y in APART
        if _inside(a, x) and _inside(b, y) or _inside(a, y) and _inside(b, x)
    ]
    crossing += [
        f"{a} imports {b} (a separate program: start it by name)"
        for a in sorted(graph)
        for b in sorted(graph[a])
        for s in NOT_IMPORTED
        if _inside(b, s) and not _inside(a, s)
    ]
    assert not crossing, "\n  ".join(["imports between rooms that keep apart:", *crossing])


def test_layer_check_can_fail():
    assert (
        layer_of("toolkit.stub.app")
        == layer_of("toolkit.engines.sglang_contract.flags")
        == len(LAYERS) - 2
    )
    assert (
        layer_of("toolkit.cli")
        < layer_of("toolkit.worker.run")
        < layer_of("toolkit.formats.records")
    )
    assert layer_of("toolkit.not_placed") is None


def test_nothing_below_the_cli_parses_arguments():
    """argparse belongs to the command line; the separate programs (stub server, rank launcher, toy tokenizer)
    and the SGLang flag checker, which mirrors SGLang's own parser, have command lines of their own."""
    own_programs = (
        "toolkit.cli",
        "toolkit.stub",
        "toolkit.engines.rank",
        "toolkit.engines.sglang",
        "toolkit.engines.sglang_contract.flags",
        "toolkit.stub.toy_tokenizer",
    )
    users = []
    for path in PACKAGE.rglob("*.py"):
        mod = _module_name(path)
        if any(mod == p or mod.startswith(p + ".") for p in own_programs):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
                if "argparse" in names:
                    users.append(mod)
            elif isinstance(node, ast.Attribute) and node.attr in ("Namespace",):
                users.append(mod)
    assert not sorted(set(users)), f"modules below the CLI that use argparse: {sorted(set(users))}"


def test_reading_a_spec_loads_no_engine_or_client():
    """What the import graph says, checked in a fresh interpreter: the spec (a format) loads only formats."""
    import subprocess
    import sys

    code = "import sys, toolkit.job.spec; print(sorted(m for m in sys.modules if m.startswith('toolkit')))"
    loaded = eval(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert "toolkit.job.spec" in loaded
    graph = import_graph()
    empty_packages = {
        m
        for m in graph
        if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists() and not graph[m]
    }  # a package __init__ that imports nothing loads nothing
    assert "toolkit.engines" in empty_packages
    above = [
        m
        for m in loaded
        if layer_of(m) is not None
        and layer_of(m) < layer_of("toolkit.job.spec")
        and m != "toolkit"
        and m not in empty_packages
    ]
    assert not above, f"importing toolkit.job.spec loads modules above the formats: {above}"


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # its parent is a module, not a package
        return False


def test_the_benchmarks_and_scripts_import_names_the_package_has():
    """Every `from toolkit... import name` in benchmarks/ and scripts/, also inside functions, names a module and
    an attribute that exist: the suite does not run the benchmarks, so a rename would otherwise break them unseen."""
    import importlib

    broken = []
    for path in sorted(
        [*(PACKAGE.parent / "benchmarks").glob("*.py"), *(PACKAGE.parent / "scripts").glob("*.py")]
    ):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and (node.module or "").split(".")[0] == "toolkit"
            ):
                module = importlib.import_module(node.module)
                broken += [
                    f"{path.name}:{node.lineno}: {node.module}.{a.name}"
                    for a in node.names
                    if not hasattr(module, a.name) and not _is_module(f"{node.module}.{a.name}")
                ]
    assert not broken, "imports of names the toolkit does not have:\n  " + "\n  ".join(broken)


def test_the_readme_names_every_module_in_its_layer():
    """docs/architecture.md's table of layers says what LAYERS enforces: each module, by its name under toolkit/,
    in backticks in the row of its layer (`engines/` stands for the engines package)."""
    import re

    readme = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    wrong = []
    for name, modules in LAYERS:
        row = re.search(rf"^\| {re.escape(name)} \|(.*)$", readme, re.M)
        if row is None:
            wrong.append(f"no row for the layer {name!r}")
            continue
        named = set(re.findall(r"`([\w/]+)`", row.group(1)))
        for m in modules:
            short = m.removeprefix("toolkit.").replace(".", "/")
            if (
                m not in ("toolkit", "toolkit.__main__")
                and short not in named
                and f"{short}/" not in named
            ):
                wrong.append(f"{m} is not named in docs/architecture.md's row {name!r}")
    assert not wrong, "\n".join(wrong)
