"""A prompt line: decoded and checked into a `Prompt` (`parse_line`); a line that cannot be used is
an `InputError` naming it.

A line is a chat, `{"id": ..., "messages": [{"role": ..., "content": ...}, ...], "tools": [...]}`,
a ShareGPT chat, `{"id": ..., "conversations": [{"from": "human", "value": ...}, ...]}` (speakers
mapped to roles as SpecForge maps them, SHAREGPT_ROLES; turns that are already `{"role", "content"}`
messages, as the conversations export writes them, kept as they are), or a single user turn,
`{"id": ..., "prompt": "..."}`. Errors name the file, the line (a table's row number) and the field,
and say what to do.

`id` is optional. A line without one gets an id derived from its content, `<dataset>:<digest>`: the
first 16 hex digits of the sha256 of its messages (and tools) as canonical JSON (keys sorted, no
spaces; a `prompt` line hashes as the one user message it stands for, a ShareGPT line as its
messages), whatever file or table holds it. Editing other lines or reordering the file does not
change it. Lines of one dataset with the same content and no id are each a prompt of their own: the
second gets `<dataset>:<digest>-2`, the third `-3`, in file order (job/inputs' `scan_dataset`
numbers them). Every prompt's `digest` is what tells, when a job is planned again
into its run, whether a prompt with an id of its own changed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec

from toolkit.errors import BadInputError
from toolkit.job.sources import BOM

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


def parse_line(raw: bytes, path: str, dataset: str, lineno: int, digest: bool = True) -> Prompt:
    """One line of a prompt file as a Prompt (its id given, or derived from its content with
    `digest`); an InputError naming the line and field when it cannot be used."""
    obj = _decode(raw, path, lineno)
    pid = _line_id(obj, path, lineno)
    key = _form(obj, path, lineno)
    messages = _prompt_turn(obj, path, lineno) if key == "prompt" else _chat(obj, key, path, lineno)
    tools = _tools(obj, path, lineno)
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


def _decode(raw: bytes, path: str, lineno: int) -> dict[str, Any]:
    """The line as a JSON object: UTF-8 (a BOM dropped), valid JSON, an object."""
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
    return obj


def _line_id(obj: dict[str, Any], path: str, lineno: int) -> str | int | None:
    """The line's own id (a string or an integer, not empty), or None when it gives none."""
    pid = obj.get("id")
    if pid is None:
        pass
    elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise InputError(
            path, lineno, "id", f"must be a string or an integer, got {type(pid).__name__}; {_FIX}"
        )
    elif isinstance(pid, str) and not pid:
        raise InputError(path, lineno, "id", f"must not be empty; {_FIX}")
    return pid


def _form(obj: dict[str, Any], path: str, lineno: int) -> str:
    """Which of _FORMS the line's chat is in: exactly one."""
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
    return forms[0]


def _prompt_turn(obj: dict[str, Any], path: str, lineno: int) -> list[dict[str, Any]]:
    """A `prompt` line as the one user message it stands for."""
    text = obj["prompt"]
    if not isinstance(text, str):
        raise InputError(
            path, lineno, "prompt", f"must be a string, got {type(text).__name__}; {_FIX}"
        )
    if not text.strip():
        raise InputError(
            path, lineno, "prompt", f"is empty: nothing for the model to answer; {_FIX}"
        )
    return [{"role": "user", "content": text}]


def _chat(obj: dict[str, Any], key: str, path: str, lineno: int) -> list[Any]:
    """The messages of a `messages` or `conversations` line (ShareGPT turns as messages), each
    checked, and at least one that is not an instruction."""
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
        _check_message(m, f"{key}[{i}]", values[i], path, lineno)
    if all(m["role"] in _INSTRUCTION_ROLES for m in messages):
        raise InputError(
            path,
            lineno,
            key,
            "has no user message, only instructions "
            f"({', '.join(sorted({m['role'] for m in messages}))}): nothing for the model to "
            f"answer; {_FIX}",
        )
    return messages


def _check_message(m: Any, f: str, value: str, path: str, lineno: int) -> None:
    """One message (`f`, its place in the line; `value`, the field its content is in): an object
    with a role, content (or tool calls) that is text or parts, and text when a user says it."""
    if not isinstance(m, dict):
        raise InputError(path, lineno, f, f"must be an object, got {type(m).__name__}; {_FIX}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise InputError(
            path, lineno, f + ".role", f"missing or not a string (got {role!r}); {_FIX}"
        )
    if "content" not in m and not m.get("tool_calls"):
        raise InputError(path, lineno, f"{f}.{value}", f"missing; {_FIX}")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise InputError(
            path,
            lineno,
            f"{f}.{value}",
            f"must be a string or a list of parts, got {type(content).__name__}; {_FIX}",
        )
    if role == "user" and _empty(content):
        raise InputError(
            path, lineno, f"{f}.{value}", f"is empty: a user message needs text; {_FIX}"
        )


def _tools(obj: dict[str, Any], path: str, lineno: int) -> list[dict[str, Any]] | None:
    """The line's tools (a list of tool objects), None when it has none."""
    tools = obj.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise InputError(path, lineno, "tools", f"must be a list of tool objects; {_FIX}")
    return tools or None
