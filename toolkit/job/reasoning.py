"""Reasoning mode, told by token ids: the ids of a tokenizer the toolkit relies on (`TokenInfo`:
think start and end, eos, the tool-call section, whitespace-only ids, what the template knows of
reasoning), where a rendered prompt leaves the model (`reasoning_mode`), whether an output is
reasoning (`output_in_reasoning`), and which template variable switches it (`thinking_hint`).
job/chat resolves a tokenizer's TokenInfo; the rest of the package reads these names from there."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from toolkit.formats import records


class TokenInfo(msgspec.Struct, frozen=True, dict=True):
    """Token ids of one tokenizer that the toolkit relies on."""

    think_start_id: int
    think_end_id: int
    # tokenizer eos, then config.json / generation_config.json eos_token_id, no duplicates
    eos_ids: list[int]
    tool_call_start_id: int | None
    tool_call_end_id: int | None
    vocab_size: int  # len(tokenizer): every id the tokenizer can produce, added tokens included
    opens_reasoning: bool  # the generation prompt of a probe conversation ends inside reasoning
    # ids that decode to whitespace only; skipped when looking at a prompt's last token
    blank_ids: list[int] = []
    template_knows_reasoning: bool = False  # the template's source writes or reads the think tokens
    # template variables that switch reasoning on or off (e.g. enable_thinking)
    thinking_kwargs: list[str] = []

    @functools.cached_property
    def blank(self) -> frozenset[int]:
        """`blank_ids` as a set, for the look-ups of every record."""
        return frozenset(self.blank_ids)


# Reasoning mode, in one place: how a rendered prompt leaves the model, read from its last
# meaningful token (`reasoning_mode`, `opens_reasoning`: the pre-flight, the worker's turns, the
# audit and the export), and whether a generated output is reasoning (`output_in_reasoning`: the
# audit and the export's --mode).
OPENED = "opened"  # the prompt ends with think-start: the template opened reasoning


CLOSED = "closed"  # the prompt ends with think-end: the template closed it (thinking


# switched off)
MODEL_OPENS = "model_opens"  # the prompt ends at the assistant header of a template that knows the


# think tokens: the model writes think-start itself (Qwen3, Kimi-K2-Thinking, GLM-4.6)
UNKNOWN = "unknown"  # a template that never mentions the think tokens: cannot tell


MODES = (OPENED, CLOSED, MODEL_OPENS, UNKNOWN)


# Template variables that switch reasoning, in the order a hint names them.
THINKING_VARIABLES = ("thinking", "enable_thinking", "reasoning", "enable_reasoning", "think")


def reasoning_mode(prompt_ids: bytes | Sequence[int], info: TokenInfo) -> str:
    """OPENED, CLOSED, MODEL_OPENS or UNKNOWN: where a rendered prompt (ids, or packed as records
    hold them) leaves the model, by its last token that is not whitespace only. Token ids decide,
    never text."""
    last = records.last_meaningful(prompt_ids, info.blank)
    if last is not None and last == info.think_start_id:
        return OPENED
    if last is not None and last == info.think_end_id:
        return CLOSED
    return MODEL_OPENS if info.template_knows_reasoning else UNKNOWN


def opens_reasoning(prompt_ids: bytes | Sequence[int], info: TokenInfo) -> bool:
    """Whether a rendered prompt (ids, or packed) ends inside reasoning: with think-start, ignoring
    trailing whitespace-only tokens (`reasoning_mode` OPENED)."""
    return reasoning_mode(prompt_ids, info) == OPENED


def output_in_reasoning(rec: records.Record, info: TokenInfo, opened: bool) -> bool:
    """Whether a record's output was generated in reasoning mode: its prompt opened reasoning
    (`opened`, from `opens_reasoning`), the model opened it (its first output id is think-start), or
    its ids hold the think-end id."""
    out = rec.output_ids
    return (
        opened
        or (len(out) >= 4 and records.id_at(out, 0) == info.think_start_id)
        or records.id_positions(out, info.think_end_id) is not None
    )


def thinking_hint(info: TokenInfo, on: bool) -> str:
    """What to set so the template switches reasoning on (or off): names the kwarg the template
    reads."""
    value = "true" if on else "false"
    if info.thinking_kwargs:
        name = info.thinking_kwargs[0]
        also = (
            f" (the template also reads {', '.join(info.thinking_kwargs[1:])})"
            if len(info.thinking_kwargs) > 1
            else ""
        )
        return f"set [model] chat_template_kwargs = {{ {name} = {value} }}{also}"
    return (
        "this template reads no thinking switch: use a chat template that "
        f"{'opens' if on else 'closes'} reasoning ([model] chat_template)"
    )


def mentions(template: Any, texts: Sequence[str]) -> bool:
    sources = template.values() if isinstance(template, Mapping) else [template]
    return any(isinstance(src, str) and any(t and t in src for t in texts) for src in sources)


def thinking_variables(template: Any) -> list[str]:
    """The variables among THINKING_VARIABLES that the template reads without defining them."""
    sources = [
        src
        for src in (template.values() if isinstance(template, Mapping) else [template])
        if isinstance(src, str)
    ]
    found: set[str] = set()
    import jinja2
    from jinja2 import meta

    # transformers renders with loop controls ({% break %}, used by Kimi-K2-Thinking's template) and
    # its own {% generation %} tag; a template this environment still cannot parse is searched for
    # the names as words.
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    for src in sources:
        try:
            found |= meta.find_undeclared_variables(env.parse(src))
        except jinja2.TemplateError:
            found |= {
                v for v in THINKING_VARIABLES if re.search(rf"(?<![\w.'\"]){v}(?![\w'\"])", src)
            }
    return [v for v in THINKING_VARIABLES if v in found]
