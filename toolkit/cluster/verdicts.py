"""The state of each shard and of the merge job, derived from facts already read: pure functions, no
I/O.

`cluster.status` reads the facts at the edge (the run's done manifests and progress files,
`slurm/jobs.json`, the answers of squeue, sacct and `scontrol show job`, whether a local worker's
pid is gone, the time) and hands them here. From Slurm's answers `view_of_answers` builds one
`SlurmView`; from it and a shard's files `shard_status` derives a `ShardStatus`, and `merge_status`
the merge job's `MergeStatus`. A shard whose done manifest exists is completed whatever Slurm still
says about its task; what no answer tells is `unknown`, with why, never guessed as `submitted`
(except for a job submitted less than SACCT_LAG_S ago, which sacct may not list yet). When slurmctld
does not answer, sacct's rows of jobs still live (PENDING, RUNNING, ...) are what slurmdbd last
heard, not what is: those states are unknown too. A generating worker's progress file far older than
its refresh interval is stale: no pace or ETA is read from it. `verdict` gives `status`'s exit code
and the sentence that explains it.
"""

from __future__ import annotations

import datetime as _dt
import re

import msgspec

from toolkit.cluster.commands import FAILED, SlurmAnswer
from toolkit.errors import EXIT_FAILED, EXIT_IN_PROGRESS, EXIT_OK, EXIT_UNKNOWN
from toolkit.formats.manifests import DoneManifest
from toolkit.formats.progress import REFRESH_S, Progress, stale_for
from toolkit.formats.text import ranges

__all__ = [
    "ACTIVE",
    "BAD_STATES",
    "CHANGED",
    "DEAD",
    "NOT_STARTED",
    "STALE",
    "UNFINISHED",
    "UNKNOWN",
    "JobsIndex",
    "MergeStatus",
    "RunFacts",
    "ShardFacts",
    "ShardStatus",
    "SlurmJob",
    "SlurmView",
    "TaskStatus",
    "Totals",
    "claimed_by",
    "exit_code",
    "expand",
    "index_jobs",
    "is_unknown",
    "merge_status",
    "needs_attention",
    "parse_sacct",
    "parse_scontrol",
    "parse_squeue",
    "pool_state",
    "run_states",
    "shard_status",
    "view_of_answers",
    "task_rows",
    "totals",
    "unknown_why",
    "verdict",
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
# Slurm's states of a job that has ended: final, so sacct's word for them holds even when slurmctld
# is down.
TERMINAL = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
# a job neither squeue nor sacct knows this long after its submission is unknown, not submitted
SACCT_LAG_S = 120
# squeue/scontrol of ids all gone from slurmctld: not a failure
NO_SUCH_JOB = "Invalid job id specified"
_LOCAL_STATES = {
    "done": "completed",
    "generating": "running",
    "loading": "running",
    "starting": "running",
}


# --------------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------------
class ShardStatus(msgspec.Struct):
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


class Totals(msgspec.Struct):
    done: int
    total: int
    failed: int
    output_tokens: int
    tok_per_s: float
    shards: dict[str, int]  # shards per state
    loops: int = 0  # outputs stopped in a repetition loop (ShardStatus.loops, summed)
    percent: float = 0.0  # done / total, in percent
    per_s: float = 0.0  # records per second of the shards running now, summed
    # seconds left for the prompts of the shards something runs (running or pending) at `per_s`
    # (None: nothing generates now)
    eta_s: float | None = None


# --------------------------------------------------------------------------------------------------
# what Slurm said
# --------------------------------------------------------------------------------------------------
class SlurmJob(msgspec.Struct):
    state: str  # Slurm's word, upper case: PENDING RUNNING COMPLETED REQUEUED ...
    node: str | None = None
    # why a pending job waits (squeue %r: Priority, Resources, Dependency, ...)
    reason: str | None = None


class SlurmView(msgspec.Struct):
    """What Slurm said about a run's jobs in one refresh, and what it could not say."""

    jobs: dict[str, SlurmJob]  # {job or array-task id: state}
    sacct: str | None = None  # why sacct gave no answer (None: it answered)
    squeue: str | None = None  # why squeue gave no answer (None: it answered)
    # {id: live state sacct last heard of} when slurmctld did not answer: not believed
    stale: dict[str, str] = {}


def expand(jid: str) -> list[str]:
    """`12_[3-5,7%2]` -> ['12_3', '12_4', '12_5', '12_7']; other ids unchanged."""
    m = re.fullmatch(r"(\d+)_\[([^\]]+)\]", jid)
    if not m:
        return [jid]
    base, spec = m.group(1), m.group(2).split("%")[0]
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += [f"{base}_{i}" for i in range(int(a), int(b or a) + 1)]
    return out


def _lines(a: SlurmAnswer) -> tuple[list[str], str | None]:
    """(the answer's lines, why there is no answer): ids Slurm no longer knows are an empty
    answer."""
    if a.ok:
        return a.out.splitlines(), None
    if a.problem == FAILED and NO_SUCH_JOB in a.why:
        return [], None
    return [], a.why


def _reason(r: str) -> str | None:
    r = r.strip()
    return None if r in ("", "None", "(null)") else r.strip("()")


def parse_sacct(lines: list[str]) -> tuple[dict[str, SlurmJob], set[str]]:
    """`sacct -n -P -X -D --format=JobID,State,NodeList` rows: ({id: job}, ids that were
    requeued)."""
    jobs: dict[str, SlurmJob] = {}
    requeued: set[str] = set()
    for line in lines:
        parts = line.split("|")
        if len(parts) < 3 or not parts[1]:
            continue
        jid, state, node = parts[0], parts[1].split()[0], parts[2]
        for j in expand(jid):
            if state == "REQUEUED":
                requeued.add(j)
            jobs[j] = SlurmJob(state, None if node in ("", "None assigned") else node)
    return jobs, requeued


def parse_squeue(lines: list[str]) -> dict[str, SlurmJob]:
    """`squeue -h -r -o %i|%T|%N|%r` rows: {id: job}."""
    jobs = {}
    for line in lines:
        parts = line.split("|")
        if len(parts) >= 4:
            jobs[parts[0]] = SlurmJob(parts[1], parts[2] or None, _reason(parts[3]))
    return jobs


def parse_scontrol(lines: list[str], job_id: str) -> dict[str, SlurmJob]:
    """`scontrol show job -o ID` lines: what slurmctld still remembers of a job (MinJobAge after it
    ended)."""
    jobs = {}
    for line in lines:
        f = dict(x.split("=", 1) for x in line.split() if "=" in x)
        if "JobState" not in f:
            continue
        node = f.get("NodeList")
        node = None if node in (None, "", "(null)") else node
        state = SlurmJob(f["JobState"], node, _reason(f.get("Reason", "")))
        task = f.get("ArrayTaskId")
        ids = (
            expand(f"{f['ArrayJobId']}_[{task}]")
            if task and f.get("ArrayJobId")
            else [f.get("JobId", job_id)]
        )
        for j in ids:
            jobs[j] = state
    return jobs


def needs_scontrol(sacct: SlurmAnswer, squeue: SlurmAnswer) -> bool:
    """When sacct did not answer but squeue did, slurmctld is asked about the jobs that left the
    queue."""
    return _lines(sacct)[1] is not None and _lines(squeue)[1] is None


def view_of_answers(
    sacct: SlurmAnswer | None,
    squeue: SlurmAnswer | None,
    scontrol: dict[str, SlurmAnswer] | None = None,
) -> SlurmView:
    """One view of the answers: squeue for live jobs (slurmctld), sacct for the rest (slurmdbd;
    REQUEUED kept visible), `scontrol show job` ({job id: answer}) for what slurmctld still knows
    when sacct did not answer. No answers at all (None): nothing was asked (a run never
    submitted)."""
    view = SlurmView(jobs={})
    if sacct is None or squeue is None:
        return view
    lines, view.sacct = _lines(sacct)
    view.jobs, requeued = parse_sacct(lines)
    lines, view.squeue = _lines(squeue)
    view.jobs.update(parse_squeue(lines))
    if view.sacct and not view.squeue:
        for jid, answer in (scontrol or {}).items():
            for j, st in parse_scontrol(_lines(answer)[0], jid).items():
                view.jobs.setdefault(j, st)
    for j in requeued:
        st = view.jobs.get(j, SlurmJob("REQUEUED"))
        if st.state in ("PENDING", "REQUEUED"):
            view.jobs[j] = SlurmJob("REQUEUED", st.node, st.reason)
    # slurmctld did not answer: a live state in sacct is only what slurmdbd heard last
    if view.squeue:
        view.stale = {j: st.state for j, st in view.jobs.items() if st.state not in TERMINAL}
        view.jobs = {j: st for j, st in view.jobs.items() if j not in view.stale}
    return view


# --------------------------------------------------------------------------------------------------
# what was submitted
# --------------------------------------------------------------------------------------------------
class JobsIndex(msgspec.Struct):
    """jobs.json arranged for status (later submissions win): the task that runs each shard of an
    array of one shard per task, the array whose tasks claim each shard of a claiming array (its
    pool), and the merge job."""

    task_of: dict[int, str]  # {shard: Slurm task id}
    submitted_at: dict[str, str]  # {task or array job id: ISO time of its submission}
    merge_job: str | None = None
    merge_submitted: str = ""
    pool_of: dict[int, str] = {}  # {shard: array job id whose tasks claim it}
    pool_tasks: dict[str, list[str]] = {}  # {array job id: its task ids}

    @property
    def job_ids(self) -> list[str]:
        """The jobs to ask Slurm about: each array once, and the merge job."""
        return sorted(
            {t.split("_")[0] for t in self.task_of.values()}
            | set(self.pool_of.values())
            | ({self.merge_job} if self.merge_job else set())
        )


def index_jobs(submissions) -> JobsIndex:
    """`submissions`: slurm.Jobs.submissions, oldest first."""
    idx = JobsIndex(task_of={}, submitted_at={}, pool_of={}, pool_tasks={})
    for sub in submissions:
        for a in sub.arrays:
            if a.claims:
                idx.pool_tasks[a.job_id] = list(a.tasks) or [a.job_id]
                idx.submitted_at[a.job_id] = sub.submitted
                for k in a.shards:
                    idx.pool_of[k] = a.job_id
                    idx.task_of.pop(k, None)
                for t in idx.pool_tasks[a.job_id]:
                    idx.submitted_at[t] = sub.submitted
                continue
            for i, k in enumerate(a.shards):
                idx.task_of[k] = a.tasks[i] if a.tasks else f"{a.job_id}_{i}"
                idx.submitted_at[idx.task_of[k]] = sub.submitted
                idx.pool_of.pop(k, None)
        if sub.merge_job_id:
            idx.merge_job, idx.merge_submitted = sub.merge_job_id, sub.submitted
    return idx


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


# --------------------------------------------------------------------------------------------------
# the states
# --------------------------------------------------------------------------------------------------
def _age_s(submitted: str, now: float) -> float | None:
    try:
        return now - _dt.datetime.fromisoformat(submitted).timestamp()
    except ValueError:
        return None


def unknown_why(view: SlurmView, job: str, submitted: str, now: float) -> str | None:
    """Why the state of `job`, which no answer named, cannot be known (None: it is only submitted
    yet)."""
    if view.sacct and view.squeue:
        return f"{view.squeue}; {view.sacct}"
    if job in view.stale:
        return (
            f"{view.squeue}; sacct still says {view.stale[job].lower()}, which only slurmctld "
            "could confirm (slurmdbd keeps the last state it was told)"
        )
    if view.sacct:
        return f"{view.sacct}; squeue and scontrol no longer know job {job}"
    if view.squeue:
        return f"{view.squeue}; sacct has no row for job {job}"
    age = _age_s(submitted, now)
    if age is not None and age > SACCT_LAG_S:
        return f"neither squeue nor sacct knows job {job}, submitted {age / 60:.0f} min ago"
    return None


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


def shard_status(
    f: ShardFacts,
    view: SlurmView,
    *,
    job: str | None,
    submitted: str,
    now: float,
    run_shown: str,
    unclaimed: tuple[str, str | None] | None = None,
) -> ShardStatus:
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
    return ShardStatus(
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


def _row(s: ShardFacts, f: RunFacts) -> ShardStatus:
    array = f.jobs.pool_of.get(s.shard)
    if array is None:
        job = f.jobs.task_of.get(s.shard)
        return shard_status(
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
    return shard_status(
        s,
        f.view,
        job=job,
        submitted=submitted,
        now=f.now,
        run_shown=f.run_shown,
        unclaimed=unclaimed,
    )


def run_states(f: RunFacts) -> tuple[list[ShardStatus], MergeStatus]:
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


def totals(rows: list[ShardStatus]) -> Totals:
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


def needs_attention(r: ShardStatus) -> bool:
    """Whether `status`'s summary of many shards lists shard `r` on its own: it does not finish
    without someone acting (failed, dead, stale, cancelled, ...), changed since done, finished
    without a readable done manifest, its progress not written for far too long, or its state
    unknown."""
    return r.state in BAD_STATES or r.state in (CHANGED, UNFINISHED, UNKNOWN) or bool(r.stale)


def is_unknown(rows: list[ShardStatus], merge: MergeStatus) -> bool:
    return any(r.state == UNKNOWN for r in rows) or merge.state == UNKNOWN


def exit_code(rows: list[ShardStatus], merge: MergeStatus) -> int:
    """`status`'s exit code: see `verdict`."""
    return verdict(rows, merge)[0]


def _shards(rows: list[ShardStatus]) -> str:
    return (
        f"shard{'s' if len(rows) != 1 else ''} {ranges([r.shard for r in rows], sep=',', limit=8)}"
    )


def _merge_named(merge: MergeStatus) -> str:
    return (
        f"merge job {merge.job} {merge.state}"
        if merge.job
        else f"merge {merge.state} ({merge.reason})"
    )


def verdict(rows: list[ShardStatus], merge: MergeStatus, run_shown: str = "RUN") -> tuple[int, str]:
    """`status`'s exit code and the sentence that says why, the first that holds of:

    0 (EXIT_OK) complete and healthy: every shard completed with no failure that may pass, merged
    after the last
      shard finished, the merged dataset what its manifest says, and the audit of that merge passed;
    1 (EXIT_FAILED) failed: a shard failed, timed out, was cancelled, its worker is dead or stale,
    the merge job
      failed or the audit did; (a shard still running does not change it: the run cannot complete on
      its own);
    4 (EXIT_UNKNOWN) some state cannot be known (Slurm did not answer); 5 (EXIT_IN_PROGRESS) still
    going: something runs it (shards or the merge job pending or running, on Slurm or
      in a live `toolkit run` here);
    1 (EXIT_FAILED) prompts.msgpack damaged (first: merge, export and retry refuse the run);
    1 (EXIT_FAILED) ended without completing: stopped (shards stopped, not started or unfinished,
    and nothing
      runs them), a finished shard's file changed since its done manifest, failures that may pass
      left, not merged (or merged before a shard changed, or the
      merged file damaged), not audited: the command to run next is said."""
    if merge.prompts:  # the run's plan is damaged: nothing else can be repaired before it
        return EXIT_FAILED, (
            f"not complete: {merge.prompts}: merge, export and retry refuse the run; `toolkit run "
            "JOB` (or `toolkit submit JOB`) with the job file that made it writes it again and "
            "generates nothing already done"
        )
    retry = [r for r in rows if r.state == "completed" and r.transient]
    if (
        all(r.state == "completed" for r in rows)
        and not retry
        and merge.merged
        and merge.current
        and merge.audit == "passed"
        and not merge.damaged
    ):
        return EXIT_OK, "complete: every shard done, merged, audit passed"
    problems = []
    bad = [r for r in rows if r.state in BAD_STATES]
    for st in dict.fromkeys(r.state for r in bad):
        these = [r for r in bad if r.state == st]
        problems.append(f"{_shards(these)} {st}")
    if merge.job and merge.state in BAD_STATES:
        problems.append(f"merge job {merge.job} {merge.state}")
    if merge.merged and merge.current and merge.audit == "failed" and not merge.damaged:
        problems.append("the audit failed")
    if problems:
        also = (
            f"; {sum(r.transient for r in retry)} failures that may pass in {_shards(retry)}: "
            f"`toolkit retry {run_shown}`"
            if retry
            else ""
        )
        return (
            EXIT_FAILED,
            f"failed: {'; '.join(problems)}; `toolkit logs {run_shown} --failed` says why{also}",
        )
    if is_unknown(rows, merge):
        return EXIT_UNKNOWN, "unknown: Slurm did not say the state of every job (see above)"
    active = [r for r in rows if r.state in ACTIVE]
    if active or merge.state in ACTIVE:
        going = [f"{_shards(active)} not finished"] if active else []
        if merge.state in ACTIVE:
            going.append(_merge_named(merge))
        return EXIT_IN_PROGRESS, f"in progress: {'; '.join(going)}"
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
        states = "/".join(dict.fromkeys(r.state for r in stopped))
        if any(r.job for r in stopped):
            resume = f"`toolkit resubmit {run_shown}` resumes them on Slurm"
        else:  # not submitted to Slurm: nothing will pick them up
            resume = (
                f"`toolkit retry {run_shown}` resumes them here (`toolkit resubmit "
                f"{run_shown}` on Slurm)"
            )
        todo.append(f"{_shards(stopped)} {states} and nothing runs them: {resume}")
    if retry:
        todo.append(
            f"{sum(r.transient for r in retry)} failures that may pass in {_shards(retry)}: "
            f"`toolkit retry {run_shown}`"
        )
    if not unfinished and not retry:
        if not merge.merged:
            todo.append(f"not merged: `toolkit merge {run_shown}`")
        elif not merge.current:
            todo.append(f"merged before a shard finished again: `toolkit merge {run_shown}`")
        elif merge.damaged:
            todo.append(
                f"the merged dataset is damaged ({merge.damaged}): `toolkit merge {run_shown}` "
                "makes it again"
            )
        elif merge.audit is None:
            todo.append(f"not audited: `toolkit audit {run_shown}`")
    return EXIT_FAILED, f"{'stopped' if stopped else 'not complete'}: {'; '.join(todo)}"
