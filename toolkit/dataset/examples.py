"""Sample outputs for the audit report: a few decoded reasoning / content pairs per dataset, and one
real message per kind of failure.

The audit counts failures by kind (numbers and quoted names folded, see `audit_counts.error_kind`);
a person reading the report also wants to see one message as the server wrote it. And a table of
token counts says nothing about whether the text looks right: a few outputs, decoded with the run's
tokenizer from the merged records, split where the audit splits them (at the think-end id) with the
think-end and the stop token shown, let a reader see it. The first ok records of each dataset in
planned order (not in the order the shards wrote them) are shown, each beside its prompt (the last
user message, shortened), and one that looks wrong (a stop without think-end, empty reasoning or
content, a truncation) when there is one, and the first output in a repetition loop
(`quality.repetition_loop`) when there is one. Long parts are cut to their head and tail, counted in
tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from toolkit.formats.prompts import PromptIndex
from toolkit.formats.records import Record
from toolkit.formats.runplan import RunPlan
from toolkit.job.inputs import PromptReader
from toolkit.job.promptline import InputError

__all__ = [
    "DatasetSamples",
    "Sample",
    "SampleCollector",
    "last_user_text",
    "shorten",
    "source_prompt",
]

SAMPLES = 3  # outputs shown per dataset
HEAD, TAIL = 200, 80  # tokens kept of a long part: its head and its tail
MAX_CHARS = 4000  # characters kept of a decoded head (a tail gets half)
PROMPT_CHARS = 300  # characters kept of the prompt shown beside an output


class Sample(msgspec.Struct):
    id: str
    why: str  # why it was picked: "first outputs" or what looks wrong with it
    finish: str | None
    matched_stop: int | str | None
    # the matched stop id as its token text, when the output ends with it
    stop_token: str | None
    think_end: str | None  # the think-end token text, when the output holds it
    think_end_id: int
    output_tokens: int
    reasoning_tokens: int
    content_tokens: int
    reasoning_head: str
    reasoning_tail: str  # "" when the head holds all of it
    # tokens between head and tail (0: none, or cut on characters only)
    reasoning_omitted: int
    content_head: str
    content_tail: str
    content_omitted: int
    # the last user message of the prompt, shortened (None: its source is unreadable)
    prompt: str | None = None


class DatasetSamples(msgspec.Struct):
    dataset: str
    max_new_tokens: int | None = None
    outputs: list[Sample] = []
    errors: dict[str, str] = {}  # failure kind (as counted) -> one real message of that kind


class _Pick(msgspec.Struct):
    rec: Record
    parts: tuple[int, int, int, int]
    has_think_end: bool
    why: str


def _looks_wrong(rec: Record, parts: tuple[int, int, int, int], has_think_end: bool) -> str | None:
    r0, r1, c0, c1 = parts
    if rec.finish == "stop" and not has_think_end:
        return "stopped without a think-end"
    if has_think_end and r1 == r0:
        return "empty reasoning"
    if rec.finish == "stop" and has_think_end and c1 == c0:
        return "empty content"
    if rec.finish == "length":
        return "hit max_new_tokens"
    return None


class SampleCollector:
    """Fed every ok record (with the audit's split) and every failure; keeps only what the report
    shows."""

    def __init__(self, datasets: list[str], max_new_tokens: dict[str, int | None]):
        self.firsts: dict[str, list[_Pick]] = {d: [] for d in datasets}
        self.odd: dict[str, _Pick | None] = {d: None for d in datasets}
        self.errors: dict[str, dict[str, str]] = {d: {} for d in datasets}
        self.loops: dict[str, _Pick | None] = {d: None for d in datasets}
        self.max_new_tokens = max_new_tokens

    def offer(self, rec: Record, parts: tuple[int, int, int, int], has_think_end: bool) -> None:
        """Keep the SAMPLES records of lowest planned position, and the lowest one that looks wrong:
        records come shard by shard, each shard's in the order it finished them."""
        firsts = self.firsts[rec.dataset]
        pick = _Pick(rec, parts, has_think_end, "first outputs")
        if len(firsts) < SAMPLES:
            firsts.append(pick)
        else:
            last = max(range(len(firsts)), key=lambda i: firsts[i].rec.index)
            if rec.index < firsts[last].rec.index:
                firsts[last] = pick
        why = _looks_wrong(rec, parts, has_think_end)
        odd = self.odd[rec.dataset]
        if why and (odd is None or rec.index < odd.rec.index):
            self.odd[rec.dataset] = _Pick(rec, parts, has_think_end, why)

    def loop(
        self, rec: Record, parts: tuple[int, int, int, int], has_think_end: bool, period: int
    ) -> None:
        """A record in a repetition loop of `period` ids: the lowest one of each dataset is shown as
        well."""
        best = self.loops[rec.dataset]
        if best is None or rec.index < best.rec.index:
            self.loops[rec.dataset] = _Pick(
                rec,
                parts,
                has_think_end,
                f"repetition loop: a span of {period} ids repeated over the tail",
            )

    def error(self, dataset: str, kind: str, message: str | None) -> None:
        self.errors[dataset].setdefault(kind, (message or "(no message)")[:1000])

    def finish(
        self,
        tok: Any,
        think_end_id: int,
        prompt_of: Callable[[Record], str | None] = lambda rec: None,
    ) -> list[DatasetSamples]:
        """The samples of each dataset; `prompt_of(record)` gives the prompt text shown beside an
        output."""
        out = []
        for name, firsts in self.firsts.items():
            picks = sorted(firsts, key=lambda p: p.rec.index)
            odd = self.odd[name]
            if (
                odd is not None
                and picks
                and not any(_looks_wrong(p.rec, p.parts, p.has_think_end) for p in picks)
            ):
                picks[-1] = odd  # show one that looks wrong in place of the last ordinary one
            for p in picks:
                p.why = _looks_wrong(p.rec, p.parts, p.has_think_end) or p.why
            loop = self.loops[name]
            if loop is not None:
                picks = [p for p in picks if p.rec.index != loop.rec.index] + [loop]
            out.append(
                DatasetSamples(
                    dataset=name,
                    max_new_tokens=self.max_new_tokens.get(name),
                    outputs=[_sample(tok, p, think_end_id, prompt_of(p.rec)) for p in picks],
                    errors=self.errors[name],
                )
            )
        return out


def shorten(text: str, limit: int = PROMPT_CHARS) -> str:
    """`text` on one line, cut in the middle past `limit` characters."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    return text[: limit * 2 // 3].rstrip() + " … " + text[-(limit // 3) :].lstrip()


def last_user_text(messages: list[dict[str, Any]], turn: int | None = None) -> str | None:
    """The text of the last user message (of the `turn`-th one, 0-based, when given), parts of text
    joined."""
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        return None
    content = (users[turn] if turn is not None and turn < len(users) else users[-1]).get("content")
    if isinstance(content, list):
        content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else None


def source_prompt(
    plan: RunPlan, refs: PromptIndex, reader: PromptReader
) -> Callable[[Record], str | None]:
    """The last user message of a record's prompt (of its turn, in a regenerated dataset), read
    from its source line with `reader`; None when the line cannot be read."""

    def prompt_of(rec: Record) -> str | None:
        ref = refs.at(rec.index)
        if ref is None:
            return None
        ds = plan.datasets[ref.dataset]
        try:
            prompt = reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
        except (OSError, InputError):
            return None
        return last_user_text(prompt.messages, ref.turn if ds.regenerate else None)

    return prompt_of


def _decode(tok: Any, ids: np.ndarray) -> str:
    return (
        tok.decode(ids.tolist(), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if len(ids)
        else ""
    )


def _head_tail(tok: Any, ids: np.ndarray) -> tuple[str, str, int]:
    """(head, tail, tokens omitted between them): the whole text when short, else the first HEAD and
    last TAIL tokens decoded (character-capped too)."""
    if len(ids) <= HEAD + TAIL:
        text = _decode(tok, ids)
        return (
            (text, "", 0)
            if len(text) <= MAX_CHARS
            else (text[: MAX_CHARS // 2], text[-MAX_CHARS // 2 :], 0)
        )
    return (
        _decode(tok, ids[:HEAD])[:MAX_CHARS],
        _decode(tok, ids[-TAIL:])[-MAX_CHARS // 2 :],
        len(ids) - HEAD - TAIL,
    )


def _token_text(tok: Any, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _sample(tok: Any, p: _Pick, think_end_id: int, prompt: str | None = None) -> Sample:
    rec = p.rec
    ids = np.frombuffer(rec.output_ids, "<u4")
    r0, r1, c0, c1 = p.parts
    rh, rt, ro = _head_tail(tok, ids[r0:r1])
    ch, ct, co = _head_tail(tok, ids[c0:c1])
    m = rec.matched_stop
    ends_with_id = isinstance(m, int) and not isinstance(m, bool) and len(ids) and int(ids[-1]) == m
    return Sample(
        id=rec.id,
        why=p.why,
        finish=rec.finish,
        matched_stop=m,
        stop_token=_token_text(tok, m) if ends_with_id else None,
        think_end=_token_text(tok, think_end_id) if p.has_think_end else None,
        think_end_id=think_end_id,
        output_tokens=len(ids),
        reasoning_tokens=r1 - r0,
        content_tokens=c1 - c0,
        reasoning_head=rh,
        reasoning_tail=rt,
        reasoning_omitted=ro,
        content_head=ch,
        content_tail=ct,
        content_omitted=co,
        prompt=shorten(prompt) if prompt is not None else None,
    )
