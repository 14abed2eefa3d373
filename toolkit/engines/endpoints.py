"""The calls of SGLang's native endpoints the toolkit makes: `/generate` (raw input_ids in, the
exact output_ids out), `/abort_request`, and the probes `/server_info`, `/health_generate` and
`/v1/loads`.

Retries with backoff cover connection errors, 5xx and 429 (too many requests: a router's rate
limit) only; any other 4xx is the request's own fault and is returned to the caller as a
`RequestRejected`, never retried. Every 200 answer is checked against its request
(answer.check_answer): one that breaks SGLang's contract is a `BadResponse`, never a result.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Callable

import msgspec

from toolkit.engines.answer import Expect, check_answer, read_answer
from toolkit.engines.client import (
    BadResponse,
    HttpClient,
    RequestRejected,
    ServerError,
    Unreachable,
)

__all__ = [
    "GenerateResult",
    "generate",
    "abort_requests",
    "EngineLoad",
    "ServerLimits",
    "health_generate",
    "read_load",
    "server_limits",
]

log = logging.getLogger(__name__)


class GenerateResult(msgspec.Struct):
    output_ids: Any  # numpy uint32 array: exactly the ids the server sent
    finish: str | None
    matched: int | str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    latency_s: float
    attempts: int
    # the answer's output_ids as JSON text, exactly as the server sent them
    output_json: bytes | None = None
    dp_rank: int | None = None  # meta_info.dp_rank: the rank whose prefix cache holds it now


class _Request(msgspec.Struct, omit_defaults=True):
    input_ids: list[int] | msgspec.Raw  # Raw: the JSON text of the ids, sent as it is
    sampling_params: dict[str, Any]
    rid: str | None = None
    routed_dp_rank: int | None = None  # pins the request to that data-parallel rank


_req_encoder = msgspec.json.Encoder()


async def generate(
    http: HttpClient,
    input_ids: list[int],
    sampling_params: dict[str, Any],
    *,
    rid: str | Callable[[], str] | None = None,
    timeout: float,
    retries: int,
    backoff_s: float = 1.0,
    backoff_max_s: float = 60.0,
    engine_alive=None,
    expect: Expect | None = None,
    input_json: bytes | None = None,
    n_input: int | None = None,
    routed_dp_rank: int | None = None,
) -> GenerateResult:
    """POST one prompt to /generate and return its result, checked against the request
    (`check_answer`).

    Retries connection errors, timeouts, 5xx and 429 up to `retries` times with jittered exponential
    backoff; raises RequestRejected on another 4xx, BadResponse on an answer that breaks the
    contract, and the last error when retries run out. `engine_alive`, when given, is called before
    each retry: once the engine is gone, retrying is pointless and the error is raised at once.
    `rid` may be a callable, called for each attempt: a retry after a timeout must not reuse the rid
    of a request the server may still hold (SGLang answers a duplicate in-flight rid with 400).
    `input_json`, when given, is `input_ids` as JSON text, sent as it is (a continuation's prompt +
    output so far is not encoded again), and `n_input` their count (input_ids is then not read).
    `routed_dp_rank` sends it to that data-parallel rank (SGLang's `routed_dp_rank`; None: the
    server's load balancer chooses).
    """
    n_in = n_input if input_json is not None else len(input_ids)
    sent_ids = msgspec.Raw(input_json) if input_json is not None else input_ids
    pin = routed_dp_rank
    fixed = (
        None
        if callable(rid)
        else _req_encoder.encode(_Request(sent_ids, sampling_params, rid, pin))
    )
    loop = asyncio.get_running_loop()
    max_new = sampling_params.get("max_new_tokens")
    attempt = 0
    began = loop.time()
    while True:
        attempt += 1
        sent = rid() if callable(rid) else rid
        body = (
            fixed
            if fixed is not None
            else _req_encoder.encode(_Request(sent_ids, sampling_params, sent, pin))
        )
        t0 = loop.time()
        try:
            status, data = await http.request("POST", "/generate", body, timeout=timeout)
            if status == 200:
                return _result(data, sent, n_in, max_new, expect, t0, attempt)
            if status >= 500 or status == 429:
                raise ServerError(status, data)
            raise RequestRejected(status, data)
        except (Unreachable, ServerError) as e:
            if attempt > retries or (engine_alive is not None and not engine_alive()):
                e.attempts = attempt
                if attempt > 1:  # the time really waited, not one attempt's
                    e.args = (f"{e}; {attempt} attempts in {loop.time() - began:.0f} s",)
                raise
            delay = min(backoff_max_s, backoff_s * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            log.debug("retrying after %s (attempt %d, %.1f s)", e, attempt, delay)
            await asyncio.sleep(delay)
        except (RequestRejected, BadResponse) as e:
            e.attempts = attempt
            raise


def _result(
    data: bytes,
    rid: str | None,
    n_in: int,
    max_new: int | None,
    expect: Expect | None,
    sent_at: float,
    attempt: int,
) -> GenerateResult:
    """The result of a 200 answer (`data`) to the request sent as `rid` at `sent_at` (the loop's
    clock), once checked against it."""
    ids, m, raw = read_answer(data)
    fr = check_answer(ids, m, rid=rid, n_input=n_in, max_new_tokens=max_new, expect=expect)
    return GenerateResult(
        output_ids=ids,
        finish=fr.get("type"),
        matched=fr.get("matched"),
        prompt_tokens=m.prompt_tokens if m.prompt_tokens is not None else n_in,
        completion_tokens=len(ids),
        cached_tokens=m.cached_tokens or 0,
        latency_s=round(asyncio.get_running_loop().time() - sent_at, 4),
        attempts=attempt,
        output_json=raw,
        dp_rank=m.dp_rank if type(m.dp_rank) is int else None,
    )


async def abort_requests(
    http: HttpClient, rids: list[str] | None, *, timeout: float = 10.0
) -> None:
    """POST /abort_request: every request of the server (`rids` None: `abort_all`), or each rid
    given.

    SGLang answers 200 with an empty body whatever it found; the requests it aborts while running
    end with their partial output and finish_reason {"type": "abort", "message": "Aborted",
    "status_code": null, "err_type": null}, those still queued with "Abort in waiting queue" (and
    usually no output: a request retracted back to the queue keeps what it had already sent on).
    Over HTTP only an exact rid aborts: the tokenizer manager drops a rid that is not one in flight;
    its scheduler then matches by prefix, so a rid must not be the prefix of another one in flight
    (worker.requests.Requests.rid_maker). Raises Unreachable.
    """
    if rids is None:
        await http.request("POST", "/abort_request", b'{"abort_all":true}', timeout=timeout)
        return
    for rid in rids:
        await http.request(
            "POST", "/abort_request", _req_encoder.encode({"rid": rid}), timeout=timeout
        )


class EngineLoad(msgspec.Struct):
    """What the server says about its load, summed over its data-parallel ranks."""

    running: int = 0  # requests generating
    waiting: int = 0  # requests queued for a running slot
    capacity: int = 0  # requests it can run at once (0: unknown)
    token_usage: float = 0.0  # share of the KV pool in use (the fullest rank)


class _RankLoad(msgspec.Struct):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    max_running_requests: int | None = None
    token_usage: float = 0.0


class _Loads(msgspec.Struct):
    loads: list[_RankLoad] = []


class _InternalState(msgspec.Struct):
    effective_max_running_requests_per_dp: int | None = None


class _ServerInfo(msgspec.Struct):
    internal_states: list[_InternalState] = []
    max_req_input_len: int | None = None


class ServerLimits(msgspec.Struct):
    """What /server_info says of the server's limits (0 and None: it does not say)."""

    capacity: int = 0  # requests it can run at once
    # its data-parallel ranks (one internal state each; 0: not said): a rank to pin a request to
    # is below it
    ranks: int = 0
    # SGLang's max_req_len (max_req_input_len + 5): prompt + output + 1 stay below
    max_req_len: int | None = None


_loads_decoder = msgspec.json.Decoder(_Loads | list[_RankLoad])
_info_decoder = msgspec.json.Decoder(_ServerInfo)


async def server_limits(http: HttpClient, *, timeout: float = 30.0) -> ServerLimits:
    """/server_info's effective_max_running_requests_per_dp summed over the data-parallel ranks, and
    its max_req_input_len (SGLang's scheduler keeps it 5 below max_req_len)."""
    try:
        status, body = await http.get("/server_info", timeout=timeout)
        info = _info_decoder.decode(body) if status == 200 else None
    except (Unreachable, msgspec.DecodeError, msgspec.ValidationError):
        return ServerLimits()
    if info is None:
        return ServerLimits()
    return ServerLimits(
        capacity=sum(s.effective_max_running_requests_per_dp or 0 for s in info.internal_states),
        ranks=len(info.internal_states),
        max_req_len=info.max_req_input_len + 5 if info.max_req_input_len else None,
    )


async def health_generate(http: HttpClient, *, timeout: float) -> str | None:
    """None when GET /health_generate answers 200 within `timeout` s (the server generates: SGLang
    sends a 1-token request through its scheduler), else why not, in words (`answered 503`, or the
    connection's error)."""
    try:
        status, _ = await http.get("/health_generate", timeout=timeout)
    except Unreachable as e:
        return str(e)
    return None if status == 200 else f"answered {status}"


async def read_load(http: HttpClient, *, timeout: float = 10.0) -> EngineLoad | None:
    """GET /v1/loads (no --enable-metrics needed): {"loads": [per DP rank: num_running_reqs,
    num_waiting_reqs, max_running_requests, token_usage, gen_throughput, ...], ...}. None when the
    server has no such endpoint or does not answer."""
    try:
        status, body = await http.get("/v1/loads", timeout=timeout)
        if status != 200:
            return None
        got = _loads_decoder.decode(body)
    except (Unreachable, msgspec.DecodeError, msgspec.ValidationError):
        return None
    ranks = got.loads if isinstance(got, _Loads) else got
    if not ranks:
        return None
    return EngineLoad(
        running=sum(r.num_running_reqs for r in ranks),
        waiting=sum(r.num_waiting_reqs for r in ranks),
        capacity=sum(r.max_running_requests or 0 for r in ranks),
        token_usage=max(r.token_usage for r in ranks),
    )
