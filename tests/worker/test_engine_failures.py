"""The engine's failures are the engine's: a burst of 503s on every request (the engine overloaded for a few seconds)
charges no prompt a try; the requests wait for the engine to answer its probe again, then go out again, and every
record is what a healthy engine gives. `toolkit run` exits as `status` judges the run it leaves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobfiles import make_job, prepared_run
from toolkit.formats.frames import read_shard

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def toolkit(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def burst_job(tmp: Path, kimi, stub_args: list[str], **client) -> Path:
    """40 greedy prompts, 16 in flight, each try one request and one retry, three tries (the defaults' shape)."""
    c = {
        "concurrency": 16,
        "retries": 1,
        "request_timeout_s": 10,
        "backoff_s": 0.05,
        "backoff_max_s": 0.2,
        "max_tries": 3,
        **client,
    }
    return make_job(
        tmp,
        kimi,
        n=40,
        shards=1,
        sampling={"max_new_tokens": 48, "temperature": 0},
        stub={"extra_args": stub_args},
        client=c,
    )


@pytest.mark.slow
def test_a_burst_of_503s_on_every_request_charges_no_prompt_and_every_record_is_exact(
    tmp_path, kimi
):
    """Every /generate answers 503 for 3 s from the second one on (the probe of a start is the first), over 400
    requests in a row: on the old code the 16 prompts in flight used their 3 tries within the burst and ended failed
    for the run. Now the engine's probe fails too, so no prompt is charged: the run completes, every record equal to a run
    without the burst, none failed for the run."""
    clean = burst_job(tmp_path / "clean", kimi, [])
    r = toolkit("run", str(clean))
    assert r.returncode == 0, r.stdout + r.stderr
    expected = {rec.id: rec.output_ids for rec in read_shard(prepared_run(clean)[0].shard_file(0))}
    assert len(expected) == 40

    # each try 26 requests 10 ms apart: the 16 prompts in flight meet the burst with over 400 requests
    job = burst_job(
        tmp_path / "burst",
        kimi,
        ["--fail-5xx-for", "2:3"],
        retries=25,
        backoff_s=0.01,
        backoff_max_s=0.02,
    )
    r = toolkit("run", str(job))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    rd, _ = prepared_run(job)
    server_log = rd.server_log_file(0).read_text()
    failed_requests = server_log.count("Injected failure (--fail-5xx-for 2:3)")
    assert failed_requests >= 400, server_log[-2000:]  # 400 in a row, as in the trial
    every = list(read_shard(rd.shard_file(0)))
    got = {rec.id: rec for rec in every}
    assert {i: rec.output_ids for i, rec in got.items()} == expected
    assert all(rec.status == "ok" for rec in got.values())
    assert not any(rec.final for rec in every)
    log = rd.log_file(0).read_text()
    assert "the engine is unwell; no prompt is charged a try" in log, log
    assert "answers its probe again" in log, log
    tries = [rec for rec in every if rec.status != "ok"]
    print(
        f"requests failed in the burst: {failed_requests}; tries recorded: {len(tries)}; prompts failed: 0"
    )
    assert (
        len(tries) <= 16
    )  # at most a try each, charged when the burst ended between a request and its probe


@pytest.mark.slow
def test_an_engine_unwell_past_its_ready_timeout_is_restarted_and_then_the_shard_fails(
    tmp_path, kimi
):
    """503 on every request for longer than [engine] ready_timeout_s: the engine is restarted (its probe still fails:
    the stub's burst begins again), up to max_restarts, then the shard fails in this task; no prompt is recorded
    failed, so the next run generates them all."""
    job = burst_job(tmp_path, kimi, ["--fail-5xx-for", "2:600"])
    text = (
        job.read_text()
        .replace("ready_timeout_s = 60", "ready_timeout_s = 10")
        .replace("max_restarts = 2", "max_restarts = 1")
    )
    job.write_text(text)
    r = toolkit("run", str(job))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    rd, _ = prepared_run(job)
    log = rd.log_file(0).read_text()
    assert "engine died 2 times (limit engine.max_restarts = 1)" in out + log, out + log
    assert "engine unwell for" in log and "its probe /generate still fails (HTTP 503)" in log, log
    assert not any(rec.status == "failed" for rec in read_shard(rd.shard_file(0)))


@pytest.mark.slow
def test_toolkit_run_exits_as_status_does_when_it_leaves_failures_that_may_pass(tmp_path, kimi):
    """One prompt answered 503 every time while the engine answers its probe: its failure is its own, final for the
    run after max_tries, the audit passes (its limit is 100 % here), and `toolkit run` — the first and the next —
    exits 1 with `status`'s words and code, not 0."""
    prompts = tmp_path / "prompts.jsonl"
    from jobfiles import write_prompts

    write_prompts(prompts, 6)
    lines = prompts.read_text().splitlines()
    lines[2] = lines[2].replace('"}]', ' ALWAYSFAILS"}]')
    prompts.write_text("\n".join(lines) + "\n")
    job = make_job(
        tmp_path,
        kimi,
        prompts=prompts,
        sampling={"max_new_tokens": 32, "temperature": 0},
        stub={"extra_args": ["--poison-prompt", "status_503=ALWAYSFAILS"]},
        client={"concurrency": 2, "retries": 0, "max_tries": 2, "backoff_s": 0.05},
        audit={"max_failed_share": 1.0, "max_empty_reasoning_share": 1.0},
    )
    rd, _ = prepared_run(job)
    for _ in range(2):
        r = toolkit("run", str(job))
        out = r.stdout + r.stderr
        st = toolkit("status", str(rd.root))
        assert st.returncode == 1, st.stdout + st.stderr
        assert r.returncode == st.returncode, out
        assert f"failures that may pass in shard 0: `toolkit retry {rd.shown}`" in r.stdout, out
        assert "(exit 1)" in r.stdout.splitlines()[-1], out
    got = {rec.id: rec for rec in read_shard(rd.shard_file(0))}
    assert (got["p0002"].status, got["p0002"].final, got["p0002"].tries) == ("failed", True, 2)
    assert sum(rec.status == "ok" for rec in got.values()) == 5


@pytest.mark.slow
def test_a_prompt_never_answered_ends_failed_within_its_bound_under_stops_that_cut_every_try_short(
    tmp_path, kimi
):
    """One prompt the server never answers, the worker stopped (SIGTERM) 4 s after each time it is sent: no try ever
    runs to its end (6 s, one request of request_timeout_s, no retry). On the old code its count stayed 0 whatever the
    stops. Now the time it waited is carried across the stops by its partial record, each 6 s of it a try: it ends
    failed, final, after 3 tries' worth of waiting (18 s, within one stop more), and the shard is then done."""
    import signal
    import time

    from jobfiles import write_prompts

    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    lines = prompts.read_text().splitlines()
    lines[1] = lines[1].replace('"}]', ' NEVERANSWERED"}]')
    prompts.write_text("\n".join(lines) + "\n")
    job = make_job(
        tmp_path,
        kimi,
        prompts=prompts,
        sampling={"max_new_tokens": 32, "temperature": 0},
        stub={"extra_args": ["--poison-prompt", "hang=NEVERANSWERED"]},
        client={
            "concurrency": 2,
            "retries": 0,
            "request_timeout_s": 6,
            "max_tries": 3,
            "save_in_flight": False,
        },
        sharding={"flush_records": 1},
    )
    rd, _ = prepared_run(job)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def sent() -> int:
        log = rd.server_log_file(0)
        return log.read_text().count("Injected poison (hang)") if log.exists() else 0

    def p1() -> list:
        return (
            [rec for rec in read_shard(rd.shard_file(0)) if rec.id == "p0001"]
            if rd.shard_file(0).exists()
            else []
        )

    stops, seen = 0, []
    while not (p1() and p1()[-1].final) and stops < 8:
        before = sent()
        proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.time() + 90
        while sent() == before:
            assert time.time() < deadline and proc.poll() is None, "the prompt was never sent"
            time.sleep(0.05)
        time.sleep(4.0)  # the try's one request would time out at 6 s
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 3, out
        stops += 1
        last = p1()[-1] if p1() else None  # (the old code wrote nothing: the count stayed 0)
        seen.append(
            (last.status, last.tries, round(last.unanswered_s, 1)) if last else ("none", 0, 0.0)
        )
    print(f"stops: {stops}; p0001 after each (status, tries, unanswered_s): {seen}")
    rec = p1()[-1]
    assert (rec.status, rec.failure, rec.tries, rec.final) == ("failed", "timeout", 3, True), seen
    assert rec.error.startswith("failed 3 times: timeout; last: no answer in "), rec.error
    assert (
        "every 6 s in flight without an answer (a try's bound), across stops, counts as a try"
        in rec.error
    )
    assert 4 <= stops <= 5, (
        seen
    )  # 18 s of waiting, 4 s and a little more per stop: within one stop of the bound
    assert [t for _, t, _ in seen] == sorted(t for _, t, _ in seen)  # the count only grows
    r = toolkit("worker", str(rd.root), "0")
    assert r.returncode == 0, r.stdout + r.stderr
    got = {x.id: x for x in read_shard(rd.shard_file(0))}
    assert sum(x.status == "ok" for x in got.values()) == 3 and got["p0001"].final


def _serve_statuses(statuses: list[int]):
    """A server answering each POST /generate with the next of `statuses` (the last one again when they run out);
    (server coroutine factory, the list of statuses answered)."""
    import asyncio

    answered: list[int] = []

    async def handle(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            status = statuses[min(len(answered), len(statuses) - 1)]
            answered.append(status)
            body = b'{"output_ids":[5],"meta_info":{"id":"x","finish_reason":{"type":"length"},"completion_tokens":1}}'
            writer.write(
                b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body)
            )
            await writer.drain()
        writer.close()

    return handle, answered


@pytest.mark.parametrize(
    "statuses, unwell, probes", [([200], False, 1), ([503, 503, 429, 200], True, 4)]
)
def test_failures_at_once_share_one_check_of_the_engine(monkeypatch, statuses, unwell, probes):
    """Ten requests failing together ask the engine once: its probe answered at once, each failure is its prompt's;
    failing (503, 429), they all wait on the same backoff until it answers, then go out again uncounted."""
    import asyncio
    from types import SimpleNamespace

    from toolkit.engines.client import HttpClient
    from toolkit.worker import enginecheck

    monkeypatch.setattr(enginecheck, "FIRST_WAIT_S", 0.02)
    handle, answered = _serve_statuses(statuses)

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = SimpleNamespace(
            url=f"http://127.0.0.1:{port}",
            api_key=None,
            probe_ids=[1, 2],
            alive=lambda: True,
            exit_code=lambda: None,
            engine=SimpleNamespace(ready_timeout_s=30),
        )
        http = HttpClient(engine.url)
        check = enginecheck.EngineCheck(engine, asyncio.Event(), http, probe_timeout_s=5)
        try:
            return await asyncio.gather(*(check.unwell(f"prompt {i}: HTTP 503") for i in range(10)))
        finally:
            check.close()
            http.close()
            server.close()

    assert asyncio.run(main()) == [unwell] * 10
    assert answered == statuses[:probes]


def test_an_engine_unwell_past_its_ready_timeout_is_hung_for_every_request_waiting(monkeypatch):
    import asyncio
    from types import SimpleNamespace

    from toolkit.engines.base import EngineHung
    from toolkit.engines.client import HttpClient
    from toolkit.worker import enginecheck

    monkeypatch.setattr(enginecheck, "FIRST_WAIT_S", 0.02)
    handle, answered = _serve_statuses([503])

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        engine = SimpleNamespace(
            url=f"http://127.0.0.1:{port}",
            api_key=None,
            probe_ids=[1],
            alive=lambda: True,
            exit_code=lambda: None,
            engine=SimpleNamespace(ready_timeout_s=0.5),
        )
        http = HttpClient(engine.url)
        check = enginecheck.EngineCheck(engine, asyncio.Event(), http, probe_timeout_s=5)
        try:
            return await asyncio.gather(
                *(check.unwell("HTTP 503") for _ in range(3)), return_exceptions=True
            )
        finally:
            check.close()
            http.close()
            server.close()

    got = asyncio.run(main())
    assert all(
        isinstance(e, EngineHung) and "its probe /generate still fails (HTTP 503)" in str(e)
        for e in got
    ), got
    assert (
        3 <= len(answered) <= 8
    )  # probes with a doubling backoff over 0.5 s, one for all three requests
