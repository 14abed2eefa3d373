"""Where an export goes and how it lands there: the output's name (from `--format`, `-o` or the
default), its side files' names (`side_file`), and the temporary files renamed to them only when
every one is complete (`written`), removed when the export fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from toolkit.dataset.export.selection import DEFAULT_FORMAT, ExportError
from toolkit.dataset.trainers import TRAINERS
from toolkit.errors import FailedError
from toolkit.formats.files import io_problem
from toolkit.formats.frames import CorruptShard
from toolkit.formats.rundir import RunDir


def side_file(out_path: Path, what: str, suffix: str) -> Path:
    """A file beside the export, named after it: `.jsonl` dropped (`conversations.jsonl` ->
    `conversations_skipped.jsonl`, `conversations_summary.json`), another extension kept, its dot
    an underscore (`records.parquet` -> `records_parquet_summary.json`): exports of one name in two
    formats keep their own side files."""
    name, ext = out_path.name, out_path.suffix
    stem = name[: len(name) - len(ext)] + ("" if ext == ".jsonl" else ext.replace(".", "_"))
    return out_path.with_name(f"{stem}_{what}{suffix}")


def default_output(run_dir: str | os.PathLike, fmt: str, trainer: str = "specforge") -> Path:
    """Where an export goes when no output is given: RUN/export/records.jsonl, records.parquet,
    tokens.jsonl (for SpecForge; tokens_speculators.jsonl for speculators), conversations.jsonl."""
    default = RunDir(run_dir).export_file(fmt)
    return default.with_name(TRAINERS[trainer].output) if fmt == "tokens" else default


# the formats an output's extension holds, the one written without --format first
_JSON_LINES = ("tokens", "jsonl", "conversations")
EXTENSIONS = {".jsonl": _JSON_LINES, ".json": _JSON_LINES, ".parquet": ("parquet",)}


def output_format(output: str | os.PathLike | None, fmt: str | None) -> str:
    """The format an export writes: `fmt`; when None, the output's extension says it (`.parquet`:
    parquet; `.jsonl`, `.json`, no extension, a folder or no output: `DEFAULT_FORMAT`). An output
    whose extension is not one of `EXTENSIONS`, or one that `fmt` does not write, is refused
    (ExportError) before anything is written."""
    text = None if output is None else os.fspath(output)
    if text is None or text.endswith(("/", os.sep)) or Path(text).is_dir():
        return fmt or DEFAULT_FORMAT
    ext = Path(text).suffix
    if not ext:
        return fmt or DEFAULT_FORMAT
    holds = EXTENSIONS.get(ext.lower())
    said = f"--format {fmt}" if fmt else "no --format"
    if holds is None:
        raise ExportError(
            f"{text}: {said} and an output named {ext}: an export is written as .jsonl or .json "
            "(tokens, jsonl, conversations) or .parquet (parquet), uncompressed; name it so"
        )
    if fmt is None:
        return holds[0]
    if fmt not in holds:
        named = " or ".join(e for e, formats in EXTENSIONS.items() if fmt in formats)
        raise ExportError(
            f"{text}: --format {fmt} writes {_kind(fmt)}, an output named {ext} holds "
            f"{_kind(holds[0])}: name it {named}, or drop --format to write {holds[0]}; nothing "
            "written"
        )
    return fmt


def _kind(fmt: str) -> str:
    return "parquet" if fmt == "parquet" else "JSON lines"


def output_path(
    run_dir: str | os.PathLike,
    fmt: str,
    output: str | os.PathLike | None,
    trainer: str = "specforge",
) -> Path:
    """The file an export writes: `output`; the default name inside it when it is a folder or ends
    with a slash (the folder made when its parent exists); `default_output` when None."""
    default = default_output(run_dir, fmt, trainer)
    if output is None:
        return default
    text = os.fspath(output)
    path = Path(text)
    if text.endswith(("/", os.sep)) or path.is_dir():
        return path / default.name
    return path


def _unlink(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


@contextmanager
def written(
    finals: list[Path], out_path: Path, damaged: Callable[[CorruptShard], Exception]
) -> Iterator[list[Path]]:
    """The temporary names of `finals` (`.NAME.PID.tmp` beside each), renamed to their final names
    when the block ends: the files appear under their names only when complete. When the block
    fails every temporary file is removed: a damaged merged dataset raises `damaged(e)`, an OSError
    (a full disk, say) a FailedError naming `out_path`."""
    tmps = [p.with_name(f".{p.name}.{os.getpid()}.tmp") for p in finals]
    try:
        yield tmps
        for t, final in zip(tmps, finals):
            os.replace(t, final)
    except CorruptShard as e:
        _unlink(tmps)
        raise damaged(e) from None
    except OSError as e:
        _unlink(tmps)
        raise FailedError(io_problem(e, out_path, "export again")) from None
    except BaseException:
        _unlink(tmps)
        raise
