"""Workers that claim shards: one engine start per worker, shards taken one after another, exactly once under
kill -9; the policy that picks the next shard; `toolkit run` with a worker per engine's worth of GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobfiles import make_job, prepared_run
from toolkit.dataset.merge import merge_run
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import read_done
from toolkit.formats.progress import read_progress
from toolkit.formats.run import Run
from toolkit.worker.claims import run_claims
from toolkit.worker.policy import Candidate, pick, start_of

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def engine_starts(server_log: Path) -> int:
    return (
        server_log.read_text().count("===== toolkit: engine start #") if server_log.exists() else 0
    )


def all_engine_starts(rd) -> int:
    return sum(engine_starts(p) for p in rd.logs_dir.glob("*.server.log"))


def merged_ids(rd) -> list[str]:
    merge_run(rd.root)
    return [r.id for r in read_shard(rd.merged_file)]


# ---------------------------------------------------------------------------------------------------
# the policy (the simulation in benchmarks/bench_claims_sim.py calls the same function)
# ---------------------------------------------------------------------------------------------------
def test_the_shard_with_most_prompts_left_is_claimed_first_ties_in_the_workers_own_order():
    pool = [0, 1, 2, 3, 4, 5]
    fresh = [Candidate(k, 10) for k in pool]
    assert (
        pick(fresh, pool, start_of(0, 2, pool)) == 0
        and pick(fresh, pool, start_of(1, 2, pool)) == 3
    )
    assert [
        start_of(i, 6, pool) for i in range(6)
    ] == pool  # as many workers as shards: worker i takes shard i
    # a shard half done by a preempted task waits until the fresh ones are taken
    assert pick([Candidate(0, 4), Candidate(4, 10)], pool, 0) == 4
    assert pick([Candidate(1, 3), Candidate(5, 3)], pool, start_of(1, 2, pool)) == 5
    assert pick([], pool, 0) is None


# ---------------------------------------------------------------------------------------------------
# one engine for every shard a worker claims
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_one_engine_start_serves_every_shard_the_worker_claims(tmp_path, kimi):
    rd, plan = prepared_run(
        make_job(tmp_path, kimi, n=16, shards=4, sampling={"max_new_tokens": 32})
    )
    r = run_claims(rd.root, [0, 1, 2, 3], task="w0", group="g")
    assert sorted(r.done) == [0, 1, 2, 3] and not r.failed and r.stopped is None
    assert r.engine_starts == 1 and all_engine_starts(rd) == 1
    ps = [read_progress(rd, k) for k in range(4)]
    assert [(p.state, p.task, p.group, p.task_engine_starts) for p in ps] == [
        ("done", "w0", "g", 1)
    ] * 4
    assert sorted(p.task_shards for p in ps) == [1, 2, 3, 4]
    second = next(k for k, p in enumerate(ps) if p.task_shards == 2)
    assert "already running" in rd.log_file(second).read_text()
    logs = [
        rd.log_file(k).read_text() for k in range(4)
    ]  # the tokenizer too is loaded once for the four
    assert sum(t.count("loaded tokenizer") for t in logs) == 1
    assert sum(t.count("tokenizer kept from this task's previous shard") for t in logs) == 3
    assert sorted(merged_ids(rd)) == sorted(f"p{i:04d}" for i in range(16))
    # claiming again finds nothing to do and starts nothing
    again = run_claims(rd.root, [0, 1, 2, 3], task="w1", group="g2")
    assert again.done == [] and again.engine_starts == 0 and all_engine_starts(rd) == 1
    # a done shard whose file changed since is checked again (salvaged, and what is missing generated)
    with open(rd.shard_file(2), "ab") as f:
        f.write(b"\0torn")
    third = run_claims(rd.root, [0, 1, 2, 3], task="w2", group="g3")
    assert (
        third.done == [2]
        and "the file changed after the shard finished" in rd.log_file(2).read_text()
    )
    assert sorted(merged_ids(rd)) == sorted(f"p{i:04d}" for i in range(16))


def claiming_worker(rd, pool: list[int], i: int, n: int, group: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "toolkit",
        "worker",
        str(rd.root),
        "--claim",
        *map(str, pool),
        "--worker",
        str(i),
        "--workers",
        str(n),
        "--group",
        group,
    ]
    return subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.slow
def test_kill_9_of_a_claiming_worker_mid_shard_its_shard_is_claimed_again_every_id_once(
    tmp_path, kimi
):
    n, shards = 36, 6
    rd, plan = prepared_run(
        make_job(
            tmp_path,
            kimi,
            n=n,
            shards=shards,
            stub={"token_delay_s": 0.01},
            sampling={"max_new_tokens": 200},
            client={"concurrency": 2},
        )
    )
    pool = list(range(shards))
    workers = [claiming_worker(rd, pool, i, 2, "g") for i in range(2)]
    try:
        deadline = time.time() + 90
        victim = None
        while time.time() < deadline and victim is None:  # worker 0 starts with shard 0
            p = read_progress(rd, 0)
            if (
                p is not None
                and p.state == "generating"
                and p.done >= 1
                and p.pid == workers[0].pid
            ):
                victim = p
            time.sleep(0.1)
        assert victim is not None, "worker 0 never generated shard 0"
        workers[0].send_signal(signal.SIGKILL)
        workers[0].wait()
        assert read_done(rd.done_file(0)) is None, "killed mid-shard"
        assert workers[1].wait(timeout=240) == 0
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    # the other worker took the dead one's shard up (its lock went with it), with its one engine
    p0 = read_progress(rd, 0)
    assert p0.state == "done" and p0.pid == workers[1].pid and p0.resumed >= 1
    assert all(read_done(rd.done_file(k)) is not None for k in pool)
    assert {
        read_progress(rd, k).task_engine_starts
        for k in pool
        if read_progress(rd, k).pid == workers[1].pid
    } == {1}
    ids = merged_ids(rd)
    assert len(ids) == n and sorted(ids) == sorted(f"p{i:04d}" for i in range(n))


# ---------------------------------------------------------------------------------------------------
# `toolkit run` on one box: a worker per engine's worth of GPUs
# ---------------------------------------------------------------------------------------------------
def toolkit_run(job: Path, *args: str, gpus: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return subprocess.run(
        [sys.executable, "-m", "toolkit", "run", str(job), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, parallel, expected",
    [(1, None, ["0", "1", "2", "3"]), (2, None, ["0,1", "2,3"]), (1, "4", ["0", "1", "2", "3"])],
)
def test_run_on_one_box_uses_every_gpu_with_a_worker_per_engine(
    tmp_path, kimi, tp, parallel, expected
):
    job = make_job(
        tmp_path, kimi, n=24, shards=8, sampling={"max_new_tokens": 32}, engine={"tp_size": tp}
    )
    r = toolkit_run(job, *(["--parallel", parallel] if parallel else []), gpus="0,1,2,3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "audit of run" in r.stdout and "PASSED" in r.stdout
    rd, _ = prepared_run(job)
    ps = [read_progress(rd, k) for k in range(8)]
    tasks = {p.task for p in ps}
    assert len(tasks) <= len(expected) and {p.gpus for p in ps} <= set(expected)
    assert len({p.group for p in ps}) == 1
    # one engine start per worker, never one per shard (under load a worker whose engine is ready last may find
    # every shard taken: it started its engine and took none)
    assert len(tasks) <= all_engine_starts(rd) <= len(expected)
    assert all(p.task_engine_starts == 1 for p in ps)
    assert sorted(merged_ids(rd)) == sorted(f"p{i:04d}" for i in range(24))


@pytest.mark.slow
def test_more_workers_than_the_gpus_hold_is_refused_before_any_engine_starts(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=4, shards=2, engine={"tp_size": 2})
    r = toolkit_run(job, "--parallel", "3", gpus="0,1,2,3")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        "--parallel 3 needs 6 GPUs (2 per engine) but 4 are visible (0,1,2,3); at most --parallel 2"
        in r.stderr
    ), r.stderr


def test_gpus_split_between_workers():
    from toolkit.engines.layout import split_gpus, visible_gpus

    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == ["0", "1", "2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == [] and visible_gpus({}, lambda: 2) == [
        "0",
        "1",
    ]
    assert split_gpus(["0", "1", "2", "3", "4", "5", "6", "7"], 8, None) == (
        1,
        [["0", "1", "2", "3", "4", "5", "6", "7"]],
    )
    assert split_gpus(["0", "1", "2", "3", "4", "5", "6", "7"], 2, None)[0] == 4
    assert split_gpus(["4", "5", "6"], 1, 3) == (
        3,
        [["4"], ["5"], ["6"]],
    )  # the visible ids, not 0..n-1
    with pytest.raises(
        ValueError, match="GPU 6 would sit idle .*give --parallel 3, or CUDA_VISIBLE_DEVICES=4,5 "
    ):
        split_gpus(["4", "5", "6"], 1, 2)
    with pytest.raises(
        ValueError,
        match=r"2 workers of 3 GPUs per engine use 6 of the 8 visible GPUs \(0,1,2,3,4,5,6,7\): "
        r"GPUs 6,7 would sit idle for the whole run; give CUDA_VISIBLE_DEVICES=0,1,2,3,4,5 ",
    ):
        split_gpus([str(i) for i in range(8)], 3, None)
    assert split_gpus([], 8, None) == (1, [[]]) and split_gpus([], 8, 3) == (3, [[], [], []])
    with pytest.raises(ValueError, match="one engine needs 8 GPUs but 4 are visible"):
        split_gpus(["0", "1", "2", "3"], 8, None)


def test_a_free_worker_is_offered_unfinished_unheld_shards_not_failed_in_its_group(tmp_path, kimi):
    import fcntl

    import msgspec

    from toolkit.formats.manifests import DoneManifest
    from toolkit.formats.progress import Progress, write_progress
    from toolkit.worker.poolview import claimable, look

    def candidates(skip: set[int], group: str) -> list[Candidate]:  # what a claiming worker sees
        return claimable(plan, look(Run(rd, plan), pool, group=group), skip)

    rd, plan = prepared_run(make_job(tmp_path, kimi, n=10, shards=5))
    pool = list(range(5))
    rd.done_file(0).parent.mkdir(parents=True, exist_ok=True)
    rd.done_file(0).write_bytes(
        msgspec.json.encode(
            DoneManifest(
                shard=0,
                fingerprint=plan.fingerprint,
                records=2,
                ok=2,
                failed=0,
                prompt_tokens=1,
                output_tokens=1,
                bytes=0,
                sha256="0",
                host="h",
                finished="2026-01-01T00:00:00+00:00",
            )
        )
    )
    write_progress(rd.progress_file(1), Progress(shard=1, total=2, state="failed", group="g"))
    write_progress(
        rd.progress_file(3), Progress(shard=3, total=2, done=1, state="stopped", group="g")
    )
    rd.shard_file(2).write_bytes(b"")
    with open(rd.shard_file(2), "rb") as held:  # another worker holds shard 2
        fcntl.flock(held, fcntl.LOCK_EX)
        assert candidates(set(), "g") == [Candidate(3, 1), Candidate(4, 2)]
        # a shard failed in another group (an earlier submission) is offered again; `skip` leaves one out
        assert candidates({4}, "h") == [Candidate(1, 2), Candidate(3, 1)]
    assert [c.shard for c in candidates(set(), "g")] == [2, 3, 4]


def parallel_run_generating(tmp_path, kimi, n: int, env: dict[str, str]):
    """`toolkit run --parallel 2` of n prompts in 4 shards, started in its own session and returned once both
    workers generate, a few records in: (job, run dir, process)."""
    job = make_job(
        tmp_path,
        kimi,
        n=n,
        shards=4,
        stub={"token_delay_s": 0.01},
        sampling={"max_new_tokens": 200},
        client={"concurrency": 2},
    )
    env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "run", str(job), "--parallel", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    rd, _ = prepared_run(job)
    deadline = time.time() + 90
    while time.time() < deadline:
        ps = [read_progress(rd, k) for k in range(4)]
        if sum(1 for p in ps if p is not None and p.state == "generating" and p.done >= 1) >= 2:
            return job, rd, proc
        time.sleep(0.1)
    proc.kill()
    pytest.fail("two workers never generated at once")


@pytest.mark.slow
def test_sigterm_stops_a_parallel_run_cleanly_and_the_next_run_finishes_every_id_once(
    tmp_path, kimi
):
    """SIGTERM to `toolkit run` with two workers mid-run: it is passed on, each worker stops its shard (what is in
    flight kept as partial outputs), the run exits 3 with no engine left; the next `toolkit run` claims what is
    left and merges every id once."""
    n = 32
    job, rd, proc = parallel_run_generating(
        tmp_path, kimi, n, {**os.environ, "PYTHONPATH": str(REPO)}
    )
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 3, out
    assert out.count("got SIGTERM: stopping") == 2, out
    ps = [read_progress(rd, k) for k in range(4)]
    stopped = [p for p in ps if p is not None and p.state == "stopped"]
    assert len(stopped) == 2 and all(p.stop_signal == "SIGTERM" for p in stopped)
    assert not any(p is not None and p.state in ("loading", "generating") for p in ps)
    left = subprocess.run(
        ["pgrep", "-f", f"toolkit.stub .*{rd.root}"], capture_output=True, text=True
    ).stdout
    assert not left.strip(), "no engine outlives its worker"
    r = toolkit_run(job, "--parallel", "2", gpus=None)
    assert r.returncode == 0 and "PASSED" in r.stdout, r.stdout + r.stderr
    assert sorted(merged_ids(rd)) == sorted(f"p{i:04d}" for i in range(n))


# overlap and tail handover decisions (the simulation calls the same functions)


def test_opens_next_only_when_nothing_left_to_send_and_room():
    from toolkit.worker.policy import opens_next

    assert opens_next(0, 10, 16)
    assert not opens_next(1, 10, 16)  # the shard held still has prompts to send
    assert not opens_next(0, 16, 16)  # the batch is full


def test_hands_over_the_smallest_tail_to_tasks_with_room():
    from toolkit.worker.policy import Tail, hands_over

    a, b, c = Tail("a", 3, 64), Tail("b", 20, 64), Tail("c", 30, 64)
    assert hands_over(a, [b, c], claimable=0)
    assert not hands_over(a, [b, c], claimable=1)  # shards left to claim: no tail yet
    assert not hands_over(b, [a, c], claimable=0)  # a runs fewer: a leaves first
    assert not hands_over(Tail("a", 20, 64), [b, c], 0)  # over the share of its target
    assert not hands_over(a, [Tail("b", 63, 64), Tail("c", 63, 64)], 0)  # no room for its 3
    assert not hands_over(a, [], 0) and not hands_over(Tail("a", 0, 64), [b], 0)
    # the task leaving is not a recipient, and two equal tails never leave for each other
    assert hands_over(Tail("b", 10, 64), [Tail("a", 3, 64, leaving=True), c], 0)
    x, y = Tail("x", 5, 64), Tail("y", 5, 64)
    assert hands_over(x, [y], 0) != hands_over(y, [x], 0)


NO_FLOCK_SITE = """
import errno, fcntl, os

def _flock(fd, op):  # a file system without flock (Lustre without -o flock, older NFS)
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

fcntl.flock = _flock
"""


@pytest.mark.slow
def test_without_flock_a_parallel_run_killed_mid_run_finishes_every_id_once(tmp_path, kimi):
    """On a file system without flock every lock is a lock file: two workers claim the shards by them,
    kill -9 of the whole run leaves them behind (their pids gone), and the next `toolkit run` takes them over,
    merges every id once and leaves no lock file."""
    n = 32
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_FLOCK_SITE)  # in every process of the run
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    job, rd, proc = parallel_run_generating(tmp_path, kimi, n, env)
    held = sorted(p.name for p in rd.shards_dir.glob("*.zst.lock"))
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert len(held) == 2, out  # the claims: one lock file per worker's shard
    assert sorted(p.name for p in rd.shards_dir.glob("*.zst.lock")) == held, (
        "left behind by kill -9"
    )

    argv = [sys.executable, "-m", "toolkit", "run", str(job), "--parallel", "2"]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "PASSED" in r.stdout, r.stdout + r.stderr
    logs = "".join(p.read_text() for p in rd.logs_dir.glob("*.log"))
    assert "no flock: an exclusive lock file stands in" in logs
    assert "which is gone" in logs  # a lock of a killed worker taken over
    assert sorted(merged_ids(rd)) == sorted(f"p{i:04d}" for i in range(n))
    assert not [*rd.shards_dir.glob("*.lock"), *rd.merged_dir.glob("*.lock")], (
        "every lock file released"
    )
    left = subprocess.run(
        ["pgrep", "-f", f"toolkit.stub .*{rd.root}"], capture_output=True, text=True
    ).stdout
    assert not left.strip(), "no engine outlives its worker"
