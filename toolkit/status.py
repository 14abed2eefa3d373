"""Watching a run: one row per shard (Slurm state, progress, tokens, ETA) and the shards' logs.

State comes from the files a run directory holds (done manifests, progress files) and, for runs submitted
to Slurm, from `squeue` (live, with the REASON a pending task waits) then `sacct` (history, may lag a few
seconds or have no row yet). A shard whose done manifest exists is completed whatever Slurm still says about
its task. Every Slurm command is bounded (slurmcmd.TIMEOUT_S); when sacct does not answer (slurmdbd down),
`scontrol show job` tells what slurmctld still remembers; what nobody could tell is `unknown`, with why, never
guessed as `submitted`, and `status` exits 4 (EXIT_UNKNOWN).
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import sys
import time
from pathlib import Path

import msgspec

from .errors import EXIT_UNKNOWN  # some state cannot be known (Slurm did not answer)
from .files import shown_path
from .plan import load_run
from .rundir import RunDir
from .progress import Progress, read_progress, worker_gone
from .shardfile import read_done
from .slurmcmd import FAILED, SlurmAnswer, call

__all__ = ["ShardStatus", "RunStatus", "run_status", "status_report"]

FINISHED = ("done", "failed", "stopped")  # progress states after which a shard's log grows no more


class ShardStatus(msgspec.Struct):
    shard: int
    state: str          # pending running completed failed cancelled requeued timeout stopped incomplete ...
    done: int
    total: int
    failed: int
    output_tokens: int
    tok_per_s: float
    eta_s: float | None
    job: str | None      # Slurm id of the task that ran (or runs) it, e.g. 1234_5
    node: str | None
    error: str | None
    reason: str | None = None  # why a pending task waits (squeue's REASON), or why the state is unknown
    running: int | None = None    # requests the engine generates / keeps queued (its /v1/loads), while running
    queued: int | None = None
    kv_usage: float | None = None  # share of the engine's KV cache in use


class MergeStatus(msgspec.Struct):
    job: str | None      # Slurm id of the run's (latest) merge + audit job
    state: str | None    # its Slurm state, lower case
    merged: bool         # merged/manifest.json exists
    reason: str | None = None  # why it is pending, or why its state is unknown


class Totals(msgspec.Struct):
    done: int
    total: int
    failed: int
    output_tokens: int
    tok_per_s: float
    shards: dict[str, int]   # shards per state


class RunStatus(msgspec.Struct):
    """`toolkit status RUN --json`: one object, the same figures as the table."""

    run: str
    shards: list[ShardStatus]
    totals: Totals
    merge: MergeStatus


def status_report(rd: RunDir, rows: list[ShardStatus], merge: dict) -> RunStatus:
    by_state: dict[str, int] = {}
    for r in rows:
        by_state[r.state] = by_state.get(r.state, 0) + 1
    totals = Totals(done=sum(r.done for r in rows), total=sum(r.total for r in rows), failed=sum(r.failed for r in rows),
                    output_tokens=sum(r.output_tokens for r in rows), tok_per_s=sum(r.tok_per_s for r in rows),
                    shards=dict(sorted(by_state.items())))
    return RunStatus(run=str(Path(rd.root).resolve()), shards=rows, totals=totals,
                     merge=MergeStatus(job=merge.get("job"), state=merge.get("state"), merged=bool(merge.get("merged")),
                                       reason=merge.get("reason")))


def _expand(jid: str) -> list[str]:
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


class SlurmJob(msgspec.Struct):
    state: str                   # Slurm's word, upper case: PENDING RUNNING COMPLETED REQUEUED ...
    node: str | None = None
    reason: str | None = None    # why a pending job waits (squeue %r: Priority, Resources, Dependency, ...)


class SlurmView(msgspec.Struct):
    """What Slurm said about a run's jobs in one refresh, and what it could not say."""

    jobs: dict[str, SlurmJob]    # {job or array-task id: state}
    sacct: str | None = None     # why sacct gave no answer (None: it answered)
    squeue: str | None = None    # why squeue gave no answer (None: it answered)


_NO_SUCH_JOB = "Invalid job id specified"  # squeue/scontrol of ids all gone from slurmctld: not a failure


def _lines(a: SlurmAnswer) -> tuple[list[str], str | None]:
    if a.ok:
        return a.out.splitlines(), None
    if a.problem == FAILED and _NO_SUCH_JOB in a.why:
        return [], None
    return [], a.why


def _reason(r: str) -> str | None:
    r = r.strip()
    return None if r in ("", "None", "(null)") else r.strip("()")


def _scontrol_jobs(job_id: str) -> tuple[dict[str, SlurmJob], str | None]:
    """`scontrol show job -o ID`: what slurmctld still remembers of a job (MinJobAge after it ended)."""
    lines, why = _lines(call(["scontrol", "show", "job", "-o", job_id]))
    jobs = {}
    for line in lines:
        f = dict(x.split("=", 1) for x in line.split() if "=" in x)
        if "JobState" not in f:
            continue
        node = f.get("NodeList")
        node = None if node in (None, "", "(null)") else node
        state = SlurmJob(f["JobState"], node, _reason(f.get("Reason", "")))
        task = f.get("ArrayTaskId")
        ids = _expand(f"{f['ArrayJobId']}_[{task}]") if task and f.get("ArrayJobId") else [f.get("JobId", job_id)]
        for j in ids:
            jobs[j] = state
    return jobs, why


def slurm_view(ids: list[str]) -> SlurmView:
    """The states of `ids` (jobs, array jobs): squeue for live jobs (slurmctld), sacct for the rest (slurmdbd;
    REQUEUED kept visible), and when sacct does not answer, `scontrol show job` for what slurmctld still knows.
    Every command is bounded (slurmcmd.TIMEOUT_S); what none could say stays out of `jobs`."""
    view = SlurmView(jobs={})
    if not ids:
        return view
    requeued: set[str] = set()
    lines, view.sacct = _lines(call(["sacct", "-n", "-P", "-X", "-D", "-j", ",".join(ids),
                                     "--format=JobID,State,NodeList"]))
    for line in lines:
        parts = line.split("|")
        if len(parts) < 3 or not parts[1]:
            continue
        jid, state, node = parts[0], parts[1].split()[0], parts[2]
        for j in _expand(jid):
            if state == "REQUEUED":
                requeued.add(j)
            view.jobs[j] = SlurmJob(state, None if node in ("", "None assigned") else node)
    lines, view.squeue = _lines(call(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i|%T|%N|%r"]))
    for line in lines:
        parts = line.split("|")
        if len(parts) >= 4:
            view.jobs[parts[0]] = SlurmJob(parts[1], parts[2] or None, _reason(parts[3]))
    if view.sacct and not view.squeue:  # slurmctld answers: ask it about the tasks that left the queue
        for jid in ids:
            found, _ = _scontrol_jobs(jid)
            for j, st in found.items():
                view.jobs.setdefault(j, st)
    for j in requeued:
        st = view.jobs.get(j, SlurmJob("REQUEUED"))
        if st.state in ("PENDING", "REQUEUED"):
            view.jobs[j] = SlurmJob("REQUEUED", st.node, st.reason)
    return view


SACCT_LAG_S = 120  # a job neither squeue nor sacct knows this long after its submission is unknown, not submitted


def _age_s(submitted: str) -> float | None:
    try:
        return time.time() - _dt.datetime.fromisoformat(submitted).timestamp()
    except ValueError:
        return None


def _unknown_why(view: SlurmView, job: str, submitted: str) -> str | None:
    """Why the state of `job`, which no answer named, cannot be known (None: it is only submitted yet)."""
    if view.sacct and view.squeue:
        return f"{view.squeue}; {view.sacct}"
    if view.sacct:
        return f"{view.sacct}; squeue and scontrol no longer know job {job}"
    if view.squeue:
        return f"{view.squeue}; sacct has no row for job {job}"
    age = _age_s(submitted)
    if age is not None and age > SACCT_LAG_S:
        return f"neither squeue nor sacct knows job {job}, submitted {age / 60:.0f} min ago"
    return None


def run_status(run_dir: str | os.PathLike) -> tuple[RunDir, list[ShardStatus], dict]:
    from .slurm import read_jobs

    rd, plan = load_run(run_dir)
    jobs = read_jobs(rd)
    task_of: dict[int, str] = {}
    submitted_at: dict[str, str] = {}
    merge_id, merge_submitted = None, ""
    for sub in jobs.submissions:  # later submissions win
        for a in sub.arrays:
            for i, k in enumerate(a.shards):
                task_of[k] = a.tasks[i] if a.tasks else f"{a.job_id}_{i}"
                submitted_at[task_of[k]] = sub.submitted
        if sub.merge_job_id:
            merge_id, merge_submitted = sub.merge_job_id, sub.submitted
    ids = sorted({t.split("_")[0] for t in task_of.values()} | ({merge_id} if merge_id else set()))
    view = slurm_view(ids)
    rows = []
    for s in plan.shards:
        k = s.index
        done = read_done(rd.done_file(k))
        p = read_progress(rd.progress_file(k)) or Progress(shard=k, state="pending", total=s.count)
        job = task_of.get(k)
        known = view.jobs.get(job) if job else None
        node = known.node if known else None
        reason = known.reason if known and known.state in ("PENDING", "REQUEUED") else None
        if done is not None:
            state, reason = "completed", None
        elif known:
            state = known.state.lower()
            if state == "completed":  # the task ended without finishing the shard (e.g. stopped, not requeued)
                state = "incomplete"
        elif job:
            reason = _unknown_why(view, job, submitted_at.get(job, ""))
            state = "unknown" if reason else "submitted"  # submitted: sacct has no row yet
        elif gone := worker_gone(p):  # `toolkit run` (no Slurm job): the local worker died without a word
            state, p.error = DEAD, f"{gone}; resume the shard with `toolkit worker {rd.shown} {k}` (or `toolkit run JOB`)"
        else:
            state = {"done": "completed", "generating": "running", "loading": "running", "starting": "running"}.get(p.state, p.state)
        rows.append(ShardStatus(
            shard=k, state=state, done=done.records if done else p.done, total=s.count,
            failed=done.failed if done else p.failed, output_tokens=done.output_tokens if done else p.output_tokens,
            tok_per_s=p.tok_per_s if state == "running" else 0.0, eta_s=p.eta_s() if state == "running" else None,
            job=job, node=node or (p.host or None), error=p.error, reason=reason,
            **({"running": p.running, "queued": p.queued, "kv_usage": p.kv_usage} if state == "running" else {}),
        ))
    merge: dict = {"job": merge_id, "state": None}
    if merge_id:
        known = view.jobs.get(merge_id)
        if known:
            merge["state"] = known.state.lower()
            if known.state == "PENDING" and known.reason:
                merge["reason"] = known.reason
        else:
            why = _unknown_why(view, merge_id, merge_submitted)
            merge["state"] = "unknown" if why else "submitted"
            if why:
                merge["reason"] = why
    merge["merged"] = rd.manifest_file.exists()
    return rd, rows, merge


def _fmt_eta(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


UNKNOWN = "unknown"
DEAD = "dead"  # a local worker's progress says generating, but its pid is gone from this host
ACTIVE = ("pending", "running", "submitted", "requeued", "configuring", "completing")


def _fmt_load(r: ShardStatus) -> str:
    return "-" if r.running is None else f"{r.running}/{r.queued if r.queued is not None else '-'}"


def format_status(rd: RunDir, rows: list[ShardStatus], merge: dict) -> str:
    head = (f"{'SHARD':>5} {'STATE':<11} {'JOB':<12} {'NODE':<10} {'DONE':>11} {'FAILED':>6} {'OUT TOKENS':>11} "
            f"{'TOK/S':>8} {'ETA':>8} {'RUN/QUEUE':>9} {'KV':>4}  REASON")
    lines = [f"run {rd.shown}", head]
    for r in rows:
        kv = f"{r.kv_usage:.0%}" if r.kv_usage is not None else "-"
        lines.append((f"{r.shard:>5} {r.state:<11} {r.job or '-':<12} {(r.node or '-')[:10]:<10} "
                      f"{f'{r.done}/{r.total}':>11} {r.failed:>6} {r.output_tokens:>11,} {r.tok_per_s:>8.0f} "
                      f"{_fmt_eta(r.eta_s):>8} {_fmt_load(r):>9} {kv:>4}  {r.reason or ''}").rstrip())
    done = sum(r.done for r in rows)
    total = sum(r.total for r in rows)
    by_state: dict[str, int] = {}
    for r in rows:
        by_state[r.state] = by_state.get(r.state, 0) + 1
    lines.append(f"total: {done}/{total} prompts, {sum(r.failed for r in rows)} failed, "
                 f"{sum(r.output_tokens for r in rows):,} output tokens, {sum(r.tok_per_s for r in rows):,.0f} tok/s; shards: "
                 + ", ".join(f"{n} {s}" for s, n in sorted(by_state.items())))
    if merge.get("job") or merge.get("merged"):
        lines.append(f"merge: job {merge.get('job') or '-'} {merge.get('state') or ''}"
                     + (f" ({merge['reason']})" if merge.get("reason") else "")
                     + (" (merged/manifest.json written)" if merge.get("merged") else ""))
    note = unknown_note(rows, merge)
    if note:
        lines.append(note)
    return "\n".join(lines)


def unknown_note(rows: list[ShardStatus], merge: dict) -> str | None:
    """One line when Slurm could not tell some states: which, why, and that nothing was guessed."""
    unknown = [r for r in rows if r.state == UNKNOWN]
    whys = list(dict.fromkeys(r.reason for r in unknown if r.reason))
    if merge.get("state") == UNKNOWN and merge.get("reason"):
        whys = list(dict.fromkeys([*whys, merge["reason"]]))
    if not unknown and merge.get("state") != UNKNOWN:
        return None
    what = f"{len(unknown)} shard{'s' if len(unknown) != 1 else ''}" + (" and the merge job" if merge.get("state") == UNKNOWN else "")
    return (f"slurm: the state of {what} is unknown ({whys[0] if whys else 'Slurm did not answer'}"
            f"{f'; and {len(whys) - 1} more' if len(whys) > 1 else ''}); DONE and OUT TOKENS come from the run "
            f"directory and are current. Check that slurmctld (squeue) and slurmdbd (sacct) answer, then run status "
            f"again (exit {EXIT_UNKNOWN})")


UNKNOWN_LIMIT_S = 600.0  # --watch gives up after the state has been unknown this long


def _exit_code(rows: list[ShardStatus], merge: dict) -> int:
    if all(r.state == "completed" for r in rows) and merge.get("state") != UNKNOWN:
        return 0
    if any(r.state == UNKNOWN for r in rows) or merge.get("state") == UNKNOWN:
        return EXIT_UNKNOWN
    return 0 if any(r.state in ACTIVE for r in rows) else 1


def cmd_status(args) -> int:
    unknown_since: float | None = None
    limit = getattr(args, "unknown_limit_s", UNKNOWN_LIMIT_S)
    while True:
        rd, rows, merge = run_status(args.run)
        if args.json:  # with --watch: one compact object per line, per refresh
            text = msgspec.json.encode(status_report(rd, rows, merge)).decode()
            if not args.watch:
                text = msgspec.json.format(text, indent=2)
        else:
            text = format_status(rd, rows, merge)
        if not args.watch:
            print(text)
            return _exit_code(rows, merge)
        unknown = any(r.state == UNKNOWN for r in rows) or merge.get("state") == UNKNOWN
        if not unknown:
            unknown_since = None
        elif unknown_since is None:
            unknown_since = time.monotonic()
        if unknown and not args.json:
            waited = time.monotonic() - unknown_since
            text += (f"\nstill refreshing every {args.interval:g} s: the state has been unknown for {waited:.0f} s; "
                     f"gives up (exit {EXIT_UNKNOWN}) after {limit:.0f} s")
        sys.stdout.write(("" if args.json else "\x1b[H\x1b[2J") + text + "\n")
        sys.stdout.flush()
        if unknown:
            if time.monotonic() - unknown_since >= limit:
                print(f"toolkit: error: the state of the run stayed unknown for {limit:.0f} s (Slurm does not answer); "
                      f"`toolkit status {rd.shown}` once it does", file=sys.stderr)
                return EXIT_UNKNOWN
        else:
            finished = all(r.state not in ACTIVE for r in rows)
            if finished and merge.get("state") not in ACTIVE:
                return 0 if all(r.state == "completed" for r in rows) else 1
        time.sleep(args.interval)


# ---------------------------------------------------------------------------------------------------
# logs
# ---------------------------------------------------------------------------------------------------
def _tail_lines(path: Path, n: int) -> list[str]:
    from .engines.base import log_tail

    return log_tail(path, n).splitlines()


def follow(path: Path, *, lines: int, stop_when=None, poll_s: float = 0.5) -> None:
    """Print the last `lines` lines, then what is appended, like `tail -f` (Ctrl-C to stop)."""
    while not path.exists():
        if stop_when and stop_when():
            return
        time.sleep(poll_s)
    for line in _tail_lines(path, lines):
        print(line)
    sys.stdout.flush()
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.write(chunk.decode("utf-8", "replace"))
                sys.stdout.flush()
            elif stop_when and stop_when():
                time.sleep(poll_s)  # the last lines are written just after the state changes
                sys.stdout.write(f.read().decode("utf-8", "replace"))
                sys.stdout.flush()
                return
            else:
                time.sleep(poll_s)


def shard_finished(rd: RunDir, shard: int) -> str | None:
    """The state of a shard that has finished (done, failed, stopped), or None while it may still write."""
    if read_done(rd.done_file(shard)) is not None:
        return "done"
    p = read_progress(rd.progress_file(shard))
    return p.state if p is not None and p.state in FINISHED else None


def failed_records(rd: RunDir, limit: int) -> tuple[int, list[tuple[str, str]]]:
    """(how many records failed, the first `limit` as (id, error)), from the merged dataset or else the shards."""
    from . import read_run
    from .records import OK

    listed = rd.failed_file
    if rd.manifest_file.exists() and listed.exists() and listed.stat().st_size == 0:
        return 0, []  # the audit of the merged run found none: no need to read every record
    n, shown = 0, []
    for rec in read_run(rd.root):
        if rec.status != OK:
            n += 1
            if len(shown) < limit:
                shown.append((rec.id, (rec.error or "(no message)").splitlines()[0]))
    return n, shown


_REASON = re.compile(r"^toolkit: error: |\bERROR toolkit\.|^\s+FAIL  ")


def _reasons(log: Path, limit: int = 5) -> list[str]:
    """The lines of a merge job's log that say why it failed (the toolkit's errors, failed audit checks)."""
    with open(log, errors="replace") as f:
        return [line.rstrip("\n") for line in f if _REASON.search(line)][:limit]


def merge_log(rd: RunDir, job: str) -> Path:
    """submitit's log of the merge job (stdout and stderr together)."""
    return rd.job_log(job)


BAD_STATES = ("failed", "dead", "timeout", "cancelled", "node_fail", "out_of_memory", "incomplete", "preempted", "boot_fail")


def _print_failed(rd: RunDir, args) -> int:
    """Failed shards (state, error, log tail), a failed merge job's log, then the failed records."""
    _, rows, merge = run_status(rd.root)
    bad = [r for r in rows if r.state in BAD_STATES]
    merge_bad = merge.get("job") and (merge.get("state") or "") in BAD_STATES
    note = unknown_note(rows, merge)
    if note:
        print(note)
    if not bad:
        print("no failed shards" + (" among those whose state is known" if note else ""))
    _print_failed_shards(rd, bad, args.lines)
    if merge_bad:
        log = merge_log(rd, merge["job"])
        print(f"==> merge job {merge['job']}: {merge['state']} ({shown_path(log)}) <==")
        if not log.exists():
            print(f"(no log at {log})")
        else:
            for line in _reasons(log):
                print(f"why: {line}")
            for line in _tail_lines(log, args.lines):
                print(line)
        print()
    n, recs = failed_records(rd, args.lines)
    if n:
        listed = rd.failed_file
        where = f"; all ids in {shown_path(listed)}" if listed.exists() else ""
        print(f"==> {n} failed record{'s' if n > 1 else ''} (prompts the server refused or that errored; "
              f"{len(recs)} shown{where}) <==")
        width = max(len(i) for i, _ in recs)
        for rid, err in recs:
            print(f"{rid:<{width}}  {err}")
    return 1 if bad or merge_bad else 0


def _print_failed_shards(rd: RunDir, bad: list[ShardStatus], lines: int) -> None:
    for r in bad:
        print(f"==> shard {r.shard}: {r.state} (job {r.job or '-'}, node {r.node or '-'}) <==")
        if r.error:
            print(f"error: {r.error.splitlines()[0]}")
        log = rd.log_file(r.shard)
        if not log.exists() and r.job:  # died before the worker started: submitit's own log says why
            log = next(iter(rd.job_logs(r.job)), log)
        for line in _tail_lines(log, lines):
            print(line)
        print()
def _retryable(rd: RunDir, plan) -> dict[int, int]:
    """{shard: transient failures} from the done manifests (see records.TRANSIENT)."""
    out = {}
    for s in plan.shards:
        m = read_done(rd.done_file(s.index))
        if m is not None and m.transient:
            out[s.index] = m.transient
    return out


def cmd_logs(args) -> int:
    rd, plan = load_run(args.run)
    if args.failed:
        retryable = _retryable(rd, plan)
        if retryable:
            print(f"{sum(retryable.values())} failed records that may pass (timeouts, 5xx, aborts, NaN) in shards "
                  f"{', '.join(map(str, retryable))}: `toolkit retry {rd.shown}` generates them again")
        rc = _print_failed(rd, args)
        return max(rc, 1 if retryable else 0)
    if args.shard is None:
        print("which shard? e.g. `toolkit logs RUN 0`; --failed shows every failed shard", file=sys.stderr)
        return 2
    if not 0 <= args.shard < len(plan.shards):
        print(f"no shard {args.shard}: the run has shards 0..{len(plan.shards) - 1}", file=sys.stderr)
        return 2
    path = rd.server_log_file(args.shard) if args.server else rd.log_file(args.shard)
    if args.follow:
        try:
            follow(path, lines=args.lines, stop_when=lambda: shard_finished(rd, args.shard))
        except KeyboardInterrupt:
            return 0
        print(f"(shard {args.shard} {shard_finished(rd, args.shard)}: stopped following)", file=sys.stderr)
        return 0
    if not path.exists():
        print(f"{path} does not exist yet (the shard has not started)", file=sys.stderr)
        return 1
    for line in _tail_lines(path, args.lines):
        print(line)
    return 0
