"""Prompt files: every line (or row, job.sources) of a dataset scanned into `Prompt`s
(job/promptline), every one validated before any GPU time is spent; a prompt read again at its
place (`PromptReader`); ids checked unique across a job's datasets."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from toolkit.formats.runplan import RunPlan
from toolkit.job.promptline import InputError, Prompt, content_digest, parse_line
from toolkit.job.readers import Source, SourceError
from toolkit.job.sources import BOM, open_source, source_sha256

__all__ = [
    "ExtraReader",
    "check_plan_inputs",
    "PromptReader",
    "duplicate_id",
    "extra_fields",
    "prompt_id",
    "read_prompt_at",
    "scan_dataset",
    "scan_lines",
    "check_unique_ids",
]


def scan_dataset(
    path: str | Path, dataset: str, errors: list[InputError] | None = None, *, digest: bool = True
) -> Iterator[Prompt]:
    """Yield every prompt of a JSONL file in order, validating each line (blank lines are skipped).

    A bad line raises InputError; with an `errors` list, it is appended there instead and the scan
    goes on. Lines without an id whose content an earlier one of the file has get the occurrence's
    number: `<id>-2`, `<id>-3`. Without `digest`, contents are not hashed (a pass that needs no ids
    and no digests): lines without an id have the id "" (`prompt_id` derives it when it is needed).
    """
    path = str(path)
    source = _open(path, dataset)
    n = 0
    before = len(errors) if errors is not None else 0
    with contextlib.closing(source):
        for p in scan_lines(
            source.lines(), path, dataset, errors=errors, digest=digest, seen={}, rows=source.rows
        ):
            n += 1
            yield p
    if n == 0 and (errors is None or len(errors) == before):
        raise InputError(
            path,
            None,
            None,
            f"dataset {dataset!r} has no prompts; add prompts or remove it from the job",
        )


@contextlib.contextmanager
def source_errors(path: str, dataset: str) -> Iterator[None]:
    """Reading dataset `dataset`'s source at `path`: an InputError naming it when it is not there or
    not a source of prompts."""
    try:
        yield
    except FileNotFoundError:
        raise InputError(
            path,
            None,
            None,
            f"prompt file of dataset {dataset!r} not found; check [[datasets]] path",
        ) from None
    except SourceError as e:
        raise InputError(path, None, None, e.problem) from None


def _open(path: str, dataset: str) -> Source:
    """The source of a dataset's prompts (`source_errors`)."""
    with source_errors(path, dataset):
        return open_source(path)


def scan_lines(
    lines: Iterable[bytes],
    path: str,
    dataset: str,
    *,
    first_line: int = 1,
    offset: int = 0,
    errors: list[InputError] | None = None,
    digest: bool = False,
    seen: dict[str, int] | None = None,
    rows: bool = False,
) -> Iterator[Prompt]:
    """The prompts of consecutive lines of a JSONL file (each with its newline), the first being
    line `first_line` at byte `offset`: a slice of a file read on its own (see scan_dataset for the
    rest). With `seen` (derived id -> occurrences so far, over the whole file), repeated contents
    without an id are numbered. With `rows`, each line is a table's row (sources.Source.rows): its
    place is its row index, length 1."""
    for lineno, raw in enumerate(lines, start=first_line):
        length = 1 if rows else len(raw)
        body = raw.rstrip(b"\r\n")
        if body.strip():
            try:
                p = parse_line(body, path, dataset, lineno, digest)
            except InputError as e:
                if errors is None:
                    raise
                errors.append(e)
            else:
                p.offset, p.length = offset, 1 if rows else len(body)
                if not p.named and digest and seen is not None:
                    k = seen[p.id] = seen.get(p.id, 0) + 1
                    if k > 1:
                        p.id = f"{p.id}-{k}"
                yield p
        offset += length


def read_prompt_at(path: str | Path, dataset: str, line: int, offset: int, length: int) -> Prompt:
    """Re-read one prompt the plan located at (offset, length); see PromptReader for many."""
    with PromptReader() as reader:
        return reader.read(path, dataset, line, offset, length)


class _Sources:
    """Each source read so far, kept open: workers read thousands of prompts."""

    def __init__(self) -> None:
        self._open: dict[str, Source] = {}

    def line(self, path: str | Path, offset: int, length: int) -> bytes:
        path = str(path)
        source = self._open.get(path)
        if source is None:
            source = self._open[path] = open_source(path)
        return source.read(offset, length)

    def close(self) -> None:
        for source in self._open.values():
            source.close()
        self._open.clear()


class PromptReader(_Sources):
    """Reads planned prompts by the place the plan pinned (a line's byte offset and length, or a
    row's index: sources.Source.read)."""

    def read(self, path: str | Path, dataset: str, line: int, offset: int, length: int) -> Prompt:
        p = parse_line(self.line(path, offset, length), str(path), dataset, line)
        p.offset, p.length = offset, length
        return p

    def __enter__(self) -> PromptReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# what a prompt line says to the toolkit
LINE_FIELDS = frozenset({"id", "messages", "prompt", "conversations", "tools"})
_raw_fields = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode


def extra_fields(raw: bytes) -> dict[str, Any]:
    """The fields of a prompt line besides LINE_FIELDS (a dataset's `source`, `category`, ...), as
    the line has them; the messages are not decoded."""
    return {
        k: msgspec.json.decode(v)
        for k, v in _raw_fields(raw.removeprefix(BOM)).items()
        if k not in LINE_FIELDS
    }


class ExtraReader(_Sources):
    """The extra fields of planned prompt lines, read at the places the plan pinned, sources kept
    open."""

    def read(self, path: str | Path, offset: int, length: int) -> dict[str, Any]:
        return extra_fields(self.line(path, offset, length))


def prompt_id(p: Prompt) -> str:
    """The prompt's id, derived from its content if it was scanned without `digest` (repeats are not
    numbered)."""
    return p.id or f"{p.dataset}:{content_digest(p.messages, p.tools)}"


def duplicate_id(path: str, line: int, pid: str, prev_path: str, prev_line: int) -> InputError:
    """The error of a line whose id an earlier line (`prev_path`:`prev_line`) uses."""
    return InputError(
        path,
        line,
        "id",
        f"duplicate id {pid!r}: already used at {prev_path}:{prev_line}; ids must be "
        "unique across the job",
    )


def check_unique_ids(
    prompts: Iterator[Prompt] | list[Prompt],
    paths: dict[str, str],
    errors: list[InputError] | None = None,
) -> None:
    """Find every id used twice, within or across datasets, naming both places: raise on the first,
    or with an `errors` list, append each there."""
    seen: dict[str, tuple[str, int]] = {}
    for p in prompts:
        prev = seen.setdefault(p.id, (p.dataset, p.line))
        if prev != (p.dataset, p.line):
            e = duplicate_id(paths[p.dataset], p.line, p.id, paths[prev[0]], prev[1])
            if errors is None:
                raise e
            errors.append(e)


def check_plan_inputs(plan: RunPlan) -> None:
    """Refuse to generate from a prompt file that changed since planning (its records would not
    match)."""
    for d in plan.datasets:
        try:
            now = source_sha256(d.path)
        except FileNotFoundError:
            raise InputError(
                d.path,
                None,
                None,
                f"prompt file of dataset {d.name!r} is gone since the run was planned",
            ) from None
        if now != d.sha256:
            raise InputError(
                d.path,
                None,
                None,
                f"changed since the run was planned (sha256 {d.sha256[:12]} -> {now[:12]}); "
                "restore it or plan a new run",
            )
