"""Engine launch and lifecycle: SGLang's command line, readiness, and a shutdown that leaves nothing running."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jobfiles import make_job, process_running
from toolkit.engines.base import EngineError
from toolkit.engines.client import HttpClient
from toolkit.engines.keys import KEY_ENV, KeyFiles
from toolkit.engines.kinds import make_engine
from toolkit.engines.sglang import substitute
from toolkit.engines.sglang_contract.extra_args import check_extra_args
from toolkit.job.spec import load_spec
from toolkit.job.specerrors import SpecError

FAKE_SGLANG = Path(__file__).parents[1] / "fake_sglang"


def sglang_spec(tmp_path, tokenizer, **engine):
    """A job of the toolkit's own SGLang launch. Its engine starts with this Python (`[engine] python`), which has
    what the fake `sglang` package imports, whatever other python3 is first on PATH."""
    if "command" not in engine:
        engine.setdefault("python", sys.executable)
    job = make_job(
        tmp_path,
        tokenizer,
        n=2,
        engine={"kind": "sglang", "tp_size": 8, "dp_size": 2, **engine},
        model={"path": str(tokenizer), "trust_remote_code": True},
    )
    return load_spec(job)


def test_sglang_argv_is_complete_and_not_a_shell_string(tmp_path, toy_tokenizer):
    tok = toy_tokenizer("kimi")
    spec = sglang_spec(tmp_path, tok, extra_args=["--mem-fraction-static", "0.85"])
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    e.port, e.api_key = 31234, "0" * 32
    e.key_files = KeyFiles(e.api_key)
    try:
        argv = e.argv()
        assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
        pairs = dict(zip(argv[3::1], argv[4::1]))
        assert pairs["--model-path"] == str(tok)
        assert pairs["--tp-size"] == "8" and pairs["--dp-size"] == "2"
        assert pairs["--host"] == "127.0.0.1" and pairs["--port"] == "31234"
        assert "--api-key" not in argv and not any("0" * 32 in a for a in argv), (
            "no key on the command line"
        )
        config = Path(
            pairs["--config"]
        )  # SGLang's YAML server arguments: quoted, so a key of digits stays text
        assert config.read_text() == 'api-key: "00000000000000000000000000000000"\n'
        assert (
            config.stat().st_mode & 0o777 == 0o600 and config.parent.stat().st_mode & 0o777 == 0o700
        )
        assert "--nccl-port" not in argv, (
            "SGLang picks its own NCCL port, one per data-parallel replica"
        )
        assert "--trust-remote-code" in argv and argv[-4:-2] == ["--mem-fraction-static", "0.85"]
        assert all(isinstance(a, str) and a for a in argv)
        assert e.key_env() == {}, "one node: the key is in the file only"
    finally:
        e.discard_key()
    assert not config.parent.exists()


def test_extra_args_may_not_fight_the_toolkit():
    assert check_extra_args(["--mem-fraction-static", "0.9"]) == []
    problems = check_extra_args(["--port", "1", "--tp=4", "--skip-server-warmup"])
    assert len(problems) == 3 and "--port is set by the toolkit" in problems[0]
    assert (
        "--tp (SGLang reads it as --tp-size) is set by the toolkit" in problems[1]
        and "[engine] tp_size" in problems[1]
    )
    assert "false positive" in problems[2]


@pytest.mark.parametrize(
    "extra, expected",
    [
        # abbreviations SGLang's parser (allow_abbrev) resolves are managed flags too
        (
            ["--tp-s", "4"],
            "--tp-s (SGLang reads it as --tp-size) is set by the toolkit; remove it from extra_args and set [engine] tp_size",
        ),
        (["--api-k", "x"], "--api-k (SGLang reads it as --api-key) is set by the toolkit"),
        (
            ["--model", "/m"],
            "--model is set by the toolkit; remove it from extra_args and set [model] path",
        ),
        (["--tensor-parallel-size", "2"], "set [engine] tp_size"),
        (
            ["--cuda-graph-max-bs", "64"],
            "`--cuda-graph-max-bs` is ambiguous in SGLang 0.5.23: it could be "
            "--cuda-graph-max-bs-decode or --cuda-graph-max-bs-prefill; use the full name",
        ),
        (
            ["--stream-output"],
            "`--stream-output` is not a flag of SGLang 0.5.23 (it is one of SGLang 0.5.9); use "
            "--incremental-streaming-output, or remove it",
        ),
        (["--no-such-flag", "1"], "`--no-such-flag` is not a flag of SGLang 0.5.23; remove it"),
        (["--mem-fraction-static"], "`--mem-fraction-static` takes a value and was given none"),
        (
            ["--mem-fraction-static", "--enable-metrics"],
            "`--mem-fraction-static` takes a value and was given none",
        ),
        (["--mem-fraction-static", "lots"], "`--mem-fraction-static`: invalid float value `lots`"),
        (
            ["--enable-metrics=true"],
            "`--enable-metrics` is a switch and takes no value, but was given `=true`",
        ),
        (
            ["--load-format", "nope"],
            "`--load-format`: invalid choice `nope` (choose from auto, pt,",
        ),
        (["--enable-metrics", "yes"], "`yes` is not a flag (SGLang takes no positional arguments"),
        (
            ["--config", "c.yaml"],
            "--config reads more flags from a YAML file the toolkit cannot check",
        ),
        (["--help"], "--help prints SGLang's help and exits"),
    ],
)
def test_extra_args_are_judged_like_sglangs_parser(extra, expected):
    problems = check_extra_args(extra)
    assert any(expected in p for p in problems), problems


def test_extra_args_sglang_accepts():
    ok = [
        "--mem-fraction-static=0.85",
        "--context-length",
        "65536",
        "--cuda-graph-max-bs-decode",
        "64",
        "--reasoning-parser",
        "kimi_k2",
        "--enable-metrics",
        "--dist-timeout",
        "-1",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--nccl-port",
        "29000",
        "--enable-dp-attention",
    ]
    assert check_extra_args(ok) == []
    assert check_extra_args(["--stream-output", "--cuda-graph-max-bs", "8"], version="0.5.9") == []
    assert check_extra_args(["--context-length", "1024"], kind="stub")[0].startswith(
        "--context-length is set by the toolkit; remove it from extra_args and set [engine.stub] context_length"
    )


def test_a_pinned_nccl_port_with_data_parallel_replicas_is_refused():
    assert check_extra_args(["--nccl-port", "29000"], dp_size=1) == []
    (problem,) = check_extra_args(["--nccl-port", "29000"], dp_size=2)
    assert "every data-parallel replica of SGLang binds this one port" in problem


@pytest.mark.parametrize("kind", ["sglang", "stub"])
def test_check_run_and_submit_refuse_what_sglang_refuses(tmp_path, toy_tokenizer, capsys, kind):
    """Without sglang installed: the flag data judges extra_args wherever a job is loaded, --dry-run included."""
    from toolkit.cli import main

    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        engine={"kind": kind, "extra_args": ["--cuda-graph-max-bs", "8"]},
    )
    for argv in (
        ["check", str(job)],
        ["run", str(job)],
        ["submit", str(job), "--dry-run"],
        ["submit", str(job)],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert f"{job}: [engine] extra_args: `--cuda-graph-max-bs` is ambiguous" in err, (argv, err)
        assert (
            "use the full name, e.g. --cuda-graph-max-bs-decode or --cuda-graph-max-bs-prefill"
            in err
        )
    assert not (tmp_path / "run").exists(), "nothing was pinned"


def test_stub_extra_args_follow_the_imitated_release(tmp_path, toy_tokenizer):
    tok = toy_tokenizer("kimi")
    job = make_job(
        tmp_path, tok, engine={"extra_args": ["--stream-output"]}, stub={"version": "0.5.9"}
    )
    assert load_spec(job).engine.extra_args == ["--stream-output"]
    job = make_job(tmp_path / "b", tok, engine={"extra_args": ["--stream-output"]})
    with pytest.raises(
        SpecError, match=r"\[engine\] extra_args: `--stream-output` is not a flag of SGLang 0.5.23"
    ):
        load_spec(job)


def test_custom_command_placeholders():
    argv = substitute(
        ["srv", "--addr={host}:{port}", "{model_path}", "--key", "{api_key}", '{"json": 1}'],
        host="127.0.0.1",
        port="9",
        model_path="/m",
        api_key="K",
    )
    assert argv == ["srv", "--addr=127.0.0.1:9", "/m", "--key", "K", '{"json": 1}']


def test_a_custom_command_gets_the_key_in_files_or_its_environment(tmp_path, toy_tokenizer):
    command = [
        "srv",
        "--port",
        "{port}",
        "--key-file",
        "{api_key_file}",
        "--config",
        "{config_file}",
    ]
    spec = sglang_spec(tmp_path, toy_tokenizer("kimi"), command=command)
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    e.port, e.api_key = 31234, "f" * 32
    e.key_files = KeyFiles(e.api_key)
    try:
        argv = e.argv()
        assert argv[:3] == ["srv", "--port", "31234"] and not any("f" * 32 in a for a in argv)
        assert (
            Path(argv[4]).read_text() == "f" * 32 + "\n"
            and Path(argv[4]).stat().st_mode & 0o777 == 0o600
        )
        assert Path(argv[6]).read_text() == f'api-key: "{"f" * 32}"\n'
        assert e.key_env() == {KEY_ENV: "f" * 32}
    finally:
        e.discard_key()


@pytest.mark.slow
def test_sglang_lifecycle_ready_probe_and_group_kill(tmp_path, toy_tokenizer):
    """The real launch path, with a stand-in `sglang` package that parses SGLang's flags strictly."""
    record = tmp_path / "seen.json"
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(Path(__file__).parents[2])]),
        "FAKE_SGLANG_RECORD": str(record),
        "ENGINE_MARKER": "yes",
        "http_proxy": "http://192.0.2.1:9",
        "HTTP_PROXY": "http://192.0.2.1:9",
    }
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


def test_server_that_exits_before_ready_fails_fast_with_log_tail(tmp_path, toy_tokenizer):
    env = {
        "PYTHONPATH": str(FAKE_SGLANG),
        "FAKE_SGLANG_RECORD": str(tmp_path / "x.json"),
        "FAKE_SGLANG_FAIL": "no GPU found",
    }
    spec = sglang_spec(tmp_path, toy_tokenizer("kimi"), env=env)
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])

    async def go():
        e.start()
        await e.wait_ready(HttpClient(e.url, api_key=e.api_key), poll_s=0.2)

    try:
        with pytest.raises(EngineError) as err:
            asyncio.run(go())
    finally:
        e.stop()
    assert "exited with code 2" in str(err.value) and "error: no GPU found" in str(err.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (
            ["--cuda-graph-max-bs", "8"],
            "ambiguous option: --cuda-graph-max-bs could match --cuda-graph-max-bs-decode",
        ),
    ],
)
def test_sglangs_own_parser_refuses_the_argv_before_launch(tmp_path, toy_tokenizer, extra, message):
    """Where sglang is importable (the GPU node), its parser judges the argv before anything loads."""
    record = tmp_path / "seen.json"
    env = {"PYTHONPATH": str(FAKE_SGLANG), "FAKE_SGLANG_RECORD": str(record)}
    spec = sglang_spec(tmp_path, toy_tokenizer("kimi"), env=env)
    spec.engine.extra_args = (
        extra  # past the login-side check, as if the flag data were older than the node's SGLang
    )
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    try:
        with pytest.raises(EngineError) as err:
            e.start()
    finally:
        e.stop()
    assert "SGLang's parser refuses the server command line" in str(err.value) and message in str(
        err.value
    )
    assert e.proc is None and not record.exists(), "nothing was launched"
    assert e.api_key not in str(err.value)


def _send_usr2_then_check_alive(e, tmp_path):
    async def go():
        e.start()
        http = HttpClient(e.url, api_key=e.api_key)
        try:
            await e.wait_ready(http, poll_s=0.2)
            os.killpg(
                e.proc.pid, signal.SIGUSR2
            )  # what Slurm's --signal=USR2@T does to the job step
            await asyncio.sleep(0.5)
            assert e.alive(), f"the engine died of SIGUSR2 (exit code {e.exit_code()})"
            await e.probe(http)
        finally:
            http.close()

    asyncio.run(go())


@pytest.mark.slow
def test_stub_engine_ignores_slurms_usr2_and_still_stops(tmp_path, toy_tokenizer):
    spec = load_spec(make_job(tmp_path, toy_tokenizer("kimi")))
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[5, 6, 7])
    try:
        _send_usr2_then_check_alive(e, tmp_path)
        pid = e.proc.pid
    finally:
        e.stop()
    assert e.proc is None and not process_running(pid)


@pytest.mark.slow
def test_sglang_engine_and_its_children_ignore_usr2_and_still_stop(tmp_path, toy_tokenizer):
    record = tmp_path / "seen.json"
    env = {
        "PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(Path(__file__).parents[2])]),
        "FAKE_SGLANG_RECORD": str(record),
    }
    spec = sglang_spec(tmp_path, toy_tokenizer("kimi"), env=env, shutdown_timeout_s=3)
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[5, 6, 7])
    try:
        _send_usr2_then_check_alive(e, tmp_path)
        seen = json.loads(record.read_text())
        assert seen["usr2_ignored"]
        assert process_running(seen["scheduler_pid"]), "the server's child survives SIGUSR2 too"
    finally:
        e.stop()
    assert e.proc is None and not process_running(seen["scheduler_pid"])


def _ignored(pid: int) -> set[int]:
    """The signals process `pid` ignores (SigIgn of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return {sig for sig in range(1, 64) if mask >> (sig - 1) & 1}


@pytest.mark.slow
def test_a_step_wide_sigterm_leaves_the_engine_serving_until_the_worker_has_aborted_and_stopped_it(
    tmp_path, toy_tokenizer
):
    """Slurm's scancel, requeue and preemption send SIGTERM to every process of the job step at once: the engine
    must outlive it, so that the worker can abort what is in flight and record the partial outputs."""
    from toolkit.engines.endpoints import abort_requests, read_load
    from toolkit.engines.process_group import group_members

    spec = load_spec(make_job(tmp_path, toy_tokenizer("kimi"), stub={"token_delay_s": 0.02}))
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[5, 6, 7])

    async def go():
        e.start()
        http = HttpClient(e.url, api_key=e.api_key)
        try:
            await e.wait_ready(http, poll_s=0.2)
            body = json.dumps(
                {
                    "rid": "r-long",
                    "input_ids": [5, 6, 7],
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
                }
            ).encode()
            answer = asyncio.ensure_future(http.request("POST", "/generate", body, timeout=60))
            for _ in range(
                300
            ):  # the request in flight on the server (its /v1/loads), at most 30 s
                load = await read_load(http)
                if load is not None and load.running >= 1:
                    break
                await asyncio.sleep(0.1)
            assert load is not None and load.running >= 1, "the request never reached the server"
            members = group_members(e.proc.pid)
            assert len(members) >= 2, "the stub runs a scheduler child, as SGLang does"
            assert all(signal.SIGTERM in _ignored(pid) for pid in members if pid != e.proc.pid)
            for pid in members:
                os.kill(pid, signal.SIGTERM)
            await asyncio.sleep(1.5)  # the server's watchdog looks every second for a dead child
            assert e.alive(), f"the engine died of Slurm's SIGTERM (exit code {e.exit_code()})"
            await abort_requests(http, ["r-long"])
            status, data = await answer
            return status, json.loads(data)
        finally:
            http.close()

    try:
        status, out = asyncio.run(go())
    finally:
        e.stop()
    assert (
        status == 200
        and out["meta_info"]["finish_reason"]["type"] == "abort"
        and 0 < len(out["output_ids"]) < 4000
    )
    assert e.proc is None


def test_an_engine_that_never_became_ready_is_killed_at_once(tmp_path, toy_tokenizer):
    """Still loading, it holds nothing and ignores SIGTERM (SGLang installs its handler once it serves): no
    shutdown_timeout_s of waiting for a SIGTERM that cannot work."""
    import time

    spec = load_spec(
        make_job(
            tmp_path,
            toy_tokenizer("kimi"),
            stub={"load_delay_s": 120},
            engine={"shutdown_timeout_s": 120},
        )
    )
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[5, 6, 7])
    e.start()
    proc = e.proc
    t0 = time.monotonic()
    e.stop()
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 60


def test_sglang_starts_without_its_crash_diagnostics_unless_asked(tmp_path, toy_tokenizer):
    """SGLang sleeps 5 s before "crash diagnostics" at every stop and crash unless both are 0."""
    tok = toy_tokenizer("kimi")
    env = make_engine(sglang_spec(tmp_path, tok), tmp_path / "a.log", probe_ids=[1]).command_env()
    assert (
        env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "0"
        and env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    )
    spec = sglang_spec(tmp_path / "b", tok, env={"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})
    env = make_engine(spec, tmp_path / "b.log", probe_ids=[1]).command_env()
    assert (
        env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"
        and env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    )


# -- an engine over several nodes -------------------------------------------------------------------------------
def multi_node_spec(tmp_path, tokenizer, nodes=2, gpus_per_node=8, **engine):
    job = make_job(
        tmp_path,
        tokenizer,
        n=2,
        engine={"kind": "sglang", "nodes": nodes, "tp_size": nodes * gpus_per_node, **engine},
        model={"path": str(tokenizer), "trust_remote_code": True},
        slurm={"gpus_per_node": gpus_per_node},
    )
    return load_spec(job)


def test_multi_node_argv_golden(tmp_path, toy_tokenizer):
    """nodes = 2: one srun step, one rank per node; each rank runs the same SGLang line plus its rank flags."""
    from toolkit.engines.rank import rank_argv

    tok = toy_tokenizer("kimi")
    spec = multi_node_spec(
        tmp_path,
        tok,
        extra_args=["--mem-fraction-static", "0.85"],
        env={"NCCL_SOCKET_IFNAME": "ib0"},
    )
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    e.port, e.api_key = 31234, "k" * 32
    e.dist_init_addr, e.first_host, e.step_name = (
        "10.1.2.3:23456",
        "gpu-a01",
        "toolkit-engine-0f0f0f0f",
    )
    py = sys.executable
    # no key: each rank writes the file --config reads on its own node, from the step's environment
    server = [
        py,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(tok),
        "--tp-size",
        "16",
        "--dp-size",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        "31234",
        "--trust-remote-code",
        "--mem-fraction-static",
        "0.85",
    ]
    assert e.key_env() == {KEY_ENV: "k" * 32}
    assert e.argv() == [
        "srun",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--mpi=none",
        "--label",
        "--unbuffered",
        "--job-name=toolkit-engine-0f0f0f0f",
        py,
        "-m",
        "toolkit.engines.rank",
        "--nnodes",
        "2",
        "--dist-init-addr",
        "10.1.2.3:23456",
        "--first-host",
        "gpu-a01",
        "--",
        *server,
    ]
    tail = ["--nnodes", "2", "--dist-init-addr", "10.1.2.3:23456"]
    assert rank_argv(server, rank=0, nnodes=2, dist_init_addr="10.1.2.3:23456") == [
        *server,
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--dist-init-addr",
        "10.1.2.3:23456",
    ]
    assert rank_argv(server, rank=1, nnodes=2, dist_init_addr="10.1.2.3:23456") == [
        *server,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        "10.1.2.3:23456",
    ]
    assert tail[0] not in server, "the rank flags are the launcher's, not the engine's line"
    env = e.command_env()
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and "127.0.0.1" in env["NO_PROXY"], (
        "srun passes this env to every rank"
    )
    # one node keeps the plain command line
    spec.engine.nodes = 1
    assert e.argv() == server


def test_multi_node_layout_on_one_node_for_tests(tmp_path, toy_tokenizer, monkeypatch):
    monkeypatch.setenv("TOOLKIT_ENGINE_RANKS_PER_NODE", "2")
    e = make_engine(
        multi_node_spec(tmp_path, toy_tokenizer("kimi"), gpus_per_node=1),
        tmp_path / "s.log",
        probe_ids=[1],
    )
    assert e.srun_argv()[1:4] == ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2"]


def test_multi_node_needs_an_allocation_of_enough_nodes(tmp_path, toy_tokenizer, monkeypatch):
    spec = multi_node_spec(tmp_path, toy_tokenizer("kimi"))
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    for var in ("SLURM_JOB_ID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(
        EngineError, match=r"nodes = 2: the engine is started with `srun` .* outside one"
    ):
        e.start()
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "1")
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    with pytest.raises(EngineError, match=r"allocation has 1 node\(s\)"):
        e.start()
    assert e.proc is None


def test_dist_init_port_is_below_the_ephemeral_range_and_free():
    import socket

    from toolkit.engines.base import ephemeral_low, tcp_free
    from toolkit.engines.rendezvous import dist_init_port

    for _ in range(5):
        port = dist_init_port(4)
        assert 20000 <= port and port + 12 < ephemeral_low()
        assert all(tcp_free(p) for p in range(port, port + 12))
    with socket.socket() as s:  # a taken port is never chosen
        s.bind(("", 0))
        s.listen()


def test_an_engines_port_is_below_the_ephemeral_range_and_a_taken_one_is_passed_over():
    """A server binds its port once loaded: a port of the ephemeral range could be an outgoing connection's by then."""
    import random
    import socket

    from toolkit.engines.base import ephemeral_low, free_port, tcp_free

    class Picks(random.Random):
        def __init__(self, ports):
            super().__init__()
            self.ports = list(ports)

        def randint(self, a, b):
            return self.ports.pop(0)

    taken = free_port()
    assert 20000 <= taken < ephemeral_low()
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        assert not tcp_free(taken)
        other = free_port()
        assert free_port(rng=Picks([taken, other])) == other


@pytest.mark.parametrize(
    "node_addr, resolved, routes, expected",
    [
        (
            "10.1.2.3",
            ["127.0.1.1"],
            [],
            "10.1.2.3",
        ),  # Slurm's NodeAddr, whatever the name resolves to
        (
            "gpu-a01",
            ["127.0.1.1", "10.1.2.3"],
            [],
            "10.1.2.3",
        ),  # NodeAddr a name: its first non-loopback address
        (
            "gpu-a01",
            ["127.0.1.1"],
            ["127.0.0.1", "10.1.2.3"],
            "10.1.2.3",
        ),  # Debian's own name: the route to the others
        ("", ["192.168.7.5"], [], "192.168.7.5"),  # Slurm did not answer: the node's name
        (
            "fd00::5",
            [],
            ["10.1.2.3"],
            "10.1.2.3",
        ),  # IPv6 (SGLang's rendezvous hangs on it): the route
    ],
)
def test_the_rendezvous_is_the_first_nodes_address_as_slurm_knows_it(
    node_addr, resolved, routes, expected
):
    from toolkit.engines.rendezvous import rendezvous_host

    assert rendezvous_host("gpu-a01", node_addr, resolved, routes) == expected


@pytest.mark.parametrize(
    "node_addr, resolved, routes, said",
    [
        ("127.0.0.1", [], [], "NodeAddr 127.0.0.1"),
        ("gpu-a01", ["127.0.1.1"], [], "NodeAddr gpu-a01; gpu-a01 resolves to 127.0.1.1 here"),
        (
            "",
            ["127.0.1.1"],
            ["127.0.0.1"],
            "no NodeAddr (Slurm did not answer); gpu-a01 resolves to 127.0.1.1 here; "
            "its address toward the other nodes is 127.0.0.1",
        ),
        ("0.0.0.0", [], [], "NodeAddr 0.0.0.0"),
    ],
)
def test_a_first_node_known_only_by_loopback_is_an_error_not_a_rendezvous(
    node_addr, resolved, routes, said
):
    from toolkit.engines.rendezvous import rendezvous_host

    with pytest.raises(EngineError) as err:
        rendezvous_host("gpu-a01", node_addr, resolved, routes)
    assert (
        f"no address of gpu-a01, the first node (rank 0), that the other nodes can reach — {said}: "
        in str(err.value)
    )
    assert "NodeAddr= in slurm.conf" in str(err.value)


def test_a_multi_node_engine_meets_at_the_first_nodes_nodeaddr_where_its_own_name_is_127_0_1_1(
    tmp_path, toy_tokenizer, monkeypatch
):
    """As on a Debian node: its hostname resolves to 127.0.1.1 and the other node's name to nothing; Slurm knows
    both by NodeAddr. The engine's --dist-init-addr is the first node's NodeAddr (issue 24: it was 127.0.1.1)."""
    import socket
    import subprocess

    from toolkit.engines import sglang

    e = make_engine(
        multi_node_spec(tmp_path, toy_tokenizer("kimi")), tmp_path / "server.log", probe_ids=[1]
    )
    for var, value in {
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "gpu-a[01-02]",
        "SLURMD_NODENAME": "gpu-a01",
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    nodes = (
        "NodeName=gpu-a01 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.1.2.3 NodeHostName=gpu-a01 Version=22.05.8\n"
        "NodeName=gpu-a02 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.1.2.4 NodeHostName=gpu-a02 Version=22.05.8\n"
    )
    answers = {
        ("scontrol", "show", "hostnames"): "gpu-a01\ngpu-a02\n",
        ("scontrol", "show", "node"): nodes,
    }

    def run(argv, **kw):
        return subprocess.CompletedProcess(argv, 0, answers[tuple(argv[:3])], "")

    def getaddrinfo(host, *a, **kw):
        if host != "gpu-a01":
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]

    monkeypatch.setattr(sglang.subprocess, "run", run)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-a01")
    monkeypatch.setattr(socket, "gethostbyname", lambda host: getaddrinfo(host)[0][4][0])
    e._prepare_step()
    assert e.dist_init_addr.rsplit(":", 1)[0] == "10.1.2.3" and e.first_host == "gpu-a01"
    # Slurm knows the node only by its name, and here that name is loopback: said, not launched
    answers[("scontrol", "show", "node")] = nodes.replace("NodeAddr=10.1.2.3", "NodeAddr=gpu-a01")
    with pytest.raises(
        EngineError, match=r"NodeAddr gpu-a01; gpu-a01 resolves to 127\.0\.1\.1 here: only loopback"
    ):
        e._prepare_step()
    # the worker on another node than the allocation's first: rank 0 could not run beside it
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-a02")
    with pytest.raises(
        EngineError, match="the worker runs on gpu-a02, not on the allocation's first node gpu-a01"
    ):
        e._prepare_step()


def test_node_addrs_are_read_from_scontrol_show_node():
    from toolkit.engines.rendezvous import parse_node_addrs

    out = (
        "NodeName=host1 Arch=x86_64 CoresPerSocket=1  CPUAlloc=0 Gres=gpu:2 NodeAddr=10.65.177.11 "
        "NodeHostName=host1 Version=22.05.8 OS=Linux\nNodeName=host2 NodeAddr=10.65.177.12 NodeHostName=host2\n"
        "Node nosuch not found\n"
    )
    assert parse_node_addrs(out) == {"host1": "10.65.177.11", "host2": "10.65.177.12"}


@pytest.mark.parametrize(
    "engine, slurm, message",
    [
        (
            {"nodes": 2, "tp_size": 8},
            {"gpus_per_node": 8},
            "uses 8 GPUs, 4 per node, but [slurm] gpus_per_node = 8: "
            "SGLang's --tp-size counts the GPUs of all nodes; set tp_size = 16 for 2 nodes of 8 GPUs",
        ),
        (
            {"nodes": 3, "tp_size": 8},
            {"gpus_per_node": 8},
            "tp_size = 8 does not split over nodes = 3",
        ),
        (
            {"nodes": 2, "tp_size": 16, "dp_size": 2},
            {"gpus_per_node": 8},
            "tp_size = 16, dp_size = 2 uses 32 GPUs",
        ),
        ({"nodes": 0}, {}, "[engine] nodes must be >= 1"),
        (
            {"nodes": 2, "kind": "stub", "tp_size": 16},
            {"gpus_per_node": 8},
            'nodes = 2 needs kind = "sglang"',
        ),
    ],
)
def test_multi_node_spec_is_checked_at_load(tmp_path, toy_tokenizer, engine, slurm, message):
    job = make_job(
        tmp_path, toy_tokenizer("kimi"), engine={"kind": "sglang", **engine}, slurm=slurm
    )
    with pytest.raises(SpecError) as err:
        load_spec(job)
    assert message in str(err.value)


def test_multi_node_spec_accepts_sglang_layouts(tmp_path, toy_tokenizer):
    tok = toy_tokenizer("kimi")
    assert (
        load_spec(
            make_job(
                tmp_path / "a",
                tok,
                engine={"kind": "sglang", "nodes": 2, "tp_size": 16},
                slurm={"gpus_per_node": 8},
            )
        ).engine.nodes
        == 2
    )
    assert (
        load_spec(
            make_job(
                tmp_path / "b",
                tok,
                engine={
                    "kind": "sglang",
                    "nodes": 2,
                    "tp_size": 16,
                    "dp_size": 8,
                    "extra_args": ["--enable-dp-attention"],
                },
                slurm={"gpus_per_node": 8},
            )
        ).engine.dp_size
        == 8
    )
    assert load_spec(make_job(tmp_path / "c", tok)).engine.nodes == 1


def test_rank_flags_are_the_toolkits():
    problems = check_extra_args(["--nnodes", "2", "--node-rank", "1", "--nccl-init-addr", "h:1"])
    assert (
        "--nnodes is set by the toolkit; remove it from extra_args and set [engine] nodes"
        in problems[0]
    )
    assert "--node-rank is set by the toolkit" in problems[1]
    assert "--nccl-init-addr is set by the toolkit" in problems[2]


def _rank(tmp_path, procid, *server, host="gpu-a01", key="SECRET"):
    import subprocess

    env = {
        **os.environ,
        "SLURM_PROCID": str(procid),
        "SLURMD_NODENAME": host,
        KEY_ENV: key,
        "PYTHONPATH": str(Path(__file__).parents[2]),
        "TMPDIR": str(tmp_path),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit.engines.rank",
            "--nnodes",
            "2",
            "--dist-init-addr",
            "10.1.2.3:23456",
            "--first-host",
            "gpu-a01",
            "--",
            *server,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )


def test_rank_launcher_runs_the_server_with_its_rank_and_reports_any_exit(tmp_path):
    show = [
        sys.executable,
        "-c",
        "import json, os, signal, sys; c = sys.argv[-1]; print(json.dumps([sys.argv[1:], "
        "signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN, open(c).read(), oct(os.stat(c).st_mode & 0o777), "
        f"'{KEY_ENV}' in os.environ]))",
        "--mem-fraction-static",
        "0.8",
    ]
    r = _rank(tmp_path, 1, *show, key="0123abcd")
    assert r.returncode == 1 and "exited (code 0) although nobody stopped it" in r.stderr, (
        "srun must end the step"
    )
    args, usr2_ignored, config, mode, key_in_env = json.loads(r.stdout.splitlines()[-1])
    assert args[:-1] == [
        "--mem-fraction-static",
        "0.8",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--dist-init-addr",
        "10.1.2.3:23456",
        "--config",
    ]
    assert config == 'api-key: "0123abcd"\n' and mode == "0o600", (
        "the key in a file of this node only the user reads"
    )
    assert not key_in_env, "the server's environment does not hold the key"
    assert not Path(args[-1]).exists() and not Path(args[-1]).parent.exists(), (
        "the file goes when the server ends"
    )
    assert Path(args[-1]).is_relative_to(tmp_path), "in the node's temporary directory ($TMPDIR)"
    assert usr2_ignored
    assert (
        "engine rank 1 of 2 on gpu-a01" in r.stdout and "0123abcd" not in r.stdout.splitlines()[0]
    )
    r = _rank(tmp_path, 1, *show, key="")
    assert r.returncode == 2 and "no API key in the step's environment" in r.stderr, (
        "never a server without a key"
    )
    r = _rank(
        tmp_path, 0, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    )
    assert r.returncode == 137 and "killed by SIGKILL" in r.stderr
    r = _rank(tmp_path, 0, sys.executable, "-c", "pass", host="gpu-a02")
    assert r.returncode == 2 and "rank 0 must run on the worker's node gpu-a01" in r.stderr
    r = _rank(tmp_path, 2, sys.executable, "-c", "pass")
    assert r.returncode == 2 and "rank out of range" in r.stderr


def _http_status(url: str) -> int | None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None  # nothing listens


@pytest.mark.slow
def test_the_fake_sglangs_rank0_is_not_ready_before_every_rank_has_joined(tmp_path, toy_tokenizer):
    """As SGLang with --nnodes 2: rank 0 serves nothing (/ready and /health_generate do not answer 200) until rank 1
    has joined it at --dist-init-addr; then it is ready, and records where rank 1 joined from."""
    import subprocess
    import time

    from toolkit.engines.base import free_port
    from toolkit.engines.rendezvous import dist_init_port

    port, rendezvous = free_port(), dist_init_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(FAKE_SGLANG), str(Path(__file__).resolve().parents[2])]),
        "FAKE_SGLANG_RECORD": str(tmp_path / "rank{rank}.json"),
    }
    argv = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(toy_tokenizer("kimi")),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{rendezvous}",
    ]
    launch = lambda rank: subprocess.Popen(
        [*argv, "--node-rank", str(rank)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    ranks = [launch(0)]
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "rank0.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(
            2.0
        )  # longer than the stub's load and warm-up (1 s in all) would take, were it started
        assert ranks[0].poll() is None
        assert (
            _http_status(url + "/ready") is None and _http_status(url + "/health_generate") is None
        )
        ranks.append(launch(1))  # on rank 0's node (the port is rank 0's): no dummy health server
        deadline = time.monotonic() + 30
        while _http_status(url + "/ready") != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _http_status(url + "/ready") == 200 and _http_status(url + "/health_generate") == 200
        assert json.loads((tmp_path / "rank0.json").read_text())["joined"] == {"1": "127.0.0.1"}
    finally:
        for p in ranks:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ---------------------------------------------------------------------------------------------------
# the Python SGLang starts with: the environment the node's setup prepares, or the one the job names
# ---------------------------------------------------------------------------------------------------
def node_env(root: Path, *, with_sglang: bool) -> Path:
    """A virtualenv as a GPU node's `source ~/venvs/sglang/bin/activate` prepares: its own prefix, the fake
    `sglang` importable (with_sglang), and the toolkit with its requirements (the test's own site-packages)."""
    import site

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    lib = next((root / "lib").glob("python3*")) / "site-packages"
    paths = ([str(FAKE_SGLANG)] if with_sglang else []) + [
        str(Path(__file__).parents[2]),
        *site.getsitepackages(),
    ]
    (lib / "node.pth").write_text("\n".join(paths) + "\n")
    return root


def activated(venv: Path) -> dict[str, str]:
    """The environment after `source VENV/bin/activate`."""
    return {
        **os.environ,
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
    }


def test_sglang_starts_with_the_python_the_node_setup_activated_when_it_has_sglang(tmp_path):
    from toolkit.engines.sglang_python import engine_python

    node = node_env(tmp_path / "sglang-env", with_sglang=True)
    python, why = engine_python(None, activated(node))
    assert python == str(node / "bin" / "python3") and "first python3 on PATH" in why
    bare = node_env(
        tmp_path / "bare-env", with_sglang=False
    )  # an environment without sglang: not that one
    assert engine_python(None, activated(bare)) == (sys.executable, "the toolkit's own Python")
    # nothing activated: the toolkit's own Python
    assert engine_python(None, {**os.environ, "PATH": os.defpath})[0] == sys.executable


def test_engine_python_names_the_interpreter_and_a_missing_one_is_said(
    tmp_path, toy_tokenizer, monkeypatch
):
    from toolkit.engines.sglang_python import engine_python

    node = node_env(tmp_path / "sglang-env", with_sglang=True)
    named = str(node / "bin" / "python3")
    assert engine_python(named, dict(os.environ)) == (named, "[engine] python")
    monkeypatch.setenv(
        "HOME", str(tmp_path)
    )  # a path from the home folder, as the template shows it
    assert engine_python("~/sglang-env/bin/python3", dict(os.environ)) == (named, "[engine] python")
    with pytest.raises(
        EngineError,
        match=r"\[engine\] python = '/nowhere/python3': no such interpreter on this node",
    ):
        engine_python("/nowhere/python3", dict(os.environ))
    # the launch line carries it, and the spec refuses it where the toolkit does not launch SGLang itself
    spec = sglang_spec(tmp_path / "a", toy_tokenizer("kimi"), python=named)
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    e.port, e.api_key = 31234, "k" * 32
    assert e.argv()[:3] == [named, "-m", "sglang.launch_server"]
    job = make_job(tmp_path / "b", toy_tokenizer("kimi"), engine={"kind": "stub", "python": named})
    with pytest.raises(
        SpecError, match=r"\[engine\] python = .*only for kind = \"sglang\" without `command`"
    ):
        load_spec(job)


@pytest.mark.slow
def test_the_engine_starts_in_the_activated_environment_though_the_worker_runs_in_another(
    tmp_path, toy_tokenizer
):
    """The worker's own Python has no sglang (a login node's); the node's environment has it: SGLang is launched
    with the latter (its record says which Python ran it), and serves the shard."""
    node = node_env(tmp_path / "sglang-env", with_sglang=True)
    record = tmp_path / "seen.json"
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=4,
        engine={
            "kind": "sglang",
            "shutdown_timeout_s": 5,
            "env": {"FAKE_SGLANG_RECORD": str(record)},
        },
        sampling={"max_new_tokens": 16},
    )
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is not None)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, (
        "the worker's Python has no sglang"
    )
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "run", str(job)],
        env=activated(node),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(record.read_text())
    assert seen["prefix"] == str(node) and seen["python"] == str(node / "bin" / "python3")
    assert f"SGLang starts with {node / 'bin' / 'python3'} (the first python3 on PATH" in r.stderr
