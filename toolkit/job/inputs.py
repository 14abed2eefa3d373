"""Prompts: lines (or rows, job.sources) decoded into `Prompt`s, every one validated before any GPU
time is spent.

A line is a chat, `{"id": ..., "messages": [{"role": ..., "content": ...}, ...], "tools": [...]}`,
a ShareGPT chat, `{"id": ..., "conversations": [{"from": "human", "value": ...}, ...]}` (speakers
mapped to roles as SpecForge maps them, SHAREGPT_ROLES; turns that are already `{"role", "content"}`
messages, as the conversations export writes them, kept as they are), or a single user turn,
`{"id": ..., "prompt": "..."}`. Errors name the file, the line (a table's row number) and the field,
and say what to do.

`id` is optional. A line without one gets an id derived from its content, `<dataset>:<digest>`: the
first 16 hex digits of the sha256 of its messages (and tools) as canonical JSON (keys sorted, no
spaces; a `prompt` line hashes as the one user message it stands for, a ShareGPT line as its
messages), whatever file or table holds it. Editing other lines or
reordering the file does not change it. Lines of one dataset with the same content and no id are
each a prompt of their own: the second gets `<dataset>:<digest>-2`, the third `-3`, in file order
(`scan_dataset` numbers them). Every prompt's `digest` is what tells, when a job is planned again
into its run, whether a prompt with an id of its own changed.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec

from toolkit.errors import BadInputError
from toolkit.formats.runplan import RunPlan
from toolkit.job.sources import BOM, Source, SourceError, open_source, source_sha256

__all__ = [
    "ExtraReader",
    "check_plan_inputs",
    "InputError",
    "Prompt",
    "PromptReader",
    "content_digest",
    "duplicate_id",
    "extra_fields",
    "prompt_id",
    "read_prompt_at",
    "scan_dataset",
    "scan_lines",
    "check_unique_ids",
]


_FIX = "fix or remove the line, then run again"
SKIP_HINT = '[inputs] on_bad_line = "skip"'
SHOWN = 10  # bad lines listed in one error; the rest are counted


class InputError(BadInputError):
    """A prompt file that cannot be used; `str()` names the file, line and field.

    One error may stand for many (see `many`): then `errors` holds each of them, first to last.
    """

    def __init__(
        self,
        path: str | Path,
        line: int | None,
        field: str | None,
        problem: str,
        *,
        message: str | None = None,
        errors: list[InputError] | None = None,
    ):
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        self.errors = errors if errors is not None else [self]
        where = f"{path}:{line}" if line else str(path)
        what = f" field `{field}`:" if field else ""
        super().__init__(message or f"{where}:{what} {problem}")

    @property
    def reason(self) -> str:
        """What is wrong with the line, without its place or the advice: `field `id`: must not be
        empty`."""
        return (f"field `{self.field}`: " if self.field else "") + self.problem.removesuffix(
            f"; {_FIX}"
        )

    @classmethod
    def many(cls, errors: list[InputError], *, shown: int = SHOWN) -> InputError:
        """One error for `errors` (at least one): itself when alone, else a count and the first
        `shown` of them."""
        errors = [e for err in errors for e in err.errors]
        if len(errors) == 1:
            return errors[0]
        dups = sum(e.field == "id" and e.problem.startswith("duplicate id") for e in errors)
        per_file: dict[str, int] = {}
        for e in errors:
            if not (e.field == "id" and e.problem.startswith("duplicate id")):
                per_file[e.path] = per_file.get(e.path, 0) + 1
        parts = []
        if per_file:
            bad = len(errors) - dups
            files = ", ".join(f"{p}: {n:,}" for p, n in per_file.items())
            parts.append(
                f"{bad:,} bad line{'s' * (bad != 1)} in {len(per_file)} prompt "
                f"file{'s' * (len(per_file) != 1)} ({files})"
            )
        if dups:
            parts.append(f"{dups:,} duplicate id{'s' * (dups != 1)}")
        head = " and ".join(parts) + (f"; the first {shown}:" if len(errors) > shown else ":")
        lines = [str(e).removesuffix(f"; {_FIX}") for e in errors[:shown]]
        if len(errors) > shown:
            lines.append(f"... and {len(errors) - shown:,} more")
        message = (
            head
            + "".join(f"\n  {line}" for line in lines)
            + "\nfix or remove these lines, then run again "
            f"(or skip them, each reported: {SKIP_HINT})"
        )
        first = errors[0]
        return cls(
            first.path, first.line, first.field, first.problem, message=message, errors=errors
        )


class Prompt(msgspec.Struct):
    id: str
    dataset: str
    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    offset: int = 0  # byte offset of the line in its file
    length: int = 0  # byte length of the line, newline excluded
    digest: str = ""  # content_digest of its messages and tools
    named: bool = True  # the line gives its id; False: the id is derived from the content


# hex digits of a content digest: 64 bits, no collision expected among billions of prompts
DIGEST_HEX = 16


def content_digest(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """What a prompt says, hashed: sha256 of its messages (and tools, when it has any) as canonical
    JSON."""
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = tools
    return hashlib.sha256(msgspec.json.encode(body, order="deterministic")).hexdigest()[:DIGEST_HEX]


_INSTRUCTION_ROLES = frozenset({"system", "developer"})


def _empty(content: Any) -> bool:
    """Whether a message's content holds nothing: no text (blank), no parts, or only blank text
    parts."""
    if isinstance(content, str):
        return not content.strip()
    if isinstance(content, list):
        return all(
            isinstance(part, dict)
            and part.get("type", "text") == "text"
            and not str(part.get("text") or "").strip()
            for part in content
        )
    return content is None


# what a line's chat is in: one of these fields
_FORMS = ("messages", "prompt", "conversations")
# ShareGPT's speakers (`from`) as chat roles, as SpecForge maps them
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def _from_sharegpt(turns: list[Any], path: str, lineno: int) -> tuple[list[Any], list[str]]:
    """A ShareGPT chat's turns as messages, and the field each one's content is in: a
    `{"from", "value"}` turn becomes `{"role", "content"}` (SHAREGPT_ROLES); a turn that is already
    a message (`role`, as the conversations export writes) stays as it is."""
    messages, values = [], []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or "from" not in t:
            messages.append(t)
            values.append("content")
            continue
        speaker = t["from"]
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise InputError(
                path,
                lineno,
                f"conversations[{i}].from",
                f"unknown speaker {speaker!r} (one of {', '.join(SHAREGPT_ROLES)}); {_FIX}",
            )
        messages.append({"role": role, "content": t["value"]} if "value" in t else {"role": role})
        values.append("value")
    return messages, values


def _parse_line(raw: bytes, path: str, dataset: str, lineno: int, digest: bool = True) -> Prompt:
    raw = raw.removeprefix(BOM)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(
            path,
            lineno,
            None,
            f"not valid UTF-8 (byte {e.start} of the line); re-encode the file as UTF-8",
        ) from None
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise InputError(path, lineno, None, f"malformed JSON ({e}); {_FIX}") from None
    if not isinstance(obj, dict):
        raise InputError(
            path, lineno, None, f"expected a JSON object, got {type(obj).__name__}; {_FIX}"
        )
    pid = obj.get("id")
    if pid is None:
        pass
    elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise InputError(
            path, lineno, "id", f"must be a string or an integer, got {type(pid).__name__}; {_FIX}"
        )
    elif isinstance(pid, str) and not pid:
        raise InputError(path, lineno, "id", f"must not be empty; {_FIX}")
    forms = [k for k in _FORMS if k in obj]
    if len(forms) != 1:
        raise InputError(
            path,
            lineno,
            "messages",
            (
                f"has both {' and '.join(f'`{k}`' for k in forms)}"
                if forms
                else "missing: a line needs `messages` (a chat), `conversations` (a ShareGPT "
                "chat) or `prompt` (one user turn)"
            )
            + f"; {_FIX}",
        )
    key = forms[0]
    if key == "prompt":
        text = obj["prompt"]
        if not isinstance(text, str):
            raise InputError(
                path, lineno, "prompt", f"must be a string, got {type(text).__name__}; {_FIX}"
            )
        if not text.strip():
            raise InputError(
                path, lineno, "prompt", f"is empty: nothing for the model to answer; {_FIX}"
            )
        messages = [{"role": "user", "content": text}]
    else:
        messages = obj[key]
        if not isinstance(messages, list) or not messages:
            raise InputError(
                path,
                lineno,
                key,
                f"must be a non-empty list of {{role, content}} objects; {_FIX}",
            )
        values = ["content"] * len(messages)
        if key == "conversations":
            messages, values = _from_sharegpt(messages, path, lineno)
        for i, m in enumerate(messages):
            f = f"{key}[{i}]"
            if not isinstance(m, dict):
                raise InputError(
                    path, lineno, f, f"must be an object, got {type(m).__name__}; {_FIX}"
                )
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise InputError(
                    path, lineno, f + ".role", f"missing or not a string (got {role!r}); {_FIX}"
                )
            if "content" not in m and not m.get("tool_calls"):
                raise InputError(path, lineno, f"{f}.{values[i]}", f"missing; {_FIX}")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise InputError(
                    path,
                    lineno,
                    f"{f}.{values[i]}",
                    f"must be a string or a list of parts, got {type(content).__name__}; {_FIX}",
                )
            if role == "user" and _empty(content):
                raise InputError(
                    path, lineno, f"{f}.{values[i]}", f"is empty: a user message needs text; {_FIX}"
                )
        if all(m["role"] in _INSTRUCTION_ROLES for m in messages):
            raise InputError(
                path,
                lineno,
                key,
                "has no user message, only instructions "
                f"({', '.join(sorted({m['role'] for m in messages}))}): nothing for the model to "
                f"answer; {_FIX}",
            )
    tools = obj.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise InputError(path, lineno, "tools", f"must be a list of tool objects; {_FIX}")
    tools = tools or None
    hashed = content_digest(messages, tools) if digest else ""
    return Prompt(
        id=str(pid) if pid is not None else f"{dataset}:{hashed}" if digest else "",
        dataset=dataset,
        line=lineno,
        messages=messages,
        tools=tools,
        digest=hashed,
        named=pid is not None,
    )


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
                p = _parse_line(body, path, dataset, lineno, digest)
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
        p = _parse_line(self.line(path, offset, length), str(path), dataset, line)
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
