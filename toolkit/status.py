"""Watching a run: one row per shard (Slurm state, progress, tokens, ETA) and the shards' logs.

State comes from the files a run directory holds (done manifests, progress files) and, for runs submitted
to Slurm, from `squeue` (live) then `sacct` (history, may lag a few seconds or have no row yet). A shard
whose done manifest exists is completed whatever Slurm still says about its task.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from .files import shown_path
from .plan import RunDir, load_run
from .progress import Progress, read_progress
from .shardfile import read_done

__all__ = ["ShardStatus", "RunStatus", "run_status", "status_report", "add_cli"]

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
    running: int | None = None    # requests the engine generates / keeps queued (its /v1/loads), while running
    queued: int | None = None
    kv_usage: float | None = None  # share of the engine's KV cache in use


class MergeStatus(msgspec.Struct):
    job: str | None      # Slurm id of the run's (latest) merge + audit job
    state: str | None    # its Slurm state, lower case
    merged: bool         # merged/manifest.json exists


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
                     merge=MergeStatus(job=merge.get("job"), state=merge.get("state"), merged=bool(merge.get("merged"))))


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


def slurm_states(ids: list[str]) -> dict[str, tuple[str, str | None]]:
    """{job or array-task id: (state, node)}: squeue for live jobs, sacct for the rest (REQUEUED kept visible)."""
    if not ids:
        return {}
    states: dict[str, tuple[str, str | None]] = {}
    requeued: set[str] = set()
    try:
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-j", ",".join(ids), "--format=JobID,State,NodeList"],
                             capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) < 3:
                continue
            jid, state, node = parts[0], parts[1].split()[0], parts[2]
            for j in _expand(jid):
                if state == "REQUEUED":
                    requeued.add(j)
                states[j] = (state, None if node in ("", "None assigned") else node)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i|%T|%N"],
                             capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            parts = line.split("|")
            if len(parts) >= 3:
                states[parts[0]] = (parts[1], parts[2] or None)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass
    for j in requeued:
        state, node = states.get(j, ("REQUEUED", None))
        if state in ("PENDING", "REQUEUED"):
            states[j] = ("REQUEUED", node)
    return states


def run_status(run_dir: str | os.PathLike) -> tuple[RunDir, list[ShardStatus], dict]:
    from .slurm import read_jobs

    rd, plan = load_run(run_dir)
    jobs = read_jobs(rd)
    task_of: dict[int, str] = {}
    merge_id = None
    for sub in jobs.submissions:  # later submissions win
        for a in sub.arrays:
            for i, k in enumerate(a.shards):
                task_of[k] = a.tasks[i] if a.tasks else f"{a.job_id}_{i}"
        merge_id = sub.merge_job_id or merge_id
    ids = sorted({t.split("_")[0] for t in task_of.values()} | ({merge_id} if merge_id else set()))
    states = slurm_states(ids)
    rows = []
    for s in plan.shards:
        k = s.index
        done = read_done(rd.done_file(k))
        p = read_progress(rd.progress_file(k)) or Progress(shard=k, state="pending", total=s.count)
        job = task_of.get(k)
        slurm_state, node = states.get(job, (None, None)) if job else (None, None)
        if done is not None:
            state = "completed"
        elif slurm_state:
            state = slurm_state.lower()
            if state == "completed":  # the task ended without finishing the shard (e.g. stopped, not requeued)
                state = "incomplete"
        elif job:
            state = "submitted"  # sacct has no row yet
        else:
            state = {"done": "completed", "generating": "running", "loading": "running", "starting": "running"}.get(p.state, p.state)
        rows.append(ShardStatus(
            shard=k, state=state, done=done.records if done else p.done, total=s.count,
            failed=done.failed if done else p.failed, output_tokens=done.output_tokens if done else p.output_tokens,
            tok_per_s=p.tok_per_s if state == "running" else 0.0, eta_s=p.eta_s() if state == "running" else None,
            job=job, node=node or (p.host or None), error=p.error,
            **({"running": p.running, "queued": p.queued, "kv_usage": p.kv_usage} if state == "running" else {}),
        ))
    merge = {"job": merge_id, "state": states.get(merge_id, ("submitted" if merge_id else None, None))[0] if merge_id else None}
    if merge["state"]:
        merge["state"] = merge["state"].lower()
    merge["merged"] = (rd.merged_dir / "manifest.json").exists()
    return rd, rows, merge


def _fmt_eta(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt_load(r: ShardStatus) -> str:
    return "-" if r.running is None else f"{r.running}/{r.queued if r.queued is not None else '-'}"


def format_status(rd: RunDir, rows: list[ShardStatus], merge: dict) -> str:
    head = f"{'SHARD':>5} {'STATE':<11} {'JOB':<12} {'NODE':<10} {'DONE':>11} {'FAILED':>6} {'OUT TOKENS':>11} {'TOK/S':>8} {'ETA':>8} {'RUN/QUEUE':>9} {'KV':>4}"
    lines = [f"run {rd.shown}", head]
    for r in rows:
        lines.append(f"{r.shard:>5} {r.state:<11} {r.job or '-':<12} {(r.node or '-')[:10]:<10} "
                     f"{f'{r.done}/{r.total}':>11} {r.failed:>6} {r.output_tokens:>11,} {r.tok_per_s:>8.0f} {_fmt_eta(r.eta_s):>8} "
                     f"{_fmt_load(r):>9} {f'{r.kv_usage:.0%}' if r.kv_usage is not None else '-':>4}")
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
                     + (" (merged/manifest.json written)" if merge.get("merged") else ""))
    return "\n".join(lines)


def cmd_status(args) -> int:
    while True:
        rd, rows, merge = run_status(args.run)
        if args.json:  # with --watch: one compact object per line, per refresh
            text = msgspec.json.encode(status_report(rd, rows, merge)).decode()
            if not args.watch:
                text = msgspec.json.format(text, indent=2)
        else:
            text = format_status(rd, rows, merge)
        if args.watch:
            sys.stdout.write(("" if args.json else "\x1b[H\x1b[2J") + text + "\n")
            sys.stdout.flush()
            finished = all(r.state not in ("pending", "running", "submitted", "requeued", "configuring") for r in rows)
            if finished and merge.get("state") not in ("pending", "running", "submitted"):
                return 0 if all(r.state == "completed" for r in rows) else 1
            time.sleep(args.interval)
        else:
            print(text)
            return 0 if all(r.state == "completed" for r in rows) else (0 if any(r.state in ("running", "pending", "submitted", "requeued") for r in rows) else 1)


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

    listed = rd.merged_dir / "failed_ids.txt"
    if (rd.merged_dir / "manifest.json").exists() and listed.exists() and listed.stat().st_size == 0:
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
    return rd.slurm_dir / job / f"{job}_0_log.out"


BAD_STATES = ("failed", "timeout", "cancelled", "node_fail", "out_of_memory", "incomplete", "preempted", "boot_fail")


def _print_failed(rd: RunDir, args) -> int:
    """Failed shards (state, error, log tail), a failed merge job's log, then the failed records."""
    _, rows, merge = run_status(rd.root)
    bad = [r for r in rows if r.state in BAD_STATES]
    merge_bad = merge.get("job") and (merge.get("state") or "") in BAD_STATES
    if not bad:
        print("no failed shards")
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
        listed = rd.merged_dir / "failed_ids.txt"
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
            log = next(iter(sorted(rd.slurm_dir.glob(f"*/{r.job}_0_log.out"))), log)
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


def add_cli(sub) -> None:
    s = sub.add_parser("status", help="one row per shard: Slurm state, prompts done, tokens, tok/s, ETA")
    s.add_argument("run", help="run directory")
    s.add_argument("-w", "--watch", action="store_true", help="refresh until the run ends")
    s.add_argument("-i", "--interval", type=float, default=5.0, help="seconds between refreshes with --watch")
    s.add_argument("--json", action="store_true",
                   help="one JSON object (shards, totals, merge job) instead of the table, for scripts")
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("logs", help="a shard's worker log (or its SGLang server log), -f to follow")
    s.add_argument("run", help="run directory")
    s.add_argument("shard", type=int, nargs="?", help="shard index")
    s.add_argument("-f", "--follow", action="store_true",
                   help="keep printing what is appended, like tail -f; ends when the shard is done, failed or stopped")
    s.add_argument("--server", action="store_true", help="the engine's own log instead of the worker's")
    s.add_argument("--failed", action="store_true",
                   help="every failed shard (error and log tail), a failed merge job's log, and the failed records")
    s.add_argument("-n", "--lines", type=int, default=40, help="lines of tail to print (default 40)")
    s.set_defaults(func=cmd_logs)
