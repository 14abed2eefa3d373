"""Prompt files: JSONL lines decoded into `Prompt`s, every line validated before any GPU time is spent.

A line is either a chat, `{"id": ..., "messages": [{"role": ..., "content": ...}, ...], "tools": [...]}`, or a
single user turn, `{"id": ..., "prompt": "..."}`. `id` is optional; the default id, `<dataset>:<line>`, is stable
as long as the file is. Errors name the file, the line and the field, and say what to do.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["InputError", "Prompt", "PromptReader", "read_prompt_at", "scan_dataset", "check_unique_ids"]


class InputError(Exception):
    """A prompt file that cannot be used; `str()` names the file, line and field."""

    def __init__(self, path: str | Path, line: int | None, field: str | None, problem: str):
        self.path, self.line, self.field, self.problem = str(path), line, field, problem
        where = f"{path}:{line}" if line else str(path)
        what = f" field `{field}`:" if field else ""
        super().__init__(f"{where}:{what} {problem}")


class Prompt(msgspec.Struct):
    id: str
    dataset: str
    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    offset: int = 0  # byte offset of the line in its file
    length: int = 0  # byte length of the line, newline excluded


_FIX = "fix or remove the line, then run again"


def _parse_line(raw: bytes, path: str, dataset: str, lineno: int) -> Prompt:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(path, lineno, None, f"not valid UTF-8 (byte {e.start} of the line); re-encode the file as UTF-8") from None
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise InputError(path, lineno, None, f"malformed JSON ({e}); {_FIX}") from None
    if not isinstance(obj, dict):
        raise InputError(path, lineno, None, f"expected a JSON object, got {type(obj).__name__}; {_FIX}")
    pid = obj.get("id")
    if pid is None:
        pid = f"{dataset}:{lineno}"
    elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise InputError(path, lineno, "id", f"must be a string or an integer, got {type(pid).__name__}; {_FIX}")
    elif isinstance(pid, str) and not pid:
        raise InputError(path, lineno, "id", f"must not be empty; {_FIX}")
    pid = str(pid)
    has_messages, has_prompt = "messages" in obj, "prompt" in obj
    if has_messages == has_prompt:
        raise InputError(
            path, lineno, "messages",
            ("has both `messages` and `prompt`" if has_messages else "missing: a line needs `messages` (a chat) or `prompt` (one user turn)")
            + f"; {_FIX}",
        )
    if has_prompt:
        text = obj["prompt"]
        if not isinstance(text, str):
            raise InputError(path, lineno, "prompt", f"must be a string, got {type(text).__name__}; {_FIX}")
        messages = [{"role": "user", "content": text}]
    else:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError(path, lineno, "messages", f"must be a non-empty list of {{role, content}} objects; {_FIX}")
        for i, m in enumerate(messages):
            f = f"messages[{i}]"
            if not isinstance(m, dict):
                raise InputError(path, lineno, f, f"must be an object, got {type(m).__name__}; {_FIX}")
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise InputError(path, lineno, f + ".role", f"missing or not a string (got {role!r}); {_FIX}")
            if "content" not in m and not m.get("tool_calls"):
                raise InputError(path, lineno, f + ".content", f"missing; {_FIX}")
            content = m.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise InputError(path, lineno, f + ".content", f"must be a string or a list of parts, got {type(content).__name__}; {_FIX}")
    tools = obj.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise InputError(path, lineno, "tools", f"must be a list of tool objects; {_FIX}")
    return Prompt(id=pid, dataset=dataset, line=lineno, messages=messages, tools=tools or None)


def scan_dataset(path: str | Path, dataset: str) -> Iterator[Prompt]:
    """Yield every prompt of a JSONL file in order, validating each line (blank lines are skipped)."""
    path = str(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise InputError(path, None, None, f"prompt file of dataset {dataset!r} not found; check [[datasets]] path") from None
    n = 0
    offset = 0
    with f:
        for lineno, raw in enumerate(f, start=1):
            length = len(raw)
            body = raw.rstrip(b"\r\n")
            if body.strip():
                p = _parse_line(body, path, dataset, lineno)
                p.offset, p.length = offset, len(body)
                n += 1
                yield p
            offset += length
    if n == 0:
        raise InputError(path, None, None, f"dataset {dataset!r} has no prompts; add prompts or remove it from the job")


def read_prompt_at(path: str | Path, dataset: str, line: int, offset: int, length: int) -> Prompt:
    """Re-read one prompt the plan located at (offset, length); see PromptReader for many."""
    with PromptReader() as reader:
        return reader.read(path, dataset, line, offset, length)


class PromptReader:
    """Reads planned prompts by (offset, length), keeping each file open: workers read thousands."""

    def __init__(self) -> None:
        self._files: dict[str, Any] = {}

    def read(self, path: str | Path, dataset: str, line: int, offset: int, length: int) -> Prompt:
        path = str(path)
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "rb")
        f.seek(offset)
        p = _parse_line(f.read(length), path, dataset, line)
        p.offset, p.length = offset, length
        return p

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> PromptReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_unique_ids(prompts: Iterator[Prompt] | list[Prompt], paths: dict[str, str]) -> None:
    """Raise on the first id used twice, within or across datasets, naming both places."""
    seen: dict[str, tuple[str, int]] = {}
    for p in prompts:
        prev = seen.setdefault(p.id, (p.dataset, p.line))
        if prev != (p.dataset, p.line):
            raise InputError(
                paths[p.dataset], p.line, "id",
                f"duplicate id {p.id!r}: already used at {paths[prev[0]]}:{prev[1]}; ids must be unique across the job",
            )
