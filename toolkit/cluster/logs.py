"""`toolkit logs`: a shard's worker log (tail, `-f` through requeues until the shard is done or
failed for good), its server log, the merge job's, and `--failed`: why each failed shard or record
failed."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from pathlib import Path

from toolkit.cluster import status  # Slurm is asked through it: tests replace its calls
from toolkit.cluster.jobs import index_jobs, read_jobs
from toolkit.cluster.rows import (
    ACTIVE,
    BAD_STATES,
    UNKNOWN,
    ShardFacts,
    ShardRow,
    pool_state,
    shard_row,
)
from toolkit.cluster.table import unknown_note
from toolkit.errors import BadInputError, FailedError
from toolkit.formats.files import shown_path
from toolkit.formats.logline import ERROR_PREFIX, parse_text
from toolkit.formats.progress import live_local_runs, read_progress, worker_gone
from toolkit.formats.records import MAY_PASS
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.shardstate import WATCHED
from toolkit.job.schema import JobSpec

# progress states after which an attempt's log grows no more
FINISHED = ("done", "failed", "stopped")


# --------------------------------------------------------------------------------------------------
# logs
# --------------------------------------------------------------------------------------------------
def _tail_lines(path: Path, n: int) -> list[str]:
    from toolkit.engines.base import log_tail

    return log_tail(path, n).splitlines()


def follow_file(path: Path, *, lines: int, stop_when=None, poll_s: float = 0.5):
    """Print the last `lines` lines, then what is appended, like `tail -f` (Ctrl-C to stop), until
    `stop_when()` says something (which is returned)."""
    while not path.exists():
        if stop_when and (end := stop_when()):
            return end
        time.sleep(poll_s)
    with open(path, "rb") as f:
        # the tail and what follows it from one handle: a line appended between the two is neither
        # lost nor doubled
        f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
        tail = deque(f.read().decode("utf-8", "replace").splitlines(), maxlen=lines)
        for line in tail or ["(server log is empty)"]:
            print(line)
        sys.stdout.flush()
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


# `logs -f` asks Slurm about a stopped or failed attempt's task at most this often
SLURM_ASK_S = 5.0


class EndedForGood:
    """Whether a followed shard has ended for good, as a callable: its end ("done", "failed (task
    12_0 failed)", ...) or None while more attempts may still write its log.

    A done manifest (or a done progress) ends it. An attempt that stopped or failed ends a shard run
    here (no Slurm task: nothing requeues it); a shard with a Slurm task ends only when that task is
    no longer pending, running or requeued (a stop at the time limit, a preemption or `scontrol
    requeue` comes back as a new attempt), asked at most every SLURM_ASK_S; while Slurm does not
    answer, it goes on."""

    def __init__(self, run: Run, shard: int):
        self.run, self.rd, self.shard = run, run.rd, shard
        jobs = index_jobs(read_jobs(run.rd).submissions)
        self.task = jobs.task_of.get(shard)
        # a claiming array: any of its tasks may take the shard up again
        self.array = jobs.pool_of.get(shard)
        self.pool_tasks = jobs.pool_tasks.get(self.array or "", [])
        self.submitted = jobs.submitted_at.get(self.task or self.array or "", "")
        self.asked, self.said = -SLURM_ASK_S, None

    def __call__(self) -> str | None:
        rd, k = self.rd, self.shard
        st = self.run.shard_state(k, WATCHED)
        if st.ended:
            return "done"
        p = st.progress
        local = self.task is None and self.array is None
        # nothing but a live process here will write it
        if local and (p is None or p.state not in FINISHED):
            gone = worker_gone(p) if p is not None else None
            if gone:
                return f"dead: {gone}"
            if p is None and not any(k in r.shards for r in live_local_runs(rd)):
                return f"not started, and nothing runs it (`toolkit retry {rd.shown}` runs it here)"
            return None
        if p is None or p.state not in FINISHED:
            return None
        if p.state == "done" or local:
            return p.state
        if time.monotonic() - self.asked >= SLURM_ASK_S and self.array is not None:
            self.asked = time.monotonic()
            view = status.slurm_view([self.array])
            state, _ = pool_state(view, self.array, self.pool_tasks, self.submitted, time.time())
            going = state in ("pending", "submitted", UNKNOWN)
            self.said = (
                None if going else f"{p.state} (no task of array {self.array} left to take it up)"
            )
        elif time.monotonic() - self.asked >= SLURM_ASK_S:
            self.asked = time.monotonic()
            view = status.slurm_view([self.task.split("_")[0]])
            st = shard_row(
                ShardFacts(shard=k, total=p.total, done=None, progress=p),
                view,
                job=self.task,
                submitted=self.submitted,
                now=time.time(),
                run_shown=rd.shown,
            )
            going = st.state in ACTIVE or st.state == UNKNOWN
            self.said = None if going else f"{p.state} (task {self.task} {st.state})"
        return self.said


def failed_records(rd: RunDir, limit: int) -> tuple[int, list[tuple[str, str]], int]:
    """(failed records, the first `limit` as (id, error), partial outputs to be continued): the
    newest record of each id, from the merged dataset or else the shard files. A record a later one
    of its id superseded (a retry, a continuation) is not counted, and a partial output kept at a
    stop is not a failure: the next attempt continues it."""
    from toolkit.formats.frames import read_shard
    from toolkit.formats.newest import newest_records, scan_shard
    from toolkit.formats.records import OK, PARTIAL

    listed = rd.failed_file
    if rd.manifest_file.exists() and listed.exists() and listed.stat().st_size == 0:
        return 0, [], 0  # the audit of the merged run found none: no need to read every record
    if rd.merged_file.exists():  # one record per id already
        records = read_shard(rd.merged_file)
    else:
        shards = [
            (p, sp)
            for sp in Run.open(rd.root, JobSpec).plan.shards
            if (p := rd.shard_file(sp.index)).exists()
        ]
        records = (
            r for p, sp in shards for r in newest_records(p, scan_shard(p, sp.first, sp.count))
        )
    n, shown, partial = 0, [], 0
    for rec in records:
        if rec is None or rec.status == OK:
            continue
        if rec.status == PARTIAL:
            partial += 1
            continue
        n += 1
        if len(shown) < limit:
            shown.append((rec.id, (rec.error or "(no message)").splitlines()[0]))
    return n, shown, partial


def _says_why(line: str) -> bool:
    """A line of a merge job's log that says why it failed: the command's error line, a toolkit
    ERROR record (formats.logline), or a check the audit failed (its summary's `FAIL` rows)."""
    if (
        line.startswith(ERROR_PREFIX)
        or line.lstrip(" ").startswith("FAIL  ")
        and line.startswith(" ")
    ):
        return True
    got = parse_text(line)
    return got is not None and got.level >= logging.ERROR and got.name.startswith("toolkit.")


def _reasons(log: Path, limit: int = 5) -> list[str]:
    """The lines of a merge job's log that say why it failed (the toolkit's errors, failed audit
    checks)."""
    with open(log, errors="replace") as f:
        return [line.rstrip("\n") for line in f if _says_why(line.rstrip("\n"))][:limit]


def merge_log(rd: RunDir, job: str) -> Path:
    """submitit's log of the merge job (stdout and stderr together)."""
    return rd.job_log(job)


def _print_failed(rd: RunDir, lines: int) -> int:
    """Failed shards (state, error, log tail), a failed merge job's log, then the failed records."""
    _, rows, merge = status.run_status(rd.root)
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
        print(
            f"==> the audit of the merged run failed: {shown_path(rd.audit_json)} (`toolkit audit "
            f"{rd.shown}` prints its checks) <==\n"
        )
    n, recs, partial = failed_records(rd, lines)
    if partial:
        print(
            f"{partial} partial output{'s' if partial > 1 else ''} kept when an attempt stopped: "
            "not failures, the next run of the shard continues them\n"
        )
    if n:
        listed = rd.failed_file
        where = f"; all ids in {shown_path(listed)}" if listed.exists() else ""
        print(
            f"==> {n} failed record{'s' if n > 1 else ''} (prompts the server refused or that "
            f"errored; {len(recs)} shown{where}) <=="
        )
        width = max(len(i) for i, _ in recs)
        for rid, err in recs:
            print(f"{rid:<{width}}  {err}")
    return 1 if bad or merge_bad or audit_bad else 0


def _print_failed_shards(rd: RunDir, bad: list[ShardRow], lines: int) -> None:
    for r in bad:
        print(f"==> shard {r.shard}: {r.state} (job {r.job or '-'}, node {r.node or '-'}) <==")
        if r.error:
            print(f"error: {r.error.splitlines()[0]}")
        if r.stale:
            print(f"why: {r.stale}")
        log = rd.log_file(r.shard)
        # died before the worker started: submitit's own log says why
        if not log.exists() and r.job:
            log = next(iter(rd.job_logs(r.job)), log)
        for line in _tail_lines(log, lines):
            print(line)
        print()


def _retryable(rd: RunDir, plan) -> dict[int, int]:
    """{shard: transient failures} from the done manifests (see records.TRANSIENT)."""
    out, run = {}, Run(rd, plan)
    for s in plan.shards:
        m = run.shard_state(s.index).done
        # given up after [client] max_tries: retry starts afresh
        if m is not None and (m.transient or m.given_up):
            out[s.index] = m.transient + m.given_up
    return out


def _has_shards(rd: RunDir, plan) -> str:
    n = len(plan.shards)
    return (
        f"the run {rd.shown} has only shard 0"
        if n == 1
        else f"the run {rd.shown} has shards 0..{n - 1}"
    )


def _server_log(rd: RunDir, shard: int) -> Path:
    """The server log of the engine that served `shard` (or serves it): a worker keeps its engine
    from shard to shard, and the engine writes the log of the first shard it was started for
    (progress `engine_shard`)."""
    p = read_progress(rd, shard)
    if p is None or p.engine_shard is None or p.engine_shard == shard:
        return rd.server_log_file(shard)
    path = rd.server_log_file(p.engine_shard)
    print(
        f"(shard {shard} was served by the engine {p.task or 'its worker'} started for shard "
        f"{p.engine_shard}: {shown_path(path)})",
        file=sys.stderr,
    )
    return path


def logs_command(
    run: str | os.PathLike,
    shard: int | None = None,
    *,
    follow: bool = False,
    server: bool = False,
    failed: bool = False,
    lines: int = 40,
) -> int:
    """`toolkit logs`: a shard's worker (or engine) log, followed with `follow`; or with `failed`
    every failure."""
    opened = Run.open(run, JobSpec)  # read-only: logs writes nothing into the run
    rd, plan = opened.rd, opened.plan
    if failed:
        retryable = _retryable(rd, plan)
        if retryable:
            print(
                f"{sum(retryable.values())} failed records that may pass ({MAY_PASS}) in shards "
                f"{', '.join(map(str, retryable))}: `toolkit retry {rd.shown}` generates them again"
            )
        rc = _print_failed(rd, lines)
        return max(rc, 1 if retryable else 0)
    if shard is None:
        raise BadInputError(
            f"which shard? {_has_shards(rd, plan)}: e.g. `toolkit logs {rd.shown} 0`; --failed "
            "shows every failed record"
        )
    if not 0 <= shard < len(plan.shards):
        raise BadInputError(f"no shard {shard}: {_has_shards(rd, plan)}")
    path = _server_log(rd, shard) if server else rd.log_file(shard)
    if follow:
        try:
            end = follow_file(path, lines=lines, stop_when=EndedForGood(opened, shard))
        except KeyboardInterrupt:
            return 0
        print(f"(shard {shard} {end}: stopped following)", file=sys.stderr)
        return 0
    if not path.exists():
        p = read_progress(rd, shard)
        if p is None:
            raise FailedError(
                f"{path} does not exist yet: shard {shard} has not started (`toolkit status "
                f"{rd.shown}`)"
            )
        if server:
            raise FailedError(
                f"{path} does not exist: shard {shard} ({p.state}) was served by an engine started "
                "for another shard, and its progress file does not say which; its worker's log "
                f"names the server log (`toolkit logs {rd.shown} {shard}`)"
            )
        raise FailedError(
            f"{path} does not exist: shard {shard} ({p.state}) ran, but its log is gone"
        )
    for line in _tail_lines(path, lines):
        print(line)
    return 0
