"""`toolkit status`: one row per shard (Slurm state, progress, tokens, ETA), the merge job, the
run's total (percent done, its ETA), and an exit code that says whether the run is complete and
healthy. A run of more than SUMMARY_OVER shards gets a summary instead of a row per shard: the
shards per state, and a row for each shard that needs attention (`--all`: every row).

State comes from the files a run directory holds (done manifests checked against their shard files,
prompts.msgpack against run.json, progress files) and, for runs submitted to Slurm, from `squeue`
(live, with the REASON a pending task waits) then `sacct` (history, may lag a few seconds or have no
row yet). Every Slurm command is bounded (cluster.commands.TIMEOUT_S); when sacct does not answer
(slurmdbd down), `scontrol show job` tells what slurmctld still remembers; what nobody could tell is
`unknown`, with why, never guessed as `submitted`, and `status` exits 4 (EXIT_UNKNOWN). `status`
exits 0 only for a run that is complete and healthy (cluster.verdicts says each code).

This module is the edge: it reads the files and asks Slurm (`read_facts`); cluster.slurmview,
cluster.rows and cluster.verdicts derive every state from those facts with pure functions, and
cluster.table formats them.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgspec

from toolkit.cluster.commands import call
from toolkit.cluster.jobs import index_jobs, read_jobs
from toolkit.cluster.rows import ACTIVE, MergeStatus, ShardFacts, ShardRow
from toolkit.cluster.slurmview import SlurmView, needs_scontrol, view_of_answers
from toolkit.cluster.table import format_status
from toolkit.cluster.verdicts import (
    RunFacts,
    TaskStatus,
    Totals,
    exit_code,
    is_unknown,
    run_states,
    task_rows,
    totals,
    verdict,
)
from toolkit.errors import EXIT_UNKNOWN
from toolkit.formats.progress import LocalRun, live_local_runs, worker_gone
from toolkit.formats.prompts import prompts_problem
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.shardstate import STATUS, done_time
from toolkit.job.schema import JobSpec


class RunStatus(msgspec.Struct):
    """`toolkit status RUN --json`: one object, the same figures as the table, and the exit code
    with its reason."""

    run: str
    shards: list[ShardRow]
    totals: Totals
    merge: MergeStatus
    exit: int = 0
    verdict: str = ""
    # the workers of the newest submission or run: shards taken, engine starts
    tasks: list[TaskStatus] = []


def status_report(
    rd: RunDir, rows: list[ShardRow], merge: MergeStatus, tasks: list[TaskStatus] | None = None
) -> RunStatus:
    code, why = verdict(rows, merge, rd.shown)
    return RunStatus(
        run=str(Path(rd.root).resolve()),
        shards=rows,
        totals=totals(rows),
        merge=merge,
        exit=code,
        verdict=why,
        tasks=tasks or [],
    )


# --------------------------------------------------------------------------------------------------
# the edge: Slurm's answers and the run's files
# --------------------------------------------------------------------------------------------------
def slurm_view(ids: list[str]) -> SlurmView:
    """What Slurm says of `ids` (jobs, array jobs): squeue and sacct, and `scontrol show job` for
    each when sacct does not answer but slurmctld does. Every command is bounded
    (cluster.commands.TIMEOUT_S)."""
    if not ids:
        return view_of_answers(None, None)
    joined = ",".join(ids)
    sacct = call(["sacct", "-n", "-P", "-X", "-D", "-j", joined, "--format=JobID,State,NodeList"])
    squeue = call(["squeue", "-h", "-r", "-j", joined, "-o", "%i|%T|%N|%r"])
    scontrol = (
        {j: call(["scontrol", "show", "job", "-o", j]) for j in ids}
        if needs_scontrol(sacct, squeue)
        else None
    )
    return view_of_answers(sacct, squeue, scontrol)


def read_facts(run_dir: str | os.PathLike) -> tuple[RunDir, RunFacts]:
    """Everything one refresh reads: jobs.json, each shard's done manifest and progress, whether a
    local worker is gone, Slurm's answers, the time."""
    run = Run.open(run_dir, JobSpec)  # read-only: status writes nothing into the run
    rd, plan = run.rd, run.plan
    jobs = index_jobs(read_jobs(rd).submissions)
    view = slurm_view(jobs.job_ids)
    live = live_local_runs(rd)
    shards = []
    last_done = 0.0
    for s in plan.shards:
        # a done manifest whose file changed since (size; sha256 of a file written after it) is no
        # longer believed
        st = run.shard_state(s.index, STATUS)
        p, done = st.progress, st.done
        if done is not None:
            last_done = max(last_done, done_time(rd, s.index) or 0.0)
        local = done is None and s.index not in jobs.task_of and s.index not in jobs.pool_of
        runner = next((r for r in live if s.index in r.shards), None) if local else None
        if (
            runner is not None
            and p is not None
            and p.state == "failed"
            and p.group
            and p.group == runner.group
        ):
            runner = None  # failed in that run's workers: not claimed again by them
        shards.append(
            ShardFacts(
                shard=s.index,
                total=s.count,
                done=done,
                progress=p,
                gone=worker_gone(p) if local and p is not None else None,
                runner=_who(runner) if runner is not None else None,
                untrusted=st.why,
            )
        )
    merged_at = _mtime(rd.manifest_file)
    current = merged_at is not None and merged_at >= last_done
    audit = _audit_verdict(rd, merged_at)
    damaged = None
    # its sha256 is read only when the rest says complete: exit 0 vouches for it
    if merged_at is not None:
        from toolkit.dataset.merge_manifest import merged_file_problem

        whole = current and audit == "passed" and all(f.done is not None for f in shards)
        damaged = merged_file_problem(rd, checksum=whole)
    return rd, RunFacts(
        run_shown=rd.shown,
        shards=shards,
        jobs=jobs,
        view=view,
        merged=merged_at is not None,
        now=time.time(),
        merged_current=current,
        audit=audit,
        merging=next((_who(r) for r in live if r.merges), None),
        merged_damaged=damaged,
        noun=plan.noun,
        prompts_damaged=prompts_problem(rd, plan),
    )


def _who(r: LocalRun) -> str:
    return f"`{r.command}` (pid {r.pid} on {r.host})"


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


class _Verdict(msgspec.Struct):
    passed: bool  # of audit.json: only the verdict is read


def _audit_verdict(rd: RunDir, merged_at: float | None) -> str | None:
    """ "passed" / "failed": the verdict of audit.json when it audits the current merge (written
    after it); else None."""
    at = _mtime(rd.audit_json)
    if merged_at is None or at is None or at < merged_at:
        return None
    try:
        return (
            "passed"
            if msgspec.json.decode(rd.audit_json.read_bytes(), type=_Verdict).passed
            else "failed"
        )
    except (OSError, msgspec.MsgspecError):
        return "failed"  # an audit.json that cannot be read vouches for nothing


def run_status(run_dir: str | os.PathLike) -> tuple[RunDir, list[ShardRow], MergeStatus]:
    rd, rows, merge, _ = run_status_tasks(run_dir)
    return rd, rows, merge


def run_status_tasks(
    run_dir: str | os.PathLike,
) -> tuple[RunDir, list[ShardRow], MergeStatus, list[TaskStatus]]:
    """`run_status`, and the workers of the newest submission or run (task_rows)."""
    rd, rows, merge, tasks, _ = _status_once(run_dir)
    return rd, rows, merge, tasks


def _status_once(
    run_dir: str | os.PathLike,
) -> tuple[RunDir, list[ShardRow], MergeStatus, list[TaskStatus], str]:
    """`run_status_tasks`, and what a planned record is called (RunPlan.noun)."""
    rd, facts = read_facts(run_dir)
    rows, merge = run_states(facts)
    return (
        rd,
        rows,
        merge,
        task_rows(facts.shards, {r.shard for r in rows if r.state == "running"}),
        facts.noun,
    )


UNKNOWN_LIMIT_S = 600.0  # --watch gives up after the state has been unknown this long


def status_command(
    run: str | os.PathLike,
    *,
    watch: bool = False,
    interval: float = 5.0,
    as_json: bool = False,
    unknown_limit_s: float = UNKNOWN_LIMIT_S,
    every_row: bool = False,
) -> int:
    """`toolkit status`: the table (or JSON) once, or refreshed every `interval` s until the run
    ends; a summary of more than SUMMARY_OVER shards unless `every_row`."""
    unknown_since: float | None = None
    while True:
        rd, rows, merge, tasks, noun = _status_once(run)
        if as_json:  # with --watch: one compact object per line, per refresh
            text = msgspec.json.encode(status_report(rd, rows, merge, tasks)).decode()
            if not watch:
                text = msgspec.json.format(text, indent=2)
        else:
            text = format_status(rd, rows, merge, tasks, noun, every_row)
        if not watch:
            print(text)
            return exit_code(rows, merge)
        unknown = is_unknown(rows, merge)
        if not unknown:
            unknown_since = None
        elif unknown_since is None:
            unknown_since = time.monotonic()
        if unknown and not as_json:
            waited = time.monotonic() - unknown_since
            text += (
                f"\nstill refreshing every {interval:g} s: the state has been unknown for "
                f"{waited:.0f} s; gives up (exit {EXIT_UNKNOWN}) after {unknown_limit_s:.0f} s"
            )
        sys.stdout.write(("" if as_json else "\x1b[H\x1b[2J") + text + "\n")
        sys.stdout.flush()
        if unknown:
            if time.monotonic() - unknown_since >= unknown_limit_s:
                print(
                    "toolkit: error: the state of the run stayed unknown for "
                    f"{unknown_limit_s:.0f} s (Slurm does not answer); `toolkit status {rd.shown}` "
                    "once it does",
                    file=sys.stderr,
                )
                return EXIT_UNKNOWN
        else:
            finished = all(r.state not in ACTIVE for r in rows)
            if finished and merge.state not in ACTIVE:
                return exit_code(rows, merge)
        time.sleep(interval)
