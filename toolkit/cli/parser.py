"""The parser and `main`: the top-level flags (-v, --quiet, --version), the command groups'
subcommands in the order `toolkit --help` lists them, "did you mean" for a mistyped command, choice
or option, a job file taken for its newest run, and every error ended in one line with the exit
code of its kind."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import textwrap
import traceback
from collections.abc import Iterator
from pathlib import Path

from toolkit.cli import dataset, local, slurm, status
from toolkit.errors import EXIT_INTERRUPTED, EXIT_MEANINGS, EXIT_OK, ToolkitError
from toolkit.formats.logline import RelayFormatter, error_line, text_formatter

EPILOG = """\
typical session:
  toolkit run jobs/demo.toml                 run every shard here, then merge and audit (no Slurm)
  toolkit submit jobs/kimi-k2.5.toml -p gpu  plan, then a Slurm array whose tasks claim the shards,
                                             and a merge job
  toolkit submit JOB --dry-run               the exact sbatch scripts, no cluster needed
  toolkit status RUN --watch                 one row per shard (--json for scripts)
  toolkit logs RUN 3 -f                      follow shard 3's worker log until it ends
                                             (--server: SGLang's)
  toolkit logs RUN --failed                  failed shards, a failed merge job, failed records
  toolkit resubmit RUN                       only the shards not finished (no done manifest,
                                             failures that may pass)
  toolkit retry RUN                          generate failures that may pass (timeouts, 5xx,
                                             NaN, ...) again
  toolkit export RUN                         RUN/export/tokens.jsonl: the model's exact ids +
                                             loss mask, for training
  toolkit export RUN --format jsonl          RUN/export/records.jsonl (-o OUT to choose)

"""


def _exit_codes() -> str:
    """The exit codes for `toolkit --help`, from their one list (errors.EXIT_MEANINGS)."""
    return textwrap.fill(
        "exit codes: " + ", ".join(f"{code} {what}" for code, what in EXIT_MEANINGS.items()),
        width=100,
        break_on_hyphens=False,
    )


QUIET_HELP = (
    "hide the INFO log lines on the terminal (the shards' log files keep them): warnings, errors "
    "and the final summary only"
)


# Every subcommand, in the order `toolkit --help` lists them; each group's module holds the flags
# of its commands beside the functions that run them.
COMMANDS = (
    local.add_run,
    local.add_worker,
    local.add_check,
    slurm.add_submit,
    slurm.add_resubmit,
    slurm.add_cancel,
    status.add_status,
    status.add_logs,
    dataset.add_merge,
    dataset.add_audit,
    dataset.add_export,
    local.add_retry,
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="toolkit",
        description="Generate a training dataset from a reasoning model served by SGLang, via raw "
        "token ids, on Slurm.",
        epilog=EPILOG + _exit_codes(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging, and the traceback of an error"
    )
    p.add_argument("--quiet", action="store_true", help=QUIET_HELP)
    # log records as JSON lines (pipeline)
    p.add_argument("--log-relay", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-V", "--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    for add in COMMANDS:
        add(sub)
    for s in sub.choices.values():  # also after the command: `toolkit run --quiet JOB`
        s.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS, help=QUIET_HELP)
        s.add_argument(
            "-v",
            "--verbose",
            action="store_true",
            default=argparse.SUPPRESS,
            help="debug logging, and the traceback of an error",
        )
    return p


class _Parser(argparse.ArgumentParser):
    """argparse with "did you mean" for a mistyped command or choice."""

    def error(self, message: str):
        import difflib
        import re

        m = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if m:
            listed = m.group(3)
            choices = re.findall(r"'([^']*)'", listed) or [c.strip() for c in listed.split(",")]
            close = difflib.get_close_matches(m.group(2), choices, n=1, cutoff=0.6)
            if close:
                message += f"; did you mean `{close[0]}`?"
        super().error(message)


def _unrecognized(parser: argparse.ArgumentParser, args, extras: list[str]) -> None:
    """Refuse the arguments no option took, in the words of the command they were given to: a
    mistyped option gets the closest one, an sbatch option the toolkit does not take gets [slurm]
    extra."""
    import difflib

    sub = _subparser(parser, getattr(args, "command", None)) or parser
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = []
    for arg in extras:
        name = arg.split("=", 1)[0]
        if not name.startswith("-"):
            continue
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.75)
        if close:
            hints.append(f"did you mean `{close[0]}` for `{name}`?")
        elif name.startswith("--") and "--partition" in options:
            key = name[2:].replace("-", "_")
            hints.append(
                f"`{name}` is not an option here: any sbatch option goes in the job's [slurm] "
                f'table as extra = {{ {key} = "..." }}'
            )
    sub.error(
        f"unrecognized arguments: {' '.join(extras)}" + ("; " + "; ".join(hints) if hints else "")
    )


def _subparser(parser: argparse.ArgumentParser, command: str | None):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


def package_version() -> str:
    """The installed distribution's version (package metadata), or "unknown" when run from a bare
    source tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("toolkit")
    except PackageNotFoundError:
        return "unknown"


# Commands that run where generation does not (login node, final job): the tokenizer's load lines
# are detail there.
QUIET_TOKENIZER = {
    "check",
    "submit",
    "resubmit",
    "status",
    "logs",
    "merge",
    "audit",
    "export",
    "cancel",
}


# Commands on a run directory that also take the job file that made it (its newest run in
# output_dir).
TAKES_A_JOB_FOR_ITS_RUN = {
    "status",
    "logs",
    "resubmit",
    "cancel",
    "retry",
    "merge",
    "audit",
    "export",
}


def _run_arg(arg: str) -> str:
    """A run directory as given, or the newest run of a job file (said on stderr, so scripts can
    tell)."""
    from toolkit.formats.files import shown_path
    from toolkit.job.findrun import run_of_job

    p = Path(arg)
    if not (p.is_file() and p.suffix == ".toml"):
        return arg
    run = run_of_job(p)
    print(f"run directory: {shown_path(run)} (the newest run of job {p})", file=sys.stderr)
    return str(run)


def quiet_terminal() -> None:
    """--quiet: the terminal's log handler shows warnings and errors only. The loggers keep their
    levels, so the shards' log files (handlers of their own) still get every INFO line, and the
    lines of worker processes relayed here (pipeline._relay) pass through the same handler, hidden
    alike."""
    for h in logging.getLogger().handlers:
        h.setLevel(logging.WARNING)


@contextlib.contextmanager
def _log_levels(args) -> Iterator[None]:
    """The command's log levels (--quiet, tokenizer lines hidden on login-node commands), put back
    as they were when it returns: `main` called in a process that goes on (a test, a notebook)
    leaves its logging unchanged."""
    root, chat = logging.getLogger(), logging.getLogger("toolkit.job.chat")
    before = [(h, h.level) for h in root.handlers], chat.level
    if args.quiet and not args.verbose:
        quiet_terminal()
    quiet = args.command in QUIET_TOKENIZER and not args.verbose
    chat.setLevel(logging.WARNING if quiet else logging.NOTSET)
    try:
        yield
    finally:
        for h, level in before[0]:
            h.setLevel(level)
        chat.setLevel(before[1])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _unrecognized(parser, args, extras)
    # (--log-relay: records for the `toolkit run` that started it)
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setFormatter(RelayFormatter() if args.log_relay else text_formatter())
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[terminal])
    try:
        with _log_levels(args):
            if args.command in TAKES_A_JOB_FOR_ITS_RUN:
                args.run = _run_arg(args.run)
            return args.func(args)
    except ToolkitError as e:  # every toolkit error: one line, and the exit code of its kind
        if args.verbose:  # -v: where it was raised too
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        print(error_line(e), file=sys.stderr)
        return e.exit_code
    # Ctrl-C where no stop is set up (planning, merging, `status --watch`)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `toolkit status RUN | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
