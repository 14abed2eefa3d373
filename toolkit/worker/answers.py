"""The records of what a prompt's requests brought back: an answer (ok, or failed when the server
aborted it or hit SGLang's NaN stop), the partial output a stop left (PARTIAL, continued by the next
run of the shard), and a PARTIAL record with no output, carrying its tries and its time waited."""

from __future__ import annotations

import msgspec

from toolkit.engines.endpoints import GenerateResult
from toolkit.formats.prompts import PromptRef
from toolkit.formats.records import (
    ABORTED,
    FAILED,
    NAN,
    NAN_MATCHED,
    OK,
    PARTIAL,
    Record,
    failed_record,
    pack_ids,
    split_output,
)

__all__ = ["Generated", "empty_partial", "partial_record", "result_record"]


class Generated:
    """What worker.generate brought back: the (combined) result, how many requests brought output,
    whether it is partial, and the continuation requests' input and cached tokens (`continued`)."""

    __slots__ = ("res", "segments", "partial", "continued")

    def __init__(
        self, res: GenerateResult, segments: int, partial: bool, continued: tuple[int, int] = (0, 0)
    ):
        self.res, self.segments, self.partial = res, segments, partial
        self.continued = continued


def result_record(ref: PromptRef, ds: str, pos: int, ids: list[int], g: Generated, info) -> Record:
    """The record of a 200 answer: ok, or failed when the server aborted it or hit SGLang's NaN
    stop."""
    res, rec = g.res, _record(ref, ds, pos, ids, g, info)
    if res.finish == "abort":
        return msgspec.structs.replace(
            rec, status=FAILED, error="aborted by the server", failure=ABORTED
        )
    if res.finish == "stop" and res.matched == NAN_MATCHED:
        error = (
            f"SGLang's NaN stop (finish_reason matched {NAN_MATCHED!r}): a token sampled from NaN "
            f"logits was replaced by a stop id after {len(res.output_ids) - 1} tokens; the output "
            "is not the model's"
        )
        return msgspec.structs.replace(rec, status=FAILED, error=error, failure=NAN)
    return rec


def partial_record(ref: PromptRef, ds: str, pos: int, ids: list[int], g: Generated, info) -> Record:
    """A PARTIAL record: the output so far of a request stopped mid-way, continued by the next
    run."""
    n = len(g.res.output_ids)
    return msgspec.structs.replace(
        _record(ref, ds, pos, ids, g, info),
        status=PARTIAL,
        finish="abort",
        matched_stop=None,
        prompt_tokens=len(ids),
        completion_tokens=n,
        latency_s=round(g.res.latency_s, 4),
        error=f"stopped after {n} generated tokens; continued from there on the next run of the "
        "shard",
        failure=PARTIAL,
    )


def _record(ref: PromptRef, ds: str, pos: int, ids: list[int], g: Generated, info) -> Record:
    """The record of an output (`g`) as the server answered it (ok, with its finish, tokens and
    latency); `info`: the token info that splits reasoning from content (None: not split)."""
    res, out = g.res, g.res.output_ids
    reasoning_end, tool_call_at = (
        split_output(out, info.think_end_id, info.tool_call_start_id) if info else (None, None)
    )
    return Record(
        id=ref.id,
        dataset=ds,
        index=pos,
        status=OK,
        prompt_ids=pack_ids(ids),
        output_ids=out.tobytes(),
        reasoning_end=reasoning_end,
        tool_call_at=tool_call_at,
        finish=res.finish,
        matched_stop=res.matched,
        prompt_tokens=res.prompt_tokens,
        completion_tokens=res.completion_tokens,
        cached_tokens=res.cached_tokens,
        latency_s=res.latency_s,
        attempts=res.attempts,
        error=None,
        failure=None,
        segments=g.segments,
        dp_rank=res.dp_rank,
        continued_tokens=g.continued[0],
        continued_cached=g.continued[1],
    )


def empty_partial(ref: PromptRef, ds: str, pos: int, ids: list[int]) -> Record:
    """A PARTIAL record with no output: what it carries (tries, unanswered_s) to the next run."""
    error = "stopped before any answer; the time it waited counts on the next run of the shard"
    failed = failed_record(ref.id, ds, pos, ids, error, 0, PARTIAL)
    return msgspec.structs.replace(failed, status=PARTIAL, finish="abort", segments=0)
