"""The `jsonl` export: one line per record with its ids, its decoded text and its prompt line's
other fields (`JsonlRecord`); `_write_lines`, the line writer the other JSON-lines formats share.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from toolkit.dataset.export.selection import _Account, _Defects, _kept
from toolkit.dataset.export.text import _ids, _Meta, _Text, _Tokens, stop_columns
from toolkit.formats.prompts import PromptRef
from toolkit.formats.records import Record
from toolkit.formats.runplan import RunPlan


class JsonlRecord(msgspec.Struct):
    """One line of the `jsonl` export (and one row of `parquet`), fields in this order."""

    id: str
    dataset: str
    sample: int
    turn: int
    # requests the output took (> 1: continued after an abort or a stop)
    segments: int
    status: str
    error: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    reasoning_end: int | None
    reasoning: str
    content: str
    finish_reason: str | None
    # the stop token id SGLang matched (None: a stop string, or no stop)
    matched_stop: int | None
    matched_stop_str: str | None  # the stop string SGLang matched, when the stop was a string
    prompt_tokens: int
    completion_tokens: int
    # the prompt line's other fields (`_Meta`); None: its file changed
    meta: dict[str, Any] | None = None


def _jsonl_rows(
    recs: list[Record], refs: list[PromptRef], texts: list[tuple[str, str]], meta: _Meta
) -> Iterator[JsonlRecord]:
    for r, ref, (reasoning, content) in zip(recs, refs, texts):
        stop_id, stop_str = stop_columns(r.matched_stop)
        yield JsonlRecord(
            id=r.id,
            dataset=r.dataset,
            sample=ref.sample,
            turn=ref.turn,
            segments=r.segments,
            status=r.status,
            error=r.error,
            prompt_ids=_ids(r.prompt_ids),
            output_ids=_ids(r.output_ids),
            reasoning_end=r.reasoning_end,
            reasoning=reasoning,
            content=content,
            finish_reason=r.finish,
            matched_stop=stop_id,
            matched_stop_str=stop_str,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            meta=meta.of(ref),
        )


def _write_lines(out, objs: Iterator[Any], enc: msgspec.json.Encoder) -> int:
    buf = bytearray()
    n = 0
    for obj in objs:
        enc.encode_into(obj, buf, -1)
        buf += b"\n"
        n += 1
    out.write(buf)
    return n


def _export_jsonl(
    path: Path, plan: RunPlan, out, acc: _Account, tokens: _Tokens, defects: _Defects
) -> int:
    text, enc, n, meta = _Text(plan, tokens), msgspec.json.Encoder(), 0, _Meta(plan)
    for recs, refs in _kept(path, acc, defects):
        n += _write_lines(out, _jsonl_rows(recs, refs, text.parts(recs), meta), enc)
    return n
