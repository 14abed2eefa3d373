"""Watching a run: one row per shard (Slurm state, progress, tokens, ETA) and the shards' logs.

State comes from the files a run directory holds (done manifests, progress files) and, for runs submitted
to Slurm, from `squeue` (live, with the REASON a pending task waits) then `sacct` (history, may lag a few
seconds or have no row yet). Every Slurm command is bounded (slurmcmd.TIMEOUT_S); when sacct does not answer
(slurmdbd down), `scontrol show job` tells what slurmctld still remembers; what nobody could tell is `unknown`,
with why, never guessed as `submitted`, and `status` exits 4 (EXIT_UNKNOWN). `status` exits 0 only for a run that is
complete and healthy (states.verdict says each code).

This module is the edge: it reads the files and asks Slurm (`read_facts`), then `states` derives every state
from those facts with pure functions; it formats the table and follows the logs.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import msgspec

from .errors import EXIT_UNKNOWN, BadInputError  # EXIT_UNKNOWN: some state cannot be known (Slurm did not answer)
from .files import shown_path
from .plan import load_run
from .progress import read_progress, worker_gone
from .rundir import RunDir
from .shardfile import read_done
from .slurmcmd import call
from .states import (
    ACTIVE,
    BAD_STATES,
    DEAD,
    UNKNOWN,
    MergeStatus,
    RunFacts,
    ShardFacts,
    ShardStatus,
    SlurmJob,
    SlurmView,
    Totals,
    exit_code,
    index_jobs,
    is_unknown,
    needs_scontrol,
    run_states,
    shard_status,
    totals,
    verdict,
)
from .states import slurm_view as view_of_answers

__all__ = ["ACTIVE", "DEAD", "UNKNOWN", "MergeStatus", "RunStatus", "ShardStatus", "SlurmJob", "SlurmView", "Totals",
           "format_status", "logs_command", "read_facts", "run_status", "slurm_view", "status_command",
           "status_report"]

FINISHED = ("done", "failed", "stopped")  # progress states after which an attempt's log grows no more


class RunStatus(msgspec.Struct):
    """`toolkit status RUN --json`: one object, the same figures as the table, and the exit code with its reason."""

    run: str
    shards: list[ShardStatus]
    totals: Totals
    merge: MergeStatus
    exit: int = 0
    verdict: str = ""


def status_report(rd: RunDir, rows: list[ShardStatus], merge: MergeStatus) -> RunStatus:
    code, why = verdict(rows, merge, rd.shown)
    return RunStatus(run=str(Path(rd.root).resolve()), shards=rows, totals=totals(rows), merge=merge, exit=code,
                     verdict=why)


# ---------------------------------------------------------------------------------------------------
# the edge: Slurm's answers and the run's files
# ---------------------------------------------------------------------------------------------------
def slurm_view(ids: list[str]) -> SlurmView:
    """What Slurm says of `ids` (jobs, array jobs): squeue and sacct, and `scontrol show job` for each when sacct
    does not answer but slurmctld does. Every command is bounded (slurmcmd.TIMEOUT_S)."""
    if not ids:
        return view_of_answers(None, None)
    joined = ",".join(ids)
    sacct = call(["sacct", "-n", "-P", "-X", "-D", "-j", joined, "--format=JobID,State,NodeList"])
    squeue = call(["squeue", "-h", "-r", "-j", joined, "-o", "%i|%T|%N|%r"])
    scontrol = ({j: call(["scontrol", "show", "job", "-o", j]) for j in ids}
                if needs_scontrol(sacct, squeue) else None)
    return view_of_answers(sacct, squeue, scontrol)


def read_facts(run_dir: str | os.PathLike) -> tuple[RunDir, RunFacts]:
    """Everything one refresh reads: jobs.json, each shard's done manifest and progress, whether a local worker
    is gone, Slurm's answers, the time."""
    from .slurm import read_jobs

    rd, plan = load_run(run_dir)
    jobs = index_jobs(read_jobs(rd).submissions)
    view = slurm_view(jobs.job_ids)
    shards = []
    last_done = 0.0
    for s in plan.shards:
        p = read_progress(rd.progress_file(s.index))
        done = read_done(rd.done_file(s.index))
        if done is not None:
            last_done = max(last_done, _mtime(rd.done_file(s.index)) or 0.0)
        local = done is None and s.index not in jobs.task_of and p is not None
        shards.append(ShardFacts(shard=s.index, total=s.count, done=done, progress=p,
                                 gone=worker_gone(p) if local else None))
    merged_at = _mtime(rd.manifest_file)
    return rd, RunFacts(run_shown=rd.shown, shards=shards, jobs=jobs, view=view, merged=merged_at is not None,
                        now=time.time(), merged_current=merged_at is not None and merged_at >= last_done,
                        audit=_audit_verdict(rd, merged_at))


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


class _Verdict(msgspec.Struct):
    passed: bool  # of audit.json: only the verdict is read


def _audit_verdict(rd: RunDir, merged_at: float | None) -> str | None:
    """"passed" / "failed": the verdict of audit.json when it audits the current merge (written after it); else None."""
    at = _mtime(rd.audit_json)
    if merged_at is None or at is None or at < merged_at:
        return None
    try:
        return "passed" if msgspec.json.decode(rd.audit_json.read_bytes(), type=_Verdict).passed else "failed"
    except (OSError, msgspec.MsgspecError):
        return "failed"  # an audit.json that cannot be read vouches for nothing


def run_status(run_dir: str | os.PathLike) -> tuple[RunDir, list[ShardStatus], MergeStatus]:
    rd, facts = read_facts(run_dir)
    rows, merge = run_states(facts)
    return rd, rows, merge


# ---------------------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------------------
def _fmt_eta(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt_load(r: ShardStatus) -> str:
    return "-" if r.running is None else f"{r.running}/{r.queued if r.queued is not None else '-'}"


def format_status(rd: RunDir, rows: list[ShardStatus], merge: MergeStatus) -> str:
    head = (f"{'SHARD':>5} {'STATE':<11} {'JOB':<12} {'NODE':<10} {'DONE':>11} {'FAILED':>6} {'OUT TOKENS':>11} "
            f"{'TOK/S':>8} {'ETA':>8} {'RUN/QUEUE':>9} {'KV':>4}  REASON")
    lines = [f"run {rd.shown}", head]
    for r in rows:
        kv = f"{r.kv_usage:.0%}" if r.kv_usage is not None else "-"
        why = "; ".join(x for x in (r.reason, r.stale) if x)
        lines.append((f"{r.shard:>5} {r.state:<11} {r.job or '-':<12} {(r.node or '-')[:10]:<10} "
                      f"{f'{r.done}/{r.total}':>11} {r.failed:>6} {r.output_tokens:>11,} {r.tok_per_s:>8.0f} "
                      f"{_fmt_eta(r.eta_s):>8} {_fmt_load(r):>9} {kv:>4}  {why}").rstrip())
    t = totals(rows)
    lines.append(f"total: {t.done}/{t.total} prompts, {t.failed} failed, {t.output_tokens:,} output tokens, "
                 f"{t.tok_per_s:,.0f} tok/s; shards: " + ", ".join(f"{n} {s}" for s, n in t.shards.items()))
    if merge.job or merge.merged:
        files = []
        if merge.merged:
            files.append(f"{rd.manifest_file.relative_to(rd.root).as_posix()} written"
                         + ("" if merge.current else ", before a shard finished again"))
            if merge.current:
                files.append(f"audit {merge.audit}" if merge.audit else "not audited")
        if merge.job:
            lines.append(f"merge: job {merge.job} {merge.state or ''}" + (f" ({merge.reason})" if merge.reason else "")
                         + (f" ({', '.join(files)})" if files else ""))
        else:  # merged here (`toolkit run`, `toolkit merge`)
            lines.append(f"merge: {', '.join(files)}")
    note = unknown_note(rows, merge)
    if note:
        lines.append(note)
    code, why = verdict(rows, merge, rd.shown)
    lines.append(f"run: {why} (exit {code})")
    return "\n".join(lines)


def unknown_note(rows: list[ShardStatus], merge: MergeStatus) -> str | None:
    """One line when Slurm could not tell some states: which, why, and that nothing was guessed."""
    unknown = [r for r in rows if r.state == UNKNOWN]
    whys = list(dict.fromkeys(r.reason for r in unknown if r.reason))
    if merge.state == UNKNOWN and merge.reason:
        whys = list(dict.fromkeys([*whys, merge.reason]))
    if not unknown and merge.state != UNKNOWN:
        return None
    what = f"{len(unknown)} shard{'s' if len(unknown) != 1 else ''}" + (" and the merge job" if merge.state == UNKNOWN else "")
    return (f"slurm: the state of {what} is unknown ({whys[0] if whys else 'Slurm did not answer'}"
            f"{f'; and {len(whys) - 1} more' if len(whys) > 1 else ''}); DONE and OUT TOKENS come from the run "
            f"directory and are current. Check that slurmctld (squeue) and slurmdbd (sacct) answer, then run status "
            f"again (exit {EXIT_UNKNOWN})")



UNKNOWN_LIMIT_S = 600.0  # --watch gives up after the state has been unknown this long


def status_command(run: str | os.PathLike, *, watch: bool = False, interval: float = 5.0, as_json: bool = False,
                   unknown_limit_s: float = UNKNOWN_LIMIT_S) -> int:
    """`toolkit status`: the table (or JSON) once, or refreshed every `interval` s until the run ends."""
    unknown_since: float | None = None
    while True:
        rd, rows, merge = run_status(run)
        if as_json:  # with --watch: one compact object per line, per refresh
            text = msgspec.json.encode(status_report(rd, rows, merge)).decode()
            if not watch:
                text = msgspec.json.format(text, indent=2)
        else:
            text = format_status(rd, rows, merge)
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
            text += (f"\nstill refreshing every {interval:g} s: the state has been unknown for {waited:.0f} s; "
                     f"gives up (exit {EXIT_UNKNOWN}) after {unknown_limit_s:.0f} s")
        sys.stdout.write(("" if as_json else "\x1b[H\x1b[2J") + text + "\n")
        sys.stdout.flush()
        if unknown:
            if time.monotonic() - unknown_since >= unknown_limit_s:
                print(f"toolkit: error: the state of the run stayed unknown for {unknown_limit_s:.0f} s (Slurm does "
                      f"not answer); `toolkit status {rd.shown}` once it does", file=sys.stderr)
                return EXIT_UNKNOWN
        else:
            finished = all(r.state not in ACTIVE for r in rows)
            if finished and merge.state not in ACTIVE:
                return exit_code(rows, merge)
        time.sleep(interval)


# ---------------------------------------------------------------------------------------------------
# logs
# ---------------------------------------------------------------------------------------------------
def _tail_lines(path: Path, n: int) -> list[str]:
    from .engines.base import log_tail

    return log_tail(path, n).splitlines()


def follow_file(path: Path, *, lines: int, stop_when=None, poll_s: float = 0.5):
    """Print the last `lines` lines, then what is appended, like `tail -f` (Ctrl-C to stop), until `stop_when()`
    says something (which is returned)."""
    while not path.exists():
        if stop_when and (end := stop_when()):
            return end
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
            elif stop_when and (end := stop_when()):
                time.sleep(poll_s)  # the last lines are written just after the state changes
                sys.stdout.write(f.read().decode("utf-8", "replace"))
                sys.stdout.flush()
                return end
            else:
                time.sleep(poll_s)


SLURM_ASK_S = 5.0  # `logs -f` asks Slurm about a stopped or failed attempt's task at most this often


class ShardEnd:
    """Whether a followed shard has ended for good, as a callable: its end ("done", "failed (task 12_0 failed)", ...)
    or None while more attempts may still write its log.

    A done manifest (or a done progress) ends it. An attempt that stopped or failed ends a shard run here (no Slurm
    task: nothing requeues it); a shard with a Slurm task ends only when that task is no longer pending, running or
    requeued (a stop at the time limit, a preemption or `scontrol requeue` comes back as a new attempt), asked at most
    every SLURM_ASK_S; while Slurm does not answer, it goes on."""

    def __init__(self, rd: RunDir, shard: int):
        from .slurm import read_jobs

        self.rd, self.shard = rd, shard
        jobs = index_jobs(read_jobs(rd).submissions)
        self.task = jobs.task_of.get(shard)
        self.submitted = jobs.submitted_at.get(self.task or "", "")
        self.asked, self.said = -SLURM_ASK_S, None

    def __call__(self) -> str | None:
        rd, k = self.rd, self.shard
        if read_done(rd.done_file(k)) is not None:
            return "done"
        p = read_progress(rd.progress_file(k))
        if p is None or p.state not in FINISHED:
            return None
        if p.state == "done" or self.task is None:
            return p.state
        if time.monotonic() - self.asked >= SLURM_ASK_S:
            self.asked = time.monotonic()
            view = slurm_view([self.task.split("_")[0]])
            st = shard_status(ShardFacts(shard=k, total=p.total, done=None, progress=p), view, job=self.task,
                              submitted=self.submitted, now=time.time(), run_shown=rd.shown)
            going = st.state in ACTIVE or st.state == UNKNOWN
            self.said = None if going else f"{p.state} (task {self.task} {st.state})"
        return self.said


def failed_records(rd: RunDir, limit: int) -> tuple[int, list[tuple[str, str]], int]:
    """(failed records, the first `limit` as (id, error), partial outputs to be continued): the newest record of each
    id, from the merged dataset or else the shard files. A record a later one of its id superseded (a retry, a
    continuation) is not counted, and a partial output kept at a stop is not a failure: the next attempt continues
    it."""
    from .records import OK, PARTIAL
    from .shardfile import read_shard

    listed = rd.failed_file
    if rd.manifest_file.exists() and listed.exists() and listed.stat().st_size == 0:
        return 0, [], 0  # the audit of the merged run found none: no need to read every record
    if rd.merged_file.exists():
        files = [rd.merged_file]
    else:
        files = [p for k in range(len(load_run(rd.root)[1].shards)) if (p := rd.shard_file(k)).exists()]
    n, shown, partial = 0, [], 0
    for path in files:
        newest: dict[str, tuple[str, str] | None] = {}
        for rec in read_shard(path):
            newest[rec.id] = None if rec.status == OK else (rec.status, rec.error or "(no message)")
        for rid, bad in newest.items():
            if bad is None:
                continue
            if bad[0] == PARTIAL:
                partial += 1
                continue
            n += 1
            if len(shown) < limit:
                shown.append((rid, bad[1].splitlines()[0]))
    return n, shown, partial


_REASON = re.compile(r"^toolkit: error: |\bERROR toolkit\.|^\s+FAIL  ")


def _reasons(log: Path, limit: int = 5) -> list[str]:
    """The lines of a merge job's log that say why it failed (the toolkit's errors, failed audit checks)."""
    with open(log, errors="replace") as f:
        return [line.rstrip("\n") for line in f if _REASON.search(line)][:limit]


def merge_log(rd: RunDir, job: str) -> Path:
    """submitit's log of the merge job (stdout and stderr together)."""
    return rd.job_log(job)


def _print_failed(rd: RunDir, lines: int) -> int:
    """Failed shards (state, error, log tail), a failed merge job's log, then the failed records."""
    _, rows, merge = run_status(rd.root)
    bad = [r for r in rows if r.state in BAD_STATES]
    merge_bad = bool(merge.job) and (merge.state or "") in BAD_STATES
    note = unknown_note(rows, merge)
    if note:
        print(note)
    if not bad:
        print("no failed shards" + (" among those whose state is known" if note else ""))
    _print_failed_shards(rd, bad, lines)
    if merge_bad:
        log = merge_log(rd, merge.job)
        print(f"==> merge job {merge.job}: {merge.state} ({shown_path(log)}) <==")
        if not log.exists():
            print(f"(no log at {log})")
        else:
            for line in _reasons(log):
                print(f"why: {line}")
            for line in _tail_lines(log, lines):
                print(line)
        print()
    audit_bad = merge.merged and merge.current and merge.audit == "failed"
    if audit_bad:
        print(f"==> the audit of the merged run failed: {shown_path(rd.audit_json)} (`toolkit audit {rd.shown}` "
              "prints its checks) <==\n")
    n, recs, partial = failed_records(rd, lines)
    if partial:
        print(f"{partial} partial output{'s' if partial > 1 else ''} kept when an attempt stopped: not failures, the "
              "next run of the shard continues them\n")
    if n:
        listed = rd.failed_file
        where = f"; all ids in {shown_path(listed)}" if listed.exists() else ""
        print(f"==> {n} failed record{'s' if n > 1 else ''} (prompts the server refused or that errored; "
              f"{len(recs)} shown{where}) <==")
        width = max(len(i) for i, _ in recs)
        for rid, err in recs:
            print(f"{rid:<{width}}  {err}")
    return 1 if bad or merge_bad or audit_bad else 0


def _print_failed_shards(rd: RunDir, bad: list[ShardStatus], lines: int) -> None:
    for r in bad:
        print(f"==> shard {r.shard}: {r.state} (job {r.job or '-'}, node {r.node or '-'}) <==")
        if r.error:
            print(f"error: {r.error.splitlines()[0]}")
        if r.stale:
            print(f"why: {r.stale}")
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


def _has_shards(rd: RunDir, plan) -> str:
    n = len(plan.shards)
    return f"the run {rd.shown} has only shard 0" if n == 1 else f"the run {rd.shown} has shards 0..{n - 1}"


def logs_command(run: str | os.PathLike, shard: int | None = None, *, follow: bool = False, server: bool = False,
                 failed: bool = False, lines: int = 40) -> int:
    """`toolkit logs`: a shard's worker (or engine) log, followed with `follow`; or with `failed` every failure."""
    rd, plan = load_run(run)
    if failed:
        retryable = _retryable(rd, plan)
        if retryable:
            print(f"{sum(retryable.values())} failed records that may pass (timeouts, 5xx, aborts, NaN) in shards "
                  f"{', '.join(map(str, retryable))}: `toolkit retry {rd.shown}` generates them again")
        rc = _print_failed(rd, lines)
        return max(rc, 1 if retryable else 0)
    if shard is None:
        raise BadInputError(f"which shard? {_has_shards(rd, plan)}: e.g. `toolkit logs {rd.shown} 0`; --failed "
                            "shows every failed record")
    if not 0 <= shard < len(plan.shards):
        raise BadInputError(f"no shard {shard}: {_has_shards(rd, plan)}")
    path = rd.server_log_file(shard) if server else rd.log_file(shard)
    if follow:
        try:
            end = follow_file(path, lines=lines, stop_when=ShardEnd(rd, shard))
        except KeyboardInterrupt:
            return 0
        print(f"(shard {shard} {end}: stopped following)", file=sys.stderr)
        return 0
    if not path.exists():
        print(f"{path} does not exist yet (the shard has not started)", file=sys.stderr)
        return 1
    for line in _tail_lines(path, lines):
        print(line)
    return 0
