"""One engine feeding from every shard its worker holds: the next shard is claimed and sent while
the previous shard's last requests finish, each shard still its own file, log, progress and end;
exactly once under a stop and under kill -9 in the middle of the overlap."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from jobfiles import make_job, prepared_run
from runs import each_id_once
from toolkit.dataset.merge import merge_run
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import read_done
from toolkit.formats.progress import read_progress
from toolkit.formats.run import Run
from toolkit.job.schema import JobSpec
from toolkit.worker.claims import run_claims

REPO = Path(__file__).resolve().parents[2]
STAMP = "%Y-%m-%d %H:%M:%S,%f"


@pytest.fixture
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def heavy_job(tmp_path, kimi, *, n: int, shards: int, delay: float = 0.01, concurrency: int = 4):
    """Output lengths with a tail (the stub's): 8-95 % of max_new_tokens, and a tenth run to it."""
    return make_job(
        tmp_path,
        kimi,
        n=n,
        shards=shards,
        stub={"token_delay_s": delay},
        sampling={"max_new_tokens": 160},
        client={"concurrency": concurrency},
    )


def when(log: str, what: str) -> datetime:
    line = next(x for x in log.splitlines() if what in x)
    return datetime.strptime(line[:23], STAMP)


def merged_ids(rd) -> list[str]:
    merge_run(rd.root)
    return [r.id for r in read_shard(rd.merged_file)]


def foreign_shard_lines(log: str, k: int) -> list[str]:
    """Lines of a shard's log that name another shard (`its shard 2 in this task` counts the
    worker's shards)."""
    return [
        x for x in log.splitlines() for j in re.findall(r"(?<!its )\bshard (\d+)", x) if int(j) != k
    ]


@pytest.mark.slow
def test_two_shards_in_flight_at_once_on_one_engine_each_its_own_log_and_status(
    tmp_path, kimi, caplog
):
    n, shards = 32, 4
    rd, plan = prepared_run(heavy_job(tmp_path, kimi, n=n, shards=shards))
    with caplog.at_level(logging.INFO, logger="toolkit"):
        r = run_claims(rd.root, list(range(shards)), task="w0", group="g")
    assert sorted(r.done) == list(range(shards)) and not r.failed and r.stopped is None
    assert r.engine_starts == 1
    most = int(re.search(r"at most (\d+) shard\(s\) open at once", caplog.text).group(1))
    assert 2 <= most <= 4 + 1, "overlap happened, bounded by the batch's room (concurrency 4, + 1)"
    logs = [rd.log_file(k).read_text() for k in range(shards)]
    order = sorted(range(shards), key=lambda k: read_progress(rd, k).task_shards)
    overlapped = [
        (a, b)
        for a, b in zip(order, order[1:])
        if when(logs[b], "generating ") < when(logs[a], f"shard {a} complete")
    ]
    assert overlapped, (
        "a shard's prompts went out before the previous shard's last answer came back"
    )
    for k in range(shards):
        assert not foreign_shard_lines(logs[k], k), f"shard {k}'s log holds another shard's lines"
        assert f"shard {k} complete: {n // shards} records" in logs[k]
        p = read_progress(rd, k)
        assert (p.state, p.done, p.total, p.task, p.task_engine_starts) == (
            "done",
            n // shards,
            n // shards,
            "w0",
            1,
        )
        assert read_done(rd.done_file(k)).records == n // shards
    assert sorted(merged_ids(rd)) == [f"p{i:04d}" for i in range(n)]


def claiming_worker(rd, pool: list[int], group: str) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "toolkit",
        "worker",
        str(rd.root),
        "--claim",
        *map(str, pool),
        "--group",
        group,
    ]
    return subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def wait_overlap(rd, shards: int, pid: int, timeout: float = 120) -> list[int]:
    """The shards the worker `pid` generates at once, as their progress files say, once there are
    two."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        ps = [read_progress(rd, k) for k in range(shards)]
        both = [
            k
            for k, p in enumerate(ps)
            if p is not None and p.pid == pid and p.state == "generating"
        ]
        if len(both) >= 2:
            return both
        time.sleep(0.05)
    pytest.fail("the worker never generated two shards at once")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_worker_ended_mid_overlap_loses_and_duplicates_nothing(tmp_path, kimi, how):
    """kill -9 (nothing saved: the shards' locks go with the process) or SIGTERM (every open shard
    stops and keeps its requests in flight as partial outputs) while two shards are open: the next
    worker finishes every id once."""
    n, shards = 32, 4
    rd, plan = prepared_run(heavy_job(tmp_path, kimi, n=n, shards=shards, delay=0.02))
    w = claiming_worker(rd, list(range(shards)), "g")
    try:
        both = wait_overlap(rd, shards, w.pid)
        w.send_signal(getattr(signal, how))
        code = w.wait(timeout=120)
    finally:
        if w.poll() is None:
            w.kill()
    if how == "SIGTERM":
        assert code == 3
        ps = {k: read_progress(rd, k) for k in both}
        assert all(p.state == "stopped" and p.stop_signal == "SIGTERM" for p in ps.values()), ps
        assert all(read_done(rd.done_file(k)) is None for k in both)
    r = run_claims(rd.root, list(range(shards)), task="again", group="g2")
    assert (
        sorted(
            r.done + [k for k in range(shards) if k not in r.done and read_done(rd.done_file(k))]
        )
        == list(range(shards))
        and not r.failed
    )
    written = each_id_once(rd, shards, n)
    if how == "SIGTERM":
        assert any(rec.status == "partial" for rec in written), "what was in flight was kept"
    assert sorted(merged_ids(rd)) == [f"p{i:04d}" for i in range(n)]


class _Open:
    """A shard open in a task, as hand_over sees it: its progress, written where status reads it."""

    def __init__(self, rd, k: int, p):
        self.rd, self.shard, self.progress = rd, k, p

    def leave(self) -> None:
        self.progress.leaving = True
        self.save_progress()

    def save_progress(self) -> None:
        from toolkit.formats.progress import write_progress

        write_progress(self.rd.progress_file(self.shard), self.progress)


class _Batch:
    def __init__(self, shards, in_flight: int, target: int):
        self.shards, self.in_flight, self.target = shards, in_flight, target


def _two_tasks_at_the_tail(tmp_path, kimi):
    """A run of two shards, each open in its task ("a", "b"), each task running one request of eight."""
    from toolkit.formats.progress import Progress, write_progress

    rd, _ = prepared_run(make_job(tmp_path, kimi, n=4, shards=2))
    opened = {}
    for k, task in ((0, "a"), (1, "b")):
        p = Progress(shard=k, total=2, state="generating", task=task, running=1, in_flight_target=8)
        write_progress(rd.progress_file(k), p)
        opened[task] = _Open(rd, k, p)
    return rd, opened


def test_two_tasks_at_the_tail_never_leave_for_each_other(tmp_path, kimi):
    """The decide-and-publish is one step under the run's lock: of two tasks each running one
    request of eight, one leaves (its progress says `leaving`); the other, seeing it, stays."""
    import fcntl

    from toolkit.worker.poolview import hand_over, tails

    rd, opened = _two_tasks_at_the_tail(tmp_path, kimi)
    run = Run.open(rd.root, JobSpec)
    files = [open(rd.shard_file(k), "ab") for k in (0, 1)]
    try:
        for f in files:  # both shards held by their tasks
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert [t.task for t in tails(run, [0, 1], "a")] == ["b"]
        b_first = hand_over(run, [0, 1], "b", _Batch([opened["b"]], 1, 8))
        a_then = hand_over(run, [0, 1], "a", _Batch([opened["a"]], 1, 8))
        assert (b_first, a_then) == (False, True), "the first name leaves at a tie, the other stays"
        assert read_progress(rd, 0).leaving
        assert not read_progress(rd, 1).leaving
        assert not hand_over(run, [0, 1], "b", _Batch([opened["b"]], 1, 8)), (
            "nobody left to receive"
        )
        # with the lock taken by another task's decision, none is made (the next look decides)
        with open(rd.handover_lock, "a+b") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            opened["a"].progress.leaving = False
            opened["a"].save_progress()
            assert not hand_over(run, [0, 1], "a", _Batch([opened["a"]], 1, 8))
    finally:
        for f in files:
            f.close()


def test_without_flock_no_task_hands_over(tmp_path, kimi, no_flock):
    """Where the file system has no flock, the decide-and-publish cannot be one step: a task at the
    tail then finishes its own shards (it never raises from the event loop, never leaves)."""

    from toolkit.worker.poolview import hand_over

    rd, opened = _two_tasks_at_the_tail(tmp_path, kimi)
    run = Run.open(rd.root, JobSpec)
    for k in (0, 1):  # both shards held by their tasks: their lock files, as without flock
        rd.shard_file(k).with_name(rd.shard_file(k).name + ".lock").write_text("{}")
    assert not hand_over(run, [0, 1], "b", _Batch([opened["b"]], 1, 8))
    assert not hand_over(run, [0, 1], "a", _Batch([opened["a"]], 1, 8))
    assert not read_progress(rd, 0).leaving and not read_progress(rd, 1).leaving
