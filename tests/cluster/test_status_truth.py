"""`status` and `logs` tell the truth: exit 0 only for a run complete and healthy, partial outputs continued are
named as such (not duplicates, not failures), `logs -f` follows a shard through its requeues, `resubmit` and
`retry --slurm` say why each shard goes again. No cluster: Slurm's answers are stood in for where needed (the
real cluster's side is in test_slurm.py)."""

from __future__ import annotations

import random
import threading
import time

import msgspec
import pytest

import runs
import toolkit.cluster.logs
import toolkit.cluster.status
from toolkit.cli import main as cli_main
from toolkit.cluster.jobs import ArrayJob, Jobs, Submission
from toolkit.cluster.slurmview import SlurmJob, SlurmView
from toolkit.cluster.status import RunStatus
from toolkit.dataset.finish import AuditFailed, merge_and_audit
from toolkit.dataset.merge import merge_run
from toolkit.formats.progress import Progress, write_progress
from toolkit.formats.records import PARTIAL, Record


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def submitted(s: runs.Synth, shards: list[int], merge_job: str = "71") -> None:
    sub = Submission(
        submitted=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        arrays=[ArrayJob("70", shards, [f"70_{i}" for i in range(len(shards))])],
        merge_job_id=merge_job,
    )
    s.rd.jobs_file.parent.mkdir(parents=True, exist_ok=True)
    s.rd.jobs_file.write_bytes(msgspec.json.encode(Jobs([sub])))


def slurm_says(monkeypatch, **states: str) -> None:
    """Slurm's answer for every job, e.g. `slurm_says(mp, **{"70_0": "COMPLETED", "71": "FAILED"})`."""
    monkeypatch.setattr(
        toolkit.cluster.status,
        "slurm_view",
        lambda ids: SlurmView(jobs={j: SlurmJob(st, "n1") for j, st in states.items()}),
    )


def status(root, capsys) -> tuple[int, str, RunStatus]:
    code = cli_main(["status", str(root)])
    table = capsys.readouterr().out
    assert cli_main(["status", str(root), "--json"]) == code
    return code, table, msgspec.json.decode(capsys.readouterr().out, type=RunStatus)


# ---------------------------------------------------------------------------------------------------
# status: exit 0 only when complete and healthy
# ---------------------------------------------------------------------------------------------------
def test_a_failed_merge_job_and_a_failed_audit_are_not_exit_0(tmp_path, kimi, capsys, monkeypatch):
    s = runs.plan_run(
        tmp_path, kimi, datasets={"math": 8}, shards=2, audit={"max_failed_share": 0.05}
    )
    runs.write_run(s, failed=[1, 2])  # 2 of 8 failed: over the audit's limit
    with pytest.raises(AuditFailed):
        merge_and_audit(s.root)
    capsys.readouterr()
    submitted(s, [0, 1])
    slurm_says(monkeypatch, **{"70_0": "COMPLETED", "70_1": "COMPLETED", "71": "FAILED"})
    code, table, st = status(s.root, capsys)
    assert (
        code == 1 and "merge: job 71 failed (merged/manifest.json written, audit failed)" in table
    )
    assert table.splitlines()[-1] == (
        f"run: failed: merge job 71 failed; the audit failed; `toolkit logs {s.rd.shown} "
        "--failed` says why (exit 1)"
    )
    assert st.exit == 1 and st.merge.audit == "failed" and st.totals.failed == 2
    assert cli_main(["logs", str(s.root), "--failed"]) == 1
    assert "==> the audit of the merged run failed" in capsys.readouterr().out


def test_exit_0_needs_every_shard_merged_and_audited_after_it_finished(tmp_path, kimi, capsys):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 6}, shards=2)
    runs.write_run(s)
    code, table, _ = status(s.root, capsys)
    assert (
        code == 1
        and table.splitlines()[-1]
        == f"run: not complete: not merged: `toolkit merge {s.rd.shown}` (exit 1)"
    )
    assert merge_and_audit(s.root).passed
    capsys.readouterr()
    code, table, st = status(s.root, capsys)
    assert code == 0 and st.verdict == "complete: every shard done, merged, audit passed"
    assert "merge: merged/manifest.json written, audit passed" in table
    later = (
        s.rd.manifest_file.stat().st_mtime + 5
    )  # a shard finished again (`toolkit retry`) after the merge
    import os

    os.utime(s.rd.done_file(1), (later, later))
    code, _, st = status(s.root, capsys)
    assert code == 1 and st.verdict.startswith("not complete: merged before a shard finished again")


# ---------------------------------------------------------------------------------------------------
# partial outputs continued after a stop: neither duplicates nor failures
# ---------------------------------------------------------------------------------------------------
def partial_of(rec: Record, keep: int) -> Record:
    return msgspec.structs.replace(
        rec,
        status=PARTIAL,
        failure=PARTIAL,
        finish="abort",
        output_ids=rec.output_ids[: 4 * keep],
        completion_tokens=keep,
        error="stopped: saved in flight",
    )


def test_partial_outputs_continued_are_counted_as_continued(tmp_path, kimi, capsys):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 6}, shards=1)
    rng = random.Random(1)
    ok = {p: runs.record(s, p, runs.healthy()(s, p, rng)) for p in range(6)}
    again = runs.record(
        s, 4, runs.healthy()(s, 4, rng)
    )  # a real duplicate: position 4 written twice
    # first attempt: 0, 1 and partial outputs of 2 and 3 at the stop; the next continues them and writes the rest
    runs.write_shard(
        s,
        0,
        [ok[0], ok[1], partial_of(ok[2], 5), partial_of(ok[3], 7)],
        done=False,
        flush_records=2,
    )
    assert cli_main(["logs", str(s.root), "--failed"]) == 0
    out = capsys.readouterr().out
    assert (
        "2 partial outputs kept when an attempt stopped: not failures" in out
        and "failed record" not in out
    )
    runs.write_shard(s, 0, [ok[2], ok[3], ok[4], again, ok[5]], flush_records=2)
    m = merge_run(s.root)
    assert (m.continued, m.duplicates, m.failed) == (2, 1, 0) and m.shards[0].continued == 2
    assert m.duplicate_ids == [s.refs[4].id]
    assert merge_and_audit(s.root).passed
    summary = capsys.readouterr().out
    assert (
        "6 planned, 6 ok, 0 failed, 0 missing; 1 duplicates kept once, 2 partial outputs continued"
        in summary
    )
    from toolkit.dataset.audit_report import read_report

    report = read_report(s.rd)
    assert report.continued == 2 and report.duplicates == 1
    coverage = next(c for c in report.checks if c.name == "coverage")
    assert coverage.message.endswith(
        "(6 ok, 0 failed; 1 duplicates kept once, 2 partial outputs continued)"
    )
    assert cli_main(["logs", str(s.root), "--failed"]) == 0
    out = capsys.readouterr().out
    assert "partial" not in out and "failed record" not in out


def test_logs_failed_lists_the_newest_record_of_each_id_only(tmp_path, kimi, capsys):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 4}, shards=1)
    rng = random.Random(2)
    ok = {p: runs.record(s, p, runs.healthy()(s, p, rng)) for p in range(4)}
    timeout = runs.record(s, 1, None, error="no answer within 10 s", failure="timeout")
    rejected = runs.record(s, 3, None, error="HTTP 400: too long", failure="rejected")
    runs.write_shard(
        s, 0, [ok[0], timeout, ok[2], rejected, ok[1]], done=False
    )  # 1 generated again since
    cli_main(["logs", str(s.root), "--failed"])
    out = capsys.readouterr().out
    assert "==> 1 failed record (" in out and f"{s.refs[3].id}  HTTP 400: too long" in out
    assert "no answer within 10 s" not in out


# ---------------------------------------------------------------------------------------------------
# logs -f: until the shard is done or failed for good, not at the first requeue
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_logs_follow_goes_on_through_requeues_until_the_shard_is_done(
    tmp_path, kimi, capsys, monkeypatch
):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 4}, shards=1)
    submitted(s, [0])
    slurm = {"70_0": "RUNNING"}
    monkeypatch.setattr(
        toolkit.cluster.status,
        "slurm_view",
        lambda ids: SlurmView(jobs={j: SlurmJob(st, "n1") for j, st in slurm.items()}),
    )
    monkeypatch.setattr(toolkit.cluster.logs, "SLURM_ASK_S", 0.1)
    log = s.rd.log_file(0)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("attempt 1\n")
    write_progress(s.rd.progress_file(0), Progress(shard=0, state="generating", total=4))
    ended = threading.Event()
    code = []
    t = threading.Thread(
        target=lambda: (code.append(cli_main(["logs", str(s.root), "0", "-f"])), ended.set()),
        daemon=True,
    )
    t.start()
    for attempt in (
        2,
        3,
        4,
    ):  # each stop (time limit, preemption, scontrol requeue) comes back as a new attempt
        write_progress(
            s.rd.progress_file(0),
            Progress(shard=0, state="stopped", total=4, stop_signal="SIGUSR2"),
        )
        with open(log, "a") as f:
            f.write(f"shard 0 stopped (attempt {attempt - 1})\n")
        for slurm["70_0"] in ("RUNNING", "REQUEUED", "PENDING"):
            assert not ended.wait(1.0), f"stopped following at the stop of attempt {attempt - 1}"
        slurm["70_0"] = "RUNNING"
        write_progress(s.rd.progress_file(0), Progress(shard=0, state="generating", total=4))
        with open(log, "a") as f:
            f.write(f"attempt {attempt}\n")
    runs.write_run(s)  # the last attempt finishes the shard: its done manifest
    assert ended.wait(10)
    cap = capsys.readouterr()
    assert code == [0] and "(shard 0 done: stopped following)" in cap.err
    assert [x for x in cap.out.splitlines() if x.startswith("attempt")] == [
        f"attempt {i}" for i in (1, 2, 3, 4)
    ]


def test_logs_follow_ends_when_the_task_failed_for_good(tmp_path, kimi, capsys, monkeypatch):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 4}, shards=1)
    submitted(s, [0])
    slurm_says(monkeypatch, **{"70_0": "FAILED"})
    s.rd.log_file(0).parent.mkdir(parents=True, exist_ok=True)
    s.rd.log_file(0).write_text("engine died\n")
    write_progress(
        s.rd.progress_file(0), Progress(shard=0, state="failed", total=4, error="engine died")
    )
    assert cli_main(["logs", str(s.root), "0", "-f"]) == 0
    assert "(shard 0 failed (task 70_0 failed): stopped following)" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------
# resubmit / retry --slurm: why each shard goes again
# ---------------------------------------------------------------------------------------------------
def test_why_shards_are_resubmitted_is_said_per_shard(tmp_path, kimi):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 9}, shards=3)
    runs.write_run(
        s, done=[1, 2], failed=[4, 5, 7]
    )  # (a failed record of runs.record is `rejected`: permanent)
    from toolkit.cluster.submit import why_unfinished
    from toolkit.formats.manifests import read_done

    m = read_done(s.rd.done_file(1))
    s.rd.done_file(1).write_bytes(msgspec.json.encode(msgspec.structs.replace(m, transient=2)))
    assert (
        why_unfinished(s.rd, [0, 1]) == "0 without a done manifest; 1 with 2 failures that may pass"
    )
    assert why_unfinished(s.rd, [1]) == "1 with 2 failures that may pass"
    from toolkit.cluster.retry import request_retry

    request_retry(
        s.root, [s.refs[7].id]
    )  # shard 2 loses its done manifest: `retry --ids` asked for one of its ids
    assert why_unfinished(s.rd, [0, 1, 2]) == (
        "0 without a done manifest; 2 with ids `toolkit retry --ids` asked for; "
        "1 with 2 failures that may pass"
    )
