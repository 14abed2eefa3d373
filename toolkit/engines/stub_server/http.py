"""The HTTP/1.1 connection protocol: keep-alive, Content-Length or chunked bodies, pipelining, streaming."""

from __future__ import annotations

import asyncio
import logging

import msgspec

logger = logging.getLogger(__name__)

REASONS = {
    100: "Continue", 200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 411: "Length Required", 413: "Payload Too Large",
    431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable",
}
JSON = "application/json"
TEXT = "text/plain; charset=utf-8"
NOT_FOUND = (404, b'{"detail":"Not Found"}', JSON)
NOT_ALLOWED = (405, b'{"detail":"Method Not Allowed"}', JSON)
MAX_HEAD = 64 * 1024

Reply = tuple  # (status, body bytes, content type or None)


class Request(msgspec.Struct):
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool


class Connection(asyncio.Protocol):
    """One client connection: parses HTTP/1.1 requests in order and writes the answers."""

    def __init__(self, server):  # the StubServer whose routes answer (server imports this module, not the reverse)
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: tuple | None = None  # parsed head of the request whose body is still arriving
        self.busy = False
        self.closed = False
        self.task: asyncio.Task | None = None
        self.idle: asyncio.TimerHandle | None = None
        self.writable: asyncio.Event | None = None
        self.keep_alive = True

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self.idle:
            self.idle.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: SGLang aborts the request
        if self.writable is not None:
            self.writable.set()

    def pause_writing(self) -> None:
        self.writable = asyncio.Event()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set()
            self.writable = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._next()

    # -- requests --------------------------------------------------------------------------------
    def _next(self) -> None:
        while not self.busy and not self.closed:
            req = self._parse()
            if req is None:
                return
            if self.idle:
                self.idle.cancel()
                self.idle = None
            self.busy = True
            self.keep_alive = req.keep_alive
            try:
                result = self.server.dispatch(self, req)
            except Exception:  # noqa: BLE001 - a handler bug must not kill the server
                logger.exception("request %s %s failed", req.method, req.path)
                result = (500, b"Internal Server Error", TEXT)
            if isinstance(result, tuple):
                self.send(*result)
                self._done(resume=False)  # this loop goes on with any pipelined request
            else:
                self.task = asyncio.get_running_loop().create_task(self._run(result))

    async def _run(self, coro) -> None:
        try:
            result = await coro
        except asyncio.CancelledError:
            return
        except Exception:  # noqa: BLE001
            logger.exception("request handler failed")
            result = (500, b"Internal Server Error", TEXT)
        if result is not None and not self.closed:
            self.send(*result)
        self.task = None
        self._done(resume=True)

    def _done(self, resume: bool) -> None:
        self.busy = False
        if self.closed:
            return
        if not self.keep_alive:
            self.transport.close()
            self.closed = True
            return
        if not self.buf:
            self._arm_idle()
        elif resume:
            self._next()

    def _arm_idle(self) -> None:
        timeout = self.server.cfg.keep_alive_timeout
        if timeout > 0 and not self.closed:
            self.idle = asyncio.get_running_loop().call_later(timeout, self._close_idle)

    def _close_idle(self) -> None:
        if not self.busy and not self.buf and not self.closed:
            self.transport.close()

    def _parse(self) -> Request | None:
        buf = self.buf
        if self.head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD:
                    self._fail(431)
                return None
            lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
            parts = lines[0].split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                self._fail(400)
                return None
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            chunked = "chunked" in headers.get("transfer-encoding", "").lower()
            try:
                length = 0 if chunked else int(headers.get("content-length") or 0)
            except ValueError:
                self._fail(400)
                return None
            if length > 1 << 30:
                self._fail(413)
                return None
            del buf[:end + 4]
            self.head = (parts[0], parts[1], parts[2], headers, chunked, length)
            if headers.get("expect", "").lower() == "100-continue":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        method, target, version, headers, chunked, length = self.head
        if chunked:
            body = self._dechunk()
            if body is None:
                return None
        else:
            if len(buf) < length:
                return None
            body = bytes(buf[:length])
            del buf[:length]
        self.head = None
        conn = headers.get("connection", "").lower()
        keep = "close" not in conn if version == "HTTP/1.1" else "keep-alive" in conn
        path, _, query = target.partition("?")
        return Request(method, path, query, headers, body, keep)

    def _dechunk(self) -> bytes | None:
        buf, pos, parts = self.buf, 0, []
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                return None
            try:
                size = int(bytes(buf[pos:eol]).split(b";")[0], 16)
            except ValueError:
                self._fail(400)
                return None
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)
                if end < 0:
                    return None
                del buf[:end + 4]
                return b"".join(parts)
            if len(buf) < eol + 2 + size + 2:
                return None
            parts.append(bytes(buf[eol + 2:eol + 2 + size]))
            pos = eol + 2 + size + 2

    def _fail(self, status: int) -> None:
        self.keep_alive = False
        self.send(status, b"", None)
        self.transport.close()
        self.closed = True

    # -- writing ---------------------------------------------------------------------------------
    def send(self, status: int, body: bytes, ctype: str | None) -> None:
        if self.closed:
            return
        head = f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\nserver: sglang-stub (not a model)\r\n" \
               f"content-length: {len(body)}\r\n"
        if ctype:
            head += f"content-type: {ctype}\r\n"
        if not self.keep_alive:
            head += "connection: close\r\n"
        self.transport.write(head.encode() + b"\r\n" + body if body else head.encode() + b"\r\n")

    def start_stream(self) -> None:
        head = "HTTP/1.1 200 OK\r\nserver: sglang-stub (not a model)\r\n" \
               "content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n"
        if not self.keep_alive:
            head += "connection: close\r\n"
        self.transport.write(head.encode() + b"\r\n")

    async def stream_chunk(self, data: bytes) -> None:
        if self.closed:
            raise asyncio.CancelledError
        self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))
        if self.writable is not None:
            await self.writable.wait()

    def end_stream(self) -> None:
        if not self.closed:
            self.transport.write(b"0\r\n\r\n")
