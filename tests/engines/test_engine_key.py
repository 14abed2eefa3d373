"""The engine's key stays secret: on no process's command line while a job runs, in no file of the run directory
(logs included), not in run.json, `status --json` or `submit --dry-run`; an external server's key is read from an
environment variable or a file the job names, never written in the job."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from keyscan import files_holding, on_command_lines, watch_run

from jobfiles import make_job
from toolkit.engines.base import EngineError
from toolkit.engines.keys import PREFIX, LogPump, sweep
from toolkit.engines.kinds import make_engine
from toolkit.engines.stub import start_standalone
from toolkit.job.spec import load_spec
from toolkit.job.specchecks import key_source_warnings
from toolkit.job.specerrors import SpecError

REPO = Path(__file__).resolve().parents[2]


def toolkit(
    *args: str, env: dict | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.slow
def test_a_stub_job_puts_its_key_on_no_command_line_and_in_no_file_of_the_run(
    tmp_path, toy_tokenizer
):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=16,
        shards=2,
        stub={"token_delay_s": 0.01},
        sampling={"max_new_tokens": 48},
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "run", str(job), "--parallel", "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        seen = watch_run(proc, "toolkit.stub", timeout=240)
        out = proc.communicate(timeout=240)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    key = seen.get("key")
    assert key and len(key) == 32, f"no stub started with --config seen: {seen}"
    assert seen["scans"] >= 3, "the command lines were read while the engine ran"
    assert seen["found"] == [], "the key is on a command line every user of the node can read"
    assert (seen["unauthorized"], seen["authorized"]) == (401, 200), (
        "the key in the file is the key that guards it"
    )
    assert not seen["folder"].exists(), "the key's folder goes when the engine stops"
    run = tmp_path / "run"
    assert (run / "logs").is_dir() and list((run / "logs").glob("*.server.log"))
    assert files_holding(run, key) == []
    assert key not in out


def test_the_log_pump_masks_a_key_cut_between_two_reads(tmp_path):
    key = "0123456789abcdef" * 2
    read_fd, write_fd = os.pipe()
    log = tmp_path / "server.log"
    pump = LogPump(read_fd, log, key)
    for part in (
        b"server_args={'api_key': '" + key[:7].encode(),
        key[7:].encode() + b"', 'port': 1}\n",
        b"tail " + key[:5].encode(),
    ):
        os.write(write_fd, part)
    os.close(write_fd)
    assert pump.join(10)
    text = log.read_text()
    assert key not in text and "'api_key': '" + "*" * 32 + "'" in text
    assert text.endswith("tail " + key[:5]), (
        "a start of the key at the very end is written once the pipe closes"
    )


def test_key_folders_of_processes_that_are_gone_are_swept(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{PREFIX}{gone.pid}-abcd"
    live = tmp_path / f"{PREFIX}{os.getpid()}-efgh"
    parent = tmp_path / f"{PREFIX}{os.getppid()}-ijkl"
    other = tmp_path / "toolkit-engine-key-x-1"
    for folder in (dead, live, parent, other):
        folder.mkdir()
        (folder / "server-args.yaml").write_text('api-key: "k"\n')
    assert sweep(tmp_path) == [dead]
    assert not dead.exists() and live.exists() and parent.exists() and other.exists()


def external_job(tmp_path, tok, url: str, **engine):
    return make_job(
        tmp_path,
        tok,
        n=6,
        engine={"kind": "external", "url": url, **engine},
        sampling={"max_new_tokens": 16},
    )


@pytest.fixture
def keyed_stub(tmp_path, toy_tokenizer):
    """A stub server someone else started, with a key given in a 0600 --config file: (url, key)."""
    key = secrets.token_hex(16)
    config = tmp_path / "server.yaml"
    config.write_text(f'api-key: "{key}"\n')
    config.chmod(0o600)
    proc, url = start_standalone(
        str(toy_tokenizer("kimi")), "--config", str(config), "--fixed-output-tokens", "8"
    )
    try:
        yield url, key
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.mark.slow
def test_an_external_servers_key_from_the_environment_is_kept_nowhere(
    tmp_path, toy_tokenizer, keyed_stub
):
    url, key = keyed_stub
    tok = toy_tokenizer("kimi")
    job = external_job(tmp_path, tok, url, api_key_env="TEST_SERVER_KEY")
    # the dry run is shown without a cluster (a real one would check the job's GPUs against its partition)
    dry = toolkit(
        "submit",
        str(job),
        "--dry-run",
        env={"TEST_SERVER_KEY": key, "SLURM_CONF": str(tmp_path / "no-cluster" / "slurm.conf")},
    )
    assert dry.returncode == 0 and "#SBATCH" in dry.stdout, dry.stdout + dry.stderr
    r = toolkit("run", str(job), env={"TEST_SERVER_KEY": key})
    assert r.returncode == 0, r.stdout + r.stderr
    run = tmp_path / "run"
    assert '"api_key_env": "TEST_SERVER_KEY"' in (run / "run.json").read_text()
    status = toolkit("status", str(run), "--json")
    assert status.returncode == 0 and status.stdout.startswith("{"), status.stdout + status.stderr
    for said in (r.stdout, r.stderr, status.stdout, status.stderr, dry.stdout, dry.stderr):
        assert key not in said
    assert files_holding(run, key) == []
    assert on_command_lines(key) == []
    # without the variable the worker cannot authenticate: it says where the key was to come from
    job = external_job(tmp_path / "again", tok, url, api_key_env="TEST_SERVER_KEY")
    no = toolkit("run", str(job), env={"TEST_SERVER_KEY": ""})
    assert no.returncode != 0
    assert (
        "the environment variable TEST_SERVER_KEY is not set (or empty) where the worker runs"
        in no.stdout + no.stderr
    )


@pytest.mark.slow
def test_an_external_servers_key_from_a_file(tmp_path, toy_tokenizer, keyed_stub):
    url, key = keyed_stub
    key_file = tmp_path / "secret" / "key"
    key_file.parent.mkdir()
    key_file.write_text(key + "\n")
    key_file.chmod(0o644)
    job = external_job(tmp_path, toy_tokenizer("kimi"), url, api_key_file="secret/key")
    check = toolkit("check", str(job))
    assert check.returncode == 0, check.stderr
    assert (
        f"[engine] api_key_file {key_file} may be read by other users (mode -rw-r--r--)"
        in check.stdout + check.stderr
    )
    key_file.chmod(0o600)
    r = toolkit("run", str(job))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "may be read by other users" not in r.stdout + r.stderr
    assert files_holding(tmp_path / "run", key) == []


def test_the_engine_reads_the_key_where_the_job_says(tmp_path, toy_tokenizer, monkeypatch):
    tok = toy_tokenizer("kimi")
    (tmp_path / "k").write_text("  sekret\n")
    spec = load_spec(external_job(tmp_path, tok, "http://127.0.0.1:9", api_key_file="k"))
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    e.start()
    assert e.api_key == "sekret"
    (tmp_path / "k").write_text("")
    with pytest.raises(EngineError, match="is empty: write the server's key in it"):
        e.start()
    (tmp_path / "k").unlink()
    with pytest.raises(EngineError, match="cannot be read here"):
        e.start()
    spec = load_spec(
        external_job(tmp_path / "env", tok, "http://127.0.0.1:9", api_key_env="TK_TEST_KEY")
    )
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[1])
    monkeypatch.setenv("TK_TEST_KEY", "from-env")
    e.start()
    assert e.api_key == "from-env"
    monkeypatch.delenv("TK_TEST_KEY")
    with pytest.raises(EngineError, match="export it before `toolkit run` or `toolkit submit`"):
        e.start()


def test_a_command_that_puts_the_key_on_its_command_line_is_warned_about(tmp_path, toy_tokenizer):
    command = ["srv", "--port", "{port}", "--api-key", "{api_key}"]
    spec = load_spec(
        make_job(
            tmp_path, toy_tokenizer("kimi"), n=2, engine={"kind": "sglang", "command": command}
        )
    )
    assert any(
        "{api_key} puts the engine's key on its command line" in w
        for w in key_source_warnings(spec.engine)
    )
    spec.engine.command = ["srv", "--port", "{port}", "--api-key-file", "{api_key_file}"]
    assert key_source_warnings(spec.engine) == []


@pytest.mark.parametrize(
    "engine, message",
    [
        (
            {"kind": "external", "url": "http://127.0.0.1:9", "api_key": "sekret"},
            ":\\d+: \\[engine\\] api_key: a key written here stays in clear in the job file and in the run's run.json",
        ),
        (
            {"kind": "stub", "api_key_env": "K"},
            'api_key_env is for kind = "external": an engine the toolkit starts '
            "gets a fresh key at each start",
        ),
        (
            {
                "kind": "external",
                "url": "http://127.0.0.1:9",
                "api_key_env": "K",
                "api_key_file": "k",
            },
            "api_key_env and api_key_file are both set",
        ),
        (
            {"kind": "external", "url": "http://127.0.0.1:9", "api_key_env": "0123abcd-key"},
            "is not an environment variable's name",
        ),
        (
            {"kind": "external", "url": "http://127.0.0.1:9", "api_key_file": "nowhere"},
            "api_key_file .*nowhere does not exist",
        ),
    ],
)
def test_a_job_never_holds_a_key(tmp_path, toy_tokenizer, engine, message):
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=2, engine=engine)
    with pytest.raises(SpecError, match=message) as err:
        load_spec(job)
    assert "sekret" not in str(err.value)


@pytest.mark.slow
def test_an_engine_restarted_gets_a_new_key_and_the_old_ones_file_is_gone(tmp_path, toy_tokenizer):
    from toolkit.engines.client import HttpClient

    spec = load_spec(make_job(tmp_path, toy_tokenizer("kimi"), n=2))
    e = make_engine(spec, tmp_path / "server.log", probe_ids=[5, 6])
    folders, keys = [], []
    try:
        for _ in range(2):
            e.start()
            folders.append(e.key_files.folder)
            keys.append(e.api_key)

            async def ready():
                http = HttpClient(e.url, api_key=e.api_key)
                try:
                    await e.wait_ready(http, poll_s=0.1)
                    await e.probe(http)
                finally:
                    http.close()

            asyncio.run(ready())
            assert on_command_lines(e.api_key) == []
            e.stop()
            assert not folders[-1].exists()
    finally:
        e.stop()
    assert keys[0] != keys[1]
    log = (tmp_path / "server.log").read_text()
    assert log.count("engine start #") == 2 and "--config" in log
    assert not any(k in log for k in keys)
