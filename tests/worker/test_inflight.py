"""Nothing generated is wasted: a stop saves what is in flight as partial records, continued on resume token for
token; a server-side abort is continued the same way; concurrency "auto" follows what the server can run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.engines.stub import start_standalone
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import read_done
from toolkit.formats.progress import read_progress
from toolkit.formats.records import PARTIAL, Record
from toolkit.worker.concurrency import auto_target
from toolkit.worker.generate import continued_params
from toolkit.worker.requests import Requests
from toolkit.worker.run import DONE, run_shard

SAME = (
    "output_ids",
    "finish",
    "matched_stop",
    "reasoning_end",
    "tool_call_at",
    "completion_tokens",
    "prompt_ids",
    "prompt_tokens",
    "status",
)


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def records(run: Path, shard: int = 0) -> list[Record]:
    return list(read_shard(Path(run) / "shards" / f"{shard:05d}.zst"))


def newest(run: Path) -> dict[str, Record]:
    return {r.id: r for r in records(run)}


def fields(r: Record) -> dict:
    return {f: getattr(r, f) for f in SAME}


def worker(rd) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(cond, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def generating(rd) -> bool:
    p = read_progress(rd, 0)
    return (
        p is not None
        and p.state == "generating"
        and rd.shard_file(0).exists()
        and len(records(rd.root)) >= 2
    )


def post(url: str, path: str, body: dict) -> None:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        r.read()


@pytest.mark.slow
def test_stop_saves_in_flight_and_resume_equals_an_uninterrupted_run(tmp_path, kimi):
    """SIGUSR2 twice mid-shard, resumed each time: partial records are written at each stop (never ok), and the
    finished shard holds, token for token, what an uninterrupted run writes, some records in several segments."""
    # Work that cannot run out before a stop: every output 400 tokens (min_new_tokens) of 4 ms each, 24 of them
    # 4 at a time (about 10 s of the stub's pace, however fast the machine)
    n = 24
    prompts = write_prompts(tmp_path / "prompts.jsonl", n)
    common = dict(
        prompts=prompts,
        stub={"token_delay_s": 0.004},
        sampling={"max_new_tokens": 400, "min_new_tokens": 400},
        client={"concurrency": 4, "request_timeout_s": 30, "retries": 3, "backoff_s": 0.05},
    )
    ref, _ = prepared_run(make_job(tmp_path / "ref", kimi, **common))
    assert run_shard(ref.root, 0).end == DONE
    expected = {i: fields(r) for i, r in newest(ref.root).items()}

    rd, _ = prepared_run(make_job(tmp_path / "stopped", kimi, **common))
    partial_seen = 0
    for stop in range(2):
        proc = worker(rd)
        before = len(records(rd.root)) if rd.shard_file(0).exists() else 0
        wait_for(lambda: generating(rd) and len(records(rd.root)) >= before + 2, what="records")
        # requests in flight: the stub's /v1/loads, read into the progress file by this worker, says they run
        wait_for(
            lambda: (lambda p: p.pid == proc.pid and (p.running or 0) > 0)(read_progress(rd, 0)),
            what="requests running on the engine",
        )
        assert read_progress(rd, 0).done < n, "work is left when the signal comes"
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(60) == 3, proc.stderr.read()
        p = read_progress(rd, 0)
        assert p.state == "stopped" and p.stop_signal == "SIGUSR2" and p.partial_saved > 0
        got = newest(rd.root)
        part = [r for r in got.values() if r.status == PARTIAL]
        assert part and all(
            r.finish == "abort" and r.n_output == r.completion_tokens > 0 for r in part
        )
        for r in part:  # a prefix of the uninterrupted output
            assert r.output_ids == expected[r.id]["output_ids"][: len(r.output_ids)]
        partial_seen += len(part)
        assert not rd.done_file(0).exists()
        assert read_progress(rd, 0).done == sum(r.status != PARTIAL for r in got.values())
    assert run_shard(rd.root, 0).end == DONE
    got = newest(rd.root)
    assert len(got) == n and not any(r.status == PARTIAL for r in got.values())
    assert {i: fields(r) for i, r in got.items()} == expected
    assert max(r.segments for r in got.values()) > 1 and partial_seen >= 2
    assert all(r.segments == 1 for r in newest(ref.root).values())
    m = read_done(rd.done_file(0))
    assert m.records == n and m.failed == 0 and m.transient == 0


@pytest.mark.slow
def test_without_save_in_flight_a_stop_throws_the_requests_in_flight_away(tmp_path, kimi):
    job = make_job(
        tmp_path,
        kimi,
        n=12,
        stub={"token_delay_s": 0.004},
        sampling={"max_new_tokens": 400},
        client={"concurrency": 4, "save_in_flight": False},
    )
    rd, _ = prepared_run(job)
    proc = worker(rd)
    wait_for(lambda: generating(rd), what="records")
    proc.send_signal(signal.SIGUSR2)
    assert proc.wait(60) == 3, proc.stderr.read()
    assert not any(r.status == PARTIAL for r in records(rd.root))
    assert run_shard(rd.root, 0).end == DONE
    assert all(r.segments == 1 for r in records(rd.root))


@pytest.mark.slow
def test_server_side_aborts_are_continued_not_regenerated(tmp_path, kimi):
    """The server aborts everything (abort_all) again and again while the worker runs: each aborted request goes
    on from its partial output, and the records equal those of a run without aborts."""
    n = 12
    prompts = write_prompts(tmp_path / "prompts.jsonl", n)
    stub, url = start_standalone(str(kimi), "--context-length", "32768", "--token-delay", "0.004")
    try:
        # seeded: one server answers both runs, and a sampled request without a seed sent again draws anew
        common = dict(
            prompts=prompts,
            engine={"kind": "external", "url": url},
            sampling={"max_new_tokens": 400, "sampling_seed": 7},
            client={"concurrency": 4, "request_timeout_s": 30, "retries": 2, "backoff_s": 0.05},
        )
        ref, _ = prepared_run(make_job(tmp_path / "ref", kimi, **common))
        assert run_shard(ref.root, 0).end == DONE
        expected = {i: fields(r) for i, r in newest(ref.root).items()}
        rd, _ = prepared_run(make_job(tmp_path / "aborted", kimi, **common))
        done = threading.Event()

        def aborter() -> None:
            while not done.wait(0.25):
                post(url, "/abort_request", {"abort_all": True})

        t = threading.Thread(target=aborter)
        t.start()
        try:
            assert run_shard(rd.root, 0).end == DONE
        finally:
            done.set()
            t.join()
        got = newest(rd.root)
        assert {i: fields(r) for i, r in got.items()} == expected
        assert sum(r.segments > 1 for r in got.values()) >= 3
        assert all(r.attempts >= r.segments for r in got.values())
    finally:
        os.killpg(stub.pid, signal.SIGKILL)


def test_rids_are_fixed_width_and_never_prefixes_of_each_other():
    made: list[str] = []
    for shard in (0, 7, 12345):
        requests = Requests(shard, tag="a1b2c3")
        for pos in (0, 1, 10, 11, 100, 123456789):
            for sample in (0, 1, 12):
                requests.rid_maker(pos, sample, made)()
    requests.rid_seq = 10**8 - 2  # the counter wraps, the width stays
    for _ in range(4):
        requests.rid_maker(5, 0, made)()
    assert len(set(made)) == len(made) and len({len(r) for r in made}) == 1
    ordered = sorted(made)
    assert not any(b.startswith(a) for a, b in zip(ordered, ordered[1:]))


def test_auto_target_is_capacity_plus_a_small_queue():
    assert auto_target(8, 0, 0, 1024) == 10
    assert auto_target(256, 256, 10, 1024) == 288
    assert (
        auto_target(256, 100, 40, 1024) == 132
    )  # waiting while below the limit: the KV cache is the limit
    assert auto_target(4096, 0, 0, 1024) == 1024
    assert auto_target(0, 0, 0, 1024) == 64  # the server does not say


def test_auto_target_caps_at_max_concurrency_and_keeps_a_queue_of_at_least_two():
    assert auto_target(4, 4, 0, 1024) == 6  # capacity // 8 is 0: the margin is 2
    assert auto_target(256, 300, 5, 100) == 100  # never past client.max_concurrency
    assert auto_target(256, 0, 7, 1024) == 288  # waiting with nothing running: the capacity, not 0


def test_continued_params_take_off_what_was_generated():
    params = {"max_new_tokens": 10, "min_new_tokens": 4, "temperature": 0.6}
    assert continued_params(params, 0) is params
    assert continued_params(params, 3) == {
        "max_new_tokens": 7,
        "min_new_tokens": 1,
        "temperature": 0.6,
    }
    assert continued_params(params, 6)["min_new_tokens"] == 0
    assert continued_params(params, 10) is None  # the budget is used up
    assert params == {
        "max_new_tokens": 10,
        "min_new_tokens": 4,
        "temperature": 0.6,
    }  # the caller's are unchanged


@pytest.mark.slow
def test_auto_concurrency_follows_the_servers_running_limit_and_progress_shows_the_load(
    tmp_path, kimi
):
    job = make_job(
        tmp_path,
        kimi,
        n=40,
        stub={"token_delay_s": 0.005, "fixed_output_tokens": 120},
        engine={"extra_args": ["--max-running-requests", "3"]},
        sampling={"max_new_tokens": 200},
        client={"concurrency": "auto"},
    )
    rd, _ = prepared_run(job)
    seen: list = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            p = read_progress(rd, 0)
            if p is not None and p.running is not None:
                seen.append((p.running, p.queued, p.kv_usage, p.capacity, p.in_flight_target))

    t = threading.Thread(target=watch)
    t.start()
    try:
        assert run_shard(rd.root, 0).end == DONE
    finally:
        stop.set()
        t.join()
    assert seen, "the progress file should show the server's load while generating"
    assert all(cap == 3 and target == 5 and running <= 3 for running, _, _, cap, target in seen)
    assert any(running == 3 and queued == 2 for running, queued, *_ in seen)
    assert any(kv and kv > 0 for _, _, kv, *_ in seen)
    log = rd.log_file(0).read_text()
    assert "requests in flight: 64 -> 5 (concurrency auto)" in log and "-> 64" not in log


def test_records_written_before_segments_still_decode():
    old = msgspec.msgpack.encode(
        ["p1", "d", 0, "ok", b"", b"", None, None, "stop", 2, 3, 0, 0, 0.1, 1, None, None]
    )
    r = msgspec.msgpack.decode(old, type=Record)
    assert r.segments == 1 and r.failure is None


def test_status_shows_the_engines_running_queued_and_kv_use(tmp_path, kimi):
    from toolkit.cluster.status import format_status, run_status
    from toolkit.formats.progress import Progress, write_progress

    rd, _ = prepared_run(make_job(tmp_path, kimi, n=4))
    write_progress(
        rd.progress_file(0),
        Progress(
            shard=0,
            state="generating",
            total=4,
            done=1,
            running=12,
            queued=3,
            kv_usage=0.41,
            capacity=12,
            in_flight_target=15,
            pid=os.getpid(),
            host="here",
            started=time.time(),
        ),
    )
    root, rows, merge = run_status(rd.root)
    assert (rows[0].running, rows[0].queued, rows[0].kv_usage) == (12, 3, 0.41)
    table = format_status(root, rows, merge)
    assert "RUN/QUEUE" in table and " 12/3 " in table and "41%" in table


@pytest.mark.slow
def test_the_watch_hands_freed_memory_back_while_generating(tmp_path, kimi, monkeypatch):
    """What the rendered prompts and the answers free stays in malloc's arenas, a few MB more as a shard goes on,
    unless it is handed back: the watch calls malloc_trim every TRIM_S (where the C library has it)."""
    import sys as _sys

    import toolkit.worker.concurrency as concurrency

    if _sys.platform == "linux":
        assert concurrency._TRIM is not None  # glibc's, on the Linux the tests run on
    calls = []
    monkeypatch.setattr(concurrency, "_TRIM", lambda pad: calls.append(pad) or 0)
    monkeypatch.setattr(concurrency, "TRIM_S", 0.3)
    job = make_job(
        tmp_path,
        kimi,
        n=6,
        stub={"token_delay_s": 0.01},
        sampling={"max_new_tokens": 300},
        client={"concurrency": 2},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    assert calls and set(calls) == {0}
