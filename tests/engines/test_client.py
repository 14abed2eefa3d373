"""toolkit.engines.answer.parse_response: SGLang's /generate answers, read from the end or decoded in full, agree."""

from __future__ import annotations

import asyncio
import json

import pytest

from toolkit.engines import answer, client, endpoints
from toolkit.engines.answer import parse_response
from toolkit.engines.client import BadResponse
from toolkit.formats.records import ids_from_json

META = {
    "id": "3f0c",
    "finish_reason": {"type": "stop", "matched": 7},
    "prompt_tokens": 17,
    "weight_version": "default",
    "completion_tokens": 3,
    "cached_tokens": 5,
    "weight_versions": [{"version": "default", "start": 0, "end": 3}],
    "dp_rank": None,
    "e2e_latency": 0.0871,
}

# Texts that would fool a search from the start: the keys themselves, brackets, escapes.
TEXTS = [
    "Paris.",
    'say "output_ids":[1,2] and "meta_info":{}',
    "a ] , [ b",
    '\\"meta_info\\":',
    "é\n\u2028",
]


def orjson_like(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def full_decode(body: bytes):
    resp = answer._resp_decoder.decode(body)
    return ids_from_json(resp.output_ids, resp.meta_info.completion_tokens).tolist(), resp.meta_info


@pytest.mark.parametrize("text", TEXTS)
def test_sglang_answers_take_the_fast_path_and_agree_with_a_full_decode(text):
    body = orjson_like({"text": text, "output_ids": [5, 6, 7], "meta_info": META})
    assert answer._split_body(body) is not None
    ids, meta = parse_response(body)
    assert (ids.tolist(), meta) == full_decode(body) == ([5, 6, 7], meta)
    assert meta.finish_reason == {"type": "stop", "matched": 7} and meta.cached_tokens == 5


@pytest.mark.parametrize(
    "obj",
    [
        {"output_ids": [5, 6, 7], "meta_info": META},  # no text (--skip-tokenizer-init)
        {"meta_info": META, "output_ids": [5, 6, 7], "text": "x"},  # another key order
        {"text": "x", "output_ids": [5, 6, 7], "extra": [1], "meta_info": META},  # a key in between
    ],
)
def test_other_layouts_are_decoded_in_full(obj):
    body = orjson_like(obj)
    ids, meta = parse_response(body)
    assert ids.tolist() == [5, 6, 7] and meta.completion_tokens == 3


def test_whitespace_between_tokens_is_decoded_in_full():
    body = json.dumps({"text": "x", "output_ids": [5, 6, 7], "meta_info": META}, indent=1).encode()
    assert parse_response(body)[0].tolist() == [5, 6, 7]


@pytest.mark.parametrize(
    "body, match",
    [
        (orjson_like({"text": "x", "output_ids": [5, 6], "meta_info": META}), "completion_tokens"),
        (
            orjson_like({"text": "x", "output_ids": [5, -6, 7], "meta_info": META}),
            "completion_tokens",
        ),
        (
            orjson_like({"text": "x", "output_ids": [5, 6.5, 7], "meta_info": META}),
            "completion_tokens",
        ),
        (orjson_like({"text": "x", "output_ids": [5, 6, 7]}), "unexpected /generate answer"),
        (
            b'{"text":"x","output_ids":[5,6,7],"meta_info":{"completion_tokens":3',
            "unexpected /generate answer",
        ),
        (b"<html>Bad Gateway</html>", "unexpected /generate answer"),
    ],
)
def test_answers_that_break_the_protocol_are_refused(body, match):
    with pytest.raises(BadResponse, match=match):
        parse_response(body)


# --- HttpClient timeouts ------------------------------------------------------------------------------------------


async def _server(delays: list[float]):
    """A keep-alive HTTP server answering request k after delays[k] seconds (forever when negative)."""
    count = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal count
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                delay, count = delays[count], count + 1
                await asyncio.sleep(delay if delay >= 0 else 3600)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.slow
def test_a_request_without_an_answer_times_out_and_the_client_goes_on():
    async def main():
        server, url = await _server([0, -1, 0.3, -1, 0])
        http = client.HttpClient(url)
        loop = asyncio.get_running_loop()
        assert await http.request("POST", "/generate", b"{}", timeout=5) == (200, b"ok")
        t0 = loop.time()
        with pytest.raises(
            client.TimedOut, match="no answer within 0.5 s"
        ):  # a kind of Unreachable
            await http.request("POST", "/generate", b"{}", timeout=0.5)
        waited = loop.time() - t0
        assert 0.5 <= waited < 0.5 + 2 * http.SWEEP_S + 0.5
        assert await http.request("POST", "/generate", b"{}", timeout=2) == (
            200,
            b"ok",
        )  # slow, within its time
        # Concurrent requests: only the one past its deadline fails.
        results = await asyncio.gather(
            http.request("POST", "/generate", b"{}", timeout=0.5),
            http.request("POST", "/generate", b"{}", timeout=5),
            return_exceptions=True,
        )
        assert isinstance(results[0], client.TimedOut) and results[1] == (200, b"ok")
        assert not http._deadlines and not http._expired  # nothing left watched
        http.close()
        server.close()

    asyncio.run(main())


@pytest.mark.slow
def test_the_errors_generate_raises_say_how_many_attempts_it_made():
    assert client.RequestRejected(400, b"{}").attempts == 1  # declared, before generate sets it
    for kind in (
        client.Unreachable,
        client.TimedOut,
        client.ServerError,
        client.RequestRejected,
        BadResponse,
    ):
        assert issubclass(kind, client.ClientError), (
            "the worker catches every failed request as a ClientError"
        )

    async def main():
        server, url = await _server([0, -1, -1])
        http = client.HttpClient(url)
        with pytest.raises(BadResponse) as bad:  # 200 "ok": not a /generate answer, not retried
            await endpoints.generate(http, [1, 2], {}, timeout=5, retries=2)
        assert bad.value.attempts == 1
        with pytest.raises(client.Unreachable) as gone:  # no answer, retried once
            await endpoints.generate(http, [1, 2], {}, timeout=0.3, retries=1, backoff_s=0.01)
        assert gone.value.attempts == 2
        http.close()
        server.close()

    asyncio.run(main())


def test_a_refused_connection_is_unreachable_not_a_timeout():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main():
        with pytest.raises(client.Unreachable) as e:
            await client.HttpClient(f"http://127.0.0.1:{port}").request("GET", "/health", timeout=2)
        assert not isinstance(e.value, client.TimedOut)

    asyncio.run(main())


def test_a_cancel_that_lands_as_the_connection_opens_is_raised_not_swallowed(monkeypatch):
    """On Python 3.11, `asyncio.wait_for` returns the result of an inner future that completes in the very step in
    which its caller is cancelled: the cancel is swallowed. The load poller cancelled at that moment polled on
    forever, and a finished worker never exited. The client's connect must raise the cancel, and close the
    connection it no longer needs."""
    real_open = asyncio.open_connection
    opened: list[asyncio.StreamWriter] = []

    async def main():
        server, url = await _server([0, 0])
        http = client.HttpClient(url)
        caller: asyncio.Task | None = None

        async def open_then_cancel_the_caller(*args, **kwargs):
            conn = await real_open(*args, **kwargs)
            opened.append(conn[1])
            caller.cancel()  # lands in the step in which the connection completes
            return conn

        monkeypatch.setattr(client.asyncio, "open_connection", open_then_cancel_the_caller)
        caller = asyncio.ensure_future(http.request("GET", "/v1/loads", timeout=5))
        with pytest.raises(asyncio.CancelledError):
            await caller
        for _ in range(200):  # the close lands within a few loop steps; at most 2 s
            if opened and opened[0].is_closing():
                break
            await asyncio.sleep(0.01)
        assert opened and opened[0].is_closing(), (
            "the connection the cancelled request opened is closed"
        )
        assert not http._deadlines and not http._idle
        monkeypatch.setattr(client.asyncio, "open_connection", real_open)
        assert await http.request("GET", "/v1/loads", timeout=5) == (
            200,
            b"ok",
        )  # the client goes on
        http.close()
        server.close()

    asyncio.run(main())


def test_a_connection_that_does_not_open_in_time_times_out():
    async def main():
        async def never(*args, **kwargs):
            await asyncio.sleep(3600)

        http = client.HttpClient("http://127.0.0.1:9")
        real_open = client.asyncio.open_connection
        client.asyncio.open_connection = never
        try:
            with pytest.raises(client.TimedOut, match="no answer within 0.2 s"):
                await http.request("GET", "/health", timeout=0.2)
        finally:
            client.asyncio.open_connection = real_open

    asyncio.run(main())


def test_a_length_finish_short_of_max_new_tokens_is_good_only_at_the_context_limit():
    """SGLang clamps max_new_tokens to max_req_len - prompt - 1: a length finish short of max_new_tokens is right
    there, and wrong anywhere else (judged only when the server said its max_req_len)."""
    import numpy as np

    ids = np.arange(5, dtype="<u4")
    meta = answer.MetaInfo(
        id="r", finish_reason={"type": "length", "length": 5}, completion_tokens=5
    )
    limits = answer.Expect(vocab_size=100, max_req_len=20)
    assert (
        answer.check_answer(ids, meta, rid="r", n_input=14, max_new_tokens=64, expect=limits)[
            "type"
        ]
        == "length"
    )
    assert (
        answer.check_answer(ids, meta, rid="r", n_input=3, max_new_tokens=5, expect=limits)["type"]
        == "length"
    )
    with pytest.raises(
        BadResponse, match=r"short of max_new_tokens = 64 and of the context limit \(3 prompt"
    ):
        answer.check_answer(ids, meta, rid="r", n_input=3, max_new_tokens=64, expect=limits)
    assert answer.check_answer(
        ids, meta, rid="r", n_input=3, max_new_tokens=64, expect=answer.Expect()
    )
    with pytest.raises(BadResponse, match=r"output id 4 outside the vocabulary \(4 ids\)"):
        answer.check_answer(
            ids, meta, rid="r", n_input=14, max_new_tokens=64, expect=answer.Expect(vocab_size=4)
        )
    assert answer.check_answer(
        ids, meta, rid=None, n_input=3, max_new_tokens=5
    )  # no rid sent: any id
