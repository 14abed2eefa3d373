"""What the drafter trainers do with an export, written from reading their sources (SpecForge 0.2.0,
speculators
0.9.0), and the checks the exports make with it: the loss-mask rule of each trainer, the SpecForge
chat-template registration that reproduces the model's own render, and the round trip of a
conversations row through the chat template as SpecForge renders it.

- Loss masks. Both trainers take the `tokens` export's `input_ids` and `loss_mask` as they are
  (SpecForge's online loader `data.prompts_path`, speculators' `prepare-data`). They differ on one
  token: SpecForge supervises from the end of the template's assistant header, so a think-start the
  template wrote at the end of the prompt is supervised; speculators supervises from the end of the
  rendered generation prompt, so it is not (`TRAINERS[name].supervise_think_start`). An output cut
  by max_new_tokens is masked the same way, every id it has, with no stop token after it (none is
  added): both rules supervise to the row's end.
- SpecForge's chat rows (`conversations`) are rendered again by the tokenizer's chat template,
  through a registered `ChatTemplate` (assistant header, end-of-turn token, system prompt, parser),
  and encoded again: `Registration` derives the one that reproduces the model's render from the
  template itself; `builtin_problems` says what a built-in registration with the same header would
  add or drop.
- `RoundTrip` renders each conversations row as SpecForge will (its message fields, tool-call
  arguments parsed to objects, tools or None, `enable_thinking=True` for a thinking parser, no
  generation prompt) and compares the ids with the stored ones, many rows encoded in one call of the
  tokenizer (`RoundTrip.check_many`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from toolkit.job.templating import _encode_chats

__all__ = [
    "TRAINERS",
    "Registration",
    "RoundTrip",
    "Trainer",
    "builtin_problems",
    "registration",
    "sanitized",
    "trainer_json",
    "writes_default_system",
]


class Trainer(msgspec.Struct, frozen=True):
    """A drafter trainer the `tokens` export is written for."""

    name: str
    # a think-start the template wrote at the end of the prompt is in the loss
    supervise_think_start: bool
    output: str  # the default file name of its tokens export


TRAINERS = {
    "specforge": Trainer("specforge", True, "tokens.jsonl"),
    "speculators": Trainer("speculators", False, "tokens_speculators.jsonl"),
}

# Message fields SpecForge's parsers keep (`specforge/data/parse.py`, standard_keys): the thinking
# parser's, the general parser's.
_KEPT = ("role", "content", "tool_calls", "reasoning_content", "name", "tool_call_id")
_KEPT_GENERAL = ("role", "content", "tool_calls")

# SpecForge 0.2.0's built-in registrations whose header a toolkit model may share
# (`specforge/data/template.py`): name -> (assistant header, end of turn, system prompt, parser
# type, enable_thinking).
BUILTINS: dict[str, tuple[str, str | None, str | None, str, bool]] = {
    "kimi-k2-thinking": (
        "<|im_assistant|>assistant<|im_middle|>",
        "<|im_end|>",
        "You are a helpful assistant.",
        "thinking",
        True,
    ),
    "kimi-k2-instruct": (
        "<|im_assistant|>assistant<|im_middle|>",
        "<|im_end|>",
        "You are a helpful assistant.",
        "general",
        False,
    ),
    "qwen3-thinking": (
        "<|im_start|>assistant\n",
        "<|im_end|>\n",
        "You are a helpful assistant.",
        "thinking",
        True,
    ),
    "qwen3-instruct": (
        "<|im_start|>assistant\n",
        "<|im_end|>\n",
        "You are a helpful assistant.",
        "general",
        False,
    ),
    "qwen3-next-thinking": (
        "<|im_start|>assistant\n<think>\n",
        "<|im_end|>\n",
        "You are a helpful assistant.",
        "thinking",
        True,
    ),
    "deepseek-r1-distill": ("<｜Assistant｜>", None, None, "general", False),
    "deepseek-v3": (
        "<｜Assistant｜>",
        "<｜end▁of▁sentence｜>",
        "You are a helpful assistant.",
        "general",
        False,
    ),
}


class Registration(msgspec.Struct, frozen=True):
    """The SpecForge `ChatTemplate` that reproduces the model's render."""

    name: str
    assistant_header: str
    end_of_turn_token: str | None
    # "thinking" when the template writes an assistant message's reasoning_content
    parser_type: str
    enable_thinking: bool
    # an empty think block the template writes after the header (thinking off)
    ignore_token: list[str] | None = None

    def python(self) -> str:
        """The registration as a Python file SpecForge's process imports (or a script runs) before
        training."""
        return (
            "# The chat-template registration SpecForge needs to render this run's conversations "
            "as the model saw\n# them: header and end of turn read from the model's own template, "
            "no system prompt of its own (a row\n# holds the system message it was generated "
            "with; without one the template writes its own default).\nfrom "
            "specforge.data.template import TEMPLATE_REGISTRY, "
            f"ChatTemplate\n\nTEMPLATE_REGISTRY.register(\n    name={self.name!r},\n    "
            f"template=ChatTemplate(\n        assistant_header={self.assistant_header!r},\n        "
            f"system_prompt=None,\n        end_of_turn_token={self.end_of_turn_token!r},\n        "
            f"parser_type={self.parser_type!r},\n        "
            f"enable_thinking={self.enable_thinking!r},\n        "
            f"ignore_token={self.ignore_token!r},\n    ),\n    override=True,\n)\n"
        )


def _render(tok: Any, messages: list[dict], *, generation: bool, **kwargs: Any) -> str:
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, **kwargs
    )


def _after(a: str, b: str) -> str:
    """What `b` holds after its common prefix with `a`."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return b[n:]


def registration(
    tok: Any,
    think_start: str,
    stop_texts: list[str],
    name: str = "toolkit-model",
    *,
    think_end: str = "",
    kwargs: dict[str, Any] | None = None,
) -> Registration:
    """The registration of the tokenizer's chat template: the assistant header is what the
    generation prompt adds to a user turn (a think-start the template writes there, and what follows
    it, left to the supervised span as the model's output starts it); the end of turn is the stop
    token written right after an answer; the parser reads reasoning (`thinking`) when the template
    reads an assistant message's `reasoning_content` (a general parser drops it before the template
    sees it)."""
    user = [{"role": "user", "content": "QUESTION"}]
    kwargs = kwargs or {}
    header = _after(
        _render(tok, user, generation=False, **kwargs),
        _render(tok, user, generation=True, **kwargs),
    )
    ignore = None
    if think_start and think_start in header:
        header, written = header[: header.index(think_start)], header[header.index(think_start) :]
        # reasoning closed by the template: not the model's, not supervised
        if think_end and think_end in written:
            ignore = [written]
    answered = _render(
        tok,
        [*user, {"role": "assistant", "content": "ANSWER", "reasoning_content": "REASONING"}],
        generation=False,
    )
    end = None
    tail = answered[answered.rfind("ANSWER") + len("ANSWER") :] if "ANSWER" in answered else ""
    for s in sorted(stop_texts, key=len, reverse=True):
        if s and tail.startswith(s):
            end = s
            break
    source = (
        tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template)
    )
    # (some write it on later turns only)
    thinking = "REASONING" in answered or "reasoning_content" in (source or "")
    return Registration(
        name=name,
        assistant_header=header,
        end_of_turn_token=end,
        parser_type="thinking" if thinking else "general",
        enable_thinking=thinking,
        ignore_token=ignore,
    )


def writes_default_system(tok: Any) -> bool:
    """Whether the chat template writes a system message of its own into a conversation that has
    none."""
    text = _render(tok, [{"role": "user", "content": "QUESTION"}], generation=False)
    return "system" in text.split("QUESTION")[0].lower()


def builtin_problems(reg: Registration, default_system: bool) -> list[str]:
    """What each SpecForge built-in registration with the model's assistant header would do to its
    rows: a system prompt it inserts where the model saw none of its (or its template's default),
    reasoning a general parser drops, an end of turn it does not stop at. `default_system`: the
    template writes a system message of its own when a conversation has none."""
    out = []
    for name, (header, end, system, parser, _thinking) in BUILTINS.items():
        if not reg.assistant_header or not header.startswith(reg.assistant_header):
            continue
        why = []
        if system:
            why.append(
                f"inserts the system prompt {system!r} in rows without one"
                + (" (the model saw its template's own default)" if default_system else "")
            )
        if reg.parser_type == "thinking" and parser != "thinking":
            why.append(
                "drops the reasoning of every row (a general parser keeps no reasoning_content)"
            )
        if header != reg.assistant_header:
            why.append(
                f"takes {header[len(reg.assistant_header) :]!r} after the header as part of it "
                "(not supervised)"
            )
        if end != reg.end_of_turn_token:
            why.append(
                f"ends a turn at {end!r}, the model at {reg.end_of_turn_token!r}"
                if end
                else f"names no end of turn, the model ends it at {reg.end_of_turn_token!r}"
            )
        if why:
            out.append(
                f"SpecForge's built-in {name!r} "
                + "; ".join(why)
                + ": train with the registration written "
                "beside the export instead"
            )
    return out


def sanitized(message: dict[str, Any], thinking: bool = True) -> dict[str, Any]:
    """A message as SpecForge's parser (thinking or general) hands it to the chat template: its
    known fields only, tool-call arguments given as a JSON string parsed to an object (an unreadable
    one becomes {})."""
    out = {k: message[k] for k in (_KEPT if thinking else _KEPT_GENERAL) if k in message}
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        clean = []
        for c in calls:
            if not isinstance(c, dict):
                continue
            f = c.get("function", {})
            args = f.get("arguments", {}) if isinstance(f, dict) else {}
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    args = {}
            clean.append(
                {
                    "id": c.get("id", ""),
                    "type": c.get("type", "function"),
                    "function": {
                        "name": f.get("name", "") if isinstance(f, dict) else "",
                        "arguments": args,
                    },
                }
            )
        out["tool_calls"] = clean
    return out


def trainer_json(args: str) -> bool:
    """Whether tool-call arguments are written as the chat template writes an object SpecForge
    parsed from them (`json.dumps` with its default separators): False for arguments the model wrote
    compactly or otherwise, which the trainer would train re-serialised."""
    try:
        return json.dumps(json.loads(args), ensure_ascii=False) == args
    except (json.JSONDecodeError, TypeError):
        return False


class RoundTrip:
    """Each conversations row rendered with the model's chat template as SpecForge renders it,
    against the ids the model saw and wrote (the prompt and the output of the row's last record)."""

    def __init__(self, tok: Any, reg: Registration):
        self.tok, self.reg = tok, reg
        self.rows = self.identical = 0

    def check(
        self, messages: list[dict[str, Any]], tools: list[dict] | None, stored: list[int]
    ) -> int | None:
        """None when the render gives the stored ids (followed, perhaps, by what the template writes
        after the model's stop token), else the first position that differs."""
        return self.check_many([(messages, tools, stored)])[0]

    def check_many(
        self, rows: list[tuple[list[dict[str, Any]], list[dict] | None, list[int]]]
    ) -> list[int | None]:
        """`check` of each (messages, tools, stored ids): the rows rendered one by one, then encoded
        in one call of the tokenizer (a fast one spreads it over the machine's cores)."""
        texts = [self._render(messages, tools) for messages, tools, _ in rows]
        rendered = [t for t in texts if t is not None]
        encoded = iter(_encode_chats(self.tok, rendered) if rendered else [])
        self.rows += len(rows)
        return [
            0 if text is None else self._first_difference(next(encoded), stored)
            for text, (_, _, stored) in zip(texts, rows)
        ]

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> str | None:
        """The row's text as SpecForge renders it; None when the template refuses the row (it
        cannot reach the stored ids)."""
        kwargs = {"enable_thinking": True} if self.reg.enable_thinking else {}
        try:
            thinking = self.reg.parser_type == "thinking"
            return self.tok.apply_chat_template(
                [sanitized(m, thinking) for m in messages],
                tokenize=False,
                add_generation_prompt=False,
                tools=tools or None,
                **kwargs,
            )
        except Exception:  # noqa: BLE001
            return None

    def _first_difference(self, ids: list[int], stored: list[int]) -> int | None:
        if ids[: len(stored)] == stored:
            self.identical += 1
            return None
        n = 0
        while n < min(len(ids), len(stored)) and ids[n] == stored[n]:
            n += 1
        return n
