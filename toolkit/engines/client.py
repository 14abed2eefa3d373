"""The async client of SGLang's native `/generate`: raw input_ids in, the exact output_ids out.

A small HTTP/1.1 client over asyncio streams with keep-alive connections: the server is on the same
node, requests are large JSON arrays of ints, and per-token CPU is what limits a worker, so there is
no proxy handling (loopback never goes through a proxy), no redirects and no cookies — only what
SGLang's API needs. Responses are decoded with msgspec into typed Structs, reading `output_ids` and
`meta_info` from the end of the body so the long `text` field is never walked; unknown `meta_info`
keys are ignored. Retries with backoff cover connection errors, 5xx and 429 (too many requests: a
router's rate limit) only; any other 4xx is the request's own fault and is returned to the caller as
a `RequestRejected`, never retried. Every 200 answer is checked against its request
(`check_answer`): one that breaks SGLang's contract (another rid, more ids than max_new_tokens, a
length finish short of it, ids outside the vocabulary, a finish reason of the wrong shape) is a
`BadResponse` saying what is wrong, never a result.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any, Callable
from urllib.parse import urlsplit

import msgspec

from toolkit.errors import FailedError
from toolkit.formats.records import (
    BAD_RESPONSE,
    REJECTED,
    SERVER_ERROR,
    TIMEOUT,
    UNREACHABLE,
    ids_from_json,
)

__all__ = [
    "BadResponse",
    "ClientError",
    "GenerateResult",
    "HttpClient",
    "RequestRejected",
    "ServerError",
    "TimedOut",
    "Unreachable",
    "generate",
    "Expect",
    "check_answer",
    "abort_requests",
    "EngineLoad",
    "ServerLimits",
    "health_generate",
    "read_load",
    "server_limits",
]

log = logging.getLogger(__name__)


class ClientError(FailedError):
    """A request to the server that did not give a result. `kind`: the failure kind a record of it
    carries (formats.records.FAILURES: unreachable, timeout, server_error, rejected, bad_response).
    `attempts`: the HTTP attempts made (generate sets it when it gives up on the request)."""

    kind: str = UNREACHABLE
    attempts: int = 1


class Unreachable(ClientError):
    """No HTTP answer: connection refused/reset, or the request timed out."""

    kind = UNREACHABLE


class TimedOut(Unreachable):
    """The server took the request but gave no answer within the request's timeout."""

    kind = TIMEOUT


class ServerError(ClientError):
    """A 5xx or 429 answer, or a 200 whose abort carries a 5xx status_code (retryable)."""

    kind = SERVER_ERROR

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}: {_message(body)}")


class RequestRejected(ClientError):
    """A 4xx answer but 429: the server refused this request (e.g. prompt over the context
    length)."""

    kind = REJECTED

    def __init__(self, status: int, body: bytes):
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}: {_message(body)}")


def _message(body: bytes) -> str:
    """The human part of SGLang's error bodies, whatever their form (a string, an object, a
    list)."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:500].decode("utf-8", "replace").strip()
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message", err))
        if isinstance(err, str):
            return err
        if "message" in obj:
            return str(obj["message"])
    return str(obj)[:500]


class HttpClient:
    """Keep-alive HTTP/1.1 connections to one server (`http://host:port`).

    Request timeouts are kept by one watchdog per client rather than one timer per request (which
    costs more than everything else a request does but parsing): every SWEEP_S it aborts the
    connection of each request past its deadline, and that request raises Unreachable. Timeouts are
    thus exact to within SWEEP_S.
    """

    SWEEP_S = 0.25

    def __init__(self, url: str, *, api_key: str | None = None, max_connections: int = 64):
        u = urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"engine url must look like http://host:port, got {url!r}")
        self.host, self.port = u.hostname, u.port or 80
        self.base_path = u.path.rstrip("/")
        self._auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._deadlines: dict[asyncio.StreamWriter, float] = {}  # requests in flight
        self._expired: set[asyncio.StreamWriter] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    async def request(
        self, method: str, path: str, body: bytes | None = None, *, timeout: float
    ) -> tuple[int, bytes]:
        """(status, body) of one request; Unreachable when there is no complete answer within
        `timeout` s."""
        async with self._slots:
            return await self._request(method, path, body, timeout)

    async def _request(
        self, method: str, path: str, body: bytes | None, timeout: float
    ) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        head = (
            (
                f"{method} {self.base_path}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body) if body else 0}\r\n"
            ).encode()
            + self._auth
            + b"\r\n"
        )
        # A pooled connection may have been closed by the server meanwhile: retry once on a fresh
        # one.
        for fresh in (False, True):
            conn = None if fresh or not self._idle else self._idle.pop()
            try:
                if conn is None:
                    conn = await _connect(self.host, self.port, max(0.0, deadline - loop.time()))
                reader, writer = conn
                self._watch(writer, deadline, loop)
                writer.write(head + body if body else head)
                status, keep, data = await self._read_response(reader)
            except (OSError, asyncio.IncompleteReadError, ValueError, asyncio.TimeoutError) as e:
                expired = conn is None and isinstance(e, asyncio.TimeoutError)
                if conn is not None:
                    expired = self._unwatch(conn[1])
                    conn[1].close()
                if expired:
                    raise TimedOut(f"{method} {path}: no answer within {timeout:g} s") from None
                if fresh or conn is None:
                    raise Unreachable(f"{method} {path}: {type(e).__name__}: {e}") from None
                continue
            except BaseException:
                if conn is not None:  # cancelled mid-request: the connection's state is unknown
                    self._unwatch(conn[1])
                    conn[1].close()
                raise
            if self._unwatch(writer) or not keep:  # answered, but aborted by the watchdog meanwhile
                writer.close()
            else:
                self._idle.append(conn)
            return status, data
        raise AssertionError("unreachable")

    def _watch(
        self, writer: asyncio.StreamWriter, deadline: float, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._deadlines[writer] = deadline
        if self._sweeper is None:
            self._sweeper = loop.call_later(self.SWEEP_S, self._sweep, loop)

    def _unwatch(self, writer: asyncio.StreamWriter) -> bool:
        """Stop watching a request's connection; True when the watchdog had aborted it."""
        self._deadlines.pop(writer, None)
        if writer in self._expired:
            self._expired.discard(writer)
            return True
        return False

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        for writer, deadline in list(self._deadlines.items()):
            if now >= deadline:
                del self._deadlines[writer]
                self._expired.add(writer)
                # the pending read ends at once, and the request raises Unreachable
                writer.transport.abort()
        self._sweeper = (
            loop.call_later(self.SWEEP_S, self._sweep, loop) if self._deadlines else None
        )

    @staticmethod
    async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP response: {lines[0][:80]!r}")
        status = int(parts[1])
        length, chunked, keep = None, False, parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"connection":
                keep = value.strip().lower() != b"close"
        if chunked:
            chunks = []
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                chunks.append(await reader.readexactly(size))
                await reader.readexactly(2)
            data = b"".join(chunks)
        elif length is not None:
            data = await reader.readexactly(length)
        else:
            data, keep = await reader.read(), False
        return status, keep, data

    async def get(self, path: str, *, timeout: float) -> tuple[int, bytes]:
        return await self.request("GET", path, timeout=timeout)

    def close(self) -> None:
        for _, w in self._idle:
            w.close()
        self._idle.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None


async def _connect(
    host: str, port: int, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection within `timeout` s (asyncio.TimeoutError after it); a cancel at any moment is
    raised.

    Not `asyncio.wait_for`: on Python 3.11 it swallows a cancel that lands in the step in which the
    connection completes (it returns the connection instead), so a poller cancelled at that moment
    polls on and the worker's final gather never returns. A connection that completes after the
    caller gave up is closed.
    """
    task = asyncio.ensure_future(asyncio.open_connection(host, port, limit=1 << 24))
    try:
        done, _ = await asyncio.wait([task], timeout=timeout)
    except BaseException:
        task.cancel()
        task.add_done_callback(_close_connection)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_close_connection)
        raise asyncio.TimeoutError()
    return task.result()


def _close_connection(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result()[1].close()


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
_resp_decoder = msgspec.json.Decoder(GenerateResponse)


class BadResponse(ClientError):
    """A 200 answer that breaks the protocol (e.g. output_ids and completion_tokens disagree)."""

    kind = BAD_RESPONSE


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
    ids, meta, _ = _parse_response(body)
    return ids, meta


def _parse_response(body: bytes):
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
                ids, m, raw = _parse_response(data)
                fr = check_answer(
                    ids, m, rid=sent, n_input=n_in, max_new_tokens=max_new, expect=expect
                )
                return GenerateResult(
                    output_ids=ids,
                    finish=fr.get("type"),
                    matched=fr.get("matched"),
                    prompt_tokens=m.prompt_tokens if m.prompt_tokens is not None else n_in,
                    completion_tokens=len(ids),
                    cached_tokens=m.cached_tokens or 0,
                    latency_s=round(loop.time() - t0, 4),
                    attempts=attempt,
                    output_json=raw,
                    dp_rank=m.dp_rank if type(m.dp_rank) is int else None,
                )
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
