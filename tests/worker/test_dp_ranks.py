"""Data-parallel attention: each rank of the engine keeps its own prefix cache, so a request that continues an output
(its next loop-stop segment, its continuation after a stop) is sent to the rank that served its start
(`routed_dp_rank`, from the answers' `meta_info.dp_rank`) and finds the output so far in that rank's cache; the audit
reports the continuations' hit rate. The stub models the ranks as SGLang 0.5.23 does (round robin, a cache each)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.dataset.finish import merge_and_audit
from toolkit.engines.stub import start_standalone
from toolkit.formats.frames import read_shard
from toolkit.formats.progress import read_progress
from toolkit.formats.records import OK, PARTIAL, Record
from toolkit.worker import generate
from toolkit.worker.generate import pinned_rank
from toolkit.worker.run import DONE, run_shard

RANKS = 4
MAX_NEW = 4096
SEGMENT = 512


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def stub_with_ranks(kimi, *args: str):
    return start_standalone(
        str(kimi),
        "--context-length",
        "32768",
        "--dp-size",
        str(RANKS),
        "--enable-dp-attention",
        "--output-scale",
        str(MAX_NEW),
        *args,
    )


def call(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + "/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def records(run: Path) -> list[Record]:
    return list(read_shard(Path(run) / "shards" / "00000.zst"))


def newest(run: Path) -> dict[str, Record]:
    return {r.id: r for r in records(run)}


def job(tmp: Path, prompts: Path, url: str, **client) -> Path:
    # 5 requests in flight over 4 ranks: the round robin does not send a slot's next request to the same rank by
    # chance (with 8, each slot would come back to its rank every time)
    return make_job(
        tmp,
        _KIMI[0],
        prompts=prompts,
        engine={"kind": "external", "url": url},
        sampling={"max_new_tokens": MAX_NEW},
        client={
            "concurrency": 5,
            "request_timeout_s": 60,
            "retries": 2,
            "backoff_s": 0.05,
            **client,
        },
        audit={"max_length_share": 1.0, "min_think_end_share": 0.0},
    )


_KIMI: list[Path] = []


def hit_rate(run: Path) -> float:
    report = merge_and_audit(run, out=(out := io.StringIO()))
    o = report.overall
    assert o.continued_tokens > 0 and "prefix cache of continuations: " in out.getvalue()
    return o.continued_cache_hit


def test_the_stub_s_ranks_each_keep_their_own_prefix_cache_and_take_routed_dp_rank(kimi):
    """Round robin over the ranks unless routed_dp_rank names one; a continuation (prompt + output) finds all but
    its last token on its own rank, next to nothing on another; a rank outside the engine is SGLang's 400."""
    stub, url = stub_with_ranks(kimi)
    plain, plain_url = start_standalone(str(kimi), "--context-length", "32768")
    try:
        prompts = [[11 + i, 500 + 7 * i, 900 + i, 4000 + i, 77, 78, 79] for i in range(2 * RANKS)]
        answers = [
            call(url, {"input_ids": p, "sampling_params": {"max_new_tokens": 24}})[1]
            for p in prompts
        ]
        assert [a["meta_info"]["dp_rank"] for a in answers] == [i % RANKS for i in range(2 * RANKS)]
        p, a = prompts[1], answers[1]
        cont = p + a["output_ids"]
        body = {"input_ids": cont, "sampling_params": {"max_new_tokens": 8}}
        status, own = call(url, {**body, "routed_dp_rank": 1})
        assert (
            status == 200
            and own["meta_info"]["dp_rank"] == 1
            and own["meta_info"]["cached_tokens"] == len(cont) - 1
        )
        status, other = call(url, {**body, "routed_dp_rank": 2})
        assert (
            status == 200
            and other["meta_info"]["dp_rank"] == 2
            and other["meta_info"]["cached_tokens"] < len(p)
        )
        status, err = call(url, {**body, "routed_dp_rank": RANKS})
        assert (
            status == 400
            and err["error"]["message"] == f"routed_dp_rank={RANKS} out of range [0, {RANKS})"
        )
        # routed requests leave the round robin where it was
        assert (
            call(url, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})[1][
                "meta_info"
            ]["dp_rank"]
            == 0
        )
        # without data parallelism: dp_rank null (SGLang 0.5.23 sends the key), routed_dp_rank 0 ignored, 1 refused
        status, one = call(
            plain_url,
            {"input_ids": p, "sampling_params": {"max_new_tokens": 4}, "routed_dp_rank": 0},
        )
        assert (
            status == 200 and "dp_rank" in one["meta_info"] and one["meta_info"]["dp_rank"] is None
        )
        status, err = call(
            plain_url,
            {"input_ids": p, "sampling_params": {"max_new_tokens": 4}, "routed_dp_rank": 1},
        )
        assert status == 400 and "out of range [0, 1)" in err["error"]["message"]
    finally:
        os.killpg(stub.pid, signal.SIGKILL)
        os.killpg(plain.pid, signal.SIGKILL)


def test_a_pin_is_a_rank_the_engine_has():
    assert pinned_rank(3, 4) == 3 and pinned_rank(0, 8) == 0
    assert pinned_rank(None, 4) is None  # a new output: the server's load balancer chooses
    assert pinned_rank(3, 2) is None  # the engine came back with fewer ranks: the pin is dropped
    assert (
        pinned_rank(0, 1) is None and pinned_rank(0, 0) is None
    )  # no data parallelism, or not said


@pytest.fixture
def ranks_run(tmp_path, kimi):
    _KIMI[:] = [kimi]
    stub, url = stub_with_ranks(kimi)
    try:
        yield tmp_path, write_prompts(tmp_path / "prompts.jsonl", 24), url
    finally:
        os.killpg(stub.pid, signal.SIGKILL)


def test_every_loop_stop_segment_goes_to_its_output_s_rank_and_finds_its_prefix(
    ranks_run, monkeypatch
):
    """Outputs asked for in segments: each next segment is pinned to the rank of the output so far, whose cache holds
    all of it but the last token; the audit's hit rate says so. Without the pin (the control), they miss."""
    tmp_path, prompts, url = ranks_run
    rd, _ = prepared_run(
        job(tmp_path / "pinned", prompts, url, loop_stop=True, segment_tokens=SEGMENT)
    )
    assert run_shard(rd.root, 0).end == DONE
    got = newest(rd.root)
    segmented = [r for r in got.values() if r.segments > 1]
    assert len(segmented) >= 5 and all(r.status == OK for r in got.values())
    for r in got.values():
        # every continuation request (segments - 1 of them) found its input but the last token
        assert r.continued_cached == r.continued_tokens - (r.segments - 1), r.id
        assert r.dp_rank in range(RANKS)
    assert (
        len({r.dp_rank for r in got.values()}) == RANKS
    )  # new outputs are not pinned: every rank served some
    assert hit_rate(rd.root) >= 0.99

    monkeypatch.setattr(generate, "pinned_rank", lambda rank, ranks: None)
    urllib.request.urlopen(
        urllib.request.Request(url + "/flush_cache", method="POST"), timeout=10
    ).read()
    control, _ = prepared_run(
        job(tmp_path / "unpinned", prompts, url, loop_stop=True, segment_tokens=SEGMENT)
    )
    assert run_shard(control.root, 0).end == DONE
    assert hit_rate(control.root) < 0.6


@pytest.mark.slow
def test_a_continuation_after_a_stop_goes_to_the_rank_its_partial_record_names(tmp_path, kimi):
    """SIGTERM mid-run: the partial records keep the rank of their output; the resumed worker (a new process, on the
    same engine) sends each continuation there and finds the output so far in its cache."""
    _KIMI[:] = [kimi]
    stub, url = stub_with_ranks(kimi, "--token-delay", "0.002")
    try:
        prompts = write_prompts(tmp_path / "prompts.jsonl", 16)
        rd, _ = prepared_run(job(tmp_path / "stopped", prompts, url))
        proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while not (rd.shard_file(0).exists() and len(records(rd.root)) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no records written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 3, proc.stderr.read()
        partial = {r.id: r for r in records(rd.root) if r.status == PARTIAL and r.n_output}
        assert len(partial) >= 3 and all(r.dp_rank in range(RANKS) for r in partial.values())
        assert len({r.dp_rank for r in partial.values()}) > 1
        assert run_shard(rd.root, 0).end == DONE
        got = newest(rd.root)
        for i, p in partial.items():
            r = got[i]
            assert r.status == OK and r.dp_rank == p.dp_rank and r.continued_tokens > 0, i
            assert r.continued_tokens - r.continued_cached <= r.segments, (
                i
            )  # at most one token a request
        assert hit_rate(rd.root) >= 0.99
    finally:
        os.killpg(stub.pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_request_handed_over_at_the_tail_is_continued_on_the_rank_that_holds_it(
    tmp_path, kimi, monkeypatch
):
    """Two tasks on one engine of four ranks: the receiver (a worker process claiming shards 1, 2, then 0) and the
    giver (this process, which finds only shard 0 left to claim), which hands its requests over once it has sent its last prompt (kept as partial
    records, its shard released; the tail's decision forced, as the policy would take it with the other task idle:
    on one shared engine both tasks see the same load). The receiver claims shard 0 and continues each partial output
    on its rank, finding the output so far in that rank's cache."""
    from toolkit.worker import claims, poolview

    stub, url = start_standalone(
        str(kimi),
        "--context-length",
        "32768",
        "--dp-size",
        str(RANKS),
        "--enable-dp-attention",
        "--token-delay",
        "0.01",
    )
    receiver = None
    try:
        rd, _ = prepared_run(
            make_job(
                tmp_path,
                kimi,
                n=48,
                shards=3,
                engine={"kind": "external", "url": url},
                sampling={"max_new_tokens": 300},
                client={"concurrency": 8},
            )
        )
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        receiver = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "toolkit",
                "worker",
                str(rd.root),
                "--claim",
                "1",
                "2",
                "0",
                "--group",
                "g",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not all(
            read_progress(rd, k) is not None and read_progress(rd, k).state == "generating"
            for k in (1, 2)
        ):
            assert receiver.poll() is None and time.monotonic() < deadline, (
                "the receiver generates nothing"
            )
            time.sleep(0.05)
        monkeypatch.setattr(
            poolview,
            "hands_over",
            lambda me, others, claimable, share=0.25: (
                me.running > 0 and any(not o.leaving for o in others)
            ),
        )
        gave = claims.run_claims(rd.root, [0, 1, 2], task="giver", group="g")
        assert gave.handed_over == [0]
        assert receiver.wait(180) == 0
        written = list(read_shard(rd.shard_file(0)))
        partial = {r.id: r for r in written if r.status == PARTIAL and r.n_output}
        assert len(partial) >= 2 and all(r.dp_rank in range(RANKS) for r in partial.values())
        got = {r.id: r for r in written}
        assert len(got) == 16 and all(r.status == OK for r in got.values())
        for i, p in partial.items():
            r = got[i]
            assert r.dp_rank == p.dp_rank and r.continued_tokens > 0, i
            assert r.continued_tokens - r.continued_cached <= r.segments, (
                i
            )  # at most one token a request
        assert hit_rate(rd.root) >= 0.99
    finally:
        if receiver is not None and receiver.poll() is None:
            receiver.kill()
        os.killpg(stub.pid, signal.SIGKILL)
