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
    res = g.res
    failure = error = None
    if res.finish == "abort":
        failure, error = ABORTED, "aborted by the server"
    elif res.finish == "stop" and res.matched == NAN_MATCHED:
        failure = NAN
        error = (
            f"SGLang's NaN stop (finish_reason matched {NAN_MATCHED!r}): a token sampled from NaN "
            f"logits was replaced by a stop id after {len(res.output_ids) - 1} tokens; the output "
            "is not the model's"
        )
    return _record(
        ref,
        ds,
        pos,
        ids,
        g,
        info,
        status=OK if failure is None else FAILED,
        finish=res.finish,
        matched=res.matched,
        tokens=(res.prompt_tokens, res.completion_tokens),
        latency_s=res.latency_s,
        error=error,
        failure=failure,
    )


def partial_record(ref: PromptRef, ds: str, pos: int, ids: list[int], g: Generated, info) -> Record:
    """A PARTIAL record: the output so far of a request stopped mid-way, continued by the next
    run."""
    n = len(g.res.output_ids)
    return _record(
        ref,
        ds,
        pos,
        ids,
        g,
        info,
        status=PARTIAL,
        finish="abort",
        matched=None,
        tokens=(len(ids), n),
        latency_s=round(g.res.latency_s, 4),
        error=f"stopped after {n} generated tokens; continued from there on the next run of the "
        "shard",
        failure=PARTIAL,
    )


def _record(
    ref: PromptRef,
    ds: str,
    pos: int,
    ids: list[int],
    g: Generated,
    info,
    *,
    status: str,
    finish: str,
    matched,
    tokens: tuple[int, int],
    latency_s: float,
    error: str | None,
    failure: str | None,
) -> Record:
    """The record of an output (`g`); `tokens`: its prompt and completion tokens; `info`: the token
    info that splits reasoning from content (None: not split)."""
    res, out = g.res, g.res.output_ids
    reasoning_end, tool_call_at = (
        split_output(out, info.think_end_id, info.tool_call_start_id) if info else (None, None)
    )
    return Record(
        id=ref.id,
        dataset=ds,
        index=pos,
        status=status,
        prompt_ids=pack_ids(ids),
        output_ids=out.tobytes(),
        reasoning_end=reasoning_end,
        tool_call_at=tool_call_at,
        finish=finish,
        matched_stop=matched,
        prompt_tokens=tokens[0],
        completion_tokens=tokens[1],
        cached_tokens=res.cached_tokens,
        latency_s=latency_s,
        attempts=res.attempts,
        error=error,
        failure=failure,
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
