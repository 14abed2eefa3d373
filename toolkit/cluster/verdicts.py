"""The run as `status` sums it up, from facts already read: pure functions, no I/O.

`cluster.status` reads the facts at the edge (the run's done manifests and progress files,
`slurm/jobs.json`, the answers of squeue, sacct and `scontrol show job`, whether a local worker's
pid is gone, the time) and hands them here as `RunFacts`. `run_states` makes every shard's row and
the merge job's (cluster.rows; a shard of a claiming array no task has claimed yet takes its
state from the array's tasks: `pool_state`), `task_rows` the workers of the newest group, `totals`
the run's sums, and `verdict` gives `status`'s exit code and the sentence that explains it.
"""

from __future__ import annotations

import msgspec

from toolkit.cluster.jobs import JobsIndex
from toolkit.cluster.rows import (
    ACTIVE,
    BAD_STATES,
    CHANGED,
    UNFINISHED,
    UNKNOWN,
    MergeStatus,
    ShardFacts,
    ShardRow,
    claimed_by,
    merge_status,
    pool_state,
    shard_row,
)
from toolkit.cluster.slurmview import SlurmView
from toolkit.errors import EXIT_FAILED, EXIT_IN_PROGRESS, EXIT_OK, EXIT_UNKNOWN
from toolkit.formats.progress import Progress
from toolkit.formats.text import ranges

__all__ = [
    "RunFacts",
    "TaskStatus",
    "Totals",
    "exit_code",
    "is_unknown",
    "needs_attention",
    "run_states",
    "task_rows",
    "totals",
    "verdict",
]


class Totals(msgspec.Struct):
    done: int
    total: int
    failed: int
    output_tokens: int
    tok_per_s: float
    shards: dict[str, int]  # shards per state
    loops: int = 0  # outputs stopped in a repetition loop (ShardRow.loops, summed)
    percent: float = 0.0  # done / total, in percent
    per_s: float = 0.0  # records per second of the shards running now, summed
    # seconds left for the prompts of the shards something runs (running or pending) at `per_s`
    # (None: nothing generates now)
    eta_s: float | None = None


class RunFacts(msgspec.Struct):
    """Everything `status` reads of a run in one refresh."""

    run_shown: str
    shards: list[ShardFacts]
    jobs: JobsIndex
    view: SlurmView
    merged: bool  # merged/manifest.json exists
    now: float  # Unix time of the refresh
    merged_current: bool = True  # merged/manifest.json is newer than every done manifest
    # "passed" / "failed": audit.json's verdict on the current merge (None: none)
    audit: str | None = None
    # a live `toolkit run` (or retry) that merges the run once its shards are done
    merging: str | None = None
    merged_damaged: str | None = None  # what is wrong with the merged dataset against its manifest
    prompts_damaged: str | None = None  # what is wrong with prompts.msgpack (formats.prompts)
    # what a planned record is: a prompt, or an output with samples (RunPlan.noun)
    noun: str = "prompt"


def _row(s: ShardFacts, f: RunFacts) -> ShardRow:
    array = f.jobs.pool_of.get(s.shard)
    if array is None:
        job = f.jobs.task_of.get(s.shard)
        return shard_row(
            s,
            f.view,
            job=job,
            submitted=f.jobs.submitted_at.get(job or "", ""),
            now=f.now,
            run_shown=f.run_shown,
        )
    submitted = f.jobs.submitted_at.get(array, "")
    job = claimed_by(s.progress, array)
    unclaimed = (
        None
        if job
        else pool_state(f.view, array, f.jobs.pool_tasks.get(array, [array]), submitted, f.now)
    )
    return shard_row(
        s,
        f.view,
        job=job,
        submitted=submitted,
        now=f.now,
        run_shown=f.run_shown,
        unclaimed=unclaimed,
    )


def run_states(f: RunFacts) -> tuple[list[ShardRow], MergeStatus]:
    rows = [_row(s, f) for s in f.shards]
    merge = merge_status(
        f.view,
        job=f.jobs.merge_job,
        submitted=f.jobs.merge_submitted,
        merged=f.merged,
        now=f.now,
        current=f.merged_current,
        audit=f.audit,
    )
    merge.damaged, merge.prompts = f.merged_damaged, f.prompts_damaged
    if f.merging and merge.state not in ACTIVE:  # merged here, by the process that runs the shards
        merge.state, merge.reason = "pending", f"{f.merging} merges once every shard is done"
    return rows, merge


class TaskStatus(msgspec.Struct):
    """One worker of the newest claiming group (a Slurm array job, or one `toolkit run`), as the
    progress files of the shards it took say."""

    task: str  # `12_3`, or `worker 1 (pid 4242)` of `toolkit run`
    node: str | None
    # the shards it took, in the order it took them (those no other task took since)
    shards: list[int]
    # engine starts, summed over its attempts (a requeued task starts its engine again)
    engine_starts: int
    working_on: int | None = None  # the shard it loads or generates now


def task_rows(shards: list[ShardFacts], running: set[int] = frozenset()) -> list[TaskStatus]:
    """The workers of the newest group and what each took, from the shards' progress files;
    `running`: the shards whose state is running (the shard a worker works on now is one of
    them)."""
    ps = [
        f.progress
        for f in shards
        if f.progress is not None and f.progress.task and f.progress.group
    ]
    if not ps:
        return []
    newest = max(ps, key=lambda p: p.updated).group
    by_task: dict[str, list[Progress]] = {}
    for p in ps:
        if p.group == newest:
            by_task.setdefault(p.task, []).append(p)
    rows = []
    for task, mine in by_task.items():
        starts: dict[int, int] = {}
        for p in mine:
            starts[p.restart_count] = max(starts.get(p.restart_count, 0), p.task_engine_starts)
        mine.sort(key=lambda p: (p.restart_count, p.task_shards, p.started))
        now = [p.shard for p in mine if p.shard in running]
        rows.append(
            TaskStatus(
                task=task,
                node=mine[-1].host or None,
                shards=[p.shard for p in mine],
                engine_starts=sum(starts.values()),
                working_on=now[-1] if now else None,
            )
        )
    return sorted(rows, key=lambda r: (len(r.task), r.task))


def totals(rows: list[ShardRow]) -> Totals:
    """The run's sums. Its ETA: the records left in the shards something runs (running, pending:
    a stopped or failed shard is left to the command that resumes it) over the records per second
    of the shards generating now (each its attempt's own pace, the one of its ETA): records, not
    tokens, since what is left is known in prompts, not in tokens."""
    by_state: dict[str, int] = {}
    for r in rows:
        by_state[r.state] = by_state.get(r.state, 0) + 1
    done, total = sum(r.done for r in rows), sum(r.total for r in rows)
    per_s = sum(r.per_s for r in rows)
    left = sum(max(r.total - r.done, 0) for r in rows if r.state in ACTIVE)
    return Totals(
        done=done,
        total=total,
        percent=100.0 * done / total if total else 100.0,
        per_s=per_s,
        eta_s=left / per_s if per_s > 0 else None,
        failed=sum(r.failed for r in rows),
        output_tokens=sum(r.output_tokens for r in rows),
        tok_per_s=sum(r.tok_per_s for r in rows),
        shards=dict(sorted(by_state.items())),
        loops=sum(r.loops for r in rows),
    )


def needs_attention(r: ShardRow) -> bool:
    """Whether `status`'s summary of many shards lists shard `r` on its own: it does not finish
    without someone acting (failed, dead, stale, cancelled, ...), changed since done, finished
    without a readable done manifest, its progress not written for far too long, or its state
    unknown."""
    return r.state in BAD_STATES or r.state in (CHANGED, UNFINISHED, UNKNOWN) or bool(r.stale)


def is_unknown(rows: list[ShardRow], merge: MergeStatus) -> bool:
    return any(r.state == UNKNOWN for r in rows) or merge.state == UNKNOWN


def exit_code(rows: list[ShardRow], merge: MergeStatus) -> int:
    """`status`'s exit code: see `verdict`."""
    return verdict(rows, merge)[0]


def _shards(rows: list[ShardRow]) -> str:
    return (
        f"shard{'s' if len(rows) != 1 else ''} {ranges([r.shard for r in rows], sep=',', limit=8)}"
    )


def _merge_named(merge: MergeStatus) -> str:
    return (
        f"merge job {merge.job} {merge.state}"
        if merge.job
        else f"merge {merge.state} ({merge.reason})"
    )


def verdict(rows: list[ShardRow], merge: MergeStatus, run_shown: str = "RUN") -> tuple[int, str]:
    """`status`'s exit code and the sentence that says why, the first that holds of:

    1 (EXIT_FAILED)      prompts.msgpack damaged (merge, export and retry refuse the run);
    0 (EXIT_OK)          complete and healthy: every shard completed with no failure that may
                         pass, merged after the last shard finished, the merged dataset what its
                         manifest says, and the audit of that merge passed;
    1 (EXIT_FAILED)      failed: a shard failed, timed out, was cancelled, its worker is dead or
                         stale, the merge job failed or the audit did (a shard still running does
                         not change it: the run cannot complete on its own);
    4 (EXIT_UNKNOWN)     some state cannot be known (Slurm did not answer);
    5 (EXIT_IN_PROGRESS) still going: something runs it (shards or the merge job pending or
                         running, on Slurm or in a live `toolkit run` here);
    1 (EXIT_FAILED)      ended without completing: stopped (shards stopped, not started or
                         unfinished, and nothing runs them), a finished shard's file changed since
                         its done manifest, failures that may pass left, not merged (or merged
                         before a shard changed, or the merged file damaged), not audited: the
                         command to run next is said."""
    if merge.prompts:  # the run's plan is damaged: nothing else can be repaired before it
        return EXIT_FAILED, (
            f"not complete: {merge.prompts}: merge, export and retry refuse the run; `toolkit run "
            "JOB` (or `toolkit submit JOB`) with the job file that made it writes it again and "
            "generates nothing already done"
        )
    retry = [r for r in rows if r.state == "completed" and r.transient]
    if _complete(rows, merge, retry):
        return EXIT_OK, "complete: every shard done, merged, audit passed"
    problems = _problems(rows, merge)
    if problems:
        also = f"; {_may_pass(retry, run_shown)}" if retry else ""
        return (
            EXIT_FAILED,
            f"failed: {'; '.join(problems)}; `toolkit logs {run_shown} --failed` says why{also}",
        )
    if is_unknown(rows, merge):
        return EXIT_UNKNOWN, "unknown: Slurm did not say the state of every job (see above)"
    going = _going(rows, merge)
    if going:
        return EXIT_IN_PROGRESS, f"in progress: {'; '.join(going)}"
    return EXIT_FAILED, _left_to_do(rows, merge, retry, run_shown)


def _complete(rows: list[ShardRow], merge: MergeStatus, retry: list[ShardRow]) -> bool:
    """Every shard completed with no failure that may pass (`retry`: those that have some), merged
    after the last one, the merged dataset intact and its audit passed."""
    return (
        all(r.state == "completed" for r in rows)
        and not retry
        and merge.merged
        and merge.current
        and merge.audit == "passed"
        and not merge.damaged
    )


def _problems(rows: list[ShardRow], merge: MergeStatus) -> list[str]:
    """What failed, a phrase each: the shards per bad state, the merge job, the audit."""
    problems = []
    bad = [r for r in rows if r.state in BAD_STATES]
    for st in dict.fromkeys(r.state for r in bad):
        these = [r for r in bad if r.state == st]
        problems.append(f"{_shards(these)} {st}")
    if merge.job and merge.state in BAD_STATES:
        problems.append(f"merge job {merge.job} {merge.state}")
    if merge.merged and merge.current and merge.audit == "failed" and not merge.damaged:
        problems.append("the audit failed")
    return problems


def _may_pass(retry: list[ShardRow], run_shown: str) -> str:
    return (
        f"{sum(r.transient for r in retry)} failures that may pass in {_shards(retry)}: "
        f"`toolkit retry {run_shown}`"
    )


def _going(rows: list[ShardRow], merge: MergeStatus) -> list[str]:
    """What something still runs: the shards not finished, the merge job (empty: nothing)."""
    active = [r for r in rows if r.state in ACTIVE]
    going = [f"{_shards(active)} not finished"] if active else []
    if merge.state in ACTIVE:
        going.append(_merge_named(merge))
    return going


def _left_to_do(
    rows: list[ShardRow], merge: MergeStatus, retry: list[ShardRow], run_shown: str
) -> str:
    """A run that ended without completing: what is left, each with the command that does it."""
    todo = []
    changed = [r for r in rows if r.state == CHANGED]
    if changed:
        again = "resubmit" if any(r.job for r in changed) else "retry"
        todo.append(
            f"{_shards(changed)} changed since done ({changed[0].reason}): `toolkit {again} "
            f"{run_shown}` checks the file, keeps what is intact and generates the rest"
        )
    unfinished = [r for r in rows if r.state != "completed"]
    stopped = [r for r in unfinished if r.state != CHANGED]
    if stopped:
        todo.append(_stopped(stopped, run_shown))
    if retry:
        todo.append(_may_pass(retry, run_shown))
    if not unfinished and not retry:
        todo += _merge_left(merge, run_shown)
    return f"{'stopped' if stopped else 'not complete'}: {'; '.join(todo)}"


def _stopped(stopped: list[ShardRow], run_shown: str) -> str:
    """Shards that stopped and that nothing runs, and the command that resumes them."""
    states = "/".join(dict.fromkeys(r.state for r in stopped))
    if any(r.job for r in stopped):
        resume = f"`toolkit resubmit {run_shown}` resumes them on Slurm"
    else:  # not submitted to Slurm: nothing will pick them up
        resume = (
            f"`toolkit retry {run_shown}` resumes them here (`toolkit resubmit "
            f"{run_shown}` on Slurm)"
        )
    return f"{_shards(stopped)} {states} and nothing runs them: {resume}"


def _merge_left(merge: MergeStatus, run_shown: str) -> list[str]:
    """Every shard done: what is left of the merge and the audit (empty: nothing)."""
    if not merge.merged:
        return [f"not merged: `toolkit merge {run_shown}`"]
    if not merge.current:
        return [f"merged before a shard finished again: `toolkit merge {run_shown}`"]
    if merge.damaged:
        return [
            f"the merged dataset is damaged ({merge.damaged}): `toolkit merge {run_shown}` "
            "makes it again"
        ]
    if merge.audit is None:
        return [f"not audited: `toolkit audit {run_shown}`"]
    return []
