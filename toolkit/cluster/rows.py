"""One shard's row of `status` and the merge job's, derived from facts already read: pure
functions, no I/O.

`shard_row` derives a shard's `ShardRow` from its files (`ShardFacts`) and what Slurm said of its
task (`SlurmView`, cluster.slurmview), `pool_state` the state of a shard no task of its claiming
array has claimed yet, and `merge_status` the merge job's `MergeStatus`. A shard whose done manifest
exists is completed whatever Slurm still says about its task; what no answer tells is `unknown`,
with why, never guessed as `submitted`. A generating worker's progress file far older than its
refresh interval is stale: no pace or ETA is read from it. The state names a row can hold are here
too.
"""

from __future__ import annotations

import msgspec

from toolkit.cluster.slurmview import SlurmView, unknown_why
from toolkit.formats.manifests import DoneManifest
from toolkit.formats.progress import REFRESH_S, Progress, stale_for

__all__ = [
    "ACTIVE",
    "BAD_STATES",
    "CHANGED",
    "DEAD",
    "NOT_STARTED",
    "STALE",
    "UNFINISHED",
    "UNKNOWN",
    "MergeStatus",
    "ShardFacts",
    "ShardRow",
    "claimed_by",
    "merge_status",
    "pool_state",
    "shard_row",
]

UNKNOWN = "unknown"
# a shard not submitted to Slurm that no attempt has started, and nothing runs it now
NOT_STARTED = "not_started"
UNFINISHED = "unfinished"  # its worker finished it, but its done manifest is missing or damaged
# its done manifest is there, but its file is no longer what it says (cut, grown, changed, gone)
CHANGED = "changed"
DEAD = "dead"  # a local worker's progress says generating, but its pid is gone from this host
# a local worker's progress says generating, but the file has not been written for far too long
STALE = "stale"
ACTIVE = ("pending", "running", "submitted", "requeued", "configuring", "completing")
# States after which a shard does not finish without someone acting (resubmit, retry, resume).
BAD_STATES = (
    "failed",
    DEAD,
    STALE,
    "timeout",
    "cancelled",
    "node_fail",
    "out_of_memory",
    "incomplete",
    "preempted",
    "boot_fail",
    "deadline",
)
_LOCAL_STATES = {
    "done": "completed",
    "generating": "running",
    "loading": "running",
    "starting": "running",
}


class ShardRow(msgspec.Struct):
    """One shard's row of `status` (and of `status --json`): its state and its figures."""

    shard: int
    # pending running completed failed cancelled requeued timeout stopped incomplete ...
    state: str
    done: int
    total: int
    failed: int
    output_tokens: int
    tok_per_s: float
    eta_s: float | None
    job: str | None  # Slurm id of the task that ran (or runs) it, e.g. 1234_5
    node: str | None
    error: str | None
    # why a pending task waits (squeue's REASON), or why the state is unknown
    reason: str | None = None
    # requests the engine generates / keeps queued (its /v1/loads), while running
    running: int | None = None
    queued: int | None = None
    kv_usage: float | None = None  # share of the engine's KV cache in use
    # of the failed records, those that may pass when generated again (done manifest)
    transient: int = 0
    # why the progress file is not believed (not written for far too long)
    stale: str | None = None
    # outputs stopped in a repetition loop ([client] loop_stop): the shard's records with finish
    # "loop" (done manifest) once it is done; before, those its current (or last) attempt stopped
    # (progress file)
    loops: int = 0
    # records per second of its current attempt while running (Progress.per_s): its ETA's pace
    per_s: float = 0.0


class MergeStatus(msgspec.Struct):
    job: str | None  # Slurm id of the run's (latest) merge + audit job
    state: str | None  # its Slurm state, lower case
    merged: bool  # merged/manifest.json exists
    reason: str | None = None  # why it is pending, or why its state is unknown
    current: bool = True  # the merge is newer than every shard's done manifest
    # "passed" / "failed": the verdict of audit.json on this merge (None: not audited)
    audit: str | None = None
    # what is wrong with the merged dataset against its manifest (None: intact)
    damaged: str | None = None
    # what is wrong with prompts.msgpack (None: what the plan wrote): merge, export and retry
    # refuse the run until the job is planned again into it
    prompts: str | None = None


class ShardFacts(msgspec.Struct):
    """What the run directory says of one shard, as read."""

    shard: int
    total: int  # prompts it owns
    done: DoneManifest | None  # its done manifest
    progress: Progress | None  # its progress file
    # why its local worker is gone (progress.worker_gone), when it is
    gone: str | None = None
    # a live `toolkit run` (retry, worker) that will run it (progress.local_run)
    runner: str | None = None
    # why its done manifest is not believed (formats.shardstate UNTRUSTED: its file changed since)
    untrusted: str | None = None


def shard_row(
    f: ShardFacts,
    view: SlurmView,
    *,
    job: str | None,
    submitted: str,
    now: float,
    run_shown: str,
    unclaimed: tuple[str, str | None] | None = None,
) -> ShardRow:
    """The state of one shard: its done manifest first, then what Slurm says of its task `job`, then
    `unclaimed` (the state and reason of a shard no task of its claiming array has claimed yet:
    pool_state), else (no Slurm job: `toolkit run`) its progress file and whether its local worker
    is still alive."""
    k, done = f.shard, f.done
    p = f.progress or Progress(shard=k, state="pending", total=f.total)
    # the progress file, if any, is of an earlier submission's attempt
    if unclaimed is not None and job is None:
        p = msgspec.structs.replace(p, host="", error=None, state="pending")
    error = p.error
    stale_s = stale_for(p, now) if done is None else None
    known = view.jobs.get(job) if job else None
    node = known.node if known else None
    reason = known.reason if known and known.state in ("PENDING", "REQUEUED") else None
    if done is not None:
        state, reason = "completed", None
    elif f.untrusted and not (known and known.state.lower() in ACTIVE):
        state, reason = CHANGED, f.untrusted
        again = "resubmit" if job else "retry"
        error = (
            f"{f.untrusted}: its done manifest no longer vouches for it; `toolkit {again} "
            f"{run_shown}` checks the file, keeps what is intact and generates the rest"
        )
    elif known:
        state = known.state.lower()
        # the task ended without finishing the shard (e.g. stopped, not requeued)
        if state == "completed":
            state = "incomplete"
    elif job:
        reason = unknown_why(view, job, submitted, now)
        state = UNKNOWN if reason else "submitted"  # submitted: sacct has no row yet
    elif unclaimed is not None:
        state, reason = unclaimed
        error = None
    elif f.gone:
        state = DEAD
        error = f"{f.gone}; `toolkit retry {run_shown}` resumes it here"
    # not submitted to Slurm: its progress file, whether its worker lives, whether a live process
    # will run it
    else:
        state = _LOCAL_STATES.get(p.state, p.state)
        # the progress file is all there is to go by, and it is old
        if state == "running" and stale_s is not None:
            state = STALE
        elif state != "running" and f.runner:
            state, reason, error = "pending", f"{f.runner} runs it next", None
        elif f.progress is None:
            state = NOT_STARTED
        elif state == "completed":  # (a done manifest, had it been readable, was taken above)
            state = UNFINISHED
            error = (
                "its worker finished it, but its done manifest is missing or damaged: the shard "
                f"is taken as not done; `toolkit retry {run_shown}` checks its file and writes the "
                "manifest again"
            )
    stale = None
    if stale_s is not None and state in ("running", UNKNOWN, STALE):
        stale = (
            f"progress file not written for {stale_s:.0f} s (a generating worker writes it every "
            f"{REFRESH_S:g} s): its worker is dead or hung"
        )
    running = state == "running" and stale is None
    return ShardRow(
        shard=k,
        state=state,
        done=done.records if done else p.done,
        total=f.total,
        failed=done.failed if done else p.failed,
        output_tokens=done.output_tokens if done else p.output_tokens,
        tok_per_s=p.tok_per_s if running else 0.0,
        eta_s=p.eta_s() if running else None,
        per_s=(p.per_s() or 0.0) if running else 0.0,
        job=job,
        node=node or (p.host or None),
        error=error,
        reason=reason,
        # (given up after max_tries: retry starts afresh)
        transient=done.transient + done.given_up if done else 0,
        loops=done.loops if done else p.resumed_loops + p.loops_stopped,
        stale=stale,
        **({"running": p.running, "queued": p.queued, "kv_usage": p.kv_usage} if running else {}),
    )


def merge_status(
    view: SlurmView,
    *,
    job: str | None,
    submitted: str,
    merged: bool,
    now: float,
    current: bool = True,
    audit: str | None = None,
) -> MergeStatus:
    """The merge + audit job's state: what Slurm says, else unknown (with why) or only submitted;
    and what the run directory says of the merge (`merged`, `current`: newer than every done
    manifest; `audit`: its verdict)."""
    files = {"merged": merged, "current": current, "audit": audit}
    if not job:
        return MergeStatus(job=None, state=None, **files)
    known = view.jobs.get(job)
    if known:
        reason = known.reason if known.state == "PENDING" and known.reason else None
        return MergeStatus(job=job, state=known.state.lower(), reason=reason, **files)
    why = unknown_why(view, job, submitted, now)
    return MergeStatus(job=job, state=UNKNOWN if why else "submitted", reason=why, **files)


def claimed_by(p: Progress | None, array: str) -> str | None:
    """The task of claiming array `array` that works (or worked) on a shard, as its progress file
    says; None when no task of that array has claimed it."""
    if p is None or not p.task or p.group != array:
        return None
    return p.task


def pool_state(
    view: SlurmView, array: str, tasks: list[str], submitted: str, now: float
) -> tuple[str, str | None]:
    """The state of a shard no task of claiming array `array` has claimed yet, from its tasks:
    pending while one of them is pending or running (it will claim it), incomplete once they have
    all ended without it, else unknown (with why) or only submitted."""
    known = {t: view.jobs[t] for t in tasks if t in view.jobs}
    live = [t for t, j in known.items() if j.state.lower() in ACTIVE]
    # why they wait, as squeue says
    if live and all(known[t].state in ("PENDING", "REQUEUED") for t in live):
        return "pending", known[
            live[0]
        ].reason or f"not claimed yet: the tasks of array {array} are pending"
    if live:
        return (
            "pending",
            f"not claimed yet: {len(live)} of the {len(tasks)} tasks of array {array} claim shards "
            "as they free up",
        )
    if len(known) == len(tasks):
        return "incomplete", f"no task of array {array} claimed it before they all ended"
    missing = next(t for t in tasks if t not in known)
    why = unknown_why(view, missing, submitted, now)
    return (UNKNOWN, why) if why else ("submitted", f"not claimed yet: array {array} submitted")
