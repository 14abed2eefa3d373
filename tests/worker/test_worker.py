"""The shard worker against the stub engine: exact ids, right splits, resume after any crash, engine faults."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest

from jobfiles import make_job, prepared_run, process_running, write_prompts
from toolkit.cluster.retry import request_retry
from toolkit.engines.stub import start_standalone
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import read_done
from toolkit.formats.progress import read_progress
from toolkit.formats.records import unpack_ids
from toolkit.formats.run import Run
from toolkit.formats.runplan import PlanError
from toolkit.job.findings import PreflightError
from toolkit.job.schema import JobSpec
from toolkit.worker.run import DONE, run_shard
from toolkit.worker.shard import ShardFailed


def records(run: Path, shard: int = 0):
    return list(read_shard(Path(run) / "shards" / f"{shard:05d}.zst"))


def newest(run: Path, shard: int = 0) -> dict:
    """The record that counts for each id: the newest one written."""
    return {r.id: r for r in records(run, shard)}


def fix_engine(rd, **stub) -> None:
    """The server is fine again: change the stub's fault flags pinned in run.json (the engine is not part of the
    run's fingerprint)."""
    plan = json.loads(rd.plan_file.read_text())
    plan["spec"]["engine"]["stub"].update(stub)
    rd.plan_file.write_text(json.dumps(plan))


def comparable(r) -> bytes:
    """A record's bytes with the fields that measure the server, not the output, zeroed: wall-clock latency and
    cached_tokens (a prompt resent after a kill finds itself in the server's prefix cache)."""
    return msgspec.msgpack.encode(msgspec.structs.replace(r, latency_s=0.0, cached_tokens=0))


def start_stub(tokenizer: Path, *args: str) -> tuple[subprocess.Popen, str]:
    return start_standalone(str(tokenizer), "--context-length", "32768", *args)


def post_generate(url: str, ids: list[int], params: dict) -> dict:
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps({"input_ids": ids, "sampling_params": params}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


@pytest.mark.slow
def test_records_hold_exactly_what_the_server_sent(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=10, sampling={"max_new_tokens": 200})
    rd, plan = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    recs = records(rd.root)
    assert sorted(r.id for r in recs) == [f"p{i:04d}" for i in range(10)]
    stub, url = start_stub(kimi)
    try:
        for r in recs:
            body = post_generate(url, unpack_ids(r.prompt_ids), {"max_new_tokens": 200})
            assert unpack_ids(r.output_ids) == body["output_ids"]
            assert r.completion_tokens == body["meta_info"]["completion_tokens"] == r.n_output
            assert r.finish == body["meta_info"]["finish_reason"]["type"]
    finally:
        os.killpg(stub.pid, signal.SIGKILL)
    done = read_done(rd.done_file(0))
    assert done is not None and done.records == 10 and done.fingerprint == plan.fingerprint
    progress = read_progress(rd, 0)
    assert progress.state == "done" and progress.done == 10 and progress.engine == "stub"
    log = rd.log_file(0).read_text()
    assert "STUB" in log and "NOT a model" in log
    assert "stub-engine, not a model" in rd.server_log_file(0).read_text()


@pytest.mark.slow
def test_records_hold_the_cached_token_counts_the_server_sent(tmp_path, kimi):
    """One request at a time, so the server admits prompts in planned order: each prompt's cached tokens are its
    longest common prefix with an earlier prompt (all share the chat template's opening), at most all but one."""
    job = make_job(tmp_path, kimi, n=8, sampling={"max_new_tokens": 32}, client={"concurrency": 1})
    rd, plan = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    recs = sorted(records(rd.root), key=lambda r: r.index)
    from toolkit.job import chat

    seen = [
        chat.probe_ids(chat.load_tokenizer(plan.spec.model), plan.spec.model)
    ]  # the probe went first
    for r in recs:
        prompt = unpack_ids(r.prompt_ids)
        common = max(
            (
                next(
                    (k for k, (a, b) in enumerate(zip(prompt, q)) if a != b),
                    min(len(prompt), len(q)),
                )
                for q in seen
            ),
            default=0,
        )
        assert r.cached_tokens == min(common, len(prompt) - 1), r.id
        seen.append(prompt)
    # the probe is a conversation of its own: the first prompt shares only the template's opening with it
    assert 0 < recs[0].cached_tokens < recs[0].prompt_tokens - 1 and all(
        r.cached_tokens > 0 for r in recs
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["kimi", "qwen3", "deepseek"])
def test_reasoning_split_per_template_family(tmp_path, toy_tokenizer, family):
    from toolkit.job import chat
    from toolkit.job.spec import load_spec

    tok_dir = toy_tokenizer(family)
    job = make_job(tmp_path, tok_dir, n=16, sampling={"max_new_tokens": 400})
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    spec = load_spec(job)
    tok = chat.load_tokenizer(spec.model)
    info = chat.token_info(tok, spec.model)
    opened = family != "qwen3"
    assert info.opens_reasoning is opened
    recs = records(rd.root)
    stopped = [r for r in recs if r.finish == "stop"]
    assert stopped, "the stub should finish most outputs with a stop token"
    tool_seen = False
    for r in recs:
        out, prompt = unpack_ids(r.output_ids), unpack_ids(r.prompt_ids)
        assert (prompt[-1] == info.think_start_id) is opened or prompt[-1] in info.blank_ids
        # The model emits <think> itself only when the template did not open it.
        assert (out[0] == info.think_start_id) is (not opened)
        if r.reasoning_end is not None:
            assert out[r.reasoning_end] == info.think_end_id
            assert info.think_end_id not in out[: r.reasoning_end]
        else:
            assert info.think_end_id not in out
        if r.finish == "stop":
            assert out[-1] == r.matched_stop and r.matched_stop in info.eos_ids
        if r.tool_call_at is not None:
            tool_seen = True
            assert out[r.tool_call_at] == info.tool_call_start_id
            assert r.reasoning_end is not None and r.tool_call_at > r.reasoning_end
    assert sum(r.reasoning_end is not None for r in stopped) == len(stopped)
    assert tool_seen, "some outputs should carry a tool-call section"


@pytest.mark.slow
def test_kill_9_at_random_moments_loses_and_duplicates_nothing(tmp_path, kimi):
    """kill -9 of the worker at 20+ random moments, then a restart: every prompt once, records byte-identical."""
    n = 80
    prompts = write_prompts(tmp_path / "prompts.jsonl", n)
    stub, url = start_stub(kimi, "--token-delay", "0.005")
    try:
        # seeded: one server answers every run, and a sampled request without a seed sent again draws anew
        common = dict(
            engine={"kind": "external", "url": url},
            client={"concurrency": 4, "request_timeout_s": 30},
            sampling={"max_new_tokens": 300, "sampling_seed": 7},
            sharding={"shards": 1, "flush_records": 3, "flush_seconds": 0.3},
        )
        ref_rd, _ = prepared_run(make_job(tmp_path / "ref", kimi, prompts=prompts, **common))
        assert run_shard(ref_rd.root, 0).end == DONE
        expected = {r.id: comparable(r) for r in records(ref_rd.root)}
        assert len(expected) == n

        rd, _ = prepared_run(make_job(tmp_path / "killed", kimi, prompts=prompts, **common))
        rng = random.Random(20261202)
        kills = 0
        progress_seen = []
        while kills < 20 and not rd.done_file(0).exists():
            size = rd.shard_file(0).stat().st_size if rd.shard_file(0).exists() else 0
            proc = subprocess.Popen(
                [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if kills % 3 == 2:
                # a kill mid-shard whatever the machine's load: once this attempt has written a frame
                deadline = time.monotonic() + 120
                while (
                    proc.poll() is None
                    and time.monotonic() < deadline
                    and not (rd.shard_file(0).exists() and rd.shard_file(0).stat().st_size > size)
                ):
                    time.sleep(0.02)
                time.sleep(rng.uniform(0, 0.5))
            else:  # from the start: loading, the engine's check, the first requests, ...
                time.sleep(rng.uniform(0.3, 3.5))
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                kills += 1
            proc.wait()
            if rd.shard_file(0).exists():
                progress_seen.append(sum(1 for _ in read_shard(rd.shard_file(0))))
        if (
            kills < 20
        ):  # the shard finished before 20 kills: restart from scratch to get the rest of the kills in
            pytest.fail(f"only {kills} kills landed before the shard completed; slow the stub down")
        assert run_shard(rd.root, 0).end == DONE
        got = records(rd.root)
        assert len(got) == n and len({r.id for r in got}) == n
        assert {r.id: comparable(r) for r in got} == expected
        assert any(0 < p < n for p in progress_seen), "kills should land mid-shard"
    finally:
        os.killpg(stub.pid, signal.SIGKILL)


@pytest.mark.slow
def test_the_render_thread_stays_a_bounded_number_of_prompts_ahead(tmp_path, kimi):
    """Rendering is far faster than generating: without backpressure every prompt of the shard would be rendered and
    held before the requests catch up (54,000 prompts at 100,000 in a shard). The bound: max(4 x concurrency,
    2 render batches of 256)."""
    job = make_job(
        tmp_path,
        kimi,
        n=1500,
        stub={"fixed_output_tokens": 8, "token_delay_s": 0.001},
        sampling={"max_new_tokens": 16},
        client={"concurrency": 4},
        sharding={"shards": 1, "flush_records": 256, "flush_seconds": 5},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    assert len(records(rd.root)) == 1500
    line = next(
        x for x in rd.log_file(0).read_text().splitlines() if "rendered prompts waited" in x
    )
    peak = int(line.split("at most ")[1].split()[0])
    assert 0 < peak <= 512, line


@pytest.mark.slow
def test_killed_worker_leaves_no_engine_running(tmp_path, kimi):
    job = make_job(
        tmp_path, kimi, n=30, stub={"token_delay_s": 0.01}, sampling={"max_new_tokens": 400}
    )
    rd, _ = prepared_run(job)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    children: list[str] = []
    while time.time() < deadline and not (rd.shard_file(0).exists() and children):
        time.sleep(0.2)
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
    assert children, "the stub engine should be running under the worker"
    assert all(process_running(int(pid)) for pid in children)
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and any(process_running(int(pid)) for pid in children):
        time.sleep(0.1)
    assert not any(process_running(int(pid)) for pid in children), (
        "the engine must die with its worker"
    )


@pytest.mark.slow
def test_engine_crash_mid_shard_is_restarted_and_shard_finishes(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=24, stub={"crash_after": 10}, engine={"max_restarts": 3})
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    got = records(rd.root)
    assert sorted(r.id for r in got) == [f"p{i:04d}" for i in range(24)]
    assert all(r.status == "ok" for r in got)
    assert read_progress(rd, 0).engine_restarts == 2
    log = rd.log_file(0).read_text()
    assert "engine died mid-shard" in log
    # every task of the attempts the crashes cut short ended with them (none is found running at the shard's end)
    assert "still running at the end of the shard" not in log and "did not end" not in log


@pytest.mark.slow
def test_engine_crashing_past_the_bound_fails_with_log_tail(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=24, stub={"crash_after": 3}, engine={"max_restarts": 1})
    rd, _ = prepared_run(job)
    with pytest.raises(ShardFailed) as e:
        run_shard(rd.root, 0)
    assert "engine died 2 times" in str(e.value) and "max_restarts = 1" in str(e.value)
    assert "stub-engine" in str(e.value)  # the server log's tail
    p = read_progress(rd, 0)
    assert p.state == "failed" and "engine died" in p.error
    kept = records(rd.root)
    assert 2 <= len(kept) < 24 and len({r.id for r in kept}) == len(kept)


@pytest.mark.slow
def test_engine_never_ready_times_out_with_log_tail(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=4, stub={"hang": True}, engine={"ready_timeout_s": 4})
    rd, _ = prepared_run(job)
    t0 = time.monotonic()
    with pytest.raises(ShardFailed) as e:
        run_shard(rd.root, 0)
    assert time.monotonic() - t0 < 30
    assert "not ready after 4 s" in str(e.value) and "ready_timeout_s" in str(e.value)
    assert "stub-engine" in str(e.value)


@pytest.mark.slow
def test_requests_without_an_answer_time_out_are_retried_then_recorded_failed_and_a_rerun_fills_the_holes(
    tmp_path, kimi
):
    """A server that stops answering (alive, but wedged): each request times out, is retried, and is recorded
    failed naming the timeout; the shard completes, but a timeout may pass: the done manifest counts it, and the
    next run of the shard generates those prompts again in place, so merge has no failed record."""
    from toolkit.dataset.merge import merge_run

    job = make_job(
        tmp_path,
        kimi,
        n=6,
        stub={"hang_after": 3},  # the probe and two prompts are answered
        client={"concurrency": 2, "request_timeout_s": 1, "retries": 1, "max_tries": 1},
    )
    rd, _ = prepared_run(job)
    t0 = time.monotonic()
    assert run_shard(rd.root, 0).end == DONE
    assert time.monotonic() - t0 < 60
    recs = records(rd.root)
    ok = [r for r in recs if r.status == "ok"]
    failed = [r for r in recs if r.status == "failed"]
    assert len(ok) == 2 and len(failed) == 4
    assert all("no answer within 1 s" in r.error and r.attempts == 2 for r in failed), [
        r.error for r in failed
    ]
    assert {r.failure for r in failed} == {"timeout"}
    assert (read_done(rd.done_file(0)).transient, read_done(rd.done_file(0)).given_up) == (0, 4)
    assert "toolkit retry" in rd.log_file(0).read_text()

    fix_engine(rd, hang_after=None)
    assert (
        run_shard(rd.root, 0).end == DONE and len(records(rd.root)) == 6
    )  # final for this run: nothing tried again
    request_retry(rd.root)  # a fresh count of tries
    assert run_shard(rd.root, 0).end == DONE
    assert {r.status for r in newest(rd.root).values()} == {"ok"} and len(
        records(rd.root)
    ) == 10  # appended
    done = read_done(rd.done_file(0))
    assert (done.records, done.failed, done.transient, done.superseded) == (6, 0, 0, 4)
    m = merge_run(rd.root)
    assert (m.ok, m.failed, m.missing, m.duplicates) == (6, 0, 0, 4) and m.complete
    assert run_shard(rd.root, 0).end == DONE
    assert "nothing to do" in rd.log_file(0).read_text().splitlines()[-1]


@pytest.mark.slow
def test_a_wedged_engine_is_noticed_and_restarted_long_before_the_request_timeout(tmp_path, kimi):
    """--hang-after: the server stays up but answers nothing; /health_generate fails (here: no answer within its
    bounded timeout), the engine is restarted and the requests in flight go back to the queue, not to failed."""
    job = make_job(
        tmp_path,
        kimi,
        n=20,
        stub={"hang_after": 8},  # the probe and 7 prompts per engine start
        engine={"hang_timeout_s": 2, "max_restarts": 4},
        client={"concurrency": 2, "request_timeout_s": 300, "retries": 1},
    )
    rd, _ = prepared_run(job)
    t0 = time.monotonic()
    assert run_shard(rd.root, 0).end == DONE
    assert time.monotonic() - t0 < 120
    got = records(rd.root)
    assert len(got) == 20 and len({r.id for r in got}) == 20 and {r.status for r in got} == {"ok"}
    assert read_progress(rd, 0).engine_restarts == 2
    log = rd.log_file(0).read_text()
    assert "engine hung: no request answered for" in log and "/health_generate" in log
    assert "still running at the end of the shard" not in log and "did not end" not in log


@pytest.mark.slow
def test_a_sigstopped_engine_is_noticed_and_restarted(tmp_path, kimi):
    job = make_job(
        tmp_path,
        kimi,
        n=16,
        stub={"token_delay_s": 0.005},
        sampling={"max_new_tokens": 200},
        engine={"hang_timeout_s": 2, "max_restarts": 2},
        client={"concurrency": 2, "request_timeout_s": 300, "retries": 1},
    )
    rd, _ = prepared_run(job)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not (
            rd.shard_file(0).exists() and len(records(rd.root)) >= 3
        ):
            time.sleep(0.1)
        engine = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(engine) == 1, engine
        t0 = time.monotonic()
        os.kill(int(engine[0]), signal.SIGSTOP)
        assert proc.wait(120) == 0, proc.stderr.read()
        assert time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            proc.kill()
    got = records(rd.root)
    assert len(got) == 16 and len({r.id for r in got}) == 16 and {r.status for r in got} == {"ok"}
    assert read_progress(rd, 0).engine_restarts == 1
    assert "engine hung" in rd.log_file(0).read_text()
    assert not process_running(int(engine[0]))


@pytest.mark.slow
def test_engine_exiting_at_start_fails_fast(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=4, stub={"exit_at_start": 3}, engine={"ready_timeout_s": 600})
    rd, _ = prepared_run(job)
    t0 = time.monotonic()
    with pytest.raises(ShardFailed, match="exited with code 3 before it was ready"):
        run_shard(rd.root, 0)
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_5xx_bursts_are_retried(tmp_path, kimi):
    job = make_job(
        tmp_path, kimi, n=12, stub={"fail_5xx": "2:5"}, client={"retries": 6, "concurrency": 2}
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    got = records(rd.root)
    assert len(got) == 12 and all(r.status == "ok" for r in got)
    assert sum(r.attempts for r in got) == 12 + 5


@pytest.mark.slow
def test_5xx_past_the_retries_are_generated_again_by_toolkit_retry(tmp_path, kimi, capsys):
    from toolkit.cli import main as cli_main
    from toolkit.dataset.merge_manifest import load_manifest

    # a 503 on every request of the prompts holding "equivalent" (5 of 12); the engine's probe passes
    job = make_job(
        tmp_path,
        kimi,
        n=12,
        stub={"extra_args": ["--poison", "status_503", "--poison-text", "equivalent"]},
        client={"retries": 1, "concurrency": 2, "max_tries": 1},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    failed = [r for r in records(rd.root) if r.status == "failed"]
    assert len(failed) >= 5 and {r.failure for r in failed} == {"server_error"}
    assert all("HTTP 503" in r.error for r in failed)
    assert read_done(rd.done_file(0)).given_up == len(failed)
    assert cli_main(["logs", str(rd.root), "--failed"]) == 1
    assert f"{len(failed)} failed records that may pass" in capsys.readouterr().out
    from toolkit.dataset.finish import AuditFailed, merge_and_audit

    with pytest.raises(AuditFailed):  # failed_share is over its limit, and says what to run
        merge_and_audit(rd.root)
    assert f"`toolkit retry {rd.root}`" in (rd.merged_dir / "audit.json").read_text()
    capsys.readouterr()

    fix_engine(rd, extra_args=[])
    assert (
        cli_main(["retry", str(rd.root)]) == 0
    )  # generates them again here, then merges and audits
    m = load_manifest(rd)
    assert (m.ok, m.failed, m.missing) == (12, 0, 0)
    assert "retrying in 1 shard: 0" in capsys.readouterr().out

    # --ids: exactly these ids again, even ok ones; the newest record counts.
    again = sorted(newest(rd.root))[:2]
    ids = tmp_path / "ids.txt"
    ids.write_text("\n".join(again) + "\n")
    assert cli_main(["retry", str(rd.root), "--ids", str(ids)]) == 0
    assert not rd.retry_file(0).exists()
    counts = {i: sum(r.id == i for r in records(rd.root)) for i in again}
    assert all(c >= 2 for c in counts.values()), counts
    assert cli_main(["retry", str(rd.root)]) == 0 and "nothing to retry" in capsys.readouterr().out


@pytest.mark.slow
def test_sglang_nan_stop_is_a_failure_and_generated_again(tmp_path, kimi):
    """A NaN stop is a failed record (kind nan) that may pass: the prompt is tried again within the same run of
    the shard, after a backoff, and passes (the next request is not the 4th)."""
    from toolkit.dataset.merge import merge_run

    job = make_job(tmp_path, kimi, n=12, stub={"nan_every": 4}, client={"concurrency": 1})
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    nan = [r for r in records(rd.root) if r.matched_stop == "NaN happened"]
    assert (
        len(nan) == 4
    )  # requests 4, 8, 12, 16 (the probe is request 1; each NaN prompt is request n + 1 again)
    assert all(r.status == "failed" and r.failure == "nan" and r.finish == "stop" for r in nan)
    assert all(r.tries == 1 and not r.final for r in nan)
    eos = {r.matched_stop for r in records(rd.root) if r.status == "ok" and r.finish == "stop"}
    assert all(
        unpack_ids(r.output_ids)[-1] in eos for r in nan
    )  # SGLang's stop id closes the output
    assert "NaN stop" in rd.log_file(0).read_text()
    done = read_done(rd.done_file(0))
    assert (done.ok, done.failed, done.transient, done.given_up, done.superseded) == (
        12,
        0,
        0,
        0,
        4,
    )
    m = merge_run(rd.root)
    assert (m.ok, m.failed) == (12, 0)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["data", "count"])
def test_a_shard_damaged_after_it_finished_is_salvaged_not_trusted(tmp_path, kimi, damage):
    """The done manifest's sha256 is checked: a damaged file is salvaged (intact frames kept, the original kept
    aside) and only the damaged frame's records are generated again. A bit flip in a descriptor's record count is
    caught like any other damage."""
    from toolkit.dataset.merge import merge_run
    from toolkit.formats.frames import iter_frames

    job = make_job(
        tmp_path,
        kimi,
        n=12,
        sampling={"max_new_tokens": 64},
        client={"concurrency": 1},
        sharding={"shards": 1, "flush_records": 3, "flush_seconds": 60},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    before = {r.id: comparable(r) for r in records(rd.root)}
    frames = list(iter_frames(rd.shard_file(0)))
    data = bytearray(rd.shard_file(0).read_bytes())
    data[frames[1].offset + (16 if damage == "count" else 40)] ^= 0x01
    rd.shard_file(0).write_bytes(bytes(data))

    assert run_shard(rd.root, 0).end == DONE
    log = rd.log_file(0).read_text()
    assert "changed after the shard finished" in log and "damaged frames at byte" in log
    assert "3 to generate" in log
    assert len(list(rd.shards_dir.glob("00000.zst.damaged-*"))) == 1
    got = records(rd.root)
    assert len(got) == 12 and {r.id: comparable(r) for r in got} == before
    m = merge_run(rd.root)
    assert m.complete and (m.ok, m.missing, len(m.corrupt)) == (12, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "field, at", [("format", 12), ("fingerprint", 14), ("fingerprint as hex", 14), ("shard", 30)]
)
def test_a_damaged_byte_in_a_shard_files_header_is_salvaged(tmp_path, kimi, field, at):
    """The header's format, fingerprint (a byte that is no ASCII, or another hex digit) or shard number damaged:
    salvaged like any other damage (the frames after it kept, the original kept aside), not a traceback."""
    from toolkit.dataset.merge import merge_run

    job = make_job(tmp_path, kimi, n=9, sampling={"max_new_tokens": 64}, client={"concurrency": 1})
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    before = {r.id: comparable(r) for r in records(rd.root)}
    data = bytearray(rd.shard_file(0).read_bytes())
    data[at] = {"format": 253, "fingerprint": 0xE9, "shard": 7}.get(
        field, ord("0") if data[at] != ord("0") else ord("1")
    )
    rd.shard_file(0).write_bytes(bytes(data))

    assert run_shard(rd.root, 0).end == DONE
    log = rd.log_file(0).read_text()
    assert "changed after the shard finished" in log and "at byte 0 (damaged header" in log
    assert "all have a record; nothing to generate" in log
    assert len(list(rd.shards_dir.glob("00000.zst.damaged-*"))) == 1
    assert {r.id: comparable(r) for r in records(rd.root)} == before
    m = merge_run(rd.root)
    assert m.complete and (m.ok, m.missing, len(m.corrupt)) == (9, 0, 0)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["done", "retry"])
@pytest.mark.parametrize("content", [b"", b"{not json", b'{"shard": "zero"}'])
def test_a_damaged_done_manifest_or_retry_request_is_said_in_one_line_and_the_run_goes_on(
    tmp_path, kimi, caplog, capsys, which, content
):
    from toolkit.cli import main as cli_main

    job = make_job(tmp_path, kimi, n=6, sampling={"max_new_tokens": 64})
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    root = str(rd.root)
    if which == "retry":
        rd.done_file(0).unlink()  # as `toolkit retry --ids` leaves it
    (rd.done_file(0) if which == "done" else rd.retry_file(0)).write_bytes(content)
    said = []
    for argv in (["status", root], ["logs", root, "--failed"], ["merge", root], ["retry", root]):
        caplog.clear()
        code = cli_main(argv)
        assert "Traceback" not in capsys.readouterr().err, argv
        said += [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert code == 0  # retry ran the shard here: nothing to generate, a new done manifest
    assert len(said) == 1 and "\n" not in said[0], said  # once, in one line
    assert ("damaged done manifest" if which == "done" else "damaged retry request") in said[0], (
        said
    )
    assert read_done(rd.done_file(0)).records == 6 and not rd.retry_file(0).exists()
    assert len(records(rd.root)) == 6


@pytest.mark.slow
def test_400_is_recorded_failed_and_the_shard_completes(tmp_path, kimi):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 12, long_every=4)
    job = make_job(
        tmp_path,
        kimi,
        prompts=prompts,
        stub={"context_length": 1024},
        sampling={"max_new_tokens": 100},
    )
    with pytest.raises(PreflightError, match="3 prompts .* do not fit the context length 1,024"):
        prepared_run(
            job
        )  # the pre-flight refuses them; past it (a server with a shorter context), the worker records them
    rd, _ = prepared_run(job, check_tokenizer=False)
    assert run_shard(rd.root, 0).end == DONE
    got = {r.id: r for r in records(rd.root)}
    failed = sorted(i for i, r in got.items() if r.status == "failed")
    assert failed == ["p0003", "p0007", "p0011"]
    assert "HTTP 400" in got["p0003"].error and "context length" in got["p0003"].error
    assert got["p0003"].n_prompt > 1000 and got["p0003"].output_ids == b""
    assert read_done(rd.done_file(0)).failed == 3


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_resumes(tmp_path, kimi):
    job = make_job(
        tmp_path, kimi, n=30, stub={"token_delay_s": 0.004}, sampling={"max_new_tokens": 300}
    )
    rd, _ = prepared_run(job)
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not (rd.shard_file(0).exists() and len(records(rd.root)) >= 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 3, proc.stderr.read()
    p = read_progress(rd, 0)
    assert p.state == "stopped" and 3 <= p.done < 30
    assert not rd.done_file(0).exists()
    assert run_shard(rd.root, 0).end == DONE
    got = newest(
        rd.root
    )  # the requests in flight at the stop left partial records, superseded since
    assert len(got) == 30 and all(r.status == "ok" for r in got.values())


def test_run_dir_with_another_fingerprint_is_refused(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=4)
    prepared_run(job)
    job.write_text(job.read_text().replace("max_new_tokens = 256", "max_new_tokens = 128"))
    with pytest.raises(PlanError, match=r"differs in: sampling.*--new-run"):
        prepared_run(job)
    rd, plan = prepared_run(job, new_run=True)
    assert (
        rd.root != tmp_path / "run"
        and Run.open(rd.root, JobSpec, finish=True).plan.fingerprint == plan.fingerprint
    )


def test_more_shards_than_prompts_is_refused(tmp_path, kimi):
    with pytest.raises(PlanError, match="3 shards for 2 prompts"):
        prepared_run(make_job(tmp_path, kimi, n=2, shards=3))
