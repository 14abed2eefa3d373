"""The stand-in SGLang server, as a real process spoken to over real HTTP.

Checks the wire contract the toolkit relies on: start-up states, validation errors (status and exact body),
response shape, stop-token and finish-reason rules, determinism across processes, think/tool tokens per
tokenizer family, the 0.5.9 profile, auth, streaming, batches, aborts, fault injection and SIGTERM drain.
All the servers of this file are launched at once (they share the start-up cost) on loopback ports.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from toolkit.engines.base import free_port

REPO = Path(__file__).resolve().parents[2]
PREFIX = "[stub-engine, not a model]"
CONTEXT = 8192
MAX_REQ_INPUT_LEN = CONTEXT - 1 - 5


def call(port: int, method: str, path: str, body=None, *, headers=None, timeout: float = 10.0):
    """One HTTP request on a fresh connection: (status, lower-cased headers, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


class Stub:
    """One stub server process with its log file."""

    def __init__(
        self,
        name: str,
        tokenizer: Path,
        args: list[str],
        log_dir: Path,
        *,
        new_session: bool = False,
    ):
        self.name, self.port = name, free_port()
        self.ready_path = "/health" if "0.5.9" in args else "/ready"
        self.log = log_dir / f"{name}.log"
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
        argv = [
            sys.executable,
            "-m",
            "toolkit.stub",
            "--model-path",
            str(tokenizer),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *args,
        ]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=new_session,
            )

    def log_text(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def wait_listening(self, deadline_s: float = 60.0) -> None:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            assert self.proc.poll() is None, f"{self.name} exited early:\n{self.log_text()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.02)
        raise AssertionError(f"{self.name} never listened:\n{self.log_text()}")

    def wait_ready(self, deadline_s: float = 60.0) -> "Stub":
        self.wait_listening(deadline_s)
        end = time.monotonic() + deadline_s
        while self.get(self.ready_path)[0] != 200:  # /health takes at least a second to answer 200
            assert time.monotonic() < end and self.proc.poll() is None, self.log_text()
            time.sleep(0.02)
        return self

    def get(self, path: str, **kw):
        return call(self.port, "GET", path, **kw)

    def post(self, path: str, body=None, **kw):
        return call(self.port, "POST", path, body, **kw)

    def generate(self, body: dict, **kw):
        status, headers, data = self.post("/generate", body, **kw)
        assert status == 200, (status, data)
        return json.loads(data)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


FLEET = {
    # name: (tokenizer family, extra flags)
    "qwen3": (
        "qwen3",
        [
            "--enable-metrics",
            "--tp-size",
            "4",
            "--mem-fraction-static",
            "0.8",
            "--cuda-graph-max-bs-d",
            "16",
        ],
    ),
    "qwen3_auth": ("qwen3", ["--api-key", "sekret"]),
    "kimi": ("kimi", []),
    "kimi_seed_bugs": ("kimi", ["--no-think-end", "--double-think-start"]),
    "v059": ("qwen3", ["--version", "0.5.9", "--skip-tokenizer-init"]),
    "faults": (
        "qwen3",
        [
            "--fail-5xx",
            "2:2",
            "--hang-after",
            "4",
            "--crash-after",
            "6",
            "--health-check-timeout",
            "0.3",
        ],
    ),
    "slow": ("qwen3", ["--token-delay", "0.01", "--fixed-output-tokens", "40"]),
    "queue": ("kimi", ["--token-delay", "0.01", "--max-running-requests", "2", "--dp-size", "2"]),
    "warmup_fails": ("qwen3", ["--warmup-delay", "0.3", "--warmup-fails"]),
    "no_cache": ("qwen3", ["--disable-radix-cache"]),
    "loops": ("kimi", ["--degenerate-fraction", "0.3", "--identical-samples"]),
}


@pytest.fixture(scope="module")
def fleet(toy_tokenizer, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("stub-logs")
    stubs = {
        name: Stub(name, toy_tokenizer(family), [*flags, "--drain-poll", "0.2"], log_dir)
        for name, (family, flags) in FLEET.items()
    }
    yield stubs
    for stub in stubs.values():
        stub.stop()


@pytest.fixture(scope="module")
def tokenizers(toy_tokenizer):
    return {
        family: AutoTokenizer.from_pretrained(toy_tokenizer(family)) for family in ("qwen3", "kimi")
    }


@pytest.fixture(scope="module")
def qwen3(fleet):
    return fleet["qwen3"].wait_ready()


def chat_ids(tok, text: str, **kwargs) -> list[int]:
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    return tok.encode(prompt, add_special_tokens=False)


def tid(tok, token: str) -> int:
    (i,) = tok.encode(token, add_special_tokens=False)
    return i


# ------------------------------------------------------------------------------------------------
# lifecycle
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_start_up_states_then_idle_sigterm_exits_zero(fleet, toy_tokenizer, tmp_path):
    # (`fleet` only to start the other servers now: their start-up overlaps this test's waiting)
    stub = Stub(
        "lifecycle",
        toy_tokenizer("qwen3"),
        ["--load-delay", "1.5", "--warmup-delay", "1.0", "--drain-poll", "0.2"],
        tmp_path,
    )
    try:
        deadline = time.monotonic() + 30
        while "Load weight begin" not in stub.log_text():
            assert time.monotonic() < deadline and stub.proc.poll() is None, stub.log_text()
            time.sleep(0.02)
        with pytest.raises(ConnectionRefusedError):  # weights "loading": the port is closed
            socket.create_connection(("127.0.0.1", stub.port), timeout=1)
        stub.wait_listening()
        # warm-up: health and ready say 503 with an empty body, the informational endpoints already answer
        for path in ("/health", "/health_generate", "/ready"):
            assert stub.get(path)[0::2] == (503, b"")
        status, headers, body = stub.get("/model_info")
        assert status == 200 and headers["content-type"] == "application/json"
        assert json.loads(body)["served_model_name"]
        info = json.loads(stub.get("/server_info")[2])
        assert info["version"] == "0.5.23" and info["context_length"] == CONTEXT
        assert (
            info["max_req_input_len"] == MAX_REQ_INPUT_LEN
            and info["max_total_num_tokens"] >= CONTEXT
        )
        assert stub.get("/get_server_info")[0] == 200 and stub.get("/get_model_info")[0] == 200
        models = json.loads(stub.get("/v1/models")[2])
        assert (
            models["data"][0]["max_model_len"] == CONTEXT
            and models["data"][0]["owned_by"] == "sglang"
        )
        assert stub.get("/health")[0] == 503  # still warming up after all that
        stub.wait_ready(10)
        for path in ("/health", "/health_generate", "/ready"):
            assert stub.get(path)[0::2] == (200, b"")
        stub.proc.send_signal(signal.SIGTERM)
        assert stub.proc.wait(5) == 0
        log = stub.log_text()
        for marker in (
            "Load weight begin",
            "Load weight end",
            "The server is fired up and ready to roll!",
        ):
            assert marker in log
        lines = log.splitlines()
        assert lines and all(line.startswith(PREFIX) for line in lines), log
    finally:
        stub.stop()


def test_exit_at_start_modes(toy_tokenizer, tmp_path):
    marker = tmp_path / "poison"
    marker.write_text("x")
    a = Stub("exit7", toy_tokenizer("qwen3"), ["--exit-at-start", "7"], tmp_path)
    b = Stub(
        "exit_if", toy_tokenizer("qwen3"), ["--exit-at-start-if-exists", str(marker)], tmp_path
    )
    assert a.proc.wait(20) == 7
    assert b.proc.wait(20) == 1
    assert str(marker) in b.log_text() and all(
        line.startswith(PREFIX) for line in b.log_text().splitlines()
    )


@pytest.mark.slow
def test_warmup_failure_kills_the_server(fleet):
    stub = fleet["warmup_fails"]
    assert stub.proc.wait(60) != 0
    log = stub.log_text()
    assert (
        "Uvicorn running on" in log
        and "warmup error" in log
        and "The server is fired up" not in log
    )


def test_sglang_flags_are_accepted_and_server_info_reports_the_setup(qwen3):
    info = json.loads(qwen3.get("/server_info")[2])
    assert info["tp_size"] == 4 and info["version"] == "0.5.23" and info["status"] == "ready"
    assert info["mem_fraction_static"] == 0.8
    assert info["cuda_graph_max_bs_decode"] == 16, (
        "an abbreviation SGLang accepts, resolved as SGLang does"
    )
    assert (
        "accepted without effect on the stub: cuda_graph_max_bs_decode, mem_fraction_static"
        in qwen3.log_text()
    )


def test_text_is_sliced_from_the_corpus_only_after_the_start_check(fleet, tokenizers):
    """The fast text path (corpus slices instead of decode) is on for the toy tokenizers, checked at start, and
    what it answers is exactly what the tokenizer decodes."""
    for name, family in (("qwen3", "qwen3"), ("kimi", "kimi")):
        stub = fleet[name].wait_ready()
        assert "text sliced from the corpus (checked equal to decode)" in stub.log_text()
        out = stub.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 64}})
        assert out["text"] == tokenizers[family].decode(out["output_ids"], skip_special_tokens=True)


def _parse(*args: str):
    from toolkit.stub import parse_config

    return parse_config(["--model-path", "/m", *args])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--cuda-graph-max-bs", "8"],
            "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode, "
            "--cuda-graph-max-bs-prefill",
        ),
        (["--stream-output"], "unrecognized arguments: --stream-output"),
        (["--some-future-flag", "3"], "unrecognized arguments: --some-future-flag 3"),
        (
            ["--trust-remote-code=yes"],
            "argument --trust-remote-code: ignored explicit argument 'yes'",
        ),
        (["--mem-fraction-static"], "argument --mem-fraction-static: expected one argument"),
        (["--load-format", "nope"], "argument --load-format: invalid choice: 'nope'"),
        # choices SGLang computes at import (its parser registries), from the same flag data
        (["--reasoning-parser", "nope"], "argument --reasoning-parser: invalid choice: 'nope'"),
        (
            ["--tool-call-parser", "kimi-k2"],
            "argument --tool-call-parser: invalid choice: 'kimi-k2'",
        ),
        (
            ["--version", "0.5.9", "--reasoning-parser", "auto"],
            "argument --reasoning-parser: invalid choice: 'auto'",
        ),
        (
            ["--kv-canary-real-data", "some"],
            "argument --kv-canary-real-data: invalid choice: 'some'",
        ),
        (
            ["--load-del", "1"],
            "unrecognized arguments: --load-del 1",
        ),  # the stub's own flags are never abbreviated
        (["--lognormal-lengths", "100"], "--lognormal-lengths wants MEDIAN:SIGMA"),
        (["--lognormal-lengths", "0:0.9"], "--lognormal-lengths wants MEDIAN:SIGMA"),
    ],
)
def test_stub_refuses_what_sglang_refuses(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        _parse(*args)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_stub_takes_sglangs_abbreviations_and_the_imitated_releases_flags():
    cfg = _parse(
        "--tp-s", "4", "--tool-call", "kimi_k2", "--model", "/x", "--tensor-parallel-size", "2"
    )
    assert cfg.tp_size == 2 and cfg.model_path == "/x" and cfg.tool_call_parser == "kimi_k2"
    cfg = _parse("--version", "0.5.9", "--stream-output", "--cuda-graph-max-bs", "8")
    assert cfg.incremental_streaming_output and cfg.other_args == {"cuda_graph_max_bs": 8}


def test_stub_reads_server_arguments_from_a_config_file_as_sglang_does(tmp_path, capsys):
    """SGLang's --config FILE: YAML keys are flags (a switch when true), the command line wins; how the toolkit
    hands an engine its key without a command line."""
    config = tmp_path / "args.yaml"
    config.write_text(
        'api-key: "0123"\nenable-metrics: true\ntrust-remote-code: false\nmax-running-requests: 3\n'
        "tp-size: 2\n"
    )
    cfg = _parse("--config", str(config), "--tp-size", "4")
    assert cfg.api_key == "0123", "quoted in YAML: digits stay text"
    assert cfg.enable_metrics and not cfg.trust_remote_code and cfg.max_running_requests == 3
    assert cfg.tp_size == 4 and "config" not in cfg.other_args
    for args, message in (
        (["--config", str(tmp_path / "args.txt")], "config file must be YAML format"),
        (["--config", str(config), "--config", str(config)], "only one allowed"),
        (["--config", str(tmp_path / "none.yaml")], "cannot read"),
    ):
        with pytest.raises(SystemExit) as e:
            _parse(*args)
        assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("version", ["0.5.23", "0.5.9"])
def test_stub_accepts_every_flag_of_the_release_it_imitates(version):
    from toolkit.engines.sglang_contract.flags import flag_set
    from toolkit.stub import build_parser

    parser = build_parser(version)
    for f in flag_set(version).flags:
        if f.action == "help":
            continue
        value = [str(f.choices[0])] if f.choices else ["16"]
        values = [] if f.nargs == 0 else value * (f.nargs if isinstance(f.nargs, int) else 1)
        for option in f.options:
            parser.parse_args(["--model-path", "/m", "--version", version, option, *values])


def test_keep_alive_connection_serves_many_requests(qwen3):
    conn = http.client.HTTPConnection("127.0.0.1", qwen3.port, timeout=10)
    conn.connect()
    sock = conn.sock
    for i in range(3):
        conn.request(
            "POST",
            "/generate",
            body=json.dumps({"input_ids": [5, 6, i]}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["output_ids"]
        assert conn.sock is sock  # the same TCP connection
    conn.close()


# ------------------------------------------------------------------------------------------------
# /generate validation
# ------------------------------------------------------------------------------------------------

SAMPLING_KEYS = (
    "`max_new_tokens`, `stop`, `stop_token_ids`, `stop_regex`, `temperature`, `top_p`, `top_k`"
)


@pytest.mark.parametrize(
    "body, expected",
    [
        (
            {"input_ids": [1, 2], "sampling_params": {"seed": 1}},
            "unknown field `seed`, expected one of " + SAMPLING_KEYS,
        ),
        ({"input_ids": [1], "stream": "yes"}, 'invalid type: string "yes", expected a boolean'),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 1.0}},
            "invalid type: floating point `1.0`, expected i64",
        ),
        (
            {"input_ids": [1], "sampling_params": {"ignore_eos": 1}},
            "invalid type: integer `1`, expected a boolean",
        ),
    ],
)
def test_schema_gate_errors_are_400_with_a_string(qwen3, body, expected):
    status, headers, data = qwen3.post("/generate", body)
    assert status == 400 and headers["content-type"] == "application/json"
    error = json.loads(data)["error"]
    assert isinstance(error, str) and error.startswith(expected)


@pytest.mark.parametrize(
    "body, words",
    [
        (
            {"input_ids": [1, 1.5]},
            "'loc': ('body', 'input_ids'), 'msg': 'Value error, contains non-int64 element: 1.5'",
        ),
        ({"input_ids": ["a"]}, "'msg': 'Value error, elements must be int or list; got str'"),
        ({"input_ids": "abc"}, "'msg': 'Value error, must be list or null; got str'"),
        (
            {"input_ids": [[1], [2, "x"]]},
            "'msg': 'Value error, row 1: contains non-int64 element: 'x''",
        ),
        (
            {"input_ids": [1], "rid": 123},
            "'loc': ('body', 'rid', 'str'), 'msg': 'Input should be a valid string'",
        ),
        ({"input_ids": [1], "rid": ["a", 1]}, "'loc': ('body', 'rid', 'str')"),
    ],
)
def test_a_body_fastapi_cannot_parse_is_a_400_error_response(qwen3, body, words):
    """SGLang parses the body into GenerateReqInput before its own gate: a bad rid or input_ids type fails there,
    and its RequestValidationError handler answers in the ErrorResponse shape (http_server.py)."""
    status, _, data = qwen3.post("/generate", body)
    answer = json.loads(data)
    assert status == 400 and set(answer) == {"object", "message", "type", "param", "code"}
    assert (answer["object"], answer["type"], answer["code"]) == ("error", "Bad Request", 400)
    assert words in answer["message"]


@pytest.mark.parametrize(
    "name, params, status, words",
    [
        ("qwen3", {"watermark": None, "beam_width": 1}, 200, None),
        (
            "qwen3",
            {"choice": 1},
            500,
            None,
        ),  # through 0.5.23's gate, then SamplingParams(**params) raises TypeError
        ("v059", {"beam_width": 1}, 500, None),  # 0.5.9 knows no beam search
        (
            "qwen3",
            {"stop": [str(i) for i in range(33)]},
            400,
            "at most 32 stop strings are allowed, got 33",
        ),
        (
            "qwen3",
            {"sampling_seed": 2**63},
            400,
            "sampling_seed must be in [-2**63, 2**63 - 1], got",
        ),
        (
            "qwen3",
            {"regex": "a", "structural_tag": "{}"},
            400,
            "Only one of json_schema, regex, ebnf, or structural_tag can be set.",
        ),
        ("v059", {"regex": "a", "structural_tag": "{}"}, 200, None),
    ],
)
@pytest.mark.slow
def test_sampling_fields_and_checks_of_each_release(fleet, name, params, status, words):
    stub = fleet[name].wait_ready()
    got, _, data = stub.post(
        "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, **params}}
    )
    assert got == status, data
    if words:
        assert words in json.loads(data)["error"]["message"]


LONG = [7] * CONTEXT


@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": []}, "input_ids cannot be empty."),
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        (
            {"input_ids": [1], "sampling_params": {"temperature": -0.5}},
            "temperature must be a non-negative finite number, got -0.5.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"top_p": 0}},
            "top_p must be in (0, 1], got 0.",
        ),  # an int stays an int
        (
            {"input_ids": [1], "sampling_params": {"top_p": 1.5}},
            "top_p must be in (0, 1], got 1.5.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"top_k": 0}},
            "top_k must be -1 (disable) or at least 1, got 0.",
        ),
        ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p must be in [0, 1], got 2."),
        (
            {"input_ids": [1], "sampling_params": {"repetition_penalty": 0}},
            "repetition_penalty must be in (0, 2] (1.0 = no penalty), got 0.",
        ),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
            "max_new_tokens must be at least 0, got -1.",
        ),
        (
            {"input_ids": LONG},
            f"The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} tokens).",
        ),
        (
            {"input_ids": [7] * 100, "sampling_params": {"max_new_tokens": CONTEXT - 99}},
            f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens. You requested a total "
            f"of {CONTEXT + 1} tokens: 100 tokens from the input messages and {CONTEXT - 99} tokens for the completion. "
            "Please reduce the number of tokens in the input messages or the completion to fit within the limit.",
        ),
        (
            {"input_ids": [7] * MAX_REQ_INPUT_LEN},
            f"Input length ({MAX_REQ_INPUT_LEN} tokens) exceeds the maximum allowed length ({MAX_REQ_INPUT_LEN} tokens). "
            "Use a shorter input or enable --allow-auto-truncate.",
        ),
        (
            {"input_ids": [[1], [2]], "rid": ["a", "a"]},
            "Duplicate request IDs detected within the request: ['a']",
        ),
        (
            {"input_ids": [[1], [2]], "rid": ["a"]},
            "The specified rids length mismatch with the batch_size for batch processing.",
        ),
    ],
)
def test_value_errors_are_400_with_a_message_object(qwen3, body, message):
    status, headers, data = qwen3.post("/generate", body)
    assert (status, headers["content-type"]) == (400, "application/json")
    assert json.loads(data) == {"error": {"message": message}}


def test_length_limits_at_the_boundary(qwen3):
    # 0.5.23 rejects only input + max_new_tokens > context; the scheduler then clamps silently
    out = qwen3.generate(
        {"input_ids": [7] * 100, "sampling_params": {"max_new_tokens": CONTEXT - 100}}
    )
    assert len(out["output_ids"]) <= CONTEXT - 1 - 100 - 1
    near = qwen3.generate(
        {"input_ids": [7] * (MAX_REQ_INPUT_LEN - 1), "sampling_params": {"ignore_eos": True}}
    )
    budget = CONTEXT - 1 - (MAX_REQ_INPUT_LEN - 1) - 1
    assert near["meta_info"]["finish_reason"] == {"type": "length", "length": budget}
    assert len(near["output_ids"]) == budget


def test_bad_json_body_is_a_400_error_object(qwen3):
    status, _, data = qwen3.post("/generate", b"{not json")
    body = json.loads(data)
    assert (
        status == 400
        and body["object"] == "error"
        and body["code"] == 400
        and body["type"] == "Bad Request"
    )


@pytest.mark.slow
def test_duplicate_in_flight_rid_is_rejected(fleet):
    slow = fleet["slow"].wait_ready()
    body = {
        "input_ids": [3, 4, 5],
        "rid": "same-rid",
        "sampling_params": {"max_new_tokens": 100, "ignore_eos": True},
    }
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(slow.generate, body)  # in flight for about 1 s (--token-delay 0.01)
        _in_flight(slow)
        status, _, data = slow.post("/generate", body)
        assert (status, json.loads(data)) == (
            400,
            {"error": {"message": "Duplicate request ID detected: same-rid"}},
        )
        assert len(first.result(10)["output_ids"]) == 100
    assert slow.post("/generate", body)[0] == 200  # no longer in flight


# ------------------------------------------------------------------------------------------------
# responses
# ------------------------------------------------------------------------------------------------

META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "e2e_latency",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "weight_versions",
    "dp_rank",
    "response_sent_to_client_ts",
}


def test_response_shape_and_stop_token_included_and_counted(qwen3, tokenizers):
    tok = tokenizers["qwen3"]
    ids = chat_ids(tok, "What is a generator?")
    status, headers, data = qwen3.post(
        "/generate", {"input_ids": ids, "rid": "r-1", "sampling_params": {"max_new_tokens": 4000}}
    )
    assert status == 200 and headers["content-type"] == "application/json"
    out = json.loads(data)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert META_KEYS <= set(meta)
    assert (
        meta["id"] == "r-1"
        and meta["prompt_tokens"] == len(ids)
        and 0 <= meta["cached_tokens"] < len(ids)
    )
    assert meta["completion_tokens"] == len(out["output_ids"]) and meta["e2e_latency"] >= 0
    eos = tid(tok, "<|im_end|>")
    assert meta["finish_reason"] == {"type": "stop", "matched": eos}
    assert out["output_ids"][-1] == eos and out["output_ids"].count(eos) == 1
    assert out["text"] == tok.decode(out["output_ids"][:-1], skip_special_tokens=True)
    assert "<|im_end|>" not in out["text"]
    # 0.5.23's order (tokenizer_manager.py): the cache breakdown only when tokens were cached
    assert list(meta)[:5] == [
        "id",
        "finish_reason",
        "prompt_tokens",
        "weight_version",
        "num_retractions",
    ]
    assert meta["cached_tokens_details"] == (
        {"device": meta["cached_tokens"], "host": 0} if meta["cached_tokens"] else None
    )
    again = qwen3.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 4}})[
        "meta_info"
    ]
    assert again["cached_tokens"] > 0 and again["cached_tokens_details"] == {
        "device": again["cached_tokens"],
        "host": 0,
    }


@pytest.mark.slow
def test_health_answers_200_after_a_second_as_sglang(qwen3):
    """SGLang's /health and /health_generate send a 1-token generation and look for an answer after sleeping 1 s."""
    for path in ("/health", "/health_generate"):
        t0 = time.monotonic()
        assert qwen3.get(path)[0] == 200
        assert time.monotonic() - t0 >= 1.0
    t0 = time.monotonic()
    assert qwen3.get("/ready")[0] == 200 and time.monotonic() - t0 < 1.0
    info = json.loads(qwen3.get("/model_info")[2])
    assert (
        info["preferred_sampling_params"] is None
    )  # an object when --preferred-sampling-params is set


def test_length_finish_and_the_silent_128_default(qwen3):
    out = qwen3.generate(
        {"input_ids": [11, 12, 13], "sampling_params": {"max_new_tokens": 3}}
    )  # < any whole answer
    assert (
        out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        and len(out["output_ids"]) == 3
    )
    lengths = []
    for i in range(60):
        out = qwen3.generate({"input_ids": [21, i]})
        assert len(out["output_ids"]) <= 128
        lengths.append(out["meta_info"]["finish_reason"].get("length"))
    assert 128 in lengths  # some outputs run into the default max_new_tokens


def test_request_stops_and_ignore_eos(qwen3, tokenizers):
    """On one seeded output (a request repeated gives the same output only when seeded or greedy)."""
    ids = chat_ids(tokenizers["qwen3"], "Explain closures.")
    whole = qwen3.generate(
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 4000, "sampling_seed": 7}}
    )
    full = whole["output_ids"]
    stop = full[len(full) // 2]
    cut = qwen3.generate(
        {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 4000,
                "sampling_seed": 7,
                "stop_token_ids": [stop],
            },
        }
    )
    assert cut["output_ids"] == full[: full.index(stop) + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    word = whole["text"][len(whole["text"]) // 2 :][:6]
    by_text = qwen3.generate(
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 4000, "sampling_seed": 7, "stop": [word]},
        }
    )
    assert by_text["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert whole["text"].startswith(by_text["text"]) and word not in by_text["text"]
    assert full[: len(by_text["output_ids"])] == by_text["output_ids"]
    # ignore_eos also disables stop_token_ids: the model writes on past its EOS up to max_new_tokens
    longer = qwen3.generate(
        {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 4000,
                "sampling_seed": 7,
                "ignore_eos": True,
                "stop_token_ids": [stop],
            },
        }
    )
    assert len(longer["output_ids"]) == 4000 and longer["output_ids"][: len(full)] == full
    assert longer["meta_info"]["finish_reason"] == {"type": "length", "length": 4000}


def test_outputs_are_deterministic_across_processes_and_repeated_sampling_draws_anew(
    fleet, qwen3, tokenizers
):
    """A fresh process answers a prompt as any other does; a sampled request without a seed sent again draws
    another output, as a real server does (so n samples sent as n requests differ); seeded or greedy, never."""
    other = fleet["qwen3_auth"].wait_ready()
    auth = {"Authorization": "Bearer sekret"}
    for text in ("first prompt", "second prompt"):
        ids = chat_ids(tokenizers["qwen3"], text)
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 300, "temperature": 0.6}}
        a, b = qwen3.generate(body), qwen3.generate(body)
        c = other.generate(body, headers=auth)
        assert (
            a["output_ids"] == c["output_ids"] and a["text"] == c["text"]
        )  # each process's first draw
        assert b["output_ids"] != a["output_ids"]  # drawn again
        for sampling in (
            {"max_new_tokens": 300, "temperature": 0.6, "sampling_seed": 3},
            {"max_new_tokens": 300, "temperature": 0},
        ):
            seeded = [
                qwen3.generate({"input_ids": ids, "sampling_params": sampling}) for _ in range(2)
            ]
            seeded.append(
                other.generate({"input_ids": ids, "sampling_params": sampling}, headers=auth)
            )
            assert seeded[0]["output_ids"] == seeded[1]["output_ids"] == seeded[2]["output_ids"]
    x = qwen3.generate({"input_ids": [1, 2, 3]})["output_ids"]
    y = qwen3.generate({"input_ids": [1, 2, 4]})["output_ids"]
    assert x != y


def test_a_rid_naming_its_sample_is_answered_the_same_by_any_process(fleet, qwen3, tokenizers):
    """The worker's rids name the sample they ask for: a stub that served samples 0 and 1 and a fresh one asked
    for sample 1 only answer it alike, and unlike sample 0 (a restarted run's sample 1 is no twin of sample 0)."""
    from toolkit.engines.rids import make_rid

    other = fleet["qwen3_auth"].wait_ready()
    ids = chat_ids(tokenizers["qwen3"], "a prompt asked for twice, in two processes")
    params = {"max_new_tokens": 200, "temperature": 0.8}
    s0, s1 = (
        qwen3.generate(
            {"input_ids": ids, "sampling_params": params, "rid": make_rid("aaaaaa", 0, k, k, k)}
        )
        for k in (0, 1)
    )
    again = other.generate(
        {"input_ids": ids, "sampling_params": params, "rid": make_rid("bbbbbb", 0, 1, 1, 1)},
        headers={"Authorization": "Bearer sekret"},
    )
    assert again["output_ids"] == s1["output_ids"] != s0["output_ids"]


def test_truncation_share_and_tool_calls_at_default_sizes(qwen3, tokenizers):
    tok = tokenizers["qwen3"]
    tool_start, think_end = tid(tok, "<tool_call>"), tid(tok, "</think>")
    truncated = tools = 0
    for i in range(200):
        out = qwen3.generate(
            {
                "input_ids": chat_ids(tok, f"task number {i}"),
                "sampling_params": {"max_new_tokens": 512},
            }
        )
        ids = out["output_ids"]
        if out["meta_info"]["finish_reason"]["type"] == "length":
            truncated += 1
            assert len(ids) == 512
        if tool_start in ids:
            tools += 1
            assert ids.index(tool_start) > ids.index(think_end)  # tool calls are in the answer
    assert 6 <= truncated <= 40 and 5 <= tools <= 60


def test_think_start_follows_the_template(qwen3, fleet, tokenizers):
    qt, kt = tokenizers["qwen3"], tokenizers["kimi"]
    # Qwen3: the template leaves <think> to the model
    out = qwen3.generate(
        {"input_ids": chat_ids(qt, "hi"), "sampling_params": {"max_new_tokens": 2000}}
    )["output_ids"]
    assert out[0] == tid(qt, "<think>") and out.count(tid(qt, "</think>")) == 1
    # Qwen3 with thinking disabled: the template closes the block, so no think tokens at all
    off = chat_ids(qt, "hi", enable_thinking=False)
    out = qwen3.generate({"input_ids": off, "sampling_params": {"max_new_tokens": 2000}})[
        "output_ids"
    ]
    assert tid(qt, "<think>") not in out and tid(qt, "</think>") not in out
    # Kimi: the template opens <think>; the model only closes it
    kimi = fleet["kimi"].wait_ready()
    finished = 0
    for i in range(8):
        ids = chat_ids(kt, f"hi {i}")
        assert ids[-1] == tid(kt, "<think>")
        out = kimi.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 2000}})
        assert tid(kt, "<think>") not in out["output_ids"]
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            finished += 1
            assert out["output_ids"].count(tid(kt, "</think>")) == 1
            assert out["output_ids"][-1] == tid(kt, "<|im_end|>")
    assert finished >= 4


def test_seed_bug_modes(fleet, tokenizers):
    kt = tokenizers["kimi"]
    buggy = fleet["kimi_seed_bugs"].wait_ready()
    for i in range(10):
        out = buggy.generate(
            {"input_ids": chat_ids(kt, f"q{i}"), "sampling_params": {"max_new_tokens": 2000}}
        )
        ids = out["output_ids"]
        assert tid(kt, "</think>") not in ids  # --no-think-end
        assert ids[0] == tid(kt, "<think>")  # --double-think-start, although the template opened it


def test_kimi_tool_sections_use_kimi_tokens(fleet, tokenizers):
    kt = tokenizers["kimi"]
    kimi = fleet["kimi"].wait_ready()
    begin, end = tid(kt, "<|tool_calls_section_begin|>"), tid(kt, "<|tool_calls_section_end|>")
    sections = 0
    for i in range(80):
        ids = kimi.generate(
            {
                "input_ids": chat_ids(kt, f"tool task {i}"),
                "sampling_params": {"max_new_tokens": 4000},
            }
        )["output_ids"]
        if begin in ids:
            sections += 1
            assert ids[-2] == end and ids[-1] == tid(kt, "<|im_end|>")
    assert sections > 0


def test_batch_and_parallel_samples(qwen3):
    a = qwen3.generate(
        {"input_ids": [31, 32], "sampling_params": {"max_new_tokens": 50, "sampling_seed": 5}}
    )
    b = qwen3.generate(
        {"input_ids": [41, 42], "sampling_params": {"max_new_tokens": 50, "sampling_seed": 5}}
    )
    batch = qwen3.generate(
        {
            "input_ids": [[31, 32], [41, 42]],
            "rid": "bat",
            "sampling_params": {"max_new_tokens": 50, "sampling_seed": 5},
        }
    )
    assert isinstance(batch, list) and [o["output_ids"] for o in batch] == [
        a["output_ids"],
        b["output_ids"],
    ]
    assert [o["meta_info"]["id"] for o in batch] == ["bat_0", "bat_1"] and "index" not in batch[0]
    samples = qwen3.generate(
        {
            "input_ids": [31, 32],
            "sampling_params": {"max_new_tokens": 50, "n": 3, "temperature": 0.8},
        }
    )
    assert len(samples) == 3 and len({tuple(s["output_ids"]) for s in samples}) == 3
    greedy = qwen3.generate(
        {"input_ids": [31, 32], "sampling_params": {"max_new_tokens": 50, "n": 2, "temperature": 0}}
    )
    assert greedy[0]["output_ids"] == greedy[1]["output_ids"]


def test_text_prompts_are_tokenized(qwen3, tokenizers):
    out = qwen3.generate({"text": "hello there", "sampling_params": {"max_new_tokens": 8}})
    assert out["meta_info"]["prompt_tokens"] == len(tokenizers["qwen3"].encode("hello there"))


def test_streaming_sse(qwen3):
    body = {
        "input_ids": [51, 52, 53],
        "sampling_params": {"max_new_tokens": 40, "sampling_seed": 1},
    }
    plain = qwen3.generate(body)
    status, headers, data = qwen3.post("/generate", {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e for e in data.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in events) and events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) == len(plain["output_ids"])  # one event per token, cumulative
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, len(chunks) + 1))
    last = chunks[-1]
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"]
    assert "e2e_latency" in last["meta_info"] and "e2e_latency" not in chunks[0]["meta_info"]
    # errors after the schema gate arrive inside the stream, with HTTP 200
    status, _, data = qwen3.post("/generate", {"input_ids": [], "stream": True})
    err = json.loads(data.split(b"\n\n")[0][6:])
    assert (
        status == 200
        and err["error"]["message"] == "input_ids cannot be empty."
        and err["error"]["code"] == 400
    )
    assert data.endswith(b"data: [DONE]\n\n")


def test_fixed_output_tokens_and_token_delay(fleet, tokenizers):
    slow, tok = (
        fleet["slow"].wait_ready(),
        tokenizers["qwen3"],
    )  # --fixed-output-tokens 40 --token-delay 0.01
    started = time.monotonic()
    out = slow.generate(
        {
            "input_ids": chat_ids(tok, "bench"),
            "sampling_params": {"max_new_tokens": 100, "sampling_seed": 1},
        }
    )
    assert time.monotonic() - started >= 0.4
    ids = out["output_ids"]
    assert len(ids) == 40 and ids[0] == tid(tok, "<think>") and tid(tok, "</think>") in ids
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": tid(tok, "<|im_end|>")}
    short = slow.generate(
        {
            "input_ids": chat_ids(tok, "bench"),
            "sampling_params": {"max_new_tokens": 25, "sampling_seed": 1},
        }
    )
    assert short["output_ids"] == ids[:25] and short["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 25,
    }


def test_abort_returns_partial_output(fleet):
    slow = fleet["slow"].wait_ready()
    body = {
        "input_ids": [61, 62],
        "rid": "to-abort",
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
    }
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(slow.generate, body)
        _in_flight(slow, tokens_over=2)  # its 2 prompt ids and some generated
        assert slow.post("/abort_request", {"rid": "to-abort"})[0::2] == (200, b"")
        out = pending.result(10)
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert 0 < len(out["output_ids"]) < 300 and out["meta_info"]["completion_tokens"] == len(
        out["output_ids"]
    )
    assert slow.post("/abort_request", {"rid": "nobody"})[0::2] == (200, b"")


def test_a_client_that_goes_away_aborts_its_request(fleet):
    """SGLang's tokenizer manager aborts the request of a disconnected client: the stub cancels it (counted), frees
    its rid at once, and counts only the tokens decoded until then; a stream is ended the same way."""
    slow = fleet["slow"].wait_ready()  # --token-delay 0.01
    before = json.loads(slow.get("/stub/counters")[2])
    for stream in (False, True):
        body = json.dumps(
            {
                "input_ids": [81, 82],
                "rid": f"gone-{stream}",
                "stream": stream,
                "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True},
            }
        ).encode()
        with socket.create_connection(("127.0.0.1", slow.port), timeout=5) as s:
            s.sendall(
                b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            time.sleep(0.3)
        deadline = time.monotonic() + 5
        while any(r["num_running_reqs"] + r["num_waiting_reqs"] for r in _loads(slow)["loads"]):
            assert time.monotonic() < deadline, (
                "the request of a client that went away is still in flight"
            )
            time.sleep(0.02)
        again = slow.generate(
            {**json.loads(body), "stream": False, "sampling_params": {"max_new_tokens": 2}}
        )
        assert len(again["output_ids"]) == 2  # the rid is free again
    after = json.loads(slow.get("/stub/counters")[2])
    assert (
        after["cancelled"] == before["cancelled"] + 1
    )  # the non-streamed one (a stream has no queue slot)
    assert 0 < after["generated_tokens"] - before["generated_tokens"] < 200


def _post_all(stub, bodies: list[dict]) -> list[dict]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(stub.generate, bodies))


def _loads(stub) -> dict:
    status, _, body = stub.get("/v1/loads")
    assert status == 200
    return json.loads(body)


def _wait_load(stub, what: str, cond, timeout: float = 30.0) -> dict:
    """Poll the stub's /v1/loads until `cond(rows)` holds (its rows: one per data-parallel rank); bounded."""
    deadline = time.monotonic() + timeout
    while True:
        rows = _loads(stub)["loads"]
        if cond(rows):
            return rows
        assert time.monotonic() < deadline, (
            f"timed out after {timeout} s waiting for {what}: {rows}"
        )
        time.sleep(0.02)


def _in_flight(stub, n: int = 1, tokens_over: int = 0) -> dict:
    """Wait until `n` requests are in the stub's scheduler (running or waiting) and its KV cache holds more than
    `tokens_over` tokens (a request's prompt plus what it generated)."""
    return _wait_load(
        stub,
        f"{n} request(s) in flight over {tokens_over} tokens",
        lambda rows: (
            sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in rows) >= n
            and sum(r["num_used_tokens"] for r in rows) > tokens_over
        ),
    )


def test_running_limit_waiting_queue_loads_and_abort_all(fleet, tokenizers):
    """--max-running-requests 2 per DP rank (x2 ranks): 4 generate, the rest wait; /v1/loads and /server_info
    report it like SGLang; abort_all ends the running ones with their partial output and the queued ones with
    "Abort in waiting queue" and no output; the stub's counters count every token decoded."""
    q = fleet["queue"].wait_ready()
    tok = tokenizers["kimi"]
    info = json.loads(q.get("/server_info")[2])
    assert [s["effective_max_running_requests_per_dp"] for s in info["internal_states"]] == [2, 2]
    bodies = [
        {
            "input_ids": chat_ids(tok, f"queue {i}"),
            "rid": f"q{i:02d}",
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        }
        for i in range(7)
    ]
    with ThreadPoolExecutor(len(bodies)) as pool:
        pending = [pool.submit(q.generate, b) for b in bodies]
        rows = _wait_load(
            q,
            "2 running on each rank, 3 waiting",
            lambda rows: (
                [r["num_running_reqs"] for r in rows] == [2, 2]
                and sum(r["num_waiting_reqs"] for r in rows) == 3
            ),
        )
        # each running request with tokens of its own: the 4 decode at one pace, so 8 more tokens in all is 2 each
        used = sum(r["num_used_tokens"] for r in rows)
        _wait_load(
            q,
            "tokens decoded by every running request",
            lambda rows: sum(r["num_used_tokens"] for r in rows) >= used + 8,
        )
        loads = _loads(q)
        assert [r["dp_rank"] for r in loads["loads"]] == [0, 1]
        assert [r["num_running_reqs"] for r in loads["loads"]] == [2, 2]
        assert sum(r["num_waiting_reqs"] for r in loads["loads"]) == 3
        assert all(
            r["max_running_requests"] == 2 and 0 < r["token_usage"] < 1 for r in loads["loads"]
        )
        assert q.post("/abort_request", {"abort_all": True})[0::2] == (200, b"")
        outs = [f.result(10) for f in pending]
    running = [o for o in outs if o["meta_info"]["finish_reason"]["message"] == "Aborted"]
    queued = [
        o for o in outs if o["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue"
    ]
    assert len(running) == 4 and len(queued) == 3
    for o in running:
        assert o["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert 0 < len(o["output_ids"]) < 2000 and o["meta_info"]["completion_tokens"] == len(
            o["output_ids"]
        )
    for o in queued:
        assert o["output_ids"] == [] and o["meta_info"]["completion_tokens"] == 0
        assert "prompt_tokens" not in o["meta_info"] and "cached_tokens" not in o["meta_info"]
        assert o["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 0}]
    assert sorted(o["meta_info"]["dp_rank"] for o in running) == [
        0,
        0,
        1,
        1,
    ]  # --dp-size 2: each rank runs 2
    counters = json.loads(q.get("/stub/counters")[2])
    assert (
        counters["generated_tokens"]
        == sum(len(o["output_ids"]) for o in outs)
        == counters["returned_tokens"]
    )
    assert counters["aborted_running"] == 4 and counters["aborted_waiting"] == 3
    assert sum(r["num_running_reqs"] + r["num_waiting_reqs"] for r in _loads(q)["loads"]) == 0


def test_abort_request_bodies_sglang_cannot_parse_are_400(qwen3):
    for body in (b"", b"not json", b'{"rid": 5}', b'{"abort_all": "yes"}', b"[1]"):
        status, _, data = qwen3.post("/abort_request", body)
        assert status == 400 and json.loads(data)["object"] == "error", body
    assert qwen3.post("/abort_request", {})[0::2] == (200, b"")  # parsed, aborts nothing


@pytest.mark.slow
def test_abort_by_rid_matches_by_prefix(fleet, tokenizers):
    """The scheduler matches an aborted rid by prefix: aborting "p1" also ends "p10" (so the toolkit's rids must
    not be prefixes of each other)."""
    q = fleet["queue"].wait_ready()
    tok = tokenizers["kimi"]
    bodies = [
        {
            "input_ids": chat_ids(tok, f"prefix {r}"),
            "rid": r,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
        }
        for r in ("p1", "p10", "p2")
    ]
    with ThreadPoolExecutor(3) as pool:
        pending = [pool.submit(q.generate, b) for b in bodies]
        _in_flight(q, 3)
        q.post("/abort_request", {"rid": "p1"})
        outs = [f.result(10) for f in pending]
    kinds = [o["meta_info"]["finish_reason"]["type"] for o in outs]
    assert kinds == ["abort", "abort", "length"]


@pytest.mark.slow
def test_continuation_of_an_aborted_output_is_the_uninterrupted_output(fleet, tokenizers):
    """prompt + partial output, max_new_tokens reduced by the partial's length: the stub writes on where it was
    cut, so partial + continuation == the output of one uninterrupted request, finish reason included. Without a
    sampling_seed, a prompt sent again draws another output, and what is continued is the draw that was cut."""
    q = fleet["queue"].wait_ready()
    kimi = fleet[
        "kimi"
    ].wait_ready()  # the same outputs as `queue` (its flags change timing, not outputs)
    tok = tokenizers["kimi"]
    for i in range(4):
        prompt = chat_ids(tok, f"continue me {i}")
        params = {"max_new_tokens": 120} if i % 2 else {"max_new_tokens": 120, "sampling_seed": 11}
        if i % 2:  # seedless: the aborted request is the prompt's second draw
            q.generate({"input_ids": prompt, "sampling_params": params})
            kimi.generate({"input_ids": prompt, "sampling_params": params})
            whole = kimi.generate({"input_ids": prompt, "sampling_params": params})
        else:
            whole = q.generate({"input_ids": prompt, "sampling_params": params})
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                q.generate, {"input_ids": prompt, "sampling_params": params, "rid": f"c{i}"}
            )
            time.sleep(0.05 + 0.05 * i)
            q.post("/abort_request", {"rid": f"c{i}"})
            part = pending.result(10)["output_ids"]
        assert 2 <= len(part) < len(whole["output_ids"]), (len(part), len(whole["output_ids"]))
        rest = q.generate(
            {
                "input_ids": prompt + part,
                "sampling_params": {
                    **params,
                    "max_new_tokens": params["max_new_tokens"] - len(part),
                },
            }
        )
        assert part + rest["output_ids"] == whole["output_ids"]
        assert (
            rest["meta_info"]["finish_reason"]["type"]
            == whole["meta_info"]["finish_reason"]["type"]
        )
        assert rest["meta_info"]["prompt_tokens"] == len(prompt) + len(part)
    assert json.loads(q.get("/stub/counters")[2])["continued"] >= 4


def test_cached_tokens_follow_a_prefix_cache(qwen3, fleet, tokenizers):
    """cached_tokens: the longest prefix an earlier prompt shares, never the whole prompt (its last token is always
    computed); /flush_cache empties the cache and --disable-radix-cache turns it off."""
    tok = tokenizers["qwen3"]
    a, b = chat_ids(tok, "Name three prime numbers."), chat_ids(tok, "Name three prime ministers.")
    common = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)

    def cached(stub, ids) -> int:
        status, _, data = stub.post(
            "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}
        )
        assert status == 200
        return json.loads(data)["meta_info"]["cached_tokens"]

    assert qwen3.post("/flush_cache")[0] == 200
    assert cached(qwen3, a) == 0
    assert cached(qwen3, a) == len(a) - 1
    assert cached(qwen3, b) == common > 0
    assert cached(qwen3, a[:common]) == common - 1
    assert qwen3.post("/flush_cache")[0] == 200
    assert cached(qwen3, b) == 0
    no_cache = fleet["no_cache"].wait_ready()
    assert [cached(no_cache, a), cached(no_cache, a)] == [0, 0]


def test_misc_endpoints(qwen3, fleet):
    status, headers, data = qwen3.get("/metrics")
    assert status == 200 and b"sglang:num_requests_total" in data
    assert fleet["kimi"].wait_ready().get("/metrics")[0] == 404  # not enabled there
    status, headers, data = qwen3.post("/flush_cache")
    assert (
        status == 200
        and data.startswith(b"Cache flushed.")
        and headers["content-type"].startswith("text/plain")
    )
    name = json.loads(qwen3.get("/v1/models")[2])["data"][0]["id"]
    assert qwen3.get("/v1/models/" + name)[0] == 200
    status, _, data = qwen3.get("/v1/models/nope")
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"
    assert qwen3.get("/nowhere")[0] == 404 and qwen3.get("/generate")[0] == 405
    assert (
        call(
            qwen3.port,
            "PUT",
            "/generate",
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}},
        )[0]
        == 200
    )


@pytest.mark.slow
def test_auth(fleet):
    stub = fleet["qwen3_auth"].wait_ready()
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        status, _, data = stub.post("/generate", body, headers=headers)
        assert (status, json.loads(data)) == (401, {"error": "Unauthorized"})
    assert stub.get("/model_info")[0] == 401
    assert stub.post("/generate", body, headers={"Authorization": "Bearer sekret"})[0] == 200
    assert (
        stub.post("/generate", body, headers={"Authorization": "bEaReR sekret"})[0] == 200
    )  # any case, as SGLang
    assert stub.get("/health")[0] == 200 and stub.get("/ready")[0] == 200  # always exempt
    assert stub.get("/metrics")[0] == 404  # exempt from auth, and not enabled


# The keys of GET /v1/loads, as each release builds its answer: 0.5.23 in sglang/srt/entrypoints/v1_loads.py with
# rows from LoadSnapshot.to_dict (sglang/srt/managers/load_snapshot.py: every scalar field, then the sections that
# are not None); 0.5.9 in the same v1_loads.py with rows from io_struct.GetLoadsReqOutput (timestamp and None
# values left out, num_total_reqs added) and an aggregate. Neither release serves /get_loads.
LOADS_TOP = {
    "0.5.23": {"timestamp", "version", "accelerator", "num_accelerators", "loads"},
    "0.5.9": {"timestamp", "version", "dp_rank_count", "loads", "aggregate"},
}
LOADS_ROW = {
    "0.5.23": {
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
    },
    "0.5.9": {
        "dp_rank",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_used_tokens",
        "max_total_num_tokens",
        "token_usage",
        "gen_throughput",
        "cache_hit_rate",
        "utilization",
        "max_running_requests",
        "disaggregation",
        "queues",
        "num_total_reqs",
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("name, version", [("kimi", "0.5.23"), ("v059", "0.5.9")])
def test_v1_loads_has_the_shape_of_each_release_and_the_client_reads_both(fleet, name, version):
    import asyncio

    from toolkit.engines.client import HttpClient
    from toolkit.engines.endpoints import read_load

    stub = fleet[name].wait_ready()
    loads = _loads(stub)
    assert set(loads) == LOADS_TOP[version]
    assert loads["version"] == version and len(loads["loads"]) == 1
    assert set(loads["loads"][0]) == LOADS_ROW[version]
    assert isinstance(loads["timestamp"], str) and loads["timestamp"].endswith(
        "+00:00"
    )  # datetime.isoformat
    if version == "0.5.23":
        assert isinstance(loads["loads"][0]["timestamp"], float) and loads["num_accelerators"] >= 1
        assert set(loads["loads"][0]["queues"]) == {
            "waiting",
            "grammar",
            "paused",
            "retracted",
            "prealloc_ready",
        }
    else:
        assert loads["aggregate"]["total_reqs"] == 0 and loads["dp_rank_count"] == 1
        assert set(loads["loads"][0]["queues"]) == {"waiting", "grammar", "paused", "retracted"}
    assert stub.get("/get_loads")[0] == 404

    async def read():
        http = HttpClient(f"http://127.0.0.1:{stub.port}")
        try:
            return await read_load(http)
        finally:
            http.close()

    got = asyncio.run(read())
    assert got is not None and got.running == 0 and got.waiting == 0
    assert got.capacity == loads["loads"][0]["max_running_requests"] > 0


@pytest.mark.slow
def test_version_0_5_9_profile_without_tokenizer_init(fleet):
    old = fleet["v059"].wait_ready()
    assert old.get("/ready")[0] == 404
    info = json.loads(old.get("/model_info")[2])
    assert "served_model_name" not in info and "reasoning_parser" not in info
    assert json.loads(old.get("/server_info")[2])["version"] == "0.5.9"
    out = old.generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 30}})
    assert "text" not in out
    meta = out["meta_info"]
    assert "total_retractions" in meta and not {
        "num_retractions",
        "reasoning_tokens",
        "dp_rank",
    } & set(meta)
    status, headers, data = old.post(
        "/generate", {"input_ids": [1], "sampling_params": {"seed": 3}}
    )
    assert status == 500 and headers["content-type"].startswith(
        "text/plain"
    )  # no schema gate in 0.5.9
    # 0.5.9 rejects input + max_new_tokens == context (>=), 0.5.23 does not
    status, _, data = old.post(
        "/generate", {"input_ids": [7] * 100, "sampling_params": {"max_new_tokens": CONTEXT - 100}}
    )
    assert status == 400 and json.loads(data)["error"]["message"].startswith(
        "Requested token count exceeds"
    )
    status, _, data = old.post("/generate", {"text": "hello"})
    message = json.loads(data)["error"]["message"]
    assert status == 400 and "skip_tokenizer_init=True cannot accept text prompts" in message


# ------------------------------------------------------------------------------------------------
# fault injection and shutdown
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_5xx_burst_then_hang_then_crash(fleet):
    stub = fleet["faults"].wait_ready()
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4}}
    answers = [stub.post("/generate", body) for _ in range(4)]  # --fail-5xx 2:2
    assert [a[0] for a in answers] == [200, 503, 503, 200]
    error = json.loads(answers[1][2])
    assert {k: error[k] for k in ("object", "type", "param", "code")} == {
        "object": "error",
        "type": "503",
        "param": None,
        "code": 503,
    }
    assert "--fail-5xx" in error["message"]
    data = json.dumps(body).encode()
    with socket.create_connection(
        ("127.0.0.1", stub.port), timeout=1.0
    ) as wedged:  # request 5: --hang-after 4
        wedged.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
            % (len(data), data)
        )
        with pytest.raises(TimeoutError):
            wedged.recv(1)  # never answered
        # SGLang's health check gets no output within its timeout: 503, and the server is UnHealthy
        assert stub.get("/health")[0::2] == (503, b"") and stub.get("/ready")[0] == 503
        assert stub.get("/model_info")[0] == 200
        with pytest.raises(
            (http.client.RemoteDisconnected, ConnectionError)
        ):  # request 6: --crash-after 6
            stub.post("/generate", body)
    assert stub.proc.wait(10) == 1
    assert "Injected crash" in stub.log_text() and "Health check failed" in stub.log_text()


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_zero(fleet):
    slow = fleet["slow"].wait_ready()
    body = {"input_ids": [71, 72], "sampling_params": {"max_new_tokens": 80, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(slow.generate, body)  # about 0.8 s of token delay
        _in_flight(slow)
        slow.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while slow.get("/health")[0] != 503:  # the signal handled
            assert time.monotonic() < deadline, "the stub never said it is shutting down"
            time.sleep(0.02)
        for path in ("/health", "/health_generate", "/ready"):
            assert slow.get(path)[0::2] == (503, b"")
        late = slow.generate(
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
        )
        assert len(late["output_ids"]) == 3  # new requests are still accepted while draining
        out = pending.result(10)
    assert len(out["output_ids"]) == 80 and out["meta_info"]["finish_reason"]["type"] == "length"
    assert slow.proc.wait(10) == 0
    assert "Gracefully exiting" in slow.log_text()


@pytest.mark.slow
def test_sigterm_to_the_process_group_kills_without_draining(toy_tokenizer, tmp_path):
    """As SGLang: a group SIGTERM ends the scheduler child at once, and the watchdog kills the server (SIGKILL)
    within about a second, requests in flight unanswered; nothing of the group is left."""
    from toolkit.engines.process_group import group_members

    stub = Stub(
        "group",
        toy_tokenizer("qwen3"),
        ["--token-delay", "0.05", "--warmup-delay", "0"],
        tmp_path,
        new_session=True,
    )  # its own process group, as the toolkit starts an engine
    stub.wait_ready()
    body = {"input_ids": [71, 72], "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(stub.generate, body)  # 20 s of token delay
        _in_flight(stub)
        t0 = time.monotonic()
        os.killpg(stub.proc.pid, signal.SIGTERM)
        assert stub.proc.wait(10) == -signal.SIGKILL
        assert time.monotonic() - t0 < 3.0
        with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
            pending.result(10)
    log = stub.log_text()
    assert (
        "Subprocess scheduler_0" in log
        and "crashed with exit code -15" in log
        and "Gracefully exiting" not in log
    )
    deadline = time.monotonic() + 5
    while group_members(stub.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_members(stub.proc.pid)


# ------------------------------------------------------------------------------------------------
# fault decisions (pure functions of the configuration and the request number)
# ------------------------------------------------------------------------------------------------


def test_request_faults_fire_on_the_requests_their_flags_name():
    from toolkit.stub import faults

    cfg = _parse("--fail-5xx", "2:2", "--hang-after", "4", "--crash-after", "6", "--nan-every", "3")
    got = {n: faults.request_faults(cfg, n) for n in range(1, 8)}
    assert [n for n, f in got.items() if f.fail_5xx] == [2, 3]
    assert [n for n, f in got.items() if f.hang] == [5, 6, 7]  # after the 4th
    assert [n for n, f in got.items() if f.crash] == [6, 7]  # from the 6th on
    assert [n for n, f in got.items() if f.nan] == [3, 6]
    assert got[1] == faults.RequestFaults()
    plain = _parse()
    assert all(faults.request_faults(plain, n) == faults.RequestFaults() for n in range(1, 50))
    assert all(faults.request_faults(_parse("--hang"), n).hang for n in (1, 2, 100))


def test_poison_fires_on_the_prompts_holding_its_text_after_the_first_requests():
    from toolkit.stub import faults

    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    bad, good = [ord(c) for c in "a BAD one"], [ord(c) for c in "fine"]
    cfg = _parse("--poison", "reset", "--poison-text", "BAD", "--poison-after", "1")
    assert not faults.poisoned(cfg, 1, [bad], decode)  # within --poison-after
    assert faults.poisoned(cfg, 2, [bad], decode) and faults.poisoned(cfg, 9, [good, bad], decode)
    assert not faults.poisoned(cfg, 2, [good], decode)
    assert not faults.health_broken(cfg, 9)  # one prompt's trouble: the server still generates
    every = _parse("--poison", "truncate", "--poison-after", "2")
    assert faults.poisoned(every, 3, [good], decode) and not faults.poisoned(
        every, 2, [good], decode
    )
    assert faults.health_broken(every, 3) and not faults.health_broken(every, 2)
    assert not faults.health_broken(_parse("--poison", "wrong_rid"), 5)  # answers, if wrong ones
    assert not faults.poisoned(_parse(), 5, [bad], decode)


@pytest.mark.slow
def test_exit_at_start_decision():
    from toolkit.stub import faults

    assert faults.exit_at_start(_parse()) is None
    assert faults.exit_at_start(_parse("--exit-at-start", "7"))[0] == 7
    cfg = _parse("--exit-at-start-if-exists", "/some/marker")
    assert faults.exit_at_start(cfg, exists=lambda p: False) is None
    code, message = faults.exit_at_start(cfg, exists=lambda p: p == "/some/marker")
    assert code == 1 and "/some/marker" in message


@pytest.mark.slow
def test_sigterm_handler_drains_unless_ignored():
    from toolkit.stub import faults

    seen = []
    faults.sigterm_handler(_parse(), seen.append)("SIGTERM")
    faults.sigterm_handler(_parse("--ignore-sigterm"), seen.append)("SIGTERM")
    assert seen == ["SIGTERM"]


@pytest.mark.slow
def test_loops_and_identical_samples_on_request(fleet, tokenizers):
    """--degenerate-fraction: that share of outputs repeat one short span until max_new_tokens, the others are the
    outputs of a stub without it; --identical-samples: the samples of a prompt are the same even when seeded."""
    from toolkit.formats.loops import repetition_loop

    tok, plain, loops = tokenizers["kimi"], fleet["kimi"].wait_ready(), fleet["loops"].wait_ready()
    looped = 0
    for i in range(24):
        body = {
            "input_ids": chat_ids(tok, f"Question {i}: why is the sky blue?"),
            "sampling_params": {"max_new_tokens": 300, "temperature": 0.7},
        }
        a, b = plain.generate(body), loops.generate(body)
        if a["output_ids"] == b["output_ids"]:
            continue
        looped += 1
        assert b["meta_info"]["finish_reason"]["type"] == "length" and len(b["output_ids"]) == 300
        assert repetition_loop(np.array(b["output_ids"], np.uint32)) is not None
    assert 2 <= looped <= 16
    body = {
        "input_ids": chat_ids(tok, "Name a colour."),
        "sampling_params": {"max_new_tokens": 60, "temperature": 0.7, "n": 2, "sampling_seed": 4},
    }
    same = [o["output_ids"] for o in loops.generate(body)]
    differ = [o["output_ids"] for o in plain.generate(body)]
    assert same[0] == same[1] and differ[0] != differ[1]


def test_poison_prompt_rules_fire_on_their_prompts_every_time():
    from toolkit.stub import faults

    decode = lambda ids: "".join(map(chr, ids))  # noqa: E731
    nan, hang, good = ([ord(c) for c in t] for t in ("a NANX one", "a HANGX one", "fine"))
    cfg = _parse("--poison-prompt", "nan=NANX", "--poison-prompt", "hang=HANGX")
    assert cfg.poison_prompts == (("nan", "NANX"), ("hang", "HANGX"))
    assert all(
        faults.poison_of(cfg, n, [nan], decode) == "nan" for n in (1, 2, 50)
    )  # from the first request on
    assert (
        faults.poison_of(cfg, 3, [hang], decode) == "hang"
        and faults.poison_of(cfg, 3, [good], decode) is None
    )
    assert not faults.health_broken(cfg, 9)  # the other prompts, and /health*, still answer
    both = _parse(
        "--poison", "reset", "--poison-text", "NANX", "--poison-prompt", "status_503=NANX"
    )
    assert faults.poison_of(both, 1, [nan], decode) == "reset"  # --poison first


@pytest.mark.parametrize("rule", ["nan", "nan=", "bogus=X", "=X"])
def test_a_poison_prompt_rule_that_cannot_be_read_is_refused(rule, capsys):
    with pytest.raises(SystemExit) as e:
        _parse("--poison-prompt", rule)
    assert e.value.code == 2 and "--poison-prompt wants KIND=TEXT" in capsys.readouterr().err


@pytest.mark.slow
def test_batch_occupancy_in_counters_and_at_shutdown(toy_tokenizer, tmp_path):
    """Time-weighted running / max running from the first request to the last answer: requests one at a time on
    4 slots give about 1/4, eight at once on 4 slots (two full waves) about 1; /stub/counters reports it and
    the log says it at shutdown."""
    flags = [
        "--token-delay",
        "0.01",
        "--fixed-output-tokens",
        "30",
        "--max-running-requests",
        "4",
        "--warmup-delay",
        "0",
        "--drain-poll",
        "0.2",
    ]
    one, full = (
        Stub(name, toy_tokenizer("qwen3"), flags, tmp_path)
        for name in ("one_at_a_time", "full_batch")
    )
    try:
        one.wait_ready()
        full.wait_ready()
        assert json.loads(one.get("/stub/counters")[2])["occupancy"] is None  # nothing ran yet
        bodies = [
            {"input_ids": [71, 72 + i], "sampling_params": {"max_new_tokens": 64}} for i in range(8)
        ]
        for body in bodies[:4]:
            one.generate(body)
        with ThreadPoolExecutor(len(bodies)) as pool:
            assert all(len(o["output_ids"]) == 30 for o in pool.map(full.generate, bodies))
        c1, c2 = (json.loads(s.get("/stub/counters")[2]) for s in (one, full))
        assert c1["max_running"] == c2["max_running"] == 4
        assert 0.2 <= c1["occupancy"] <= 0.26, (
            c1
        )  # 1 of 4 slots, less the gaps between the requests
        assert c2["occupancy"] >= 0.9, c2
        assert c1["occupancy_s"] >= 4 * 30 * 0.01 and c2["occupancy_s"] >= 2 * 30 * 0.01
    finally:
        one.stop()
        full.stop()
    for stub, figure in ((one, c1), (full, c2)):
        assert stub.proc.returncode == 0, stub.log_text()
        line = next(x for x in stub.log_text().splitlines() if "Batch occupancy" in x)
        assert (
            f"Batch occupancy {figure['occupancy']:.4f} (time-weighted running / max running 4)"
            in line
        ), line
