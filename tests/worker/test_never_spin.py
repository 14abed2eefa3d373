"""Never spin: a prompt whose failure may pass but recurs every time (a 503, a NaN stop, a reset connection, a
request that never answers) is tried [client] max_tries times, then its failure is final for the run and the shard
is done; every loop of the worker ends with a fault that always recurs; the readiness probe is none of the job's
prompts, so a prompt's bad answer is that prompt's failure, never the engine's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import read_done
from toolkit.formats.progress import read_progress

REPO = Path(__file__).resolve().parents[2]

# prompt position -> (the stub's poison kind, the failure kind it is recorded with)
ALWAYS = {
    2: ("status_503", "server_error"),
    5: ("nan", "nan"),
    7: ("reset", "unreachable"),
    9: ("hang", "timeout"),
}


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def marked_prompts(path: Path, n: int, marks: dict[int, str]) -> Path:
    """`n` prompts; the one at position i holds the word marks[i] (what a --poison-prompt rule looks for)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_prompts(path, n)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for i, word in marks.items():
        lines[i]["messages"][0]["content"] += f" {word}"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def mark(kind: str) -> str:
    return f"ALWAYS{kind.upper().replace('_', '')}"


def always_job(
    tmp: Path,
    kimi,
    faults: dict[int, str],
    *,
    n: int = 12,
    shards: int = 2,
    max_tries: int = 3,
    poison: bool = True,
    **tables,
) -> Path:
    """A greedy job (outputs repeat exactly) whose prompts at `faults` get the stub's poison of that kind on every
    request (with `poison` False: the same prompts, a healthy engine)."""
    prompts = marked_prompts(tmp / "prompts.jsonl", n, {i: mark(k) for i, k in faults.items()})
    rules = [
        a for k in dict.fromkeys(faults.values()) for a in ("--poison-prompt", f"{k}={mark(k)}")
    ]
    client = {
        "concurrency": 2,
        "retries": 1,
        "request_timeout_s": 2.0,
        "backoff_s": 0.05,
        "backoff_max_s": 0.2,
        "max_tries": max_tries,
        **tables.pop("client", {}),
    }
    tables.setdefault(
        "audit", {"max_failed_share": 1.0, "max_empty_reasoning_share": 1.0}
    )  # (a few tiny outputs)
    return make_job(
        tmp,
        kimi,
        prompts=prompts,
        shards=shards,
        sampling={"max_new_tokens": 48, "temperature": 0},
        stub={"extra_args": rules if poison else []},
        client=client,
        **tables,
    )


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


def newest(rd, shards: int) -> dict:
    return {r.id: r for k in range(shards) for r in read_shard(rd.shard_file(k))}


def every_record(rd, shards: int) -> list:
    return [r for k in range(shards) for r in read_shard(rd.shard_file(k))]


def clean_outputs(tmp: Path, kimi, faults: dict[int, str], n: int = 12) -> dict[str, bytes]:
    """The outputs of the same job on a healthy engine: what every record that did not fail must hold."""
    job = always_job(tmp, kimi, faults, n=n, poison=False)
    r = toolkit("run", str(job))
    assert r.returncode == 0, r.stdout + r.stderr
    rd, _ = prepared_run(job)
    return {i: rec.output_ids for i, rec in newest(rd, 2).items()}


@pytest.mark.slow
def test_prompts_that_fail_the_same_way_every_time_end_the_run_failed_with_their_count(
    tmp_path, kimi
):
    """One prompt always answered 503, one always a NaN stop, one whose connection is always reset, one never
    answered: `toolkit run` ends by itself, each of them failed 3 times and final (the shard done), every other
    record exactly what a healthy engine gives; `status` names the failures and `toolkit retry`, which starts a
    fresh count."""
    faults = {i: k for i, (k, _) in ALWAYS.items()}
    expected = clean_outputs(tmp_path / "clean", kimi, faults)
    job = always_job(tmp_path / "run", kimi, faults)
    r = toolkit("run", str(job))
    out = r.stdout + r.stderr
    rd, _ = prepared_run(job)
    got = newest(rd, 2)
    assert len(got) == 12
    for i, (_, failure) in ALWAYS.items():
        rec = got[f"p{i:04d}"]
        assert (rec.status, rec.failure, rec.tries, rec.final) == ("failed", failure, 3, True), rec
        assert rec.error.startswith(f"failed 3 times: {failure}; last: "), rec.error
    for i, rec in got.items():
        if rec.status == "ok":
            assert rec.output_ids == expected[i], i
    assert sum(rec.status == "ok" for rec in got.values()) == 12 - len(ALWAYS)
    # three tries of each, each written (the count lives in the records), then nothing more
    tries = [rec for rec in every_record(rd, 2) if rec.status != "ok"]
    assert sorted((rec.id, rec.tries) for rec in tries) == sorted(
        (f"p{i:04d}", t) for i in ALWAYS for t in (1, 2, 3)
    )
    dones = [read_done(rd.done_file(k)) for k in range(2)]
    assert all(m is not None for m in dones), out
    assert sum(m.given_up for m in dones) == 4 and sum(m.transient for m in dones) == 0
    assert sum(m.failed for m in dones) == 4
    assert all(read_progress(rd, k).state == "done" for k in range(2))
    logs = out + rd.log_file(0).read_text() + rd.log_file(1).read_text()
    assert "failed 3 times: nan" in logs and "final for this run: `toolkit retry" in logs
    assert rd.merged_file.exists(), out  # merged and audited: the run ended with its failures

    st = toolkit("status", str(rd.root))
    assert st.returncode == 1, st.stdout + st.stderr
    assert "4 failures that may pass" in st.stdout and f"toolkit retry {rd.shown}" in st.stdout, (
        st.stdout
    )

    # `toolkit retry` gives them a fresh budget: tried 3 more times (counted from 1 again), final again
    r = toolkit("retry", str(rd.root))
    got = newest(rd, 2)
    again = [rec for rec in every_record(rd, 2) if rec.status != "ok"]
    assert len(again) == 2 * len(tries), r.stdout + r.stderr
    assert all(got[f"p{i:04d}"].tries == 3 and got[f"p{i:04d}"].final for i in ALWAYS)
    assert sum(rec.tries == 1 for rec in again) == 2 * len(ALWAYS)


# ---------------------------------------------------------------------------------------------------
# every loop of the worker ends when its fault recurs every time
# ---------------------------------------------------------------------------------------------------
EVERY = "EVERYONE"  # a word every prompt of these jobs holds
LOOPS = {
    # the loop: (what the stub does, job tables, what becomes of each shard, words in the worker's output)
    "retry of failures that may pass": (
        ["--poison-prompt", f"status_503={EVERY}"],
        {},
        "done",
        "failed 3 times",
    ),
    "reconnect of a reset connection": (
        ["--poison-prompt", f"reset={EVERY}"],
        {},
        "done",
        "failed 3 times",
    ),
    "continuation of aborts": (
        ["--poison-prompt", f"abort_empty={EVERY}"],
        {},
        "done",
        "failed 3 times: aborted",
    ),
    "engine restart": (
        [],
        {"stub": {"crash_after": 2}, "engine": {"max_restarts": 1}},
        "failed",
        "engine died 2 times",
    ),
    "engine start (never ready)": (
        ["--hang"],
        {"engine": {"ready_timeout_s": 2}},
        "failed",
        "not ready after 2 s",
    ),
    "readiness probe": (
        ["--poison", "no_completion_tokens"],
        {},
        "failed",
        "probe /generate breaks SGLang's protocol",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_every_loop_of_a_claiming_worker_ends_when_its_fault_always_recurs(tmp_path, kimi, loop):
    """A claiming worker over two shards whose fault recurs on every request (or every engine start): it ends by
    itself, within a bound, having claimed each shard once; a shard is done with its prompts failed (final, with the
    count) or failed in this worker, never claimed again; no traceback."""
    args, tables, outcome, words = LOOPS[loop]
    stub = {"extra_args": args, **tables.pop("stub", {})}
    prompts = marked_prompts(tmp_path / "prompts.jsonl", 6, {i: EVERY for i in range(6)})
    engine = {"max_restarts": 2, **tables.pop("engine", {})}
    job = make_job(
        tmp_path,
        kimi,
        prompts=prompts,
        shards=2,
        sampling={"max_new_tokens": 32},
        stub=stub,
        engine=engine,
        client={"concurrency": 2, "retries": 1, "backoff_s": 0.05, "backoff_max_s": 0.1},
    )
    rd, _ = prepared_run(job)
    r = toolkit(
        "worker", str(rd.root), "--claim", "0", "1", timeout=180
    )  # a worker that spins fails here
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out
    assert out.count("claims shard 0") == 1 and out.count("claims shard 1") == 1, out
    logs = out + rd.log_file(0).read_text() + rd.log_file(1).read_text()
    assert words in logs, logs
    if outcome == "done":
        assert r.returncode == 0, out
        got = newest(rd, 2)
        assert len(got) == 6 and all(
            rec.status == "failed" and rec.final and rec.tries == 3 for rec in got.values()
        )
        assert all(read_done(rd.done_file(k)).given_up == 3 for k in range(2))
    else:
        assert r.returncode == 1, out
        assert all(read_progress(rd, k).state == "failed" for k in range(2))
        assert "2 failed" in out


# ---------------------------------------------------------------------------------------------------
# on the local Slurm cluster
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.slurm
def test_on_slurm_prompts_that_always_fail_end_the_array_and_the_merge_job_runs(tmp_path, kimi):
    """The same four prompts on the cluster, the array's tasks claiming two shards: the array ends by itself, the
    merge job runs, and `status` says what failed and that `toolkit retry` generates it again."""
    import time

    from toolkit.cluster.status import run_status

    if not os.environ.get("SLURM_CONF"):
        pytest.fail(
            'SLURM_CONF is not set: start the local cluster first, eval "$(slurm/start.sh)" (see README)'
        )
    faults = {i: k for i, (k, _) in ALWAYS.items()}
    job = always_job(
        tmp_path,
        kimi,
        faults,
        slurm={"gpus_per_node": 1, "cpus_per_task": 1, "time": "00:10:00", "merge_cpus": 1},
    )
    r = toolkit("submit", str(job), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    rd, _ = prepared_run(job)
    active = ("pending", "running", "submitted", "requeued", "configuring", "completing")
    deadline = time.time() + 300
    while (
        True
    ):  # until every task and the merge job have left the queue (a spinning task would hold it)
        _, rows, merge = run_status(rd.root)
        if all(x.state not in active for x in rows) and merge.state not in (*active, None):
            break
        assert time.time() < deadline, (
            f"the run did not end: {[(x.shard, x.state) for x in rows]}, merge {merge}"
        )
        time.sleep(1.0)
    assert [x.state for x in rows] == ["completed", "completed"] and merge.merged, (rows, merge)
    got = newest(rd, 2)
    assert sorted(i for i, rec in got.items() if rec.status != "ok") == sorted(
        f"p{i:04d}" for i in ALWAYS
    )
    assert all(
        got[f"p{i:04d}"].error.startswith(f"failed 3 times: {f}") for i, (_, f) in ALWAYS.items()
    )
    st = toolkit("status", str(rd.root))
    assert st.returncode == 1 and "4 failures that may pass in shards 0-1" in st.stdout, st.stdout
    assert f"`toolkit retry {rd.shown}`" in st.stdout, st.stdout


@pytest.mark.slow
def test_the_count_of_tries_survives_a_stop_and_a_requeue_and_retry_ids_starts_it_afresh(
    tmp_path, kimi
):
    """The count lives in the records, not in a process: a worker stopped (SIGTERM) while it waits to try a prompt
    again leaves its first try recorded; the next run (a requeued task) goes on with tries 2 and 3, then the failure
    is final. `toolkit retry --ids` asks for it again with a fresh count: tries 1 to 3 again."""
    import signal
    import time

    # (no retry within a try: its backoff, 30 to 60 s with these settings, would delay the first try's record)
    job = always_job(
        tmp_path,
        kimi,
        {1: "status_503"},
        n=4,
        shards=1,
        sharding={"flush_records": 1},
        client={"backoff_s": 60.0, "backoff_max_s": 60.0, "retries": 0},
    )
    rd, _ = prepared_run(job)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 60

    def first_try_recorded() -> bool:
        return rd.shard_file(0).exists() and any(rec.id == "p0001" for rec in every_record(rd, 1))

    while not first_try_recorded():
        assert time.time() < deadline and proc.poll() is None, "the first try was never recorded"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # while it waits 60 s to try p0001 again
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    first = [rec for rec in every_record(rd, 1) if rec.id == "p0001"]
    assert [(rec.tries, rec.final) for rec in first] == [(1, False)] and read_done(
        rd.done_file(0)
    ) is None

    plan = json.loads(
        rd.plan_file.read_text()
    )  # the job's backoff shortened, as a job planned again would
    plan["spec"]["client"].update(backoff_s=0.05, backoff_max_s=0.1)
    rd.plan_file.write_text(json.dumps(plan))
    r = toolkit("worker", str(rd.root), "0")
    assert r.returncode == 0, r.stdout + r.stderr
    tries = [(rec.tries, rec.final) for rec in every_record(rd, 1) if rec.id == "p0001"]
    assert tries == [(1, False), (2, False), (3, True)]
    assert read_done(rd.done_file(0)).given_up == 1

    ids = tmp_path / "ids.txt"
    ids.write_text("p0001\n")
    r = toolkit("retry", str(rd.root), "--ids", str(ids))
    tries = [(rec.tries, rec.final) for rec in every_record(rd, 1) if rec.id == "p0001"]
    assert tries == [(1, False), (2, False), (3, True)] * 2, r.stdout + r.stderr
