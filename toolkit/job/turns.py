"""Multi-turn regeneration: every assistant turn of a conversation generated again by the target
model.

Drafter data from chat datasets (ShareGPT, UltraChat) is made by regenerating each assistant turn
with the model itself, feeding it its own earlier answers. A dataset with `regenerate = true` is
planned as one record per user turn: turn k's prompt is the source conversation up to its k-th user
message, in which every earlier assistant message is replaced by the answer the model generated for
that turn (`content` and `reasoning_content`, decoded from its output ids). The chat template then
renders that history the way the model's own template renders it (most drop or empty earlier
reasoning, each in its own way). Other messages (system, tool) keep their place; the source's
assistant messages are never sent.

Record ids are `<id>/t<k>` (k from 0). Turn k can only be rendered once turn k-1 has an ok record;
when turn k-1 failed, turn k is recorded as failed too: with the same kind when that failure is
permanent, else as "previous_turn" (transient), so that it is generated again with the turn before
it.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["answer_of", "turn_id", "user_turns", "turn_messages", "turn_prompt", "answer_message"]


def turn_id(record_id: str, turn: int, regenerate: bool) -> str:
    """The record id of turn `turn`: the id itself for a dataset that is not regenerated turn by
    turn."""
    return f"{record_id}/t{turn}" if regenerate else record_id


def user_turns(messages: list[dict[str, Any]]) -> int:
    """How many user messages (turns to generate) a conversation holds."""
    return sum(1 for m in messages if m.get("role") == "user")


def turn_messages(
    messages: list[dict[str, Any]], turn: int, answers: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The conversation sent for turn `turn` (0-based): the source up to its turn-th user message,
    with every source assistant message dropped and `answers[j]` (the generated answer of turn j)
    after user message j."""
    if len(answers) < turn:
        raise ValueError(
            f"turn {turn} needs the answers of the {turn} turns before it, got {len(answers)}"
        )
    out: list[dict[str, Any]] = []
    seen = -1
    for m in messages:
        role = m.get("role")
        if role == "assistant":
            continue
        if role == "user":
            # the user message after this turn's: the conversation sent ends before it
            if seen == turn:
                break
            if seen >= 0:
                out.append(answers[seen])
            seen += 1
        out.append(m)
    return out


def answer_message(
    reasoning: str, content: str, tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A generated answer as an assistant message of the history (what chat templates read)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def turn_prompt(prompt: Any, turn: int, answers: list[dict[str, Any]]) -> Any:
    """`prompt` (an inputs.Prompt) with the messages of turn `turn` (see turn_messages)."""
    return msgspec.structs.replace(prompt, messages=turn_messages(prompt.messages, turn, answers))


def answer_of(rec: Any, tok: Any, info: Any) -> dict[str, Any]:
    """The assistant message of a generated turn, decoded from its exact output ids: the reasoning
    (up to the think-end id), the content, and a tool-call section as structured tool_calls (the
    stop token in none)."""
    from toolkit.formats.records import split_parts, unpack_ids
    from toolkit.job.chat import opens_reasoning
    from toolkit.job.toolcalls import parse_tool_calls

    opened = opens_reasoning(rec.prompt_ids, info)
    r0, r1, c0, c1 = split_parts(rec, info.think_start_id, opened)
    ids = unpack_ids(rec.output_ids)
    tc = rec.tool_call_at if rec.tool_call_at is not None and c0 <= rec.tool_call_at < c1 else c1
    decode = lambda part: tok.decode(
        part, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )  # noqa: E731
    section = decode(ids[tc:c1]) if tc < c1 else ""
    return answer_message(
        decode(ids[r0:r1]), decode(ids[c0:tc]), parse_tool_calls(section) if section else None
    )
