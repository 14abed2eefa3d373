"""One conformance suite, run against the stub engine and against real SGLang 0.5.23: the same probes and the
same assertions, so that the stand-in cannot drift from the server it stands in for.

Both servers are started through the toolkit's own launch path (tests/real_sglang/serve.py: argv, environment,
process group, API key) with the same model folder (the tiny model of tests/realsglang.py) and the same limits:
at most two requests running (a third waits in the queue), a context of 8,192 tokens. What the expected values
are was observed on real SGLang; the stub must give the same.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.sglang

# meta_info of a finished /generate answer, and of a request aborted while it waited in the queue.
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "cached_tokens_details",
    "dp_rank",
    "e2e_latency",
    "response_sent_to_client_ts",
}
QUEUED_ABORT_META_KEYS = {
    "id",
    "finish_reason",
    "completion_tokens",
    "weight_version",
    "weight_versions",
    "e2e_latency",
    "response_sent_to_client_ts",
}
LOADS_KEYS = {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
RANK_LOAD_KEYS = {
    "timestamp",
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_uncached_tokens",
    "num_used_tokens",
    "num_total_tokens",
    "num_active_tokens",
    "num_prealloc_ready_tokens",
    "max_total_num_tokens",
    "max_running_requests",
    "token_usage",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
    "total_prefill_uncached_tokens",
    "total_prefill_busy_us",
    "decode_moments",
    "memory",
    "disaggregation",
    "queues",
}
PROMPT = [5, 6, 7, 8]


@pytest.fixture(params=["stub", "sglang"], scope="module")
def server(request):
    return request.getfixturevalue(f"{request.param}_server")


class Http:
    def __init__(self, served):
        self.url, self.key = served.url, served.api_key

    def __call__(
        self,
        method: str,
        path: str,
        body=None,
        *,
        key: bool = True,
        content_type: bool = True,
        timeout: float = 120,
    ) -> tuple[int, bytes]:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None and content_type else {}
        if key:
            headers["Authorization"] = f"Bearer {self.key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def generate(
        self, sampling: dict | None = None, ids=PROMPT, **extra
    ) -> tuple[int, dict | list]:
        body = {"input_ids": ids, **extra}
        if sampling is not None:
            body["sampling_params"] = sampling
        status, data = self("POST", "/generate", body)
        return status, json.loads(data)


@pytest.fixture
def http(server):
    return Http(server)


def test_readiness_and_health_answer_200_with_an_empty_body_and_need_no_key(http):
    for path in ("/health", "/health_generate", "/ready"):
        assert http("GET", path, key=False) == (200, b"")
    assert http("GET", "/get_load") == (404, b'{"detail":"Not Found"}')


def test_every_other_endpoint_wants_the_key(http):
    for method, path in (
        ("GET", "/server_info"),
        ("GET", "/v1/loads"),
        ("GET", "/model_info"),
        ("POST", "/generate"),
        ("POST", "/abort_request"),
        ("GET", "/get_load"),
    ):
        body = {"rid": "x"} if method == "POST" else None
        assert http(method, path, body, key=False) == (401, b'{"error":"Unauthorized"}'), path


def test_a_length_finish_counts_every_token_and_says_how_many(http):
    status, out = http.generate({"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert status == 200 and set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert len(out["output_ids"]) == meta["completion_tokens"] == 8 and meta[
        "prompt_tokens"
    ] == len(PROMPT)
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]


def test_zero_new_tokens_and_no_sampling_params(http):
    status, out = http.generate({"max_new_tokens": 0})
    assert (
        status == 200
        and out["output_ids"] == []
        and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    )
    status, out = http.generate({"ignore_eos": True})  # SGLang's silent default: 128 new tokens
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


def test_a_stop_token_is_the_last_output_id_and_counted(http):
    _, first = http.generate({"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    stop_id = first["output_ids"][3]
    k = first["output_ids"].index(stop_id)
    status, out = http.generate(
        {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id]}
    )
    assert status == 200 and out["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": stop_id,
    }
    assert (
        out["output_ids"] == first["output_ids"][: k + 1]
        and out["meta_info"]["completion_tokens"] == k + 1
    )


def test_a_list_of_prompts_or_n_samples_answer_a_list(http):
    status, out = http.generate({"max_new_tokens": 3, "ignore_eos": True}, ids=[PROMPT, [9, 10]])
    assert (
        status == 200
        and isinstance(out, list)
        and len(out) == 2
        and all(len(o["output_ids"]) == 3 for o in out)
    )
    status, out = http.generate({"max_new_tokens": 3, "n": 2, "ignore_eos": True})
    assert status == 200 and isinstance(out, list) and len(out) == 2


@pytest.mark.parametrize(
    "ids, new, message",
    [
        (
            8200,
            8,
            "The input (8200 tokens) is longer than the model's context length (8192 tokens).",
        ),
        (
            8000,
            500,
            "Requested token count exceeds the model's maximum context length of 8192 tokens. You requested a "
            "total of 8500 tokens: 8000 tokens from the input messages and 500 tokens for the completion. Please "
            "reduce the number of tokens in the input messages or the completion to fit within the limit.",
        ),
        (
            8188,
            1,
            "Input length (8188 tokens) exceeds the maximum allowed length (8186 tokens). Use a shorter input or "
            "enable --allow-auto-truncate.",
        ),
    ],
)
def test_prompts_the_context_cannot_hold_are_refused_with_sglangs_words(http, ids, new, message):
    status, out = http.generate({"max_new_tokens": new}, ids=[5] * ids)
    assert status == 400 and out == {"error": {"message": message}}


def test_sampling_sglang_refuses(http):
    status, out = http.generate({"max_new_tokens": 2, "seed": 1})
    assert status == 400 and out["error"].startswith(
        "unknown field `seed`, expected one of `max_new_tokens`, "
    )
    assert http.generate({"max_new_tokens": 2, "top_p": 0}) == (
        400,
        {"error": {"message": "top_p must be in (0, 1], got 0."}},
    )
    assert http.generate({"max_new_tokens": 2}, ids=[]) == (
        400,
        {"error": {"message": "input_ids cannot be empty."}},
    )


def test_a_body_that_is_not_json_is_refused_in_sglangs_error_shape(http):
    status, data = http(
        "POST",
        "/generate",
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
        content_type=False,
    )
    out = json.loads(data)
    assert (
        status == 400
        and out["object"] == "error"
        and out["type"] == "Bad Request"
        and out["code"] == 400
    )
    status, data = http("POST", "/abort_request", {"rid": 5})
    out = json.loads(data)
    assert (
        status == 400
        and out["object"] == "error"
        and out["code"] == 400
        and "AbortReq" in out["message"]
    )


def test_server_info_says_what_the_toolkit_sizes_its_requests_by(http):
    status, data = http("GET", "/server_info")
    info = json.loads(data)
    assert status == 200 and info["version"] == "0.5.23" and info["max_running_requests"] == 2
    state = info["internal_states"][0]
    assert (
        state["effective_max_running_requests_per_dp"] == 2 and state["max_running_requests"] == 2
    )


def _long(http, rid: str, out: dict) -> threading.Thread:
    def go():
        out[rid] = http.generate(
            {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 0}, rid=rid
        )

    t = threading.Thread(target=go)
    t.start()
    return t


def _loads(http) -> dict:
    status, data = http("GET", "/v1/loads")
    assert status == 200
    return json.loads(data)


def test_loads_aborts_running_and_queued_and_rids(http):
    answers: dict = {}
    threads = []
    for i in range(3):  # two run, the third waits: each sent once the server holds the one before
        threads.append(_long(http, f"conf-{i}", answers))
        deadline = time.monotonic() + 60
        while (
            sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in _loads(http)["loads"])
            < i + 1
        ):
            assert time.monotonic() < deadline, f"request conf-{i} never reached the server"
            time.sleep(0.05)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        loads = _loads(http)
        rank = loads["loads"][0]
        if rank["num_running_reqs"] == 2 and rank["num_waiting_reqs"] == 1:
            break
        time.sleep(0.2)
    assert set(loads) == LOADS_KEYS and loads["version"] == "0.5.23" and set(rank) == RANK_LOAD_KEYS
    assert (rank["num_running_reqs"], rank["num_waiting_reqs"], rank["max_running_requests"]) == (
        2,
        1,
        2,
    )
    assert http.generate({"max_new_tokens": 2}, rid="conf-0") == (
        400,
        {"error": {"message": "Duplicate request ID detected: conf-0"}},
    )
    assert http("POST", "/abort_request", {"rid": "conf-"}) == (
        200,
        b"",
    )  # a prefix aborts nothing over HTTP
    time.sleep(1.0)
    assert not answers
    assert http("POST", "/abort_request", {"rid": "conf-2"}) == (200, b"")
    assert http("POST", "/abort_request", {"rid": "conf-0"}) == (200, b"")
    assert http("POST", "/abort_request", {"abort_all": True}) == (200, b"")
    for t in threads:
        t.join(60)
    for rid in ("conf-0", "conf-1"):
        status, out = answers[rid]
        meta = out["meta_info"]
        assert status == 200 and set(meta) == META_KEYS
        assert meta["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert 0 < len(out["output_ids"]) == meta["completion_tokens"] < 4000
    status, out = answers["conf-2"]
    assert (
        status == 200
        and out["output_ids"] == []
        and set(out["meta_info"]) == QUEUED_ABORT_META_KEYS
    )
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Abort in waiting queue",
    }


def test_a_stop_string_ends_the_output_where_it_is_written(http):
    _, first = http.generate({"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    ids, text = first["output_ids"], first["text"]
    word = next(
        text[i : i + 3]
        for i in range(len(text) // 2, len(text) - 3)
        if text[i : i + 3].strip() and text.find(text[i : i + 3]) == i
    )
    status, out = http.generate(
        {"max_new_tokens": 16, "temperature": 0, "stop": [word], "ignore_eos": True}
    )
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    n = len(out["output_ids"])
    assert (
        0 < n < len(ids)
        and out["output_ids"] == ids[:n]
        and out["meta_info"]["completion_tokens"] == n
    )
    assert word not in out["text"] and text.startswith(out["text"])


def test_a_sampled_request_sent_again_draws_another_output_a_greedy_one_does_not(http):
    """n samples of a prompt are n requests (the toolkit sends no `n`): without a sampling_seed each must be its
    own draw, or every sample of a prompt would be the same (the audit's identical_samples check)."""
    ids = [15, 16, 17, 18]
    sampled = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    outs = [http.generate(sampled, ids=ids)[1]["output_ids"] for _ in range(3)]
    assert len({tuple(o) for o in outs}) == 3
    greedy = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    assert (
        http.generate(greedy, ids=ids)[1]["output_ids"]
        == http.generate(greedy, ids=ids)[1]["output_ids"]
    )
