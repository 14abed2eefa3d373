"""`toolkit status`: one row per shard (Slurm state, progress, tokens, ETA), the merge job, the
run's total (percent done, its ETA), and an exit code that says whether the run is complete and
healthy. A run of more than SUMMARY_OVER shards gets a summary instead of a row per shard: the
shards per state, and a row for each shard that needs attention (`--all`: every row).

State comes from the files a run directory holds (done manifests checked against their shard files,
prompts.msgpack against run.json, progress files) and, for runs
submitted to Slurm, from `squeue` (live, with the REASON a pending task waits) then `sacct`
(history, may lag a few seconds or have no row yet). Every Slurm command is bounded
(cluster.commands.TIMEOUT_S); when sacct does not answer (slurmdbd down), `scontrol show job` tells
what slurmctld still remembers; what nobody could tell is `unknown`, with why, never guessed as
`submitted`, and `status` exits 4 (EXIT_UNKNOWN). `status` exits 0 only for a run that is complete
and healthy (cluster.verdicts says each code).

This module is the edge: it reads the files and asks Slurm (`read_facts`), then cluster.verdicts
derives every state from those facts with pure functions; it formats the table.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgspec

from toolkit.cluster.commands import call
from toolkit.cluster.verdicts import (
    ACTIVE,
    UNKNOWN,
    MergeStatus,
    RunFacts,
    ShardFacts,
    ShardStatus,
    SlurmView,
    TaskStatus,
    Totals,
    exit_code,
    index_jobs,
    is_unknown,
    needs_attention,
    needs_scontrol,
    run_states,
    task_rows,
    totals,
    verdict,
    view_of_answers,
)
from toolkit.errors import EXIT_UNKNOWN
from toolkit.formats.progress import LocalRun, live_local_runs, worker_gone
from toolkit.formats.prompts import prompts_problem
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.shardstate import STATUS, done_time
from toolkit.formats.text import ranges
from toolkit.job.spec import JobSpec

# more shards than this: the table is a summary (the shards per state, a row for each shard that
# needs attention); `status --all` gives every row
SUMMARY_OVER = 32


class RunStatus(msgspec.Struct):
    """`toolkit status RUN --json`: one object, the same figures as the table, and the exit code
    with its reason."""

    run: str
    shards: list[ShardStatus]
    totals: Totals
    merge: MergeStatus
    exit: int = 0
    verdict: str = ""
    # the workers of the newest submission or run: shards taken, engine starts
    tasks: list[TaskStatus] = []


def status_report(
    rd: RunDir, rows: list[ShardStatus], merge: MergeStatus, tasks: list[TaskStatus] | None = None
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
    from toolkit.cluster.jobs import read_jobs

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
        from toolkit.dataset.merge import merged_file_problem

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


def run_status(run_dir: str | os.PathLike) -> tuple[RunDir, list[ShardStatus], MergeStatus]:
    rd, rows, merge, _ = run_status_tasks(run_dir)
    return rd, rows, merge


def run_status_tasks(
    run_dir: str | os.PathLike,
) -> tuple[RunDir, list[ShardStatus], MergeStatus, list[TaskStatus]]:
    """`run_status`, and the workers of the newest submission or run (task_rows)."""
    rd, rows, merge, tasks, _ = _status_once(run_dir)
    return rd, rows, merge, tasks


def _status_once(
    run_dir: str | os.PathLike,
) -> tuple[RunDir, list[ShardStatus], MergeStatus, list[TaskStatus], str]:
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


# --------------------------------------------------------------------------------------------------
# status
# --------------------------------------------------------------------------------------------------
def _fmt_eta(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt_load(r: ShardStatus) -> str:
    return "-" if r.running is None else f"{r.running}/{r.queued if r.queued is not None else '-'}"


def format_tasks(tasks: list[TaskStatus]) -> list[str]:
    """`tasks: 12_0 on vm: shards 0,2,5 (engine started 1 time), now 5; ...`: who took which
    shard."""
    if not tasks:
        return []
    out = []
    for t in tasks:
        starts = f"engine started {t.engine_starts} time{'s' if t.engine_starts != 1 else ''}"
        now = f", now shard {t.working_on}" if t.working_on is not None else ""
        out.append(
            f"  {t.task}{f' on {t.node}' if t.node else ''}: shards {','.join(map(str, t.shards))} "
            f"({starts}{now})"
        )
    total = sum(t.engine_starts for t in tasks)
    return [f"tasks: {len(tasks)}, {total} engine start{'s' if total != 1 else ''} in all", *out]


def _percent(p: float) -> str:
    """A share in percent, one decimal, rounded down: 100% only when it is all."""
    return f"{int(p * 10) / 10:.1f}%"


def format_summary(rows: list[ShardStatus]) -> tuple[list[str], list[ShardStatus]]:
    """The summary of many shards: a line per state with its shards, and the rows to show (those
    that need attention, verdicts.needs_attention, at most SUMMARY_OVER)."""
    by_state: dict[str, list[int]] = {}
    for r in rows:
        by_state.setdefault(r.state, []).append(r.shard)
    attention = [r for r in rows if needs_attention(r)]
    said = (
        f"the {len(attention)} that need attention below" if attention else "none needs attention"
    )
    lines = [f"shards: {len(rows)}, by state ({said}; --all: a row for each)"]
    width = max(map(len, by_state))
    lines += [
        f"  {st:<{width}} {len(ks):>5}  {ranges(ks, sep=',', limit=8)}"
        for st, ks in sorted(by_state.items())
    ]
    if len(attention) > SUMMARY_OVER:
        lines.append(
            f"  (the first {SUMMARY_OVER} of the {len(attention)} that need attention "
            "below; --all lists every shard)"
        )
    return lines, attention[:SUMMARY_OVER]


def format_status(
    rd: RunDir,
    rows: list[ShardStatus],
    merge: MergeStatus,
    tasks: list[TaskStatus] | None = None,
    noun: str = "prompt",
    every_row: bool = False,
) -> str:
    """The table of `status`: a row per shard, or with more than SUMMARY_OVER shards (and not
    `every_row`) a summary (format_summary)."""
    head = (
        f"{'SHARD':>5} {'STATE':<11} {'JOB':<12} {'NODE':<10} {'DONE':>11} {'FAILED':>6} "
        f"{'LOOPS':>5} {'OUT TOKENS':>11} {'TOK/S':>8} {'ETA':>8} {'RUN/QUEUE':>9} {'KV':>4}  "
        "REASON"
    )
    lines = [f"run {rd.shown}"]
    summary = len(rows) > SUMMARY_OVER and not every_row
    shown = rows
    if summary:
        said, shown = format_summary(rows)
        lines += said
    if shown:
        lines.append(head)
    for r in shown:
        kv = f"{r.kv_usage:.0%}" if r.kv_usage is not None else "-"
        why = "; ".join(x for x in (r.reason, r.stale) if x)
        lines.append(
            (
                f"{r.shard:>5} {r.state:<11} {r.job or '-':<12} {(r.node or '-')[:10]:<10} "
                f"{f'{r.done}/{r.total}':>11} {r.failed:>6} {r.loops:>5} {r.output_tokens:>11,} "
                f"{r.tok_per_s:>8.0f} {_fmt_eta(r.eta_s):>8} {_fmt_load(r):>9} {kv:>4}  {why}"
            ).rstrip()
        )
    t = totals(rows)
    loops = f"{t.loops} stopped in a repetition loop, " if t.loops else ""
    eta = (
        f", run ETA {_fmt_eta(t.eta_s)} at {t.per_s:,.2f} {noun}s/s" if t.eta_s is not None else ""
    )
    lines.append(
        f"total: {t.done}/{t.total} {noun}s ({_percent(t.percent)}), {t.failed} failed, {loops}"
        f"{t.output_tokens:,} output tokens, {t.tok_per_s:,.0f} tok/s{eta}; "
        "shards: " + ", ".join(f"{n} {s}" for s, n in t.shards.items())
    )
    lines += format_tasks(tasks or [])[: 1 if summary else None]
    if merge.job or merge.merged or merge.state:
        files = []
        if merge.merged:
            files.append(
                f"{rd.manifest_file.relative_to(rd.root).as_posix()} written"
                + ("" if merge.current else ", before a shard finished again")
            )
            if merge.damaged:
                files.append(f"but {merge.damaged}")
            if merge.current:
                files.append(f"audit {merge.audit}" if merge.audit else "not audited")
        if merge.job:
            lines.append(
                f"merge: job {merge.job} {merge.state or ''}"
                + (f" ({merge.reason})" if merge.reason else "")
                + (f" ({', '.join(files)})" if files else "")
            )
        elif merge.state:  # a `toolkit run` here merges once its shards are done
            lines.append(
                f"merge: {merge.state} ({merge.reason})"
                + (f" ({', '.join(files)})" if files else "")
            )
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
    what = f"{len(unknown)} shard{'s' if len(unknown) != 1 else ''}" + (
        " and the merge job" if merge.state == UNKNOWN else ""
    )
    first = whys[0] if whys else "Slurm did not answer"
    more = f"; and {len(whys) - 1} more" if len(whys) > 1 else ""
    return (
        f"slurm: the state of {what} is unknown ({first}{more}); "
        "DONE and OUT TOKENS come from the run directory and are current. Check that slurmctld "
        f"(squeue) and slurmdbd (sacct) answer, then run status again (exit {EXIT_UNKNOWN})"
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
