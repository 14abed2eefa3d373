"""Overlapping shards on the local Slurm cluster: a task requeued (`scontrol requeue`) while its
engine serves two shards at once loses and duplicates nothing."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobfiles import make_job
from runs import each_id_once
from toolkit.cluster.status import run_status
from toolkit.dataset.merge import merge_run
from toolkit.formats.frames import read_shard
from toolkit.formats.progress import read_progress
from toolkit.formats.rundir import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ACTIVE = ("pending", "running", "submitted", "requeued", "configuring", "completing")


@pytest.fixture(autouse=True)
def cluster():
    if not os.environ.get("SLURM_CONF"):
        pytest.fail(
            'SLURM_CONF is not set: start the local cluster first, eval "$(slurm/start.sh)" (see '
            "README)"
        )


def wait_settled(run: Path, timeout: float) -> tuple[list, object]:
    deadline = time.time() + timeout
    while True:
        _, rows, merge = run_status(run)
        if all(r.state not in ACTIVE for r in rows) and merge.state not in (*ACTIVE, None):
            return rows, merge
        assert time.time() < deadline, (
            f"run did not settle: {[(r.shard, r.state) for r in rows]} {merge}"
        )
        time.sleep(1.0)


def test_a_task_requeued_while_two_shards_are_open_loses_and_duplicates_nothing(
    tmp_path, toy_tokenizer
):
    n, shards = 48, 6
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=n,
        shards=shards,
        stub={"token_delay_s": 0.02},
        sampling={"max_new_tokens": 200},
        client={"concurrency": 3},
        slurm={
            "gpus_per_node": 1,
            "cpus_per_task": 1,
            "time": "00:10:00",
            "merge_cpus": 1,
            "array_parallelism": 1,
        },
    )
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", str(job)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run, rd = tmp_path / "run", RunDir(tmp_path / "run")
    deadline = time.time() + 180
    both: list = []
    while len(both) < 2:  # one task generating two shards at once
        assert time.time() < deadline, "the task never had two shards open at once"
        ps = [read_progress(rd, k) for k in range(shards)]
        gen = [p for p in ps if p is not None and p.state == "generating"]
        both = [p for p in gen if sum(q.task == p.task for q in gen) >= 2]
        time.sleep(0.05)
    subprocess.run(["scontrol", "requeue", both[0].task], check=True)
    rows, merge = wait_settled(run, 360)
    assert [x.state for x in rows] == ["completed"] * shards and merge.state == "completed"
    # the shards open at the requeue were stopped, then finished by the requeued task
    for p in both:
        again = read_progress(rd, p.shard)
        assert again.state == "done" and again.restart_count >= 1
    each_id_once(rd, shards, n)
    merge_run(run)
    ids = [rec.id for rec in read_shard(rd.merged_file)]
    assert len(ids) == n and sorted(ids) == [f"p{i:04d}" for i in range(n)]


def _handover_job(tmp_path, toy_tokenizer, n: int, shards: int) -> Path:
    return make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=n,
        shards=shards,
        stub={"token_delay_s": 0.02},
        sampling={"max_new_tokens": 300},
        client={"concurrency": 8},
        slurm={
            "gpus_per_node": 1,
            "cpus_per_task": 1,
            "time": "00:10:00",
            "merge_cpus": 1,
            "array_parallelism": 2,
        },
    )


def _sacct_end(task: str) -> str:
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", task, "--format=State,End"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return next((line.split("|")[1] for line in out if line.startswith("COMPLETED")), "")


def _handed(rd: RunDir, shards: int) -> list[int]:
    return [
        k
        for k in range(shards)
        if rd.log_file(k).exists() and "handed over with" in rd.log_file(k).read_text()
    ]


@pytest.mark.parametrize("then", ["nothing", "kill -9 the receiver", "requeue the receiver"])
def test_the_run_tail_is_handed_over_exactly_once(tmp_path, toy_tokenizer, then):
    """Two tasks, two shards: at the tail, the task running the fewest requests hands them over
    (kept as partial outputs), releases its shard and ends (its node freed, exit 0); the other
    claims the shard and continues the partials. With the receiving task killed (kill -9) or
    requeued while it continues them, every id is still recorded once (a killed task's shards are
    finished by the next worker)."""
    # two shards of 16 at concurrency 8: the two tasks' batches drain at different paces at the tail
    n, shards = 32, 2
    job = _handover_job(tmp_path, toy_tokenizer, n, shards)
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", str(job)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    run, rd = tmp_path / "run", RunDir(tmp_path / "run")
    deadline = time.time() + 240
    receiver = None
    # a shard handed over and claimed by the other task, its partials being continued
    while receiver is None:
        assert time.time() < deadline, "no task handed its tail over"
        for k in _handed(rd, shards):
            p = read_progress(rd, k)
            if p is not None and p.state == "generating" and not p.leaving:
                receiver = p
        time.sleep(0.05)
    giver = next(k for k in _handed(rd, shards))
    if then == "kill -9 the receiver":
        os.kill(receiver.pid, 9)
    elif then == "requeue the receiver":
        subprocess.run(["scontrol", "requeue", receiver.task], check=True)
    rows, merge = wait_settled(run, 360)
    if then == "kill -9 the receiver":  # its task failed; the next worker finishes what it held
        from toolkit.worker.claims import run_claims

        run_claims(run, list(range(shards)), task="after", group="after")
        merge_run(run)
    else:
        assert [x.state for x in rows] == ["completed"] * shards and merge.state == "completed"
    log = rd.log_file(giver).read_text()
    assert re.search(r"handed over with \d+ of \d+", log)
    assert re.search(r"\([1-9]\d* to continue from a partial output\)", log), (
        "the receiver continued them"
    )
    written = each_id_once(rd, shards, n)
    assert any(rec.status == "partial" for rec in written), (
        "the handed over requests were kept as partials"
    )
    # the giving task ended first, with exit 0: its node was freed before the run's end
    if then == "nothing":
        outs = {p.name: p.read_text() for p in (run / "slurm").rglob("*_log.out")}
        gave = [
            name
            for name, text in outs.items()
            if "handed over" in text and "at the run's tail" in text
        ]
        assert gave, "the giving task's log says it handed its requests over"
        tasks = [name[: -len("_0_log.out")] for name in outs]
        ends = {t: _sacct_end(t) for t in tasks}
        giving = gave[0][: -len("_0_log.out")]
        assert all(ends[giving] <= e for e in ends.values()), f"the giving task ended first: {ends}"
    ids = [rec.id for rec in read_shard(rd.merged_file)]
    assert len(ids) == n and sorted(ids) == [f"p{i:04d}" for i in range(n)]
