"""Records: one typed Struct per prompt, holding the model's exact output token ids and where
reasoning ends.

Token ids are the truth; text is derived later (export, audit). Ids are stored packed as
little-endian uint32 bytes: measured on 4,096-token outputs of real English text, that is the
smallest zstd-compressed form for a 160k vocabulary (1.24 B/token vs 1.42 for msgpack integer lists)
and it decodes without creating one Python object per token, which keeps merge and audit fast. The
worker never makes Python ints of output ids either: they go from the response's JSON text to packed
bytes in one C call (`ids_from_json`).
"""

from __future__ import annotations

import sys
import warnings
from array import array
from collections.abc import Collection, Sequence
from typing import Any

import msgspec
import numpy as np

__all__ = [
    "Record",
    "pack_ids",
    "unpack_ids",
    "ids_from_json",
    "first_index",
    "split_output",
    "id_positions",
    "split_parts",
    "ends_with_stop",
    "last_meaningful",
    "all_blank",
    "id_at",
    "FAILURES",
    "TRANSIENT",
    "MAY_PASS",
    "is_transient",
    "is_given_up",
    "is_nan_stop",
    "OK",
    "FAILED",
    "LOOP",
    "PARTIAL",
    "RECORD_CHECKS",
    "defects",
]

OK, FAILED = "ok", "failed"
# A PARTIAL record holds what the server had generated when the worker stopped (the requests in
# flight were aborted and their partial outputs kept): never part of the dataset (not ok), continued
# on the next run of the shard from where it stopped (its failure kind PARTIAL is transient), and
# superseded by the completed record.
PARTIAL = "partial"
# The finish of an ok record the worker stopped while it was generated, because its output had
# fallen into a repetition loop (formats/loops; worker/inflight): never training data
# (dataset/quality calls it "degenerate"), never generated again (a loop comes back), its output
# kept as far as it went.
LOOP = "loop"

# Why a record failed (`Record.failure`). Permanent failures are the request's own fault and come
# back the same every time; transient ones depend on the server's state at that moment, so they are
# generated again (a rerun of the shard, `toolkit resubmit`, `toolkit retry`).
REJECTED = "rejected"  # a 4xx answer, e.g. a prompt over the context length (permanent)
TEMPLATE = "template"  # the chat template failed on the prompt (permanent)
TIMEOUT = "timeout"  # no answer within request_timeout_s, retries included (transient)
SERVER_ERROR = "server_error"  # 5xx past the client's retries (transient)
UNREACHABLE = "unreachable"  # the connection failed past the retries (transient)
BAD_RESPONSE = "bad_response"  # a 200 answer that breaks the protocol (transient)
ABORTED = "aborted"  # the server aborted the request (finish_reason abort) (transient)
NAN = "nan"  # SGLang's NaN stop: a token sampled from NaN logits was replaced by
# a stop id regenerated conversations: the turn before failed in a way that may pass
PREVIOUS_TURN = "previous_turn"
# PARTIAL (above) is also the failure kind of a PARTIAL record: transient, so the shard is not
# complete with one
FAILURES = {
    REJECTED: False,
    TEMPLATE: False,
    TIMEOUT: True,
    SERVER_ERROR: True,
    UNREACHABLE: True,
    BAD_RESPONSE: True,
    ABORTED: True,
    NAN: True,
    PREVIOUS_TURN: True,
    PARTIAL: True,
}  # kind -> transient
TRANSIENT = frozenset(k for k, transient in FAILURES.items() if transient)
# The kinds of failure that may pass when generated again, as messages name them (a partial output
# is not a failure)
MAY_PASS = ", ".join(sorted(TRANSIENT - {PARTIAL, PREVIOUS_TURN}))
NAN_MATCHED = "NaN happened"  # meta_info.finish_reason.matched of SGLang's NaN stop


def is_nan_stop(finish: str | None, matched: Any) -> bool:
    """Whether SGLang stopped this request on NaN logits (its output ends in an EOS the model never
    wrote)."""
    return finish == "stop" and matched == NAN_MATCHED


class Record(msgspec.Struct, array_like=True):
    """One generated output, as shard files and the merged dataset store it (an array: the fields'
    order is the file format, their names are not stored). `finish` is what the exports and SGLang
    call `finish_reason`, also readable under that name (`finish_reason`)."""

    id: str
    dataset: str
    index: int  # position in the run's planned order
    status: str  # "ok" | "failed" | "partial"
    prompt_ids: bytes  # uint32 LE
    output_ids: bytes  # uint32 LE, exactly as the server returned them, stop token
    # included
    reasoning_end: int | None  # index of the think-end id in output_ids, None when absent
    tool_call_at: int | None  # index of the tool-call section start in output_ids, None when
    # absent
    finish: str | None  # "stop" | "length" | "abort", or LOOP (stopped in a loop);
    # None: a failed request
    matched_stop: int | str | None  # the stop token id (or string) SGLang matched
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the server found in its prefix cache
    latency_s: float  # wall time of the successful attempt
    attempts: int
    error: str | None = None
    # why a failed record failed: a key of FAILURES (None: ok, or written before kinds)
    failure: str | None = None
    segments: int = 1  # requests the output took: > 1 when continued after an abort or a stop
    # Failed generations of this id in the current budget (since the run began, or since `toolkit
    # retry` asked for it), this one included when it failed; what bounds a failure that may pass
    # (client.max_tries) across requeues, tasks and resubmits. A PARTIAL record carries the count of
    # the failures before it.
    tries: int = 1
    # a failure that may pass, given up for this run after `tries` tries
    final: bool = False
    # Seconds this id has been in flight without an answer, not yet counted as a try: carried by a
    # PARTIAL record across stops, requeues and tasks (worker.inflight.keep_unanswered), so that a
    # prompt never answered ends failed after its bound even when every stop cuts its try short.
    unanswered_s: float = 0.0
    # The data-parallel rank whose prefix cache holds this output (meta_info.dp_rank of its last
    # answer; None: not said, no data parallelism): what continues it (its next segment, its
    # continuation after a stop, a regenerated conversation's next turn) is sent to that rank.
    dp_rank: int | None = None
    # Requests that continued this output (input_ids = prompt + output so far), across its runs:
    # their input tokens, and of those the ones the server found in its prefix cache.
    continued_tokens: int = 0
    continued_cached: int = 0

    @property
    def n_output(self) -> int:
        return len(self.output_ids) // 4

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids) // 4

    @property
    def finish_reason(self) -> str | None:
        """`finish` under the exports' name: "stop", "length", "abort" or "loop"; None for a failed
        request. The stored field keeps its name `finish`."""
        return self.finish


_LITTLE = sys.byteorder == "little"


def pack_ids(ids: list[int]) -> bytes:
    a = array("I", ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    a = array("I")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def id_positions(
    packed: bytes, token_id: int, start: int = 0, end: int | None = None
) -> int | None:
    """First index in [start, end) of `token_id` in packed ids, without unpacking them (None when
    absent)."""
    needle = token_id.to_bytes(4, "little")
    hi = len(packed) if end is None else 4 * end
    i = packed.find(needle, 4 * start, hi)
    while i != -1 and i % 4:
        i = packed.find(needle, i + 1, hi)
    return None if i == -1 else i // 4


def ids_from_json(raw: bytes | memoryview, expected: int | None = None) -> np.ndarray:
    """Token ids straight from a JSON array of integers (`[12,7,...]`) as a uint32 array, in one C
    call, without one Python int per token.

    `expected` is the count the server reported (meta_info.completion_tokens): a parse that stopped
    early (anything but integers in the array) is caught by it. Raises ValueError.
    """
    body = bytes(raw).strip()
    if not (body.startswith(b"[") and body.endswith(b"]")):
        raise ValueError(f"expected a JSON array of token ids, got {body[:40]!r}")
    inner = body[1:-1]
    if not inner.strip():
        arr = np.zeros(0, dtype="<u4")
    else:
        with warnings.catch_warnings():
            # an early stop is caught by the count below
            warnings.simplefilter("ignore", DeprecationWarning)
            arr = np.fromstring(inner, dtype="<u4", sep=",")
    n = expected if expected is not None else (inner.count(b",") + 1 if inner.strip() else 0)
    if len(arr) != n or b"-" in inner[:1]:
        raise ValueError(
            f"{n} token ids expected, {len(arr)} parsed as non-negative integers from "
            f"{inner[:60]!r}"
        )
    return arr


def first_index(ids: np.ndarray, token_id: int | None) -> int | None:
    """Index of the first `token_id` in a uint32 array (None when absent or token_id is None)."""
    if token_id is None or not len(ids):
        return None
    hit = ids == token_id
    i = int(hit.argmax())
    return i if hit[i] else None


def split_output(
    output_ids: np.ndarray, think_end_id: int, tool_call_start_id: int | None
) -> tuple[int | None, int | None]:
    """Where reasoning ends (index of the think-end id) and where a tool-call section starts, on
    token ids."""
    return first_index(output_ids, think_end_id), first_index(output_ids, tool_call_start_id)


def is_transient(record: Record) -> bool:
    """A failed record worth generating again (see TRANSIENT), not given up for this run
    (`final`)."""
    return record.status != OK and record.failure in TRANSIENT and not record.final


def is_given_up(record: Record) -> bool:
    """A failure that may pass, final for this run: it failed client.max_tries times (`toolkit
    retry` starts over)."""
    return record.status != OK and record.final


def failed_record(
    id: str,
    dataset: str,
    index: int,
    prompt_ids: list[int],
    error: str,
    attempts: int,
    failure: str | None = None,
    *,
    final: bool = False,
) -> Record:
    return Record(
        id=id,
        dataset=dataset,
        index=index,
        status=FAILED,
        prompt_ids=pack_ids(prompt_ids),
        output_ids=b"",
        reasoning_end=None,
        tool_call_at=None,
        finish=None,
        matched_stop=None,
        prompt_tokens=len(prompt_ids),
        completion_tokens=0,
        cached_tokens=0,
        latency_s=0.0,
        attempts=attempts,
        error=error,
        failure=failure,
        final=final,
    )


# --------------------------------------------------------------------------------------------------
# reading an output on its ids: where reasoning and content are
# --------------------------------------------------------------------------------------------------
def id_at(packed: bytes, i: int) -> int:
    return int.from_bytes(packed[4 * i : 4 * i + 4], "little")


def last_meaningful(ids: bytes | Sequence[int], blank: Collection[int]) -> int | None:
    """The last id that is not whitespace-only, of packed ids (bytes) or of a list of ids."""
    if isinstance(ids, (bytes, bytearray, memoryview)):
        for i in range(len(ids) - 4, -1, -4):
            t = int.from_bytes(ids[i : i + 4], "little")
            if t not in blank:
                return t
        return None
    for t in reversed(ids):
        if t not in blank:
            return t
    return None


def all_blank(packed: bytes, a: int, b: int, blank: frozenset[int]) -> bool:
    """Whether ids a .. b-1 of packed ids are all whitespace-only (True for an empty range)."""
    for i in range(4 * a, 4 * b, 4):
        if int.from_bytes(packed[i : i + 4], "little") not in blank:
            return False
    return True


def ends_with_stop(rec: Record) -> bool:
    """Whether the last output id is the stop token the server matched (then it is not text)."""
    m = rec.matched_stop
    return (
        rec.finish == "stop"
        and isinstance(m, int)
        and not isinstance(m, bool)
        and len(rec.output_ids) >= 4
        and int.from_bytes(rec.output_ids[-4:], "little") == m
    )


def split_parts(rec: Record, think_start_id: int, opened: bool) -> tuple[int, int, int, int]:
    """Token ranges [r0, r1) of the reasoning and [c0, c1) of the content in `rec.output_ids`.

    The stop token is in neither; a think-start the model wrote at position 0 and the think-end are
    in neither. Without a think-end, an output that started inside reasoning (`opened`: the prompt
    ends with think-start, or the model wrote one) is all reasoning up to a tool-call section, which
    ends reasoning implicitly; any other output is all content.
    """
    out = rec.output_ids
    n = len(out) >> 2
    end = n - 1 if ends_with_stop(rec) else n
    start = 1 if n and id_at(out, 0) == think_start_id else 0
    end = max(end, start)
    re_ = rec.reasoning_end
    if re_ is not None and start <= re_ < n:
        return start, re_, re_ + 1, max(end, re_ + 1)
    if start or opened:
        tc = rec.tool_call_at
        if tc is not None and start <= tc < end:
            return start, tc, tc, end
        return start, end, end, end
    return 0, 0, 0, end


# --------------------------------------------------------------------------------------------------
# what an ok record must hold on its own: the audit counts each (dataset.audit_report.Integrity),
# export refuses them
# --------------------------------------------------------------------------------------------------
RECORD_CHECKS = {
    "completion_mismatch": "completion_tokens is not the number of output ids",
    "prompt_mismatch": "prompt_tokens is not the number of prompt ids",
    "over_max_new_tokens": "more output ids than max_new_tokens",
    "out_of_vocab": "an id outside the tokenizer",
    "stop_mismatch": "a stop finish whose matched id is not the last output id",
    "bad_finish": "a finish other than stop, length or loop",
    "split_mismatch": "reasoning_end is not the first think-end id",
}


def defects(
    rec: Record, vocab_size: int, think_end_at: int | None, max_new_tokens: int | None
) -> list[str]:
    """The RECORD_CHECKS an ok record fails, in their order. `think_end_at`: the index of the first
    think-end id of its output (None: none); `max_new_tokens`: its dataset's."""
    out, pk = rec.output_ids, rec.prompt_ids
    n = len(out) >> 2
    found = []
    if rec.completion_tokens != n:
        found.append("completion_mismatch")
    if rec.prompt_tokens != len(pk) >> 2:
        found.append("prompt_mismatch")
    if max_new_tokens is not None and n > max_new_tokens:
        found.append("over_max_new_tokens")
    if (
        n
        and int(np.frombuffer(out, "<u4").max()) >= vocab_size
        or pk
        and int(np.frombuffer(pk, "<u4").max()) >= vocab_size
    ):
        found.append("out_of_vocab")
    m = rec.matched_stop
    if rec.finish == "stop":
        if isinstance(m, int) and not isinstance(m, bool) and not ends_with_stop(rec):
            found.append("stop_mismatch")
    elif rec.finish not in ("length", LOOP):
        found.append("bad_finish")
    if think_end_at != rec.reasoning_end:
        found.append("split_mismatch")
    return found
