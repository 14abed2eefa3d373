"""`status`'s table: a row per shard (Slurm state, progress, tokens, ETA, load), the run's total,
the workers, the merge job and the verdict; with more than SUMMARY_OVER shards a summary instead
(the shards per state, and a row for each shard that needs attention). It formats the rows
cluster.rows and cluster.verdicts derive, and reads nothing.
"""

from __future__ import annotations

from toolkit.cluster.rows import UNKNOWN, MergeStatus, ShardRow
from toolkit.cluster.verdicts import TaskStatus, needs_attention, totals, verdict
from toolkit.errors import EXIT_UNKNOWN
from toolkit.formats.rundir import RunDir
from toolkit.formats.text import ranges

# more shards than this: the table is a summary (the shards per state, a row for each shard that
# needs attention); `status --all` gives every row
SUMMARY_OVER = 32


def _fmt_eta(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt_load(r: ShardRow) -> str:
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


def format_summary(rows: list[ShardRow]) -> tuple[list[str], list[ShardRow]]:
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
    rows: list[ShardRow],
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


def unknown_note(rows: list[ShardRow], merge: MergeStatus) -> str | None:
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
