"""The toolkit against real SGLang 0.5.23 on the CPU (tests/realsglang.py): what the stub stands in for.

Each test drives the toolkit's own commands (with the SGLang venv's Python, as a GPU node runs them) against a
real server: a whole job, exactness of the stored ids, stops by Slurm's signals and the resume, a crash and a
hang of the engine, what it refuses, and an external server sized by `concurrency = "auto"`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from keyscan import files_holding, watch_run
from realsglang import CPU_ENV, python, sglang_job, toolkit

from jobfiles import write_prompts
from toolkit.engines.process_group import group_members
from toolkit.formats.frames import read_shard
from toolkit.formats.progress import read_progress
from toolkit.formats.records import unpack_ids
from toolkit.formats.rundir import RunDir

pytestmark = pytest.mark.sglang


def _records(run: Path, shards: int = 1) -> list:
    return [rec for k in range(shards) for rec in read_shard(run / "shards" / f"{k:05d}.zst")]


def _newest(records: list) -> dict:
    out = {}
    for rec in records:
        out[rec.id] = rec
    return out


def _wait(cond, timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the worker exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _run_in_background(job: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(python()), "-m", "toolkit", "run", str(job)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _generating(rd: RunDir, shard: int = 0, at_least: int = 0):
    p = read_progress(rd, shard)
    return p if p is not None and p.state == "generating" and p.done >= at_least else None


def _running_here(rd: RunDir, pid: int | None = None, shard: int = 0):
    """The progress of the worker (`pid`, when given) once the server it reads (/v1/loads) runs requests of it: in
    flight, with the tokens of their prefill and more (SGLang makes the first output token with the prefill)."""
    p = read_progress(rd, shard)
    ok = (
        p is not None
        and pid in (None, p.pid)
        and p.state == "generating"
        and (p.running or 0) > 0
        and (p.kv_usage or 0) > 0
    )
    return p if ok else None


def _engine_pid(rd: RunDir, start: int) -> int:
    """The pid of the engine's `start`-th launch, from the shard's log."""
    pids = re.findall(r"engine sglang started: pid (\d+)", rd.log_file(0).read_text())
    return int(pids[start - 1])


def _post(url: str, key: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------------------------------------------------------
def test_a_whole_job_of_two_shards_check_run_merge_audit_every_export_and_exact_ids(
    tmp_path, tiny_model, sglang_server
):
    job = sglang_job(tmp_path, tiny_model, n=12, shards=2, sampling={"max_new_tokens": 48})
    assert "ok" in toolkit("check", str(job)).stdout
    r = toolkit("run", str(job))
    run = tmp_path / "run"
    assert "audit of run t" in r.stdout and "PASSED" in r.stdout
    records = _records(run, 2)
    assert sorted(rec.id for rec in records) == [f"p{i:04d}" for i in range(12)]
    assert all(rec.status == "ok" and 0 < rec.n_output <= 48 for rec in records)
    for fmt, name in (
        ("jsonl", "out.jsonl"),
        ("parquet", "out.parquet"),
        ("tokens", "tok.jsonl"),
        ("conversations", "conv.jsonl"),
    ):
        # exports run on the login node: its Python, no SGLang. A random model's outputs are not training data (cut by
        # max_new_tokens, no think-end): the training formats keep them only when asked to
        keep = ["--include", "all"] if fmt in ("tokens", "conversations") else []
        subprocess.run(
            [
                sys.executable,
                "-m",
                "toolkit",
                "export",
                str(run),
                "--format",
                fmt,
                "-o",
                str(tmp_path / name),
                *keep,
            ],
            check=True,
            capture_output=True,
        )
        assert (tmp_path / name).stat().st_size > 0
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    status = toolkit("status", str(run))
    assert status.returncode == 0 and "shards: 2 completed" in status.stdout, status.stdout
    # Exactness: the stored prompt and output ids, replayed through a server at temperature 0, give the same ids.
    for rec in records:
        code, out = _post(
            sglang_server.url,
            sglang_server.api_key,
            "/generate",
            {
                "input_ids": unpack_ids(rec.prompt_ids),
                "sampling_params": {"max_new_tokens": 48, "temperature": 0},
            },
        )
        assert code == 200 and out["output_ids"] == unpack_ids(rec.output_ids), rec.id


def test_stops_by_usr2_and_by_a_step_wide_sigterm_save_what_is_in_flight_and_the_resume_continues_it(
    tmp_path, tiny_model
):
    # Work that cannot finish before the signal, however fast the machine: every output is exactly 1,200 tokens
    # (min_new_tokens: no early end), 16 of them 4 at a time — half a minute at the fastest this server has been
    # seen to run, many times the worker's 1 s poll of /v1/loads — and the signal is sent as soon as the progress
    # file says requests are running on the server. However slow the machine: no request timeout in the way.
    job = sglang_job(
        tmp_path,
        tiny_model,
        n=16,
        sampling={"max_new_tokens": 1200, "min_new_tokens": 1200},
        client={"concurrency": 4, "request_timeout_s": 1800},
    )
    rd = RunDir(tmp_path / "run")
    saved = {}
    for attempt, how in enumerate(("SIGUSR2", "SIGTERM"), start=1):
        proc = _run_in_background(job)
        p = _wait(lambda: _running_here(rd, proc.pid), 300, "requests running on the server", proc)
        assert p.done < p.total, "the shard is not finished when the signal comes"
        engine = _engine_pid(rd, attempt)
        # As Slurm does: the signal reaches every process of the step, the engine's included.
        for pid in [proc.pid, *group_members(engine)]:
            os.kill(pid, getattr(signal, how))
        assert proc.wait(120) == 3, f"{how}: the worker exits 3 (stopped)"
        p = read_progress(rd, 0)
        assert p.state == "stopped" and p.stop_signal == how
        saved[how] = p.partial_saved
        assert not group_members(engine), f"{how}: the engine is gone"
    assert saved["SIGUSR2"] > 0 and saved["SIGTERM"] > 0, saved
    toolkit("run", str(job))
    records = _records(rd.root)
    newest = _newest(records)
    assert sorted(newest) == [f"p{i:04d}" for i in range(16)]
    assert all(rec.status == "ok" for rec in newest.values())
    continued = [rec for rec in newest.values() if rec.segments > 1]
    assert continued, "outputs stopped mid-way were continued, not generated again"
    assert all(rec.n_output == rec.completion_tokens == 1200 for rec in newest.values())
    print(f"in flight saved: {saved}; {len(continued)} of 16 outputs continued")


def _scheduler(engine: int) -> int:
    for pid in group_members(engine):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "scheduler" in title:
            return pid
    raise AssertionError(f"no scheduler process in the engine's group: {group_members(engine)}")


def test_a_killed_scheduler_and_a_stopped_engine_are_restarted_and_the_shard_completes(
    tmp_path, tiny_model
):
    # Enough work left after the crash for the hang to come mid-shard: two requests at a time.
    job = sglang_job(
        tmp_path,
        tiny_model,
        n=24,
        sampling={"max_new_tokens": 200},
        client={"concurrency": 2},
        engine={"hang_timeout_s": 8, "max_restarts": 2},
    )
    rd = RunDir(tmp_path / "run")
    proc = _run_in_background(job)
    try:
        _wait(lambda: _generating(rd, at_least=2), 300, "two records", proc)
        first = _engine_pid(rd, 1)
        os.kill(_scheduler(first), signal.SIGKILL)  # a crash
        t_kill = time.time()
        _wait(
            lambda: read_progress(rd, 0).engine_restarts >= 1,
            60,
            "the crash noticed",
            proc,
        )
        noticed = time.time() - t_kill
        done = read_progress(rd, 0).done
        _wait(lambda: _generating(rd, at_least=done + 1), 300, "generation after the restart", proc)
        second = _engine_pid(rd, 2)
        for pid in group_members(second):  # a hang: every process of the engine stopped
            os.kill(pid, signal.SIGSTOP)
        _wait(
            lambda: read_progress(rd, 0).engine_restarts >= 2,
            120,
            "the hang noticed",
            proc,
        )
        assert proc.wait(600) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert sorted(_newest(_records(rd.root))) == [f"p{i:04d}" for i in range(24)]
    log = rd.log_file(0).read_text()
    assert log.count("engine died mid-shard") == 2 and "shard 0 complete: 24 records" in log
    stops = re.findall(r"engine stopped \(exit code (-?\d+)\)", log)
    assert stops[-1] == "0", "the last stop is SGLang's own graceful shutdown"
    t = [
        line[:23]
        for line in log.splitlines()
        if "rendered prompts waited" in line or "engine stopped" in line
    ]
    from datetime import datetime

    stop_s = (
        datetime.fromisoformat(t[-1].replace(",", "."))
        - datetime.fromisoformat(t[-2].replace(",", "."))
    ).total_seconds()
    print(f"crash noticed after {noticed:.1f} s; last engine stop took {stop_s:.1f} s")
    assert noticed < 15, "a crash is noticed within seconds (no 5-s crash diagnostics)"


# ---------------------------------------------------------------------------------------------------------------
def test_what_check_refuses_is_what_real_sglang_refuses(tmp_path, tiny_model, sglang_server):
    # Sampling: the check gives SGLang's own words, the same the server answers.
    job = sglang_job(tmp_path / "a", tiny_model, n=2, sampling={"top_p": 0})
    r = toolkit("check", str(job), check=False)
    code, out = _post(
        sglang_server.url,
        sglang_server.api_key,
        "/generate",
        {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "top_p": 0}},
    )
    assert r.returncode == 2 and code == 400 and out["error"]["message"] in r.stderr
    # A prompt longer than the model's context: refused by check, and by the server.
    prompts = write_prompts(tmp_path / "long.jsonl", 3)
    words = " ".join(["Consider the following."] * 3000)  # about 12,000 tokens
    with open(prompts, "a") as f:
        f.write(json.dumps({"id": "long", "messages": [{"role": "user", "content": words}]}) + "\n")
    job = sglang_job(
        tmp_path / "b", tiny_model, n=4, prompts=prompts, sampling={"max_new_tokens": 64}
    )
    r = toolkit("check", str(job), check=False)
    assert (
        r.returncode == 2
        and "do not fit the context length 8,192" in r.stderr
        and "long.jsonl:4" in r.stderr
    )
    from toolkit.job.chat import load_tokenizer, render
    from toolkit.job.inputs import scan_dataset
    from toolkit.job.spec import load_spec

    spec = load_spec(job)
    tok = load_tokenizer(spec.model)
    ids = render(tok, spec.model, list(scan_dataset(str(prompts), "d"))[3])
    code, out = _post(
        sglang_server.url,
        sglang_server.api_key,
        "/generate",
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 64}},
    )
    assert code == 400 and "context length" in out["error"]["message"]
    # A flag value SGLang's own parser refuses, judged by SGLang itself in its environment.
    from toolkit.engines.base import EngineError
    from toolkit.engines.sglang_python import check_argv_with_sglang

    with pytest.raises(EngineError, match="invalid choice: 'nope'"):
        check_argv_with_sglang(
            ["--model-path", str(tiny_model), "--reasoning-parser", "nope"],
            {**os.environ, **CPU_ENV},
            python=str(python()),
        )


def test_an_external_server_with_a_key_sized_by_auto_concurrency_and_its_load_in_status(
    tmp_path, tiny_model, sglang_server
):
    job = sglang_job(
        tmp_path,
        tiny_model,
        n=16,
        # Work that outlasts a few progress refreshes (2 s) and `toolkit status` calls however fast the server:
        # 480 tokens each, no early end, 2 at a time.
        sampling={"max_new_tokens": 480, "min_new_tokens": 480},
        engine={
            "kind": "external",
            "url": sglang_server.url,
            "api_key_env": "TEST_SGLANG_KEY",
            "extra_args": [],
            "env": {},
        },
        client={"concurrency": "auto"},
    )
    rd = RunDir(tmp_path / "run")
    # An external engine needs no SGLang here: the login node's own Python runs the job.
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "run", str(job)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TEST_SGLANG_KEY": sglang_server.api_key},
    )
    seen = []
    while proc.poll() is None:
        p = read_progress(rd, 0) if rd.progress_file(0).exists() else None
        if p is not None and p.state == "generating" and p.running is not None:
            status = subprocess.run(
                [sys.executable, "-m", "toolkit", "status", str(rd.root)],
                capture_output=True,
                text=True,
            ).stdout
            seen.append((p.running, p.queued, p.capacity, p.in_flight_target, status))
        time.sleep(0.5)
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    assert seen, "the progress file showed the server's load while generating"
    assert all(c == 2 for _, _, c, _, _ in seen), (
        "capacity from /server_info: --max-running-requests 2"
    )
    assert any(run == 2 and target == 4 for run, _, _, target, _ in seen), seen[:3]
    assert any(re.search(r"\b2/\d+\b", status) for *_, status in seen), (
        "status shows RUN/QUEUE from /v1/loads"
    )
    assert sorted(_newest(_records(rd.root))) == [f"p{i:04d}" for i in range(16)]
    assert files_holding(rd.root, sglang_server.api_key) == [], (
        "the server's key is kept nowhere in the run"
    )


def test_real_sglang_gets_its_key_on_no_command_line_and_leaves_it_in_no_file_of_the_run(
    tmp_path, tiny_model
):
    """SGLang reads the key from the 0600 file `--config` names: no process's command line holds it while the job
    runs, /generate answers 401 without it and 200 with it, and SGLang's own log line of its server arguments
    (which holds the key) reaches the server log masked."""
    job = sglang_job(tmp_path, tiny_model, n=8, sampling={"max_new_tokens": 48})
    proc = subprocess.Popen(
        [str(python()), "-m", "toolkit", "run", str(job)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen = watch_run(proc, "sglang.launch_server", timeout=600)
        out = proc.communicate(timeout=600)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    key = seen.get("key")
    assert key, f"no SGLang started with --config seen: {seen}"
    assert seen["scans"] >= 3 and seen["found"] == [], seen["found"]
    assert (seen["unauthorized"], seen["authorized"]) == (401, 200)
    assert not seen["folder"].exists(), "the key's folder goes when the engine stops"
    run = tmp_path / "run"
    server_log = (run / "logs" / "00000.server.log").read_text()
    assert "server_args=" in server_log and "'api_key': '" + "*" * 32 + "'" in server_log
    assert files_holding(run, key) == [] and key not in out


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slurm
@pytest.mark.parametrize("how", ["requeue", "scancel"])
def test_under_slurm_a_requeue_or_a_cancel_of_a_real_engine_saves_what_is_in_flight(
    tmp_path, tiny_model, how
):
    """On the local cluster: Slurm's SIGTERM reaches every process of the step (the worker and SGLang) at once;
    the share of the in-flight requests whose partial output reaches the shard file is measured."""
    if not os.environ.get("SLURM_CONF"):
        pytest.fail(
            'SLURM_CONF is not set: start the local cluster first, eval "$(slurm/start.sh)" (see README)'
        )
    from toolkit.cluster.jobs import read_jobs

    # as in the test above: 16 prompts of 1,200 tokens each (min_new_tokens), 4 at a time, the stop as soon as the
    # server runs requests (8 of 300 took 2 s on an idle machine: over before the worker's 1 s poll saw them)
    job = sglang_job(
        tmp_path,
        tiny_model,
        n=16,
        sampling={"max_new_tokens": 1200, "min_new_tokens": 1200},
        client={"concurrency": 4, "request_timeout_s": 1800},
        slurm={"gpus_per_node": 1, "cpus_per_task": 2, "time": "00:20:00", "merge_cpus": 1},
    )
    toolkit("submit", str(job))
    rd = RunDir(tmp_path / "run")
    task = read_jobs(rd).submissions[0].arrays[0].tasks[0]
    p = _wait(lambda: _running_here(rd), 300, "requests running on the server, under Slurm")
    assert p.done < p.total
    if how == "requeue":
        subprocess.run(["scontrol", "requeue", task], check=True)
    else:
        subprocess.run(["scancel", task], check=True)
    log = rd.log_file(0)
    # The shard file holds what was in flight once the shard says it stopped: the worker closes its shards (their
    # partial outputs written, their state "stopped") before it stops the engine, which SGLang takes 3 to 7 s to
    # do, so the cluster's KillWait of 5 s cannot cut in between. The engine's stop is the task's line, not the
    # shard's.
    stopping = lambda: (
        lambda x: "got SIGTERM" in x and "shard 0 stopped" in x.split("got SIGTERM", 1)[1]
    )(log.read_text())
    _wait(stopping, 120, "the requests in flight saved (the engine being stopped)")
    text = log.read_text()
    saved = (
        int(re.search(r"aborting the (\d+) requests in flight", text).group(1))
        if "aborting the" in text
        else 0
    )
    partial = [rec for rec in _records(rd.root) if rec.status == "partial"]
    print(f"{how}: {saved} requests in flight at the SIGTERM, {len(partial)} partial outputs saved")
    assert partial and len(partial) == saved, "every request in flight at the SIGTERM is saved"
    if how == "requeue":  # the task comes back and continues them
        _wait(lambda: "shard 0 complete" in log.read_text(), 420, "the requeued task to finish")
        newest = _newest(_records(rd.root))
        assert sorted(newest) == [f"p{i:04d}" for i in range(16)] and any(
            r.segments > 1 for r in newest.values()
        )


def test_outputs_asked_for_in_segments_are_the_one_request_outputs_and_loops_are_stopped(
    tmp_path, tiny_model, sglang_server
):
    """[client] loop_stop against real SGLang: each output asked for in segments of 256 tokens, continued from
    prompt + output so far (the radix cache holds it), is token for token what one greedy request of 1,024 tokens
    gives. A second dataset loops (a logit_bias makes the model repeat one id): its outputs are stopped at the first
    segment's end, a prefix of the one request's output, which goes on looping to max_new_tokens."""
    from toolkit.formats.loops import repetition_loop
    from toolkit.formats.records import LOOP

    max_new, seg = 1024, 256
    job = sglang_job(
        tmp_path,
        tiny_model,
        n=8,
        sampling={"max_new_tokens": max_new},
        client={
            "loop_stop": True,
            "segment_tokens": seg,
            "loop_window": seg,
            "loop_max_period": 64,
        },
        audit={"max_degenerate_share": 1.0},
    )
    write_prompts(tmp_path / "loops.jsonl", 3, prefix="loop")
    bias = {"300": 100.0}
    job.write_text(
        job.read_text() + f'[[datasets]]\nname = "loops"\npath = "{tmp_path / "loops.jsonl"}"\n'
        'sampling = { logit_bias = { "300" = 100.0 } }\n'
    )
    toolkit("run", str(job))
    records = _records(tmp_path / "run")
    assert len(records) == 11 and all(rec.status == "ok" for rec in records)
    for rec in records:
        params = {
            "max_new_tokens": max_new,
            "temperature": 0,
            **({"logit_bias": bias} if rec.dataset == "loops" else {}),
        }
        code, out = _post(
            sglang_server.url,
            sglang_server.api_key,
            "/generate",
            {"input_ids": unpack_ids(rec.prompt_ids), "sampling_params": params},
        )
        assert code == 200
        whole, got = out["output_ids"], unpack_ids(rec.output_ids)
        if rec.dataset == "loops":
            assert rec.finish == LOOP and got == whole[:seg] and rec.segments == 1, rec.id
            assert repetition_loop(np.array(got, np.uint32), seg, 64) == 1
            assert (
                out["meta_info"]["finish_reason"]["type"] == "length"
            )  # unstopped, it loops to the end
        else:
            assert rec.finish != LOOP and got == whole, rec.id
            assert rec.segments == -(-len(got) // seg), (rec.id, rec.segments)
    assert max(rec.segments for rec in records) > 1
