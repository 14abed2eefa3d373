"""What SpecForge (sgl-project/SpecForge), the drafter trainer, asks of its data: written here from reading its source
at commit a6b6b0230009d15ec2a97a57384e6f53f0f96946, not copied from it.

- `row_problem` is the contract of `scripts/validate_regenerated_data.py` with `scripts/conversation_validation.py`
  (the checks its regeneration recipe runs on every successful row before training);
- `expand` is the rule of `scripts/expand_reasoning_conversations.py` (one row per assistant turn, the history's
  assistant messages without their reasoning), trained with `data.train_only_last_turn: true`;
- `specforge_mask` is the loss-mask rule of `specforge/data/parse.py` (`GeneralParser.parse`, which
  `ThinkingParser` uses with `enable_thinking`): the conversation rendered by the tokenizer's chat template
  without a generation prompt, then every character from the end of the template's assistant header up to and
  including its end-of-turn token (or the end of the text) supervised, mapped to tokens by the length of the
  encoded prefix; with `train_only_last_turn` only the last such span. The header and end token of Kimi-K2-Thinking
  are those `specforge/data/template.py` registers as `kimi-k2-thinking`.
"""

from __future__ import annotations

import re
from typing import Any

SPECFORGE_COMMIT = "a6b6b0230009d15ec2a97a57384e6f53f0f96946"
KIMI_HEADER, KIMI_END = "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"


def _marker(text: str) -> bool:
    low = text.lower()
    return "<think>" in low or "</think>" in low


def conversation_problem(messages: Any) -> str | None:
    """The shape every conversation must have: a non-empty list of objects with non-empty string content; system
    messages only before the first user message; then user and assistant alternating, from a user message."""
    if not isinstance(messages, list) or not messages:
        return "conversations must be a non-empty list"
    want, saw_user = "user", False
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {i} is not an object"
        content = m.get("content")
        if not isinstance(content, str) or not content.strip():
            return f"message {i} content must be a non-empty string"
        role = m.get("role")
        if role == "system" and not saw_user:
            continue
        if role not in ("user", "assistant"):
            return f"message {i} has role {role!r}"
        if role != want:
            return f"message {i} is {role!r} where {want!r} was expected"
        saw_user = True
        want = "assistant" if role == "user" else "user"
    return None if saw_user else "no user message"


def row_problem(
    row: Any,
    *,
    expect_reasoning: bool = False,
    expect_non_reasoning: bool = False,
    strict_think_markers: bool = False,
) -> str | None:
    """What the validator refuses in one row (None: it passes)."""
    if not isinstance(row, dict):
        return "not an object"
    if not isinstance(row.get("id"), str) or not row["id"].strip():
        return "id must be a non-empty string"
    if row.get("status") != "success":
        return "status must be 'success'"
    messages = row.get("conversations")
    problem = conversation_problem(messages)
    if problem:
        return problem
    assistants = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        assistants += 1
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return f"assistant message {i}: reasoning_content must be a string or null"
        if expect_non_reasoning and reasoning and reasoning.strip():
            return f"assistant message {i} has reasoning"
        if expect_reasoning and (not isinstance(reasoning, str) or not reasoning.strip()):
            return f"assistant message {i} has empty reasoning"
        if strict_think_markers and (
            _marker(m["content"]) or isinstance(reasoning, str) and _marker(reasoning)
        ):
            return f"assistant message {i} holds a think marker"
    if not assistants:
        return "no assistant message"
    if messages[-1]["role"] != "assistant":
        return "the last message is not the assistant's"
    return None


def file_problems(rows: list[dict], **kw) -> list[str]:
    """Every problem of a file of rows, as `line N: problem`; a file without rows is one too."""
    if not rows:
        return ["no data rows"]
    return [f"line {i}: {p}" for i, row in enumerate(rows, 1) if (p := row_problem(row, **kw))]


def expand(row: dict) -> list[dict]:
    """One row per assistant turn: the history up to it (earlier assistant messages without reasoning), then it."""
    history: list[dict] = []
    events = []
    for m in row["conversations"]:
        if m["role"] != "assistant":
            history.append(dict(m))
            continue
        events.append(
            {
                "id": f"{row['id']}#turn{len(events)}",
                "status": row["status"],
                "conversations": [dict(h) for h in history] + [dict(m)],
            }
        )
        history.append({k: v for k, v in m.items() if k != "reasoning_content"})
    return events


def specforge_mask(
    tok: Any,
    messages: list[dict],
    tools: list | None,
    header: str,
    end: str,
    train_only_last_turn: bool = True,
    **template_kwargs,
) -> tuple[list[int], list[int], str, list]:
    """(input_ids, loss_mask, text, supervised character spans) as SpecForge builds them from a conversation."""
    text = tok.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=False,
        tools=tools or None,
        **template_kwargs,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    spans = [
        (m.start(1), m.end(1))
        for m in re.finditer(re.escape(header) + r"([\s\S]*?(?:" + re.escape(end) + "|$))", text)
    ]
    if train_only_last_turn and spans:
        spans = spans[-1:]
    for a, b in spans:
        start = len(tok.encode(text[:a], add_special_tokens=False))
        stop = len(tok.encode(text[:b], add_special_tokens=False))
        for i in range(min(start, len(ids)), min(stop, len(ids))):
            mask[i] = 1
    return ids, mask, text, spans
