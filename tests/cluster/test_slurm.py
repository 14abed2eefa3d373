"""The Slurm layer on the real local cluster (slurm/start.sh): submit, status, logs, resubmit, requeue, limits."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from jobfiles import make_job, process_running, write_prompts
from toolkit.cluster.jobs import read_jobs
from toolkit.cluster.status import run_status
from toolkit.formats.frames import read_shard
from toolkit.formats.rundir import RunDir

pytestmark = pytest.mark.slurm

ACTIVE = ("pending", "running", "submitted", "requeued", "configuring", "completing")


@pytest.fixture(autouse=True)
def cluster():
    if not os.environ.get("SLURM_CONF"):
        pytest.fail(
            'SLURM_CONF is not set: start the local cluster first, eval "$(slurm/start.sh)" (see README)'
        )


def toolkit(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=120
    )
    if check and r.returncode != 0:
        raise AssertionError(
            f"toolkit {' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        )
    return r


def slurm_job(tmp: Path, tokenizer: Path, *, n: int, shards: int, **tables) -> Path:
    slurm = {
        "gpus_per_node": 1,
        "cpus_per_task": 1,
        "time": "00:10:00",
        "merge_cpus": 1,
        **tables.pop("slurm", {}),
    }
    return make_job(tmp, tokenizer, n=n, shards=shards, slurm=slurm, **tables)


def wait_run(run: Path, timeout: float = 240, until=None) -> tuple[list, dict]:
    """Poll status until every shard and the merge job have left the queue (or `until(rows, merge)` holds)."""
    deadline = time.time() + timeout
    while True:
        _, rows, merge = run_status(run)
        if until is not None and until(rows, merge):
            return rows, merge
        if (
            until is None
            and all(r.state not in ACTIVE for r in rows)
            and merge.state not in (*ACTIVE, None)
        ):
            return rows, merge
        if time.time() > deadline:
            raise AssertionError(
                f"run did not settle in {timeout} s: {[(r.shard, r.state) for r in rows]} merge {merge}"
            )
        time.sleep(1.0)


def submitted_ids(out: str) -> list[str]:
    return re.findall(r"Submitted batch job (\d+)", out)


def sacct_times(job: str) -> list[tuple[str, str, str]]:
    out = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-j", job, "--format=JobID,Start,End"],
        capture_output=True,
        text=True,
    ).stdout
    return [tuple(line.split("|")) for line in out.splitlines() if line]


def test_four_shards_complete_then_merge_runs(tmp_path, toy_tokenizer):
    job = slurm_job(tmp_path, toy_tokenizer("kimi"), n=16, shards=4)
    r = toolkit("submit", str(job))
    array_id, merge_id = submitted_ids(r.stdout)
    run = tmp_path / "run"
    assert f"run directory: {run}" in r.stdout and f"toolkit status {run}" in r.stdout
    rows, merge = wait_run(run)
    assert [x.state for x in rows] == ["completed"] * 4
    assert {x.job for x in rows} <= {
        f"{array_id}_{i}" for i in range(4)
    }  # the task that claimed each
    assert sum(x.done for x in rows) == 16 and merge.state == "completed" and merge.merged
    # The merge job started only after the last shard task ended.
    for _ in range(30):
        tasks, merged = sacct_times(array_id), sacct_times(merge_id)
        if len(tasks) == 4 and merged and merged[0][1] not in ("", "Unknown"):
            break
        time.sleep(1)
    assert max(t[2] for t in tasks) <= merged[0][1]
    status = toolkit("status", str(run)).stdout
    assert (
        len(re.findall(r"^\s+\d+ completed ", status, re.M)) == 4
        and f"merge: job {merge_id} completed" in status
    )
    for k in range(4):
        log = toolkit("logs", str(run), str(k)).stdout
        assert f"shard {k} of run" in log and f"(array {array_id}, task " in log and "GPUs " in log
    for k in range(
        4
    ):  # each shard's server log: the engine's of the task that claimed it, whichever shard it began
        assert "[stub-engine, not a model]" in toolkit("logs", str(run), str(k), "--server").stdout


def test_a_finished_shard_file_damaged_after_the_run_is_resubmitted_and_the_run_completes_again(
    tmp_path, toy_tokenizer
):
    job = slurm_job(tmp_path, toy_tokenizer("kimi"), n=8, shards=2)
    toolkit("submit", str(job))
    run = tmp_path / "run"
    rows, merge = wait_run(run)
    assert merge.state == "completed" and toolkit("status", str(run)).returncode == 0
    path = RunDir(run).shard_file(1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    merged = toolkit("merge", str(run), check=False)  # refused: the complete merged dataset is kept
    assert (
        merged.returncode == 2
        and "nothing merged, the merged dataset is kept as it was" in merged.stderr
    )
    assert "`toolkit resubmit " in merged.stderr  # submitted: on Slurm again
    st = toolkit("status", str(run), check=False)
    assert (
        st.returncode == 1
        and "shard 1 changed since done" in st.stdout
        and "`toolkit resubmit " in st.stdout
    )
    r = toolkit("resubmit", str(run))  # the advice works: the shard whose file changed goes again
    assert "resubmitting 1 shard: 1 without a done manifest" in r.stdout
    rows, merge = wait_run(
        run, until=lambda rows, m: m.state == "completed" and m.current and m.audit == "passed"
    )
    assert [x.state for x in rows] == ["completed", "completed"]
    assert toolkit("status", str(run)).returncode == 0


def test_a_grown_job_submitted_again_sends_only_its_new_shard(tmp_path, toy_tokenizer):
    from toolkit.dataset.audit_report import read_report
    from toolkit.dataset.merge_manifest import load_manifest

    job = slurm_job(tmp_path, toy_tokenizer("kimi"), n=8, shards=2)
    toolkit("submit", str(job))
    run = tmp_path / "run"
    wait_run(run)
    first = RunDir(run).shard_file(0).read_bytes()
    with open(tmp_path / "prompts.jsonl", "a") as f:
        f.writelines(
            f'{{"prompt": "An appended question {i}: what is {i} times {i}?"}}\n' for i in range(3)
        )
    r = toolkit("submit", str(job))
    array_id = submitted_ids(r.stdout)[0]
    assert f"Submitted batch job {array_id} (1 task claiming shards 2: " in r.stdout
    rows, merge = wait_run(run)
    assert [x.state for x in rows] == ["completed"] * 3 and [x.done for x in rows][2] == 3
    assert merge.state == "completed" and merge.merged
    assert RunDir(run).shard_file(0).read_bytes() == first  # nothing generated again
    m = load_manifest(RunDir(run))
    assert (m.planned, m.records, m.missing, m.duplicates) == (11, 11, 0, 0)
    assert read_report(RunDir(run)).passed


def test_failed_shard_shows_in_status_and_logs_then_resubmit_runs_only_it(tmp_path, toy_tokenizer):
    broken = tmp_path / "BROKEN-1"
    broken.write_text("node has no GPU driver\n")
    # shards slow enough that task 1 claims shard 1 (its first) before another task is free to take it
    job = slurm_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=9,
        shards=3,
        stub={"exit_at_start_if_exists": str(tmp_path / "BROKEN-{shard}"), "token_delay_s": 0.03},
    )
    toolkit("submit", str(job))
    run = tmp_path / "run"
    rows, merge = wait_run(run)
    assert [x.state for x in rows] == ["completed", "failed", "completed"]
    assert merge.state == "failed", "the merge refuses a run with a shard missing"
    st = toolkit("status", str(run), check=False)
    assert st.returncode == 1 and " failed " in st.stdout
    logs = toolkit("logs", str(run), "--failed", check=False).stdout
    assert "shard 1: failed" in logs and "exited with code 1 before it was ready" in logs
    assert "==> shard 0" not in logs and "==> shard 2" not in logs
    merge_id = merge.job
    assert (
        f"==> merge job {merge_id}: failed (" in logs and f"{merge_id}/{merge_id}_0_log.out" in logs
    )
    assert (
        "why: toolkit: error: " in logs and "shards are not done" in logs
    )  # the reason, before the tail
    merge_log = RunDir(run).job_log(merge_id).read_text()
    assert (
        "Traceback" not in merge_log and f"merge job: `toolkit merge {run}` exited 2 (" in merge_log
    )

    broken.unlink()  # the cause is fixed
    before = len(read_jobs(RunDir(run)).submissions)
    r = toolkit("resubmit", str(run))
    assert "resubmitting 1 shard: 1 without a done manifest" in r.stdout
    subs = read_jobs(RunDir(run)).submissions
    task = subs[-1].arrays[0].tasks[0]
    assert f"Submitted batch job {task} (1 task claiming shards 1:" in r.stdout
    assert len(subs) == before + 1 and [a.shards for a in subs[-1].arrays] == [[1]]
    again = toolkit("resubmit", str(run), check=False)
    assert again.returncode == 1 and "still pending or running" in again.stderr
    rows, merge = wait_run(run)
    assert [x.state for x in rows] == ["completed"] * 3 and merge.state == "completed"
    assert "nothing to resubmit" in toolkit("resubmit", str(run)).stdout
    assert len(read_jobs(RunDir(run)).submissions) == before + 1


def _records(run: Path) -> list:
    path = run / "shards" / "00000.zst"
    return list(read_shard(path)) if path.exists() else []


def test_scontrol_requeue_resumes_and_nothing_is_lost(tmp_path, toy_tokenizer):
    n = 40
    job = slurm_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=n,
        shards=1,
        stub={"token_delay_s": 0.003},
        sampling={"max_new_tokens": 400},
        client={"concurrency": 2},
    )
    toolkit("submit", str(job))
    run = tmp_path / "run"
    task = read_jobs(RunDir(run)).submissions[0].arrays[0].tasks[0]
    deadline = time.time() + 120
    while len(_records(run)) < 4:
        assert time.time() < deadline, "the task never started writing"
        time.sleep(0.3)
    subprocess.run(["scontrol", "requeue", task], check=True)
    seen = set()
    rows, merge = wait_run(
        run, until=lambda rows, merge: seen.add(rows[0].state) or merge.state not in (*ACTIVE, None)
    )
    assert rows[0].state == "completed" and merge.state == "completed"
    written = _records(run)
    newest = {
        r.id: r for r in written
    }  # a stop saves what is in flight as partial records, continued after
    assert len(newest) == n and all(r.status == "ok" for r in newest.values())
    assert all(r.status == "partial" for r in written if newest[r.id] is not r)
    progress = msgspec.json.decode((run / "progress" / "00000.json").read_bytes())
    assert progress["restart_count"] >= 1, "the requeued task knows it was requeued"
    assert "requeued" in seen or "pending" in seen


def test_a_requeue_mid_run_records_each_loop_stopped_in_flight_once(tmp_path, toy_tokenizer):
    """[client] loop_stop under Slurm: outputs in segments of 512 tokens, a quarter of them looping, the task
    requeued by scontrol mid-run: the run completes and is audited with each loop recorded once (finish loop)."""
    from toolkit.formats.loops import repetition_loop

    n = 24
    job = slurm_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=n,
        shards=1,
        stub={"token_delay_s": 0.0005, "degenerate_fraction": 0.25},
        sampling={"max_new_tokens": 2048},
        client={"concurrency": 4, "segment_tokens": 512},
        audit={"max_degenerate_share": 1.0, "max_length_share": 1.0, "min_think_end_share": 0.0},
    )
    toolkit("submit", str(job))
    run = tmp_path / "run"
    task = read_jobs(RunDir(run)).submissions[0].arrays[0].tasks[0]
    deadline = time.time() + 120
    while len(_records(run)) < 4:
        assert time.time() < deadline, "the task never started writing"
        time.sleep(0.3)
    subprocess.run(["scontrol", "requeue", task], check=True)
    rows, merge = wait_run(run)
    assert rows[0].state == "completed" and merge.state == "completed"
    written = [r for r in _records(run) if r.status != "partial"]
    assert sorted(r.id for r in written) == [
        f"p{i:04d}" for i in range(n)
    ]  # each prompt recorded once
    loops = [r for r in written if r.finish == "loop"]
    assert loops and all(r.status == "ok" and r.n_output < 2048 for r in loops)
    assert all(repetition_loop(np.frombuffer(r.output_ids, "<u4")) is not None for r in loops)
    audit = msgspec.json.decode((run / "merged" / "audit.json").read_bytes())
    assert sum(d["degenerate"] for d in audit["datasets"]) == len(loops)


def test_two_tasks_claim_eight_shards_with_two_engine_starts_and_a_requeue_loses_nothing(
    tmp_path, toy_tokenizer
):
    """8 shards at parallelism 2: two tasks, each starting its engine once and claiming shards until none is left;
    one of them requeued mid-shard (`scontrol requeue`): its shard is claimed again and every id is merged once."""
    from toolkit.dataset.merge import merge_run
    from toolkit.formats.progress import read_progress

    n = 48
    job = slurm_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=n,
        shards=8,
        stub={"token_delay_s": 0.02},
        sampling={"max_new_tokens": 300},
        client={"concurrency": 2},
        slurm={"array_parallelism": 2},
    )
    r = toolkit("submit", str(job))
    array_id = submitted_ids(r.stdout)[0]
    assert f"array of 2 tasks {array_id}_[0-1] claiming shards 0-7" in r.stdout
    run, rd = tmp_path / "run", RunDir(tmp_path / "run")
    deadline = time.time() + 180
    victim = None
    while victim is None:  # a task busy with its second shard or later, a few records in
        assert time.time() < deadline, "no task went on to a second shard"
        for k in range(8):
            p = read_progress(rd, k)
            if p is not None and p.state == "generating" and p.task_shards >= 2 and p.done >= 1:
                victim = p
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", victim.task], check=True)
    rows, merge = wait_run(run, timeout=300)
    assert [x.state for x in rows] == ["completed"] * 8 and merge.state == "completed"
    status = toolkit("status", str(run)).stdout
    assert re.search(r"^tasks: 2, [23] engine starts in all$", status, re.M), status
    starts = sum(
        p.read_text().count("===== toolkit: engine start #")
        for p in (run / "logs").glob("*.server.log")
    )
    assert 2 <= starts <= 3, (
        "one start per task, and one more for the requeued task if it found shards left"
    )
    again = read_progress(rd, victim.shard)
    assert again.state == "done" and (again.task != victim.task or again.restart_count >= 1)
    merge_run(run)
    ids = [rec.id for rec in read_shard(rd.merged_file)]
    assert len(ids) == n and sorted(ids) == sorted(f"p{i:04d}" for i in range(n))


def test_time_limit_signal_requeues_and_finishes(tmp_path, toy_tokenizer):
    """--time 1 with the signal 45 s before it: the task stops at ~15 s, submitit requeues it, it resumes.
    The shard takes about a minute undisturbed: Slurm sends the signal up to half a minute late, and it must still
    come mid-shard."""
    n = 60
    job = slurm_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=n,
        shards=1,
        stub={"token_delay_s": 0.008},
        sampling={"max_new_tokens": 400},
        client={"concurrency": 2},
    )
    toolkit("submit", str(job), "--time", "1", "--signal-delay-s", "45")
    run = tmp_path / "run"
    follow = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "logs", str(run), "0", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # from before the first attempt to the end
    try:
        rows, merge = wait_run(run, timeout=300)
        out, err = follow.communicate(timeout=60)  # it ends by itself, once the shard is done
    finally:
        follow.kill()
    assert rows[0].state == "completed" and merge.state == "completed"
    assert follow.returncode == 0 and "(shard 0 done: stopped following)" in err, err
    assert "got SIGUSR2" in out and "shard 0 stopped with" in out and "shard 0 complete" in out, out
    assert out.index("got SIGUSR2") < out.index("shard 0 complete")  # followed through the requeue
    written = _records(run)
    newest = {r.id: r for r in written}
    assert len(newest) == n and all(r.status == "ok" for r in newest.values())
    partial = [r for r in written if newest[r.id] is not r]
    assert all(r.status == "partial" for r in partial)  # what was in flight at the signal, kept ...
    assert all(
        newest[r.id].segments >= 2 and newest[r.id].output_ids.startswith(r.output_ids)
        for r in partial
    )
    log = (
        run / "logs" / "00000.log"
    ).read_text()  # ... and continued token for token after the requeue
    assert "got SIGUSR2" in log
    progress = msgspec.json.decode((run / "progress" / "00000.json").read_bytes())
    assert progress["restart_count"] >= 1


def test_tasks_are_no_more_than_max_array_size(tmp_path, toy_tokenizer):
    job = slurm_job(tmp_path, toy_tokenizer("kimi"), n=130, shards=130)
    dry = toolkit("submit", str(job), "--dry-run").stdout
    # as many tasks as may run at once (256 by default), within MaxArraySize, claiming all 130 shards
    assert "1 job array(s) (MaxArraySize 100): 100 tasks claiming shards 0-129" in dry
    assert "#SBATCH --gpus-per-node=1" in dry and "#SBATCH --signal=USR2@" in dry
    assert not (tmp_path / "run").exists(), "a dry run plans nothing on disk"
    r = toolkit("submit", str(job), "--array-parallelism", "3")
    ids = submitted_ids(r.stdout)
    toolkit("cancel", str(tmp_path / "run"))
    subs = read_jobs(RunDir(tmp_path / "run")).submissions
    assert [(len(a.shards), len(a.tasks), a.claims) for a in subs[0].arrays] == [
        (130, 3, True)
    ] and len(ids) == 2
    # What the dry run showed is what was submitted (but for the parallelism flag given here).
    shown = dry.split("==> array 1 of 1")[1].split("\n", 1)[1].split("\n==> ")[0]
    sent = (tmp_path / "run" / "slurm" / ids[0] / f"{ids[0]}_submission.sh").read_text()
    assert "#SBATCH --array=0-2%3" in sent and "#SBATCH --array=0-99%100" in shown
    assert sent.replace("0-2%3\n", "0-99%100\n", 1).strip() == shown.strip()
    assert "validated against the cluster: partition gpu (nodes with up to 4 GPUs, 8 CPUs)" in dry


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"args": ["--partition", "nope"]}, "unknown partition 'nope'; this cluster has: gpu"),
        (  # an engine of 8 GPUs (the GPU rule passes), on nodes of 4
            {"args": ["--gpus-per-node", "8"], "spec": ("[engine]", "[engine]\ntp_size = 8")},
            "have at most 4 GPUs",
        ),
        (
            {"args": ["--cpus-per-task", "64"]},
            "--cpus-per-task 64 but the nodes of partition 'gpu' have at most 8 CPUs",
        ),
        (
            {"args": ["--mem", "64G"]},
            "--mem 64G (65536 MB) but the nodes of partition 'gpu' have at most",
        ),
        (
            {"args": ["--time", "5", "--signal-delay-s", "300"]},
            "--time 00:05:00 (300 s) is not longer than --signal-delay-s 300: every task would be told to stop at once",
        ),
        (
            {"spec": ("[sampling]", "[sampling]\nseed = 1")},
            "unknown sampling key `seed` in [sampling]; there is no `seed`: use `sampling_seed`",
        ),
        (
            {"line": b'{"id": "x", "messages": [{"role": "user"}]}\n'},
            "prompts.jsonl:3: field `messages[0].content`",
        ),
    ],
)
def test_bad_submissions_fail_before_sbatch(tmp_path, toy_tokenizer, change, expected):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    if "line" in change:
        lines = prompts.read_bytes().splitlines(keepends=True)
        prompts.write_bytes(b"".join(lines[:2] + [change["line"]] + lines[2:]))
    job = slurm_job(tmp_path, toy_tokenizer("kimi"), n=4, shards=1, prompts=prompts)
    if "spec" in change:
        job.write_text(job.read_text().replace(*change["spec"]))
    queued = lambda: set(
        subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    )
    before = queued()
    r = toolkit("submit", str(job), *change.get("args", []), check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    assert expected in r.stderr
    assert not (tmp_path / "run" / "slurm" / "jobs.json").exists()
    assert queued() <= before, "nothing was submitted"


def test_status_shows_why_pending_tasks_wait(tmp_path, toy_tokenizer):
    job = slurm_job(tmp_path, toy_tokenizer("kimi"), n=6, shards=3, stub={"token_delay_s": 0.05})
    toolkit("submit", str(job), "--array-parallelism", "1")
    run = tmp_path / "run"
    try:
        deadline = time.monotonic() + 20
        while True:  # squeue says (None) until slurmctld's scheduler has looked at a new job; a busy one takes a while
            r = toolkit("status", str(run), "--json", check=False)
            assert r.returncode == 5, r.stderr  # still going
            st = msgspec.json.decode(r.stdout)
            waiting = [s for s in st["shards"] if s["state"] == "pending"]
            if (
                waiting
                and all(s["reason"] for s in waiting)
                and st["merge"]["reason"]
                or time.monotonic() > deadline
            ):
                break
            time.sleep(0.5)
        assert waiting and all(s["reason"] for s in waiting), [
            (s["state"], s["reason"]) for s in st["shards"]
        ]
        # the one task waits as squeue says (before slurmctld's scheduler has looked at it, squeue gives no reason
        # and status says the task is pending), or runs: the shards it has not claimed yet wait for it
        claims = (
            "not claimed yet: 1 of the 1 tasks of array ",
            "not claimed yet: the tasks of array ",
        )
        assert all(
            s["reason"] in ("JobArrayTaskLimit", "Priority", "Resources", "None")
            or s["reason"].startswith(claims)
            for s in waiting
        ), [s["reason"] for s in waiting]
        assert st["merge"]["state"] == "pending" and st["merge"]["reason"] == "Dependency"
        table = toolkit("status", str(run), check=False).stdout
        assert "REASON" in table and re.search(
            r"^\s+\d+ pending .*(Priority|Resources|not claimed yet: .*)$", table, re.M
        )
        assert "merge: job " in table and "pending (Dependency)" in table
    finally:
        toolkit("cancel", str(run))


def _slurmctld_pid_file() -> Path:
    conf = Path(os.environ["SLURM_CONF"]).read_text()
    return Path(re.search(r"^SlurmctldPidFile=(\S+)", conf, re.M).group(1))


def _squeue_answers() -> bool:
    return subprocess.run(["squeue", "-h"], capture_output=True, timeout=30).returncode == 0


def test_with_slurmctld_down_and_slurmdbd_up_a_killed_worker_is_unknown_not_running(
    tmp_path, toy_tokenizer, monkeypatch, capsys
):
    """sacct (slurmdbd) still says RUNNING for a task whose worker was killed while slurmctld was down: status says
    unknown (exit 4), takes no pace or ETA from the progress file, and shows that file as stale."""
    import signal

    from toolkit.cli import main as cli_main
    from toolkit.cluster.status import RunStatus
    from toolkit.formats import progress as worker_progress

    job = slurm_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=40,
        shards=1,
        stub={"token_delay_s": 0.01},
        sampling={"max_new_tokens": 400},
        client={"concurrency": 2},
    )
    toolkit("submit", str(job))
    run = tmp_path / "run"
    task = read_jobs(RunDir(run)).submissions[0].arrays[0].tasks[0]
    deadline = time.time() + 120
    while True:
        progress = run / "progress" / "00000.json"
        p = msgspec.json.decode(progress.read_bytes()) if progress.exists() else {}
        sacct = subprocess.run(
            ["sacct", "-n", "-P", "-X", "-j", task.split("_")[0], "--format=JobID,State"],
            capture_output=True,
            text=True,
        ).stdout
        if p.get("state") == "generating" and f"{task}|RUNNING" in sacct:
            break
        assert time.time() < deadline, f"the task never ran: {p} {sacct}"
        time.sleep(0.5)
    pid_file = _slurmctld_pid_file()
    ctld = int(pid_file.read_text())
    os.kill(ctld, signal.SIGTERM)  # slurmctld down; slurmdbd stays up
    try:
        while process_running(ctld):
            time.sleep(0.2)
        os.kill(p["pid"], signal.SIGKILL)  # the worker dies, and nobody tells slurmctld
        monkeypatch.setattr(worker_progress, "STALE_S", 3.0)
        progress, bound = run / "progress" / "00000.json", time.time() + 60
        while (
            time.time() - progress.stat().st_mtime <= 3.5
        ):  # the file older than STALE_S: no writer is left
            assert time.time() < bound, "the progress file is still being written"
            time.sleep(0.2)
        assert cli_main(["status", str(run), "--json"]) == 4
        st = msgspec.json.decode(capsys.readouterr().out, type=RunStatus)
        row = st.shards[0]
        assert row.state == "unknown" and row.tok_per_s == 0 and row.eta_s is None, row
        assert "sacct still says running" in row.reason and row.stale.startswith(
            "progress file not written for "
        )
        assert st.merge.state == "unknown" and st.exit == 4
        assert cli_main(["status", str(run)]) == 4
        table = capsys.readouterr().out
        assert "    0 unknown " in table and "progress file not written for" in table
    finally:  # slurmctld back, as slurm/start.sh starts it (it daemonizes; its output goes to its log)
        conf = os.environ["SLURM_CONF"]
        log = re.search(r"^SlurmctldLogFile=(\S+)", Path(conf).read_text(), re.M).group(1)
        with open(log, "a") as out:
            subprocess.run(
                ["slurmctld", "-f", conf],
                check=True,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.time() + 60
        while not _squeue_answers():
            assert time.time() < deadline, "slurmctld did not come back"
            time.sleep(0.5)
        toolkit("cancel", str(run), check=False)
        while subprocess.run(
            ["squeue", "-h", "-j", task.split("_")[0]], capture_output=True, text=True
        ).stdout.strip():
            assert time.time() < deadline + 60, "the killed task never left the queue"
            time.sleep(1)  # the next tests start on an idle node


def test_the_engine_starts_in_the_environment_the_node_setup_activates(tmp_path, toy_tokenizer):
    """Two environments, as a login node and a GPU node have them: `toolkit submit` runs in one without sglang
    (the worker runs with that Python, as submitit pins it), the tasks' [slurm] setup activates another that has
    it: SGLang (the fake of tests/fake_sglang) starts with the latter's Python, and the run completes."""
    from engines.test_engines import node_env

    node = node_env(tmp_path / "venvs" / "sglang", with_sglang=True)
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is not None)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, (
        "the login Python has no sglang"
    )
    record = tmp_path / "seen.json"
    job = slurm_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=8,
        shards=2,
        engine={
            "kind": "sglang",
            "shutdown_timeout_s": 5,
            "env": {"FAKE_SGLANG_RECORD": str(record)},
        },
        slurm={"setup": [f"source {node}/bin/activate"], "array_parallelism": 1},
    )
    r = toolkit("submit", str(job))
    assert "cannot start SGLang" in r.stdout + r.stderr, (
        "the login node is told it has no sglang (a warning)"
    )
    run = tmp_path / "run"
    rows, merge = wait_run(run)
    assert (
        [x.state for x in rows] == ["completed"] * 2 and merge.state == "completed" and merge.merged
    )
    seen = msgspec.json.decode(record.read_bytes())
    assert seen["prefix"] == str(node) and seen["python"] == str(node / "bin" / "python3")
    log = toolkit("logs", str(run), "0").stdout
    assert f"SGLang starts with {node}/bin/python3 (the first python3 on PATH, with sglang" in log
    script = next((run / "slurm").rglob("*_submission.sh")).read_text()
    assert f"source {node}/bin/activate" in script and f"{sys.executable} -u -m submitit" in script


def _scontrol_job(job: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True
    ).stdout
    first = out.splitlines()[0] if out else ""
    return dict(f.split("=", 1) for f in first.split() if "=" in f)


def test_sbatch_options_on_the_command_line_reach_slurm_and_the_merge_job_its_own_partition(
    tmp_path, toy_tokenizer
):
    """`submit` with sbatch's own flags: the tasks and the merge job carry them as Slurm records them, and the merge
    job (no GPU) goes to the partition --merge-partition names."""
    job = slurm_job(tmp_path, toy_tokenizer("kimi"), n=4, shards=2, stub={"token_delay_s": 0.05})
    run = tmp_path / "run"
    r = toolkit(
        "submit",
        str(job),
        "--array-parallelism",
        "1",
        "--comment",
        "toolkit-flags",
        "-x",
        "host1",
        "--mail-type",
        "END",
        "--merge-partition",
        "hosts",
    )
    try:
        array_id, merge_id = submitted_ids(r.stdout)[:2]
        tasks, merge = _scontrol_job(array_id), _scontrol_job(merge_id)
        assert tasks["Comment"] == "toolkit-flags" and tasks["ExcNodeList"] == "host1", tasks
        assert tasks["MailType"] == "END" and tasks["Partition"] == "gpu", tasks
        assert merge["Partition"] == "hosts" and merge["Comment"] == "toolkit-flags", merge
        assert merge["ExcNodeList"] == "host1" and merge["MailType"] == "END", merge
    finally:
        toolkit("cancel", str(run))
