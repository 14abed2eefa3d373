"""A /generate answer read and checked: its output ids and meta_info, decoded with msgspec into
typed Structs, reading `output_ids` and `meta_info` from the end of the body so the long `text`
field is never walked (unknown `meta_info` keys are ignored); then checked against its request
(`check_answer`): one that breaks SGLang's contract (another rid, more ids than max_new_tokens, a
length finish short of it, ids outside the vocabulary, a finish reason of the wrong shape) is a
`BadResponse` saying what is wrong, never a result.
"""

from __future__ import annotations

from typing import Any

import msgspec

from toolkit.engines.client import BadResponse, RequestRejected, ServerError
from toolkit.formats.records import ids_from_json

__all__ = ["Expect", "MetaInfo", "check_answer", "parse_response", "read_answer"]


class MetaInfo(msgspec.Struct):
    """The part of /generate's meta_info the worker keeps (the rest, e.g. e2e_latency, is skipped
    unread)."""

    id: Any = None  # the request's rid
    finish_reason: Any = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int = 0
    # the data-parallel rank that ran it (0.5.23; null without data parallelism, absent in 0.5.9;
    # anything but an int is taken as not said)
    dp_rank: Any = None


class GenerateResponse(msgspec.Struct):
    # parsed to packed ids by records.ids_from_json (no Python int per token)
    output_ids: msgspec.Raw
    meta_info: MetaInfo


_resp_decoder = msgspec.json.Decoder(GenerateResponse)


class _Tail(msgspec.Struct):
    meta_info: MetaInfo


_tail_decoder = msgspec.json.Decoder(_Tail)
_IDS_KEY, _META_KEY = b'"output_ids":', b'"meta_info":'


def _split_body(body: bytes) -> tuple[bytes, MetaInfo] | None:
    """(output_ids' JSON text, meta_info) found without reading `text`, or None to decode the whole
    body.

    SGLang answers `{"text": ..., "output_ids": [...], "meta_info": {...}}`. Decoding it in full
    means walking the text string, as long as the ids. Here the keys are found from the end instead:
    the last `"meta_info":` is the top-level key (the bytes `s":` cannot occur inside a JSON string,
    where every quote is escaped, and meta_info holds no key of that name); the array just before
    it, with nothing but a comma between, must be `"output_ids":[...]`. Anything else — another key
    order, whitespace, an added key — takes the full decode.
    """
    m = body.rfind(_META_KEY)
    close = body.rfind(b"]", 0, m) if m > 0 else -1
    start = body.rfind(b"[", 0, close) if close > 0 else -1
    if (
        start < len(_IDS_KEY)
        or body[start - len(_IDS_KEY) : start] != _IDS_KEY
        or body[close + 1 : m] != b","
    ):
        return None
    try:
        meta = _tail_decoder.decode(b"{" + body[m:]).meta_info
    except msgspec.DecodeError:
        return None
    return body[start : close + 1], meta


def parse_response(body: bytes):
    """(output ids as a uint32 array, meta_info) of a /generate answer, checked: len(output_ids) ==
    meta_info.completion_tokens (SGLang counts the stop token in both; an answer without it is
    refused)."""
    ids, meta, _ = read_answer(body)
    return ids, meta


def read_answer(body: bytes):
    """parse_response's ids and meta_info, and the JSON text of the ids (what a continuation sends
    on)."""
    found = _split_body(body)
    if found is not None:
        raw, meta = found
    else:
        try:
            resp = _resp_decoder.decode(body)
        except msgspec.DecodeError as e:
            raise BadResponse(f"unexpected /generate answer ({e}): {body[:200]!r}") from None
        raw, meta = resp.output_ids, resp.meta_info
    if not isinstance(meta.completion_tokens, int):
        raise BadResponse(f"meta_info has no completion_tokens (got {meta.completion_tokens!r})")
    try:
        ids = ids_from_json(raw, meta.completion_tokens)
    except ValueError as e:
        raise BadResponse(f"output_ids do not match meta_info.completion_tokens: {e}") from None
    return ids, meta, bytes(raw)


class Expect(msgspec.Struct, frozen=True):
    """What an answer is checked against besides its request: the tokenizer's size (every id below
    it) and SGLang's max_req_len (a request's prompt + output + 1 never passes it: its scheduler
    clamps max_new_tokens there, so a length finish short of max_new_tokens must reach it). None:
    not checked."""

    vocab_size: int | None = None
    max_req_len: int | None = None


FINISH_TYPES = ("stop", "length", "abort")


def check_answer(
    ids,
    meta: MetaInfo,
    *,
    rid: str | None,
    n_input: int,
    max_new_tokens: int | None,
    expect: Expect | None = None,
) -> dict:
    """The finish_reason of a 200 answer to the request (`rid`, `n_input` prompt ids,
    `max_new_tokens`), once the answer is checked against it; BadResponse saying what breaks
    SGLang's contract. An abort that carries an HTTP status code is that error, as SGLang's own HTTP
    layer turns it into one: ServerError (5xx) or RequestRejected (4xx)."""
    fr = meta.finish_reason
    if not isinstance(fr, dict) or fr.get("type") not in FINISH_TYPES:
        raise BadResponse(
            f"finish_reason {_short(fr)} is not an object whose type is stop, length or abort"
        )
    if rid is not None and meta.id != rid:
        raise BadResponse(
            f"the answer of another request: meta_info.id {_short(meta.id)}, sent as rid {rid!r}"
        )
    n, kind = len(ids), fr["type"]
    if max_new_tokens is not None and n > max_new_tokens:
        raise BadResponse(f"{n} output ids, more than max_new_tokens = {max_new_tokens}")
    limit = expect.max_req_len if expect else None
    if (
        kind == "length"
        and max_new_tokens is not None
        and limit
        and n < max_new_tokens
        and n_input + n + 1 < limit
    ):
        raise BadResponse(
            f"finish_reason length after {n} output ids, short of max_new_tokens = "
            f"{max_new_tokens} and of the context limit ({n_input} prompt + {n} output ids + 1 < "
            f"{limit})"
        )
    vocab = expect.vocab_size if expect else None
    if vocab is not None and n and int(ids.max()) >= vocab:
        raise BadResponse(f"output id {int(ids.max())} outside the vocabulary ({vocab} ids)")
    code = fr.get("status_code") if kind == "abort" else None
    if isinstance(code, int) and not isinstance(code, bool) and code >= 400:
        body = msgspec.json.encode(
            {"message": f"aborted with status_code {code}: {fr.get('message')}"}
        )
        raise (ServerError if code >= 500 else RequestRejected)(code, body)
    return fr


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
