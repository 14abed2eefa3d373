"""The async HTTP client of SGLang's native API, and the errors of a request that gave no result.

A small HTTP/1.1 client over asyncio streams with keep-alive connections: the server is on the same
node, requests are large JSON arrays of ints, and per-token CPU is what limits a worker, so there is
no proxy handling (loopback never goes through a proxy), no redirects and no cookies — only what
SGLang's API needs. The calls of its endpoints (/generate with retries, the probes) are in
`endpoints`; the check of an answer against its request in `answer`.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import msgspec

from toolkit.errors import FailedError
from toolkit.formats.records import (
    BAD_RESPONSE,
    REJECTED,
    SERVER_ERROR,
    TIMEOUT,
    UNREACHABLE,
)

__all__ = [
    "BadResponse",
    "ClientError",
    "HttpClient",
    "RequestRejected",
    "ServerError",
    "TimedOut",
    "Unreachable",
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


class BadResponse(ClientError):
    """A 200 answer that breaks the protocol (e.g. output_ids and completion_tokens disagree)."""

    kind = BAD_RESPONSE


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
