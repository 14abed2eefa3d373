"""Where a job's paths point: `~` and environment variables expanded, relative paths resolved from
the job file's folder, and the variables a path names that are not set said by name (a path with
`${DATA_ROOT}` left in it would fail later, far from the key that holds it)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.job.specerrors import SpecError

if TYPE_CHECKING:
    from toolkit.job.schema import JobSpec, ModelSpec

_VAR = re.compile(r"\$(\w+)|\$\{([^}]*)\}")


def _unset(expanded: str) -> list[str]:
    """The environment variables a path (expanded) still names that are not set."""
    names = (m.group(1) or m.group(2) for m in _VAR.finditer(expanded))
    return [name for name in names if name not in os.environ]


def resolve(
    base: Path, p: str | None, where: str | None = None, source: Path | None = None
) -> str | None:
    """`p` with ~ and environment variables expanded, relative to `base`. With `where`, a variable
    that is not set is an error naming the key (os.path.expandvars would leave `${DATA_ROOT}` in the
    path)."""
    if p is None:
        return None
    expanded = os.path.expandvars(os.path.expanduser(p))
    if where is not None:
        for name in _unset(expanded):
            raise SpecError(
                f"{source}: {where}: environment variable {name} is not set "
                "(export it, or write the path out)"
            )
    q = Path(expanded)
    return str(q if q.is_absolute() else (base / q).resolve())


def relative(written: str, base: Path) -> str:
    """How a path that was written relative was resolved (for a message that it does not exist):
    from the job file's folder, not the current one."""
    expanded = os.path.expandvars(os.path.expanduser(written))
    if Path(expanded).is_absolute():
        return ""
    shown = f"{written!r}" + (f", i.e. {expanded!r}" if expanded != written else "")
    return f" ({shown} is relative: it resolves from the job file's folder {base}, not from here)"


def check_unset_variables(spec: JobSpec, source: Path) -> None:
    """Every environment variable the job's paths name that is not set, said at once (one at a time
    would take a user as many tries); one variable keeps the message of the key that names it."""
    paths = [
        ("output_dir", spec.output_dir),
        ("[model] path", spec.model.path),
        ("[model] tokenizer_path", spec.model.tokenizer_path),
        ("[model] chat_template", spec.model.chat_template),
    ]
    paths += [("[[datasets]] path", d.path) for d in spec.datasets]
    unset: dict[str, list[str]] = {}
    for where, p in paths:
        for name in _unset(os.path.expandvars(os.path.expanduser(p or ""))):
            if where not in unset.setdefault(name, []):
                unset[name].append(where)
    if len(unset) > 1:
        said = "; ".join(f"{name} (in {', '.join(keys)})" for name, keys in unset.items())
        raise SpecError(
            f"{source}: environment variables not set: {said}; export them (e.g. `export "
            f"{'=... '.join(unset)}=...`), or write the paths out"
        )


def looks_local(p: str, base: Path) -> bool:
    """False only for a Hugging Face hub id (`org/name`) that is not also a local folder."""
    return (base / p).exists() or not re.fullmatch(r"[\w.-]+/[\w.-]+", p) or p.startswith(".")


def resolve_model_paths(
    m: ModelSpec, kind: str, source: Path, base: Path, check_paths: bool
) -> None:
    """[model]: the weights' and the tokenizer's paths resolved when they look local (hub ids,
    `org/name`, stay as they are), the chat template's always; with `check_paths`, each must
    exist."""

    # Hub ids ("org/name") stay as they are; local-looking paths are resolved.
    def key(name: str) -> str | None:
        return name if check_paths else None

    m.path = (
        resolve(base, m.path, key("[model] path"), source) if looks_local(m.path, base) else m.path
    )
    if m.tokenizer_path is not None:
        m.tokenizer_path = (
            resolve(base, m.tokenizer_path, key("[model] tokenizer_path"), source)
            if looks_local(m.tokenizer_path, base)
            else m.tokenizer_path
        )
    m.chat_template = resolve(base, m.chat_template, key("[model] chat_template"), source)
    if check_paths and m.chat_template and not Path(m.chat_template).is_file():
        raise SpecError(f"{source}: [model] chat_template file {m.chat_template} does not exist")
    tok = m.tokenizer_path or m.path
    if check_paths and kind != "external" and looks_local(tok, base) and not Path(tok).exists():
        raise SpecError(
            f"{source}: [model] tokenizer path {tok} does not exist "
            f"(set `tokenizer_path` if the tokenizer lives apart from the weights)"
        )
