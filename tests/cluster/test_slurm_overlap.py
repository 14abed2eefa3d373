"""Overlapping shards on the local Slurm cluster: a task requeued (`scontrol requeue`) while its engine serves two
shards at once loses and duplicates nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobfiles import make_job
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
        pytest.fail("SLURM_CONF is not set: start the local cluster first, eval \"$(slurm/start.sh)\" (see README)")


def wait_settled(run: Path, timeout: float) -> tuple[list, object]:
    deadline = time.time() + timeout
    while True:
        _, rows, merge = run_status(run)
        if all(r.state not in ACTIVE for r in rows) and merge.state not in (*ACTIVE, None):
            return rows, merge
        assert time.time() < deadline, f"run did not settle: {[(r.shard, r.state) for r in rows]} {merge}"
        time.sleep(1.0)


def test_a_task_requeued_while_two_shards_are_open_loses_and_duplicates_nothing(tmp_path, toy_tokenizer):
    n, shards = 48, 6
    job = make_job(tmp_path, toy_tokenizer("kimi"), n=n, shards=shards, stub={"token_delay_s": 0.02},
                   sampling={"max_new_tokens": 200}, client={"concurrency": 3},
                   slurm={"gpus_per_node": 1, "cpus_per_task": 1, "time": "00:10:00", "merge_cpus": 1,
                          "array_parallelism": 1})
    r = subprocess.run([sys.executable, "-m", "toolkit", "submit", str(job)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    run, rd = tmp_path / "run", RunDir(tmp_path / "run")
    deadline = time.time() + 180
    both: list = []
    while len(both) < 2:  # one task generating two shards at once
        assert time.time() < deadline, "the task never had two shards open at once"
        ps = [read_progress(rd.progress_file(k)) for k in range(shards)]
        gen = [p for p in ps if p is not None and p.state == "generating"]
        both = [p for p in gen if sum(q.task == p.task for q in gen) >= 2]
        time.sleep(0.05)
    subprocess.run(["scontrol", "requeue", both[0].task], check=True)
    rows, merge = wait_settled(run, 360)
    assert [x.state for x in rows] == ["completed"] * shards and merge.state == "completed"
    for p in both:  # the shards open at the requeue were stopped, then finished by the requeued task
        again = read_progress(rd.progress_file(p.shard))
        assert again.state == "done" and again.restart_count >= 1
    written = [rec for k in range(shards) for rec in read_shard(rd.shard_file(k))]
    newest = {rec.id: rec for rec in written}
    assert sorted(newest) == [f"p{i:04d}" for i in range(n)] and all(x.status == "ok" for x in newest.values())
    assert all(rec.status == "partial" for rec in written if newest[rec.id] is not rec), "each id once"
    merge_run(run)
    ids = [rec.id for rec in read_shard(rd.merged_file)]
    assert len(ids) == n and sorted(ids) == [f"p{i:04d}" for i in range(n)]
