"""The `conversations` export: SpecForge's chat JSONL, each row rendered again through the chat
template as SpecForge renders it (`_Checks`, `trainers.RoundTrip`) and the per-row result written
beside it; a regenerated conversation as one row with every turn (`_Rows`, `_Chain`), written
only when every turn is training data.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from toolkit.dataset.export.jsonl import _write_lines
from toolkit.dataset.export.selection import OTHER_TURN, _Account, _batches, _Defects
from toolkit.dataset.export.text import _ids, _Text, _Tokens
from toolkit.dataset.export.tokens import loss_mask
from toolkit.dataset.trainers import RoundTrip, trainer_json
from toolkit.formats.prompts import PromptRef
from toolkit.formats.records import OK, Record
from toolkit.formats.runplan import RunPlan
from toolkit.job.inputs import PromptReader
from toolkit.job.toolcalls import parse_tool_calls
from toolkit.job.turns import answer_message, turn_messages, user_turns

# conversations rows whose round trip is checked in one tokenizer call (at most CHECK_TOKENS ids)
CHECK_ROWS = 64
CHECK_TOKENS = 1 << 18


def has_think_marker(text: str) -> bool:
    """`<think>` or `</think>` written as text, in any case (what SpecForge's strict validation
    refuses)."""
    low = text.lower()
    return "<think>" in low or "</think>" in low


def _text_problem(answer: dict[str, Any]) -> str | None:
    """What makes a decoded answer unfit for a conversation turn, seen on its text."""
    if has_think_marker(answer["content"]) or has_think_marker(answer["reasoning_content"]):
        return "text_think_marker"
    calls = answer.get("tool_calls") or []
    if any("raw" in c for c in calls):
        return "unreadable_tool_call"
    if not answer["content"].strip():
        return "tool_call_only" if calls else "empty_answer"
    return None


def _visible(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message of the history as a trainer's multi-turn rows hold it: its visible
    content, no reasoning."""
    if message.get("role") != "assistant" or "reasoning_content" not in message:
        return message
    return {k: v for k, v in message.items() if k != "reasoning_content"}


class _Chain:
    """The turns of one regenerated conversation read so far: (record, ref, answer or None, why
    not)."""

    def __init__(self) -> None:
        self.turns: list[tuple[Record, PromptRef, dict[str, Any] | None, str | None]] = []
        self.done = -1  # the last turn accounted for (a row ending at it written, or left out)


class _Checks:
    """The conversations export's own round trip: each row rendered with the model's chat template
    as SpecForge renders it (`trainers.RoundTrip`), written per row to the round-trip file; and
    tool-call arguments SpecForge would re-serialise, counted. Rows are checked in batches
    (CHECK_ROWS rows or CHECK_TOKENS ids, whichever comes first: one tokenizer call each, on every
    core), written in row order; `every` > 1 checks one row in `every` (`--check-sample`)."""

    def __init__(self, tokens: _Tokens, reg, out, every: int = 1):
        self.trip = RoundTrip(tokens.tok, reg)
        self.out, self.enc = out, msgspec.json.Encoder()
        self.reformatted = 0
        self.every, self.seen = every, 0
        self.pending: list[tuple[str, int, list, list | None, list[int]]] = []
        self.tokens = 0

    def row(self, row: dict[str, Any], last: Record) -> None:
        reformatted = 0
        for m in row["conversations"]:
            for call in m.get("tool_calls") or ():
                args = call.get("function", {}).get("arguments")
                reformatted += isinstance(args, str) and not trainer_json(args)
        self.reformatted += reformatted
        self.seen += 1
        if (self.seen - 1) % self.every:
            return
        stored = _ids(last.prompt_ids + last.output_ids)
        self.pending.append((row["id"], reformatted, row["conversations"], row["tools"], stored))
        self.tokens += len(stored)
        if len(self.pending) >= CHECK_ROWS or self.tokens >= CHECK_TOKENS:
            self.flush()

    def flush(self) -> None:
        """Check the rows held and write their lines."""
        if not self.pending:
            return
        firsts = self.trip.check_many([(c, t, ids) for _, _, c, t, ids in self.pending])
        buf = bytearray()
        for (row_id, reformatted, *_), at in zip(self.pending, firsts):
            self.enc.encode_into(
                {
                    "id": row_id,
                    "identical": at is None,
                    "first_difference": at,
                    "arguments_reformatted": reformatted,
                },
                buf,
                -1,
            )
            buf += b"\n"
        self.out.write(buf)
        self.pending.clear()
        self.tokens = 0


def _export_conversations(
    path: Path,
    plan: RunPlan,
    out,
    acc: _Account,
    tokens: _Tokens,
    defects: _Defects,
    checks: _Checks,
) -> int:
    text, enc, n = _Text(plan, tokens), msgspec.json.Encoder(), 0
    reader = PromptReader()
    rows = _Rows(plan, acc, tokens, checks, reader)
    with reader:
        for recs in _batches(path, defects):
            n += _write_lines(out, rows.of(recs, text.parts_and_tools(recs)), enc)
    checks.flush()
    rows.left_over()
    return n


def _base(r: Record, ref: PromptRef) -> dict[str, Any]:
    return {
        "id": r.id,
        "status": "success",
        "dataset": r.dataset,
        "sample": ref.sample,
        "turn": ref.turn,
        "segments": r.segments,
    }


def _answer_of(r: Record, parts: tuple[str, str, str]) -> dict[str, Any] | None:
    reasoning, content, section = parts
    if r.status != OK:
        return None
    return answer_message(reasoning, content, parse_tool_calls(section) if section else None)


class _Rows:
    """The rows of the records read, in order: one per record of a source history, one per
    selected turn of a regenerated conversation (its turns held in `chains` until its last is
    read); every selected record accounted for (`acc`), every row checked (`checks`)."""

    def __init__(self, plan: RunPlan, acc: _Account, tokens: _Tokens, checks: _Checks, reader):
        self.plan, self.acc, self.tokens = plan, acc, tokens
        self.checks, self.reader = checks, reader
        self.chains: dict[tuple[int, int, int], _Chain] = {}

    def of(self, recs: list[Record], parts: list[tuple[str, str, str]]) -> Iterator[dict]:
        acc = self.acc
        for r, p in zip(recs, parts):
            ref = acc.ref(r)
            ds = self.plan.datasets[ref.dataset]
            if not acc.selected(r, ref) and (
                not ds.regenerate
                or acc.sel.datasets is not None
                and ds.name not in acc.sel.datasets
            ):
                # (a regenerated turn not selected may still be the history of one that is)
                continue
            prompt = self.reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
            why, answer = self._judged(r, p)
            if ds.regenerate:
                yield from self._regenerated(
                    r, ref, prompt, why if r.status == OK or why is not None else "failed", answer
                )
                continue
            if why is not None:
                acc.left_out(r, ref, why)
                continue
            yield self._single(r, ref, prompt, answer)

    def _judged(self, r: Record, parts: tuple[str, str, str]) -> tuple[str | None, Any]:
        """(why the record is left out or None, its answer message or None)."""
        why = self.acc.outcome(r)
        answer = _answer_of(r, parts) if why is None else None
        if answer is not None:
            why = _text_problem(answer)
            if why is not None and why in self.acc.include:
                why = None
            answer = answer if why is None else None
        return why, answer

    def _single(self, r: Record, ref: PromptRef, prompt, answer) -> dict:
        """The row of a record whose history is the source's."""
        self.acc.exported()
        row = _base(r, ref)
        if r.status != OK:  # --include-failed
            row["status"] = "failed"
            answer = answer_message("", "")
        row["conversations"] = [*(_visible(m) for m in prompt.messages), answer]
        row["tools"] = prompt.tools or []
        if r.status == OK:
            self.checks.row(row, r)
            self.acc.measured(r, loss_mask(r.prompt_ids, r.n_output, self.tokens.info))
        return row

    def _regenerated(
        self, r: Record, ref: PromptRef, prompt, why: str | None, answer
    ) -> Iterator[dict]:
        """The row of a regenerated conversation that ends at this turn, when it is selected and
        every turn up to it is training data (else its turns are left out)."""
        acc = self.acc
        key = (ref.dataset, ref.line, ref.sample)
        chain = self.chains.setdefault(key, _Chain())
        chain.turns.append((r, ref, answer, why))
        last = ref.turn + 1 >= user_turns(prompt.messages)
        if last:
            del self.chains[key]
        if not acc.selected(r, ref) or not (
            acc.sel.turns is None
            and last
            or acc.sel.turns is not None
            and ref.turn in acc.sel.turns
        ):
            return
        turns = chain.turns[: ref.turn + 1]
        # a turn is missing from the merged dataset
        if [t[1].turn for t in turns] != list(range(ref.turn + 1)):
            return
        bad = next((t for t in turns if t[3] is not None), None)
        selected = [t for t in turns[chain.done + 1 :] if acc.selected(t[0], t[1])]
        chain.done = ref.turn
        if bad is not None:
            for rec, tref, _, twhy in selected:
                acc.left_out(rec, tref, twhy if twhy is not None else OTHER_TURN)
            return
        acc.exported(len(selected))
        answers = [t[2] for t in turns]
        row = _base(r, ref)
        row["id"] = r.id.rsplit("/t", 1)[0]
        row["turns"] = len(turns)
        row["segments"] = sum(t[0].segments for t in turns)
        row["conversations"] = [*turn_messages(prompt.messages, ref.turn, answers), answers[-1]]
        row["tools"] = prompt.tools or []
        self.checks.row(row, r)
        acc.measured(r, loss_mask(r.prompt_ids, r.n_output, self.tokens.info))
        yield row

    def left_over(self) -> None:
        """Account for the turns of conversations whose later turns the merged dataset does not
        hold."""
        for chain in self.chains.values():
            for rec, ref, _, why in chain.turns[chain.done + 1 :]:
                if self.acc.selected(rec, ref):
                    self.acc.left_out(rec, ref, why if why is not None else OTHER_TURN)
