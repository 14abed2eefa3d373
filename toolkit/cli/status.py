"""`status` and `logs`: what a run's shards and merge job are doing (cluster.status), and their
logs (cluster.logs)."""

from __future__ import annotations

from toolkit.cli.shared import RUN_HELP_ARG, add_command, at_least
from toolkit.errors import EXIT_UNKNOWN

STATUS_HELP = """\
One row per shard (state, prompts done, tokens, tok/s, ETA, engine load, why it waits; over 32
shards a summary instead: the shards per state and a row for each that needs attention, --all for
every row), the total (percent done, the run's ETA), the merge job, and a last line that says what
the exit code means:

  0  complete and healthy: every shard done with no failure that may pass, merged after the last
     one, audit passed
  1  failed (a shard failed, timed out, was cancelled, its worker is dead or its progress stale; the
     merge job or the audit failed), or ended without completing (stopped: shards stopped or not
     started and nothing runs them; failures to retry, not merged, not audited, a damaged done
     manifest or merged file): the command to run next is said
  4  the state of some shard or of the merge job is unknown: Slurm did not answer
  5  still going: something runs it (Slurm jobs pending or running, a `toolkit run` here), nothing
     failed yet"""


def add_status(sub) -> None:
    from toolkit.cluster.status import UNKNOWN_LIMIT_S
    from toolkit.cluster.table import SUMMARY_OVER

    s = add_command(
        sub,
        "status",
        cmd_status,
        help="one row per shard: Slurm state, prompts done, tokens, tok/s, ETA; exit 0 only "
        "when complete and healthy",
        description=STATUS_HELP,
    )
    s.add_argument("run", help=RUN_HELP_ARG)
    s.add_argument("-w", "--watch", action="store_true", help="refresh until the run ends")
    s.add_argument(
        "--all",
        action="store_true",
        help=f"a row for every shard (over {SUMMARY_OVER} shards the table is a summary: the "
        "shards per state, a row for each that needs attention)",
    )
    s.add_argument(
        "-i", "--interval", type=float, default=5.0, help="seconds between refreshes with --watch"
    )
    s.add_argument(
        "--json",
        action="store_true",
        help="one JSON object (shards, totals, merge job) instead of the table, for scripts",
    )
    s.add_argument(
        "--unknown-limit-s",
        type=float,
        default=UNKNOWN_LIMIT_S,
        metavar="S",
        help=f"with --watch: give up (exit {EXIT_UNKNOWN}) once Slurm has not told the state for S "
        f"seconds (default {UNKNOWN_LIMIT_S:.0f})",
    )


def cmd_status(args) -> int:
    from toolkit.cluster.status import status_command

    return status_command(
        args.run,
        watch=args.watch,
        interval=args.interval,
        as_json=args.json,
        unknown_limit_s=args.unknown_limit_s,
        every_row=args.all,
    )


def add_logs(sub) -> None:
    s = add_command(
        sub, "logs", cmd_logs, help="a shard's worker log (or its SGLang server log), -f to follow"
    )
    s.add_argument("run", help=RUN_HELP_ARG)
    s.add_argument("shard", type=int, nargs="?", help="shard index")
    s.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing what is appended, like tail -f; ends when the shard is done, failed "
        "or stopped",
    )
    s.add_argument(
        "--server", action="store_true", help="the engine's own log instead of the worker's"
    )
    s.add_argument(
        "--failed",
        action="store_true",
        help="every failed shard (error and log tail), a failed merge job's log, and the failed "
        "records",
    )
    s.add_argument(
        "-n", "--lines", type=int, default=40, help="lines of tail to print (default 40)"
    )


def cmd_logs(args) -> int:
    from toolkit.cluster.logs import logs_command

    at_least("-n", args.lines, 0, "lines of tail to print")
    return logs_command(
        args.run,
        args.shard,
        follow=args.follow,
        server=args.server,
        failed=args.failed,
        lines=args.lines,
    )
