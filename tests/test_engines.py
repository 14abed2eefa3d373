"""Engine launch and lifecycle: SGLang's command line, readiness, and a shutdown that leaves nothing running."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from toolkit.client import HttpClient
from toolkit.engines import EngineError, make_engine
from toolkit.engines.sglang import check_extra_args, substitute
from toolkit.spec import load_spec

from jobfiles import make_job, process_running

FAKE_SGLANG = Path(__file__).parent / "fake_sglang"


def sglang_spec(tmp_path, tokenizer, **engine):
    job = make_job(tmp_path, tokenizer, n=2, engine={"kind": "sglang", "tp_size": 8, "dp_size": 2, **engine},
                   model={"path": str(tokenizer), "trust_remote_code": True})
    return load_spec(job)


def test_sglang_argv_is_complete_and_not_a_shell_string(tmp_path, toy_tokenizer):
    tok = toy_tokenizer("kimi")
    spec = sglang_spec(tmp_path, tok, extra_args=["--mem-fraction-static", "0.85"])
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    e.port, e.api_key = 31234, "k" * 32
    argv = e.argv()
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::1], argv[4::1]))
    assert pairs["--model-path"] == str(tok)
    assert pairs["--tp-size"] == "8" and pairs["--dp-size"] == "2"
    assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "31234" and pairs["--api-key"] == "k" * 32
    assert int(pairs["--nccl-port"]) > 0
    assert "--trust-remote-code" in argv and argv[-2:] == ["--mem-fraction-static", "0.85"]
    assert all(isinstance(a, str) and a for a in argv)


def test_extra_args_may_not_fight_the_toolkit():
    assert check_extra_args(["--mem-fraction-static", "0.9"]) == []
    problems = check_extra_args(["--port", "1", "--tp=4", "--skip-server-warmup"])
    assert len(problems) == 3 and "--port is set by the toolkit" in problems[0]
    assert "false positive" in problems[2]


def test_custom_command_placeholders():
    argv = substitute(["srv", "--addr={host}:{port}", "{model_path}", "--key", "{api_key}", '{"json": 1}'],
                      host="127.0.0.1", port="9", model_path="/m", api_key="K")
    assert argv == ["srv", "--addr=127.0.0.1:9", "/m", "--key", "K", '{"json": 1}']


def test_sglang_lifecycle_ready_probe_and_group_kill(tmp_path, toy_tokenizer):
    """The real launch path, with a stand-in `sglang` package that parses SGLang's flags strictly."""
    record = tmp_path / "seen.json"
    env = {"PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(Path(__file__).parents[1])]),
           "FAKE_SGLANG_RECORD": str(record), "ENGINE_MARKER": "yes", "http_proxy": "http://192.0.2.1:9",
           "HTTP_PROXY": "http://192.0.2.1:9"}
    spec = sglang_spec(tmp_path, toy_tokenizer("kimi"), env=env, shutdown_timeout_s=3)
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[5, 6, 7])

    async def go():
        e.start()
        http = HttpClient(e.url, api_key=e.api_key)
        try:
            await e.wait_ready(http, poll_s=0.2)
            await e.probe(http)
        finally:
            http.close()

    try:
        asyncio.run(go())
        seen = json.loads(record.read_text())
        assert seen["pgid"] == seen["pid"] == e.proc.pid, "the engine leads its own process group"
        assert "127.0.0.1" in seen["no_proxy"] and seen["env_marker"] == "yes"
        assert e.version == "0.5.23"
        scheduler = seen["scheduler_pid"]
        assert process_running(scheduler)
    finally:
        e.stop()
    assert e.proc is None
    assert not process_running(scheduler), "a child that ignores SIGTERM is killed with its group"
    log = (tmp_path / "server.log").read_text()
    assert "engine start #1" in log and e.api_key not in log, "the api key must not be logged"


def test_unknown_sglang_flag_fails_fast_with_log_tail(tmp_path, toy_tokenizer):
    env = {"PYTHONPATH": str(FAKE_SGLANG), "FAKE_SGLANG_RECORD": str(tmp_path / "x.json")}
    spec = sglang_spec(tmp_path, toy_tokenizer("kimi"), env=env, extra_args=["--no-such-flag"])
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])

    async def go():
        e.start()
        await e.wait_ready(HttpClient(e.url, api_key=e.api_key), poll_s=0.2)

    try:
        with pytest.raises(EngineError) as err:
            asyncio.run(go())
    finally:
        e.stop()
    assert "exited with code 2" in str(err.value) and "unrecognized arguments: --no-such-flag" in str(err.value)
