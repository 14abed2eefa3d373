"""What Slurm said about a run's jobs in one refresh, and what it could not say: pure functions, no
I/O.

`cluster.status` asks squeue, sacct and `scontrol show job` (cluster.commands: every call bounded)
and hands their answers here; `view_of_answers` makes them one `SlurmView`. When slurmctld does not
answer, sacct's rows of jobs still live (PENDING, RUNNING, ...) are what slurmdbd last heard, not
what is: those are kept apart as stale. `unknown_why` says why the state of a job no answer named
cannot be known (None for a job submitted less than SACCT_LAG_S ago, which sacct may not list yet).
"""

from __future__ import annotations

import datetime as _dt
import re

import msgspec

from toolkit.cluster.commands import FAILED, SlurmAnswer

__all__ = [
    "SlurmJob",
    "SlurmView",
    "expand",
    "needs_scontrol",
    "parse_sacct",
    "parse_scontrol",
    "parse_squeue",
    "unknown_why",
    "view_of_answers",
]

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
