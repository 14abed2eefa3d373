"""One bad request never blocks a shard, and a wrong answer is never good data: the worker against a stub that cuts
the answer of one prompt every time (--poison reset / truncate), answers a prompt against SGLang's contract, rate
limits (429), or stops generating altogether."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.cluster.retry import request_retry
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import read_done
from toolkit.worker.run import DONE, run_shard
from toolkit.worker.shard import ShardFailed

MARK = "POISONED"


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def newest(rd) -> dict:
    return {r.id: r for r in read_shard(rd.shard_file(0))}


def poisoned_prompts(path: Path, n: int, poisoned: tuple[int, ...]) -> Path:
    """`n` prompts, those at `poisoned` holding the word the stub's --poison-text looks for."""
    write_prompts(path, n)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for i in poisoned:
        lines[i]["messages"][0]["content"] += f" {MARK}"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def poison_job(tmp_path, kimi, kind: str, *, n: int = 8, poisoned=(3,), **tables):
    prompts = poisoned_prompts(tmp_path / "prompts.jsonl", n, poisoned)
    tables.setdefault("client", {}).update({"concurrency": 2, "retries": 1})
    sampling = tables.pop("sampling", {"max_new_tokens": 64})
    return make_job(
        tmp_path,
        kimi,
        prompts=prompts,
        sampling=sampling,
        stub={"extra_args": ["--poison", kind, "--poison-text", MARK]},
        **tables,
    )


def fix_engine(rd) -> None:
    plan = json.loads(rd.plan_file.read_text())
    plan["spec"]["engine"]["stub"]["extra_args"] = []
    rd.plan_file.write_text(json.dumps(plan))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["reset", "truncate"])
def test_a_prompt_whose_answer_is_cut_every_time_is_a_failed_record_and_the_shard_goes_on(
    tmp_path, kimi, kind
):
    """The connection of one prompt's request is reset (or its body cut) on every attempt while the engine answers
    /health_generate and every other prompt: that prompt is tried [client] max_tries times, then it is a failed
    record of kind `unreachable`, final for the run, with the reason and the count; the shard completes, and a rerun
    finds nothing to do (no spin). Prompt 0, the shard's first, is poisoned too: the readiness probe is none of the
    job's prompts, so it passes. Once the engine is fine, `toolkit retry` generates them (a fresh count)."""
    job = poison_job(tmp_path, kimi, kind, poisoned=(0, 3))
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    got = newest(rd)
    failed = {i: r for i, r in got.items() if r.status != "ok"}
    assert sorted(failed) == ["p0000", "p0003"] and len(got) == 8
    for r in failed.values():
        assert (r.failure, r.attempts, r.tries, r.final) == ("unreachable", 2, 3, True)
        assert r.error.startswith(
            "failed 3 times: unreachable; last: no complete answer after 2 attempts"
        )
        assert "/health_generate" in r.error
    m = read_done(rd.done_file(0))
    assert (m.given_up, m.transient, m.failed) == (2, 0, 2)
    size = rd.shard_file(0).stat().st_size
    assert (
        run_shard(rd.root, 0).end == DONE and rd.shard_file(0).stat().st_size == size
    )  # nothing left to try
    log = rd.log_file(0).read_text()
    assert (
        "prompt p0003 (d) failed (unreachable), try 1 of 3" in log and "probe /generate" not in log
    )

    fix_engine(rd)
    request_retry(rd.root)
    assert run_shard(rd.root, 0).end == DONE
    assert {r.status for r in newest(rd).values()} == {"ok"}


@pytest.mark.slow
def test_an_engine_that_answers_nothing_fails_the_shard_naming_the_prompt_and_the_probe(
    tmp_path, kimi
):
    """Every request cut, the engine's own probe /generate too: the engine, not a prompt, is at fault; no prompt is
    charged a try while it is, it is waited for up to [engine] ready_timeout_s, restarted up to max_restarts (none
    here), and then the shard fails in this task (the prompts in flight are not recorded failed) with a message naming
    a prompt and the probe."""
    job = make_job(
        tmp_path,
        kimi,
        n=8,
        sampling={"max_new_tokens": 64},
        client={"concurrency": 1, "retries": 1},
        engine={"ready_timeout_s": 10, "max_restarts": 0},
        stub={"extra_args": ["--poison", "reset", "--poison-after", "3"]},
    )  # probe + 2 prompts answered
    rd, _ = prepared_run(job)
    with pytest.raises(ShardFailed) as e:
        run_shard(rd.root, 0)
    msg = str(e.value)
    assert "engine died 1 time" in msg and "engine unwell for" in msg, msg
    assert "requests failed (prompt p0002: POST /generate:" in msg, msg
    assert "its probe /generate still fails (POST /generate:" in msg, msg
    got = newest(rd)
    assert sorted(got) == ["p0000", "p0001"] and {r.status for r in got.values()} == {"ok"}


@pytest.mark.slow
def test_429_is_retried_and_past_the_retries_a_transient_failure_not_a_rejection(tmp_path, kimi):
    job = make_job(
        tmp_path,
        kimi,
        n=8,
        stub={"fail_5xx": "2:3", "extra_args": ["--fail-status", "429"]},
        client={"retries": 6, "concurrency": 2},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    got = newest(rd)
    assert {r.status for r in got.values()} == {"ok"} and sum(
        r.attempts for r in got.values()
    ) == 8 + 3

    # every prompt's request answered 429, the engine's probe not: each prompt's own failure
    (tmp_path / "past").mkdir()
    job = poison_job(
        tmp_path / "past",
        kimi,
        "status_429",
        poisoned=tuple(range(8)),
        client={"retries": 1, "concurrency": 2, "max_tries": 1},
    )
    rd, _ = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    failed = [r for r in newest(rd).values() if r.status == "failed"]
    assert len(failed) == 8 and {r.failure for r in failed} == {"server_error"}
    assert all(
        "HTTP 429" in r.error and r.error.startswith("failed once: server_error") for r in failed
    )
    m = read_done(rd.done_file(0))
    assert (m.transient, m.given_up) == (0, 8)


BAD_ANSWERS = {
    # --poison kind: (failure kind, words of the reason)
    "wrong_rid": ("bad_response", "the answer of another request: meta_info.id 'x"),
    "over_max": ("bad_response", "output ids, more than max_new_tokens = 64"),
    "early_length": ("bad_response", "finish_reason length after"),
    "out_of_vocab": ("bad_response", "outside the vocabulary"),
    "unknown_finish": (
        "bad_response",
        "finish_reason {'type': 'finished', 'matched': None} is not an object whose "
        "type is stop, length or abort",
    ),
    "finish_string": ("bad_response", "finish_reason 'stop' is not an object"),
    "finish_null": ("bad_response", "finish_reason None is not an object"),
    "no_completion_tokens": ("bad_response", "meta_info has no completion_tokens"),
    "abort_500": ("server_error", "HTTP 500: aborted with status_code 500: Internal server error"),
}


@pytest.fixture(scope="module")
def healthy_outputs(tmp_path_factory, kimi) -> dict[str, bytes]:
    """The outputs of the poisoned jobs' prompts (greedy) from an engine without poison."""
    tmp = tmp_path_factory.mktemp("healthy")
    job = poison_job(
        tmp, kimi, "reset", n=6, poisoned=(0, 3), sampling={"max_new_tokens": 64, "temperature": 0}
    )
    rd, _ = prepared_run(job)
    fix_engine(rd)
    assert run_shard(rd.root, 0).end == DONE
    return {i: r.output_ids for i, r in newest(rd).items()}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BAD_ANSWERS))
def test_an_answer_that_breaks_the_contract_is_a_failed_record_with_the_reason(
    tmp_path, kimi, kind, healthy_outputs
):
    """Each way an answer can be wrong, checked against its request when it arrives: never stored ok. The shard's
    first prompt is poisoned too: the readiness probe is not that prompt, so its bad answer is its own failure,
    never the engine's. Both are tried max_tries times, then final; the run ends, every other record exact."""
    failure, words = BAD_ANSWERS[kind]
    rd, _ = prepared_run(
        poison_job(
            tmp_path,
            kimi,
            kind,
            n=6,
            poisoned=(0, 3),
            sampling={"max_new_tokens": 64, "temperature": 0},
        )
    )
    assert run_shard(rd.root, 0).end == DONE
    got = newest(rd)
    for i in ("p0000", "p0003"):
        bad = got[i]
        assert (bad.status, bad.failure, bad.tries, bad.final) == ("failed", failure, 3, True), bad
        assert words in bad.error and bad.error.startswith(f"failed 3 times: {failure}"), bad.error
        assert bad.output_ids == b"" and bad.finish is None
    assert all(
        r.status == "ok" and r.output_ids == healthy_outputs[i]
        for i, r in got.items()
        if i not in ("p0000", "p0003")
    )
    m = read_done(rd.done_file(0))
    assert (m.transient, m.given_up) == (0, 2)


@pytest.mark.slow
def test_an_engine_that_refuses_connections_while_its_process_ends_is_restarted_not_unreachable(
    monkeypatch,
):
    """A multi-node engine whose rank died closes rank 0's port seconds before srun ends the step: a request refused
    meanwhile waits for the process to end (EngineDied: restarted) before calling the engine unreachable."""
    import asyncio
    import socket
    import time as _time
    from types import SimpleNamespace

    from toolkit.engines.base import EngineDied, EngineUnreachable
    from toolkit.engines.client import HttpClient, Unreachable
    from toolkit.worker import inflight

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: connections are refused

    def engine(ends_after: float | None):
        t0 = _time.monotonic()
        return SimpleNamespace(
            url=f"http://127.0.0.1:{port}",
            api_key=None,
            exit_code=lambda: -9,
            alive=lambda: ends_after is None or _time.monotonic() - t0 < ends_after,
        )

    def shard():
        return SimpleNamespace(
            spec=SimpleNamespace(engine=SimpleNamespace(hang_timeout_s=5.0)),
            session=SimpleNamespace(probes=HttpClient(f"http://127.0.0.1:{port}")),
        )

    refused = Unreachable("POST /generate: ConnectionRefusedError")
    refused.attempts = 4
    with pytest.raises(EngineDied):
        asyncio.run(inflight._poisoned(shard(), engine(ends_after=1.5), "p1", refused))
    monkeypatch.setattr(inflight, "DYING_S", 1.0)
    with pytest.raises(EngineUnreachable, match="prompt p1 got no answer"):
        asyncio.run(inflight._poisoned(shard(), engine(ends_after=None), "p1", refused))
