"""The state of shards and of the merge job, from hand-built facts (toolkit.cluster.slurmview, rows and verdicts: no files, no Slurm)."""

from __future__ import annotations

import datetime as dt

import pytest

from toolkit.cluster.commands import FAILED, TIMEOUT, SlurmAnswer
from toolkit.cluster.jobs import ArrayJob, Submission, index_jobs
from toolkit.cluster.rows import (
    ACTIVE,
    CHANGED,
    DEAD,
    NOT_STARTED,
    STALE,
    UNFINISHED,
    UNKNOWN,
    MergeStatus,
    ShardFacts,
    merge_status,
    shard_row,
)
from toolkit.cluster.slurmview import (
    SlurmJob,
    SlurmView,
    expand,
    needs_scontrol,
    parse_sacct,
    parse_scontrol,
    parse_squeue,
    view_of_answers,
)
from toolkit.cluster.verdicts import RunFacts, exit_code, run_states, totals, verdict
from toolkit.errors import EXIT_FAILED, EXIT_IN_PROGRESS, EXIT_OK, EXIT_UNKNOWN
from toolkit.formats.manifests import DoneManifest
from toolkit.formats.progress import Progress

NOW = 1_800_000_000.0


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="seconds")


def ok(cmd: str, out: str) -> SlurmAnswer:
    return SlurmAnswer(cmd, True, out=out)


def down(cmd: str, why: str | None = None, problem: str = TIMEOUT) -> SlurmAnswer:
    return SlurmAnswer(cmd, False, problem=problem, why=why or f"{cmd} did not answer in 5 s")


def done_manifest(shard: int, records: int = 4, failed: int = 0) -> DoneManifest:
    return DoneManifest(
        shard=shard,
        fingerprint="f",
        records=records,
        ok=records - failed,
        failed=failed,
        prompt_tokens=10 * records,
        output_tokens=100 * records,
        bytes=1,
        sha256="0",
        host="n1",
        finished=iso(NOW - 5),
    )


def generating(shard: int = 0, **kw) -> Progress:
    kw = {"started": NOW - 20, "updated": NOW - 1, "state": "generating", "host": "n1", **kw}
    return Progress(
        shard=shard,
        total=4,
        done=2,
        output_tokens=200,
        tok_per_s=50.0,
        running=3,
        queued=1,
        kv_usage=0.5,
        **kw,
    )


def state(
    facts: ShardFacts, view: SlurmView | None = None, job: str | None = None, submitted: str = ""
):
    return shard_row(
        facts,
        view or SlurmView(jobs={}),
        job=job,
        submitted=submitted or iso(NOW - 10),
        now=NOW,
        run_shown="RUN",
    )


# ---------------------------------------------------------------------------------------------------
# parsing Slurm's answers
# ---------------------------------------------------------------------------------------------------
def test_expand_array_ids():
    assert expand("12_[3-5,7%2]") == ["12_3", "12_4", "12_5", "12_7"]
    assert expand("12_4") == ["12_4"] and expand("13") == ["13"]


def test_parse_sacct_squeue_scontrol():
    jobs, requeued = parse_sacct(
        [
            "70_0|COMPLETED|n1",
            "70_[1-2]|PENDING|None assigned",
            "70_3|REQUEUED|n2",
            "71|CANCELLED by 0|",
            "junk",
        ]
    )
    assert jobs["70_0"] == SlurmJob("COMPLETED", "n1") and jobs["70_2"] == SlurmJob("PENDING", None)
    assert jobs["71"].state == "CANCELLED" and requeued == {"70_3"}
    assert parse_squeue(["70_1|PENDING||(Priority)", "70_2|RUNNING|n3|None"]) == {
        "70_1": SlurmJob("PENDING", None, "Priority"),
        "70_2": SlurmJob("RUNNING", "n3", None),
    }
    line = (
        "JobId=75 ArrayJobId=70 ArrayTaskId=4-5 JobState=PENDING Reason=Resources NodeList=(null)"
    )
    assert parse_scontrol([line], "70") == {
        "70_4": SlurmJob("PENDING", None, "Resources"),
        "70_5": SlurmJob("PENDING", None, "Resources"),
    }


def test_view_squeue_wins_and_requeued_stays_visible():
    view = view_of_answers(
        ok("sacct", "70_0|REQUEUED|n1\n70_1|FAILED|n2\n"),
        ok("squeue", "70_0|PENDING||(BeginTime)\n"),
    )
    assert view.jobs["70_0"] == SlurmJob("REQUEUED", None, "BeginTime")
    assert view.jobs["70_1"].state == "FAILED" and view.sacct is None and view.squeue is None


def test_view_asks_scontrol_only_when_sacct_is_down_and_squeue_answers():
    sacct_down, squeue_ok = down("sacct"), ok("squeue", "")
    assert needs_scontrol(sacct_down, squeue_ok)
    assert not needs_scontrol(ok("sacct", ""), squeue_ok) and not needs_scontrol(
        sacct_down, down("squeue")
    )
    view = view_of_answers(
        sacct_down,
        squeue_ok,
        {"70": ok("scontrol", "JobId=70 ArrayJobId=70 ArrayTaskId=1 JobState=FAILED NodeList=n2")},
    )
    assert (
        view.jobs == {"70_1": SlurmJob("FAILED", "n2", None)}
        and view.sacct == "sacct did not answer in 5 s"
    )


def test_ids_slurm_no_longer_knows_are_an_empty_answer_not_a_failure():
    gone = down("squeue", "squeue failed (exit 1): Invalid job id specified", problem=FAILED)
    view = view_of_answers(ok("sacct", ""), gone)
    assert view.squeue is None and view.jobs == {}


# ---------------------------------------------------------------------------------------------------
# one shard
# ---------------------------------------------------------------------------------------------------
def test_pending_with_reason():
    view = SlurmView(jobs={"70_0": SlurmJob("PENDING", None, "Priority")})
    r = state(ShardFacts(0, 4, None, None), view, job="70_0")
    assert (r.state, r.reason, r.job, r.done, r.eta_s) == ("pending", "Priority", "70_0", 0, None)


def test_running_on_slurm_shows_pace_and_engine_load():
    view = SlurmView(jobs={"70_0": SlurmJob("RUNNING", "n7")})
    r = state(ShardFacts(0, 4, None, generating()), view, job="70_0")
    assert (
        r.state == "running"
        and r.node == "n7"
        and r.tok_per_s == 50.0
        and r.eta_s == pytest.approx(19.0)
    )
    assert (r.running, r.queued, r.kv_usage) == (3, 1, 0.5) and r.reason is None


def test_done_manifest_wins_over_what_slurm_still_says():
    view = SlurmView(jobs={"70_0": SlurmJob("RUNNING", "n7")})
    r = state(
        ShardFacts(0, 4, done_manifest(0, records=4, failed=1), generating()), view, job="70_0"
    )
    assert (r.state, r.done, r.failed, r.output_tokens, r.tok_per_s) == (
        "completed",
        4,
        1,
        400,
        0.0,
    )


@pytest.mark.parametrize(
    "slurm, shown",
    [
        ("FAILED", "failed"),
        ("TIMEOUT", "timeout"),
        ("PREEMPTED", "preempted"),
        ("CANCELLED", "cancelled"),
        ("OUT_OF_MEMORY", "out_of_memory"),
        ("COMPLETED", "incomplete"),
    ],
)
def test_ended_tasks(slurm, shown):
    p = generating(error="engine died")
    r = state(
        ShardFacts(0, 4, None, p), SlurmView(jobs={"70_0": SlurmJob(slurm, "n1")}), job="70_0"
    )
    assert r.state == shown and r.tok_per_s == 0.0 and r.eta_s is None and r.error == "engine died"
    assert r.running is None


def test_requeued_keeps_its_reason():
    r = state(
        ShardFacts(0, 4, None, None),
        SlurmView(jobs={"70_0": SlurmJob("REQUEUED", None, "BeginTime")}),
        job="70_0",
    )
    assert r.state == "requeued" and r.reason == "BeginTime" and "requeued" in ACTIVE


def test_not_listed_yet_is_submitted_then_unknown():
    facts = ShardFacts(0, 4, None, None)
    assert state(facts, job="70_0", submitted=iso(NOW - 30)).state == "submitted"
    r = state(facts, job="70_0", submitted=iso(NOW - 600))
    assert (
        r.state == UNKNOWN
        and r.reason == "neither squeue nor sacct knows job 70_0, submitted 10 min ago"
    )


def test_unknown_when_slurm_does_not_answer():
    both = SlurmView(
        jobs={}, sacct="sacct did not answer in 5 s", squeue="squeue did not answer in 5 s"
    )
    r = state(ShardFacts(0, 4, None, generating()), both, job="70_1")
    assert (
        r.state == UNKNOWN
        and r.reason == "squeue did not answer in 5 s; sacct did not answer in 5 s"
    )
    assert r.done == 2 and r.tok_per_s == 0.0  # the run directory's counts, no pace guessed
    only_sacct = SlurmView(jobs={}, sacct="sacct did not answer in 5 s")
    assert state(ShardFacts(0, 4, None, None), only_sacct, job="70_1").reason == (
        "sacct did not answer in 5 s; squeue and scontrol no longer know job 70_1"
    )


def test_local_worker_dead_or_alive():
    dead = state(
        ShardFacts(1, 4, None, generating(1), gone="worker gone: pid 5 is not running on n1")
    )
    assert dead.state == DEAD and dead.tok_per_s == 0.0 and dead.eta_s is None
    assert (
        dead.error == "worker gone: pid 5 is not running on n1; `toolkit retry RUN` resumes it here"
    )
    assert state(ShardFacts(1, 4, None, generating(1))).state == "running"
    assert (
        state(ShardFacts(1, 4, None, Progress(shard=1, state="stopped", total=4))).state
        == "stopped"
    )


def test_outside_slurm_a_shard_is_pending_only_while_a_live_process_will_run_it():
    """In progress means something runs it: a shard no attempt started, with no live `toolkit run` to take it up
    (after Ctrl-C, after `run --shards 0 --no-merge`) is not started, and the run is stopped, not in progress."""
    idle = state(ShardFacts(2, 4, None, None))
    assert idle.state == NOT_STARTED and idle.state not in ACTIVE
    waiting = state(ShardFacts(1, 4, None, None, runner="`toolkit run` (pid 7 on n1)"))
    assert (waiting.state, waiting.reason) == (
        "pending",
        "`toolkit run` (pid 7 on n1) runs it next",
    )
    stopped = Progress(shard=1, state="stopped", total=4, done=2)
    assert (
        state(ShardFacts(1, 4, None, stopped, runner="`toolkit run` (pid 7 on n1)")).state
        == "pending"
    )
    code, why = verdict(
        [completed(0), state(ShardFacts(1, 4, None, stopped)), idle],
        MergeStatus(None, None, False),
        "RUN",
    )
    assert code == EXIT_FAILED and code != EXIT_IN_PROGRESS
    assert why == (
        "stopped: shards 1-2 stopped/not_started and nothing runs them: `toolkit retry RUN` resumes them "
        "here (`toolkit resubmit RUN` on Slurm)"
    )
    # a process here that merges once its shards are done: the merge is pending, the run in progress
    facts = RunFacts(
        run_shown="RUN",
        shards=[
            ShardFacts(0, 4, done_manifest(0), None),
            ShardFacts(1, 4, None, None, runner="`toolkit run` (pid 7 on n1)"),
        ],
        jobs=index_jobs([]),
        view=SlurmView(jobs={}),
        merged=False,
        now=NOW,
        merging="`toolkit run` (pid 7 on n1)",
    )
    rows, merge = run_states(facts)
    assert verdict(rows, merge, "RUN") == (
        EXIT_IN_PROGRESS,
        "in progress: shard 1 not finished; merge pending (`toolkit run` (pid 7 on n1) merges once "
        "every shard is done)",
    )


def test_a_shard_whose_done_manifest_is_damaged_is_not_complete():
    """Its progress says done, its manifest cannot be read: merge refuses it, so status does not say complete."""
    r = state(ShardFacts(1, 4, None, Progress(shard=1, state="done", total=4, done=4)))
    assert r.state == UNFINISHED and "done manifest is missing or damaged" in r.error
    code, why = verdict([completed(0), r], MergeStatus(None, None, True, audit="passed"), "RUN")
    assert (
        code == EXIT_FAILED
        and "shard 1 unfinished and nothing runs them: `toolkit retry RUN`" in why
    )


def test_a_finished_shard_whose_file_changed_is_not_complete_and_names_the_repair():
    """Its done manifest is there but no longer vouches for its file: merge refuses it, so status says so, with the
    command that repairs it (here, or on Slurm for a shard submitted there)."""
    why = "shards/00001.zst has 10 bytes, its done manifest says 12"
    facts = ShardFacts(1, 4, None, Progress(shard=1, state="done", total=4, done=4), untrusted=why)
    r = state(facts)
    assert (
        r.state == CHANGED and r.reason == why and "`toolkit retry RUN` checks the file" in r.error
    )
    code, text = verdict([completed(0), r], MergeStatus(None, None, True, audit="passed"), "RUN")
    assert (code, text) == (
        EXIT_FAILED,
        f"not complete: shard 1 changed since done ({why}): `toolkit retry RUN` "
        "checks the file, keeps what is intact and generates the rest",
    )
    on_slurm = state(facts, SlurmView(jobs={"70_1": SlurmJob("COMPLETED", "n1")}), job="70_1")
    assert (
        on_slurm.state == CHANGED
        and "`toolkit resubmit RUN`" in verdict([on_slurm], MergeStatus(None, None, True))[1]
    )
    # a task that runs it again now: running, not changed
    assert (
        state(facts, SlurmView(jobs={"70_1": SlurmJob("RUNNING", "n1")}), job="70_1").state
        == "running"
    )


def test_a_damaged_prompts_msgpack_is_not_complete_whatever_else_holds():
    merge = MergeStatus(None, None, True, audit="passed", prompts="prompts.msgpack is missing")
    code, why = verdict([completed(0), completed(1)], merge, "RUN")
    assert code == EXIT_FAILED and why.startswith(
        "not complete: prompts.msgpack is missing: merge, export and retry "
        "refuse the run; `toolkit run JOB`"
    )


def test_a_damaged_merged_file_is_not_complete():
    merge = MergeStatus(
        None, None, True, audit="passed", damaged="records.zst has 10 bytes, its manifest says 12"
    )
    code, why = verdict([completed(0), completed(1)], merge, "RUN")
    assert code == EXIT_FAILED and why == (
        "not complete: the merged dataset is damaged (records.zst has 10 bytes, "
        "its manifest says 12): `toolkit merge RUN` makes it again"
    )


# ---------------------------------------------------------------------------------------------------
# the merge job, a whole run
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "view, expected",
    [
        (
            SlurmView(jobs={"71": SlurmJob("PENDING", None, "Dependency")}),
            MergeStatus("71", "pending", False, "Dependency"),
        ),
        (SlurmView(jobs={"71": SlurmJob("RUNNING", "n1")}), MergeStatus("71", "running", False)),
        (
            SlurmView(jobs={"71": SlurmJob("COMPLETED", "n1")}),
            MergeStatus("71", "completed", False),
        ),
        (SlurmView(jobs={"71": SlurmJob("FAILED", "n1")}), MergeStatus("71", "failed", False)),
        (SlurmView(jobs={}), MergeStatus("71", "submitted", False)),
        (
            SlurmView(jobs={}, squeue="squeue did not answer in 5 s"),
            MergeStatus(
                "71", UNKNOWN, False, "squeue did not answer in 5 s; sacct has no row for job 71"
            ),
        ),
    ],
)
def test_merge_job_states(view, expected):
    assert merge_status(view, job="71", submitted=iso(NOW - 5), merged=False, now=NOW) == expected


def test_no_merge_job_when_never_submitted():
    assert merge_status(
        SlurmView(jobs={}), job=None, submitted="", merged=True, now=NOW
    ) == MergeStatus(None, None, True)


def test_run_states_follow_the_latest_submission_and_exit_codes():
    subs = [
        Submission(iso(NOW - 900), [ArrayJob("70", [0, 1], ["70_0", "70_1"])], "71"),
        Submission(iso(NOW - 60), [ArrayJob("80", [1], ["80"])], "81"),
    ]
    jobs = index_jobs(subs)
    assert (
        jobs.task_of == {0: "70_0", 1: "80"}
        and jobs.merge_job == "81"
        and jobs.job_ids == ["70", "80", "81"]
    )
    view = SlurmView(
        jobs={
            "70_0": SlurmJob("COMPLETED", "n1"),
            "80": SlurmJob("RUNNING", "n2"),
            "81": SlurmJob("PENDING", None, "Dependency"),
        }
    )
    facts = RunFacts(
        run_shown="RUN",
        shards=[ShardFacts(0, 4, done_manifest(0), None), ShardFacts(1, 4, None, generating(1))],
        jobs=jobs,
        view=view,
        merged=False,
        now=NOW,
    )
    rows, merge = run_states(facts)
    assert [r.state for r in rows] == ["completed", "running"] and rows[1].job == "80"
    assert merge == MergeStatus("81", "pending", False, "Dependency")
    assert totals(rows).shards == {"completed": 1, "running": 1} and totals(rows).done == 6
    assert exit_code(rows, merge) == EXIT_IN_PROGRESS
    assert exit_code(rows, MergeStatus("81", UNKNOWN, False, "why")) == EXIT_UNKNOWN
    rows[
        1
    ].state = "failed"  # known to have failed: the run cannot complete, whatever else is unknown
    assert exit_code(rows, MergeStatus("81", "cancelled", False)) == EXIT_FAILED
    assert exit_code(rows, MergeStatus("81", UNKNOWN, False, "why")) == EXIT_FAILED


# ---------------------------------------------------------------------------------------------------
# what status says when the run is not complete and healthy (its exit code), stale answers
# ---------------------------------------------------------------------------------------------------
def completed(shard: int, transient: int = 0):
    r = state(ShardFacts(shard, 4, done_manifest(shard, failed=transient), None))
    r.transient = transient
    return r


@pytest.mark.parametrize(
    "merge, rows, code, says",
    [
        (
            MergeStatus("71", "completed", True, audit="passed"),
            None,
            EXIT_OK,
            "complete: every shard done, merged, audit",
        ),
        (
            MergeStatus(None, None, True, audit="passed"),
            None,
            EXIT_OK,
            "complete",
        ),  # merged here: no merge job
        (
            MergeStatus("71", "failed", True, audit="failed"),
            None,
            EXIT_FAILED,
            "failed: merge job 71 failed; the audit failed",
        ),
        (
            MergeStatus("71", "failed", False),
            None,
            EXIT_FAILED,
            "failed: merge job 71 failed; `toolkit logs RUN --failed`",
        ),
        (
            MergeStatus(None, None, True, audit="failed"),
            None,
            EXIT_FAILED,
            "failed: the audit failed",
        ),
        (
            MergeStatus(None, None, False),
            None,
            EXIT_FAILED,
            "not complete: not merged: `toolkit merge RUN`",
        ),
        (
            MergeStatus(None, None, True, current=False, audit="passed"),
            None,
            EXIT_FAILED,
            "not complete: merged before a shard finished again",
        ),
        (
            MergeStatus(None, None, True),
            None,
            EXIT_FAILED,
            "not complete: not audited: `toolkit audit RUN`",
        ),
        (
            MergeStatus(None, None, True, audit="passed"),
            "transient",
            EXIT_FAILED,
            "not complete: 2 failures that may pass in shard 1: `toolkit retry RUN`",
        ),
        (
            MergeStatus("71", "pending", False, "Dependency"),
            None,
            EXIT_IN_PROGRESS,
            "in progress: merge job 71 pending",
        ),
        (
            MergeStatus("71", UNKNOWN, True, "why", audit="passed"),
            None,
            EXIT_OK,
            "complete",
        ),  # the files say it all
        (MergeStatus("71", UNKNOWN, False, "why"), None, EXIT_UNKNOWN, "unknown"),
    ],
)
def test_status_exits_0_only_when_the_run_is_complete_and_healthy(merge, rows, code, says):
    shards = [completed(0), completed(1, transient=2 if rows == "transient" else 0)]
    got, why = verdict(shards, merge, "RUN")
    assert got == code and why.startswith(says), why
    assert exit_code(shards, merge) == code


def test_a_failed_or_stopped_shard_is_never_exit_0():
    running = state(
        ShardFacts(2, 4, None, generating(2)),
        SlurmView(jobs={"70_2": SlurmJob("RUNNING", "n1")}),
        job="70_2",
    )
    failed = state(
        ShardFacts(1, 4, None, None), SlurmView(jobs={"70_1": SlurmJob("FAILED", "n1")}), job="70_1"
    )
    code, why = verdict(
        [completed(0), failed, running], MergeStatus("71", "pending", False, "Dependency"), "RUN"
    )
    assert code == EXIT_FAILED and why.startswith(
        "failed: shard 1 failed"
    )  # the run cannot complete on its own
    assert (
        verdict([completed(0), running], MergeStatus("71", "pending", False), "RUN")[0]
        == EXIT_IN_PROGRESS
    )
    stopped = state(ShardFacts(1, 4, None, Progress(shard=1, state="stopped", total=4)))
    code, why = verdict([completed(0), stopped], MergeStatus(None, None, False), "RUN")
    assert (
        code == EXIT_FAILED
        and "shard 1 stopped and nothing runs them: `toolkit retry RUN` resumes them here" in why
    )


def test_slurmctld_down_sacct_up_a_live_state_in_sacct_is_unknown():
    """slurmdbd keeps the last state slurmctld told it: RUNNING stays RUNNING after the worker was killed."""
    view = view_of_answers(
        ok(
            "sacct",
            "70_0|COMPLETED|n1\n70_1|RUNNING|n1\n70_2|FAILED|n1\n71|PENDING|None assigned\n",
        ),
        down(
            "squeue", "squeue failed (exit 1): Unable to contact slurm controller", problem=FAILED
        ),
    )
    assert view.jobs == {
        "70_0": SlurmJob("COMPLETED", "n1"),
        "70_2": SlurmJob("FAILED", "n1"),
    }  # final states hold
    assert view.stale == {"70_1": "RUNNING", "71": "PENDING"}
    stale_progress = generating(1, updated=NOW - 45)  # written 45 s ago by a worker since killed
    r = state(ShardFacts(1, 4, None, stale_progress), view, job="70_1")
    assert r.state == UNKNOWN and r.tok_per_s == 0.0 and r.eta_s is None and r.running is None
    assert r.reason.startswith(
        "squeue failed (exit 1): Unable to contact slurm controller; sacct still says running"
    )
    assert r.stale.startswith("progress file not written for 45 s")
    m = merge_status(view, job="71", submitted=iso(NOW - 900), merged=False, now=NOW)
    assert m.state == UNKNOWN and "sacct still says pending" in m.reason
    assert exit_code([r], m) == EXIT_UNKNOWN
    failed = state(ShardFacts(2, 4, None, None), view, job="70_2")
    assert failed.state == "failed"


def test_a_progress_file_far_older_than_its_refresh_is_stale():
    old = generating(0, updated=NOW - 45)
    local = state(
        ShardFacts(0, 4, None, old)
    )  # `toolkit run` on another host: the file is all there is
    assert local.state == STALE and local.tok_per_s == 0.0 and local.eta_s is None
    assert local.stale == (
        "progress file not written for 45 s (a generating worker writes it every 2 s): its worker "
        "is dead or hung"
    )
    assert exit_code([local], MergeStatus(None, None, False)) == EXIT_FAILED
    on_slurm = state(
        ShardFacts(0, 4, None, old), SlurmView(jobs={"70_0": SlurmJob("RUNNING", "n7")}), job="70_0"
    )
    assert (
        on_slurm.state == "running"
        and on_slurm.eta_s is None
        and on_slurm.tok_per_s == 0.0
        and on_slurm.stale
    )
    fresh = state(ShardFacts(0, 4, None, generating(0, updated=NOW - 5)))
    assert fresh.state == "running" and fresh.stale is None and fresh.eta_s is not None
    loading = Progress(
        shard=0, state="loading", total=4, updated=NOW - 900
    )  # weights load for minutes: not stale
    assert state(ShardFacts(0, 4, None, loading)).stale is None


# ---------------------------------------------------------------------------------------------------
# claiming arrays: tasks take shards as they come (worker.claims)
# ---------------------------------------------------------------------------------------------------
def claim_facts(
    progress: dict[int, Progress], sacct: dict[str, str], done: tuple[int, ...] = ()
) -> RunFacts:
    sub = Submission(
        submitted=iso(NOW - 60),
        arrays=[ArrayJob("12", [0, 1, 2, 3], ["12_0", "12_1"], claims=True)],
        merge_job_id="13",
    )
    view = SlurmView(
        jobs={j: SlurmJob(s, "n1" if s == "RUNNING" else None) for j, s in sacct.items()}
    )
    shards = [
        ShardFacts(
            shard=k, total=4, done=done_manifest(k) if k in done else None, progress=progress.get(k)
        )
        for k in range(4)
    ]
    return RunFacts(
        run_shown="RUN", shards=shards, jobs=index_jobs([sub]), view=view, merged=False, now=NOW
    )


def claimed(shard: int, task: str, group: str = "12", **kw) -> Progress:
    p = generating(shard, task=task, group=group, **{"task_engine_starts": 1, **kw})
    return p


def test_a_claiming_array_is_asked_about_once_and_each_shard_shows_the_task_that_took_it():
    f = claim_facts(
        {1: claimed(1, "12_0", task_shards=2), 2: claimed(2, "12_1")},
        {"12_0": "RUNNING", "12_1": "RUNNING"},
        done=(0,),
    )
    assert f.jobs.job_ids == ["12", "13"] and f.jobs.pool_of == {0: "12", 1: "12", 2: "12", 3: "12"}
    rows, _ = run_states(f)
    assert [(r.state, r.job) for r in rows] == [
        ("completed", None),
        ("running", "12_0"),
        ("running", "12_1"),
        ("pending", None),
    ]
    assert (
        rows[3].reason
        == "not claimed yet: 2 of the 2 tasks of array 12 claim shards as they free up"
    )


def test_a_shard_of_an_earlier_submission_or_no_task_left_is_not_running():
    old = claimed(
        3, "9_1", group="9", state="stopped"
    )  # an attempt of an earlier array: not this one's
    rows, _ = run_states(claim_facts({3: old}, {"12_0": "COMPLETED", "12_1": "PREEMPTED"}))
    assert rows[3].state == "incomplete" and rows[3].job is None and rows[3].node is None
    assert rows[3].reason == "no task of array 12 claimed it before they all ended"
    assert verdict(rows, MergeStatus(job=None, state=None, merged=False))[0] == EXIT_FAILED
    # a stopped attempt of a task Slurm requeued: requeued, and claimed again by whichever task is free
    rows, _ = run_states(
        claim_facts(
            {3: claimed(3, "12_1", state="stopped")}, {"12_0": "RUNNING", "12_1": "REQUEUED"}
        )
    )
    assert (rows[3].state, rows[3].job) == ("requeued", "12_1")
    # nobody answered: unknown, with why
    f = claim_facts({}, {})
    f.view = SlurmView(jobs={}, sacct="sacct did not answer", squeue="squeue did not answer")
    assert run_states(f)[0][0].state == UNKNOWN


def test_tasks_list_what_each_took_and_its_engine_starts():
    from toolkit.cluster.verdicts import task_rows

    f = claim_facts(
        {
            0: claimed(0, "12_0", task_shards=1, host="n1", state="done"),
            1: claimed(1, "12_0", task_shards=2, host="n1"),
            2: claimed(2, "12_1", task_shards=1, host="n2", state="stopped"),
            3: claimed(3, "12_1", task_shards=1, host="n2", restart_count=1, task_engine_starts=1),
        },
        {},
    )
    rows = task_rows(f.shards, running={1, 3})
    assert [(t.task, t.node, t.shards, t.engine_starts, t.working_on) for t in rows] == [
        ("12_0", "n1", [0, 1], 1, 1),
        ("12_1", "n2", [2, 3], 2, 3),
    ]  # a requeued task started its engine again
