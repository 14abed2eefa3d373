"""The HTTP layer: a FastAPI app over the stub's handlers (served by uvicorn, as SGLang is).

Routes take the raw request body and hand it to the engine's own checks, so status codes and error
texts are the stub's, not FastAPI's validation; answers are `Response(content=bytes)` of bytes the
engine encoded (compact JSON, keys in SGLang's order). A handler that waits (token delay, queue,
hang, a wedged health check) is raced against the client's disconnect, which cancels it, as SGLang's
tokenizer manager aborts a request whose client went away; streams are cancelled by Starlette's own
disconnect watch. Unknown paths and methods get FastAPI's 404 and 405.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import socket
import struct
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from toolkit.stub import info
from toolkit.stub.faults import Cut
from toolkit.stub.server import JSON, Reply, StubServer

UNAUTHORIZED = b'{"error":"Unauthorized"}'
CUT = "toolkit.stub.cut"  # scope key: the faults.Cut of this request, carried out by with_cuts


def _response(reply: Reply) -> Response:
    status, body, ctype = reply
    return Response(content=body, status_code=status, media_type=ctype)


async def _client_gone(request: Request) -> None:
    """Returns when the client has disconnected (the body has been read by then, or there is
    none)."""
    receive = request.receive
    while (await receive())["type"] != "http.disconnect":
        pass


async def answer(request: Request, result: Any) -> Response:
    """A Reply, a coroutine resolving to one (cancelled if the client goes away), a stream of SSE
    events, or a faults.Cut (carried out by `with_cuts`)."""
    if type(result) is tuple:
        return _response(result)
    if isinstance(result, Cut):
        request.scope[CUT] = result
        return Response(content=result.body, status_code=200, media_type=JSON)
    if inspect.isasyncgen(result):
        return StreamingResponse(result, media_type="text/event-stream")
    work = asyncio.ensure_future(result)
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler is cancelled (shutdown): so is the work
        work.cancel()
        raise
    finally:
        gone.cancel()
    # the client went away: abort the request, and let it unwind (counters, in-flight set)
    if not work.done():
        work.cancel()
        await asyncio.wait((work,))
        return Response(status_code=499)  # nobody reads it
    return _response(work.result())


def _state_route(srv: StubServer, handler: Callable) -> Callable:
    async def endpoint(request: Request) -> Response:
        return await answer(request, handler(srv))

    return endpoint


def json_content(request: Request, body: bytes) -> bool:
    """Whether FastAPI reads the body as JSON, as it decides for SGLang's typed routes: no content
    type, or an application/json (or +json) one. A form-encoded body (what a bare `curl -d` sends)
    stays bytes."""
    ctype = request.headers.get("content-type")
    if not body or not ctype:
        return True
    main, _, sub = ctype.split(";")[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def not_an_object(body: bytes, model: str) -> Reply:
    """FastAPI's validation error for a body that is not JSON, in SGLang's ErrorResponse shape."""
    detail = (
        f"1 validation error:\n  {{'type': 'dataclass_type', 'loc': ('body',), 'msg': 'Input "
        f"should be a dictionary or an instance of {model}', 'input': {body[:200]!r}, 'ctx': "
        f"{{'class_name': '{model}'}}}}"
    )
    err = {"object": "error", "message": detail, "type": "Bad Request", "param": None, "code": 400}
    return 400, json.dumps(err, separators=(",", ":")).encode(), JSON


def build_app(srv: StubServer):
    """The ASGI app of one stub server (with --api-key, wrapped in SGLang's bearer check)."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    async def generate(request: Request) -> Response:
        body = await request.body()
        if not json_content(request, body):
            return _response(not_an_object(body, "GenerateReqInput"))
        return await answer(request, srv.generate(body))

    async def abort_request(request: Request) -> Response:
        body = await request.body()
        if not json_content(request, body):
            return _response(not_an_object(body, "AbortReq"))
        return _response(srv.abort_request(body))

    async def v1_model(request: Request) -> Response:
        return _response(info.v1_model(srv, request.path_params["name"]))

    for path, (methods, handler) in info.routes(srv).items():
        if path == "/generate":
            endpoint = generate
        elif path == "/abort_request":
            endpoint = abort_request
        else:
            endpoint = _state_route(srv, handler)
        app.add_api_route(path, endpoint, methods=list(methods), include_in_schema=False)
    app.add_api_route("/v1/models/{name:path}", v1_model, methods=["GET"], include_in_schema=False)
    key = srv.cfg.api_key
    app = with_cuts(app)
    return with_api_key(app, key, srv.cfg.version) if key else app


def with_cuts(app):
    """Carry out a faults.Cut that a handler left in the request's scope: `reset` resets the
    connection before anything is sent (RST: SO_LINGER 0, then close); `truncate` sends the headers
    and half the body, and the server closes the connection when the app returns without completing
    the response. Needs uvicorn's own `send` (its request cycle holds the transport), which this
    wrapper, outermost but for the api key, receives."""

    async def cutting(scope, receive, send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        done = False

        async def send_or_cut(message) -> None:
            nonlocal done
            cut = scope.get(CUT)
            if cut is None:
                await send(message)
                return
            if done:
                return
            if cut.how == "reset":
                done = True
                _reset(getattr(getattr(send, "__self__", None), "transport", None))
            elif message["type"] == "http.response.start":
                await send(message)
            else:
                done = True
                await send(
                    {
                        "type": "http.response.body",
                        "body": cut.body[: len(cut.body) // 2],
                        "more_body": True,
                    }
                )

        await app(scope, receive, send_or_cut)

    return cutting


def _reset(transport) -> None:
    """Reset a connection: the peer's next read fails with ECONNRESET. Without the transport, it is
    closed."""
    if transport is None:
        return  # uvicorn then closes the connection (a response never completed)
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def with_api_key(app, key: str, version: str):
    """`Authorization: Bearer <key>` (the scheme in any case) on every path but /health*, /metrics*
    (0.5.23: /ready* too) and OPTIONS: else 401."""
    expected = key.encode()
    exempt = info.AUTH_EXEMPT[version]
    denied = Response(content=UNAUTHORIZED, status_code=401, media_type=JSON)

    async def guarded(scope, receive, send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"
            and not scope["path"].startswith(exempt)
        ):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token, expected):
                await denied(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded
