"""The `toolkit` command line: parses arguments and calls the modules that do the work.

Exit codes: 0 success; 1 a run, shard or audit failed; 2 bad input (spec, prompt file, tokenizer, run dir)
or usage; 3 a shard stopped early on a signal and wants to be requeued; 4 (`status`) the state of some shard
or of the merge job cannot be known because Slurm did not answer; 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_UNKNOWN = 0, 1, 2, 3, 4

log = logging.getLogger("toolkit.cli")

EPILOG = """\
typical session:
  toolkit run jobs/demo.toml                 run every shard here, then merge and audit (no Slurm)
  toolkit submit jobs/kimi-k2.5.toml -p gpu  plan, then one Slurm array task per shard + a merge job
  toolkit submit JOB --dry-run               the exact sbatch scripts, no cluster needed
  toolkit status RUN --watch                 one row per shard (--json for scripts)
  toolkit logs RUN 3 -f                      follow shard 3's worker log until it ends (--server: SGLang's)
  toolkit logs RUN --failed                  failed shards, a failed merge job, failed records
  toolkit resubmit RUN                       only the shards without a done manifest
  toolkit retry RUN                          generate failures that may pass (timeouts, 5xx, NaN) again
  toolkit export RUN --format jsonl          RUN/export/records.jsonl (-o OUT to choose)

exit codes: 0 ok, 1 failed, 2 bad input or usage, 3 stopped early (requeue), 4 state unknown (Slurm did not
answer; status), 130 interrupted
"""


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from .chat import ChatError
    from .inputs import InputError
    from .plan import PlanError
    from .preflight import PreflightError
    from .spec import SpecError

    return (SpecError, InputError, PlanError, ChatError, PreflightError)


# ---------------------------------------------------------------------------------------------------
# run, worker, check: local execution
# ---------------------------------------------------------------------------------------------------
def prepare_run(job: str, *, new_run: bool = False, check_tokenizer: bool = True):
    """Run the pre-flight (spec, every prompt line, tokenizer, every prompt rendered, reasoning, lengths) and pin
    the job's run directory."""
    from .plan import create_run
    from .preflight import preflight

    pf = preflight(job, check_tokenizer=check_tokenizer, warn_other_run=False)  # create_run refuses another run
    pf.print_warnings()
    rd = create_run(pf.plan, pf.refs, new_run=new_run)
    return rd, pf.plan


def cmd_check(args) -> int:
    from .preflight import preflight

    pf = preflight(args.job)
    plan = pf.plan
    print(f"{args.job}: ok — {plan.total} prompts in {len(plan.datasets)} datasets, {len(plan.shards)} shards, "
          f"fingerprint {plan.fingerprint}")
    info, m = pf.info, pf.spec.model
    if info is not None:
        print(f"tokenizer {m.tokenizer_path or m.path}: {info.vocab_size} ids; think {m.think_start!r} "
              f"{info.think_start_id} / {m.think_end!r} {info.think_end_id}, eos {list(info.eos_ids)}")
    for line in pf.summary():
        print(line)
    for w in pf.warnings:
        print(f"warning: {w}")
    return EXIT_OK


def cmd_worker(args) -> int:
    from .worker import STOPPED, ShardFailed, run_shard

    try:
        result = run_shard(args.run, args.shard)
    except ShardFailed as e:
        log.error("%s", e)
        return e.exit_code
    return EXIT_STOPPED if result == STOPPED else EXIT_OK


def cmd_run(args) -> int:
    from .worker import STOPPED, ShardFailed, run_shard

    rd, plan = prepare_run(args.job, new_run=args.new_run)
    print(f"run directory: {rd.shown}")
    shards = args.shards if args.shards is not None else range(len(plan.shards))
    failed = []
    from .livebar import LiveBar

    with LiveBar(rd, plan):  # drawn on stderr only when it is a terminal
        for k in shards:
            log.info("shard %d of %d", k, len(plan.shards))
            try:
                if run_shard(rd.root, k) == STOPPED:
                    return EXIT_STOPPED
            except ShardFailed as e:
                log.error("shard %d failed: %s", k, e)
                failed.append(k)
    if failed:
        print(f"shards failed: {failed}; see `toolkit logs {rd.shown} --failed`, then `toolkit run {args.job}` again "
              "to resume them")
        return EXIT_FAILED
    if args.no_merge:
        return EXIT_OK
    from .merge import merge_and_audit

    return merge_and_audit(rd.root)


# ---------------------------------------------------------------------------------------------------
# parser
# ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="toolkit",
        description="Generate a training dataset from a reasoning model served by SGLang, via raw token ids, on Slurm.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("-V", "--version", action="version", version=f"%(prog)s {package_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("run", help="run every shard of a job here (no Slurm), then merge and audit")
    s.add_argument("job", help="job spec (TOML), e.g. jobs/demo.toml")
    s.add_argument("--shards", type=int, nargs="+", metavar="K", help="only these shard indices")
    s.add_argument("--new-run", action="store_true", help="start a new run directory if output_dir holds another run")
    s.add_argument("--no-merge", action="store_true", help="stop after the shards")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("worker", help="generate one shard of a planned run (what each Slurm array task runs)")
    s.add_argument("run", help="run directory")
    s.add_argument("shard", type=int, help="shard index")
    s.set_defaults(func=cmd_worker)

    s = sub.add_parser("check", help="validate a job: spec, every prompt line, tokenizer, every prompt rendered with the "
                       "chat template, reasoning mode, lengths against the context length, run directory")
    s.add_argument("job")
    s.set_defaults(func=cmd_check)

    for add in _EXTRA_COMMANDS:
        add(sub)
    return p


def _add_merge_commands(sub) -> None:
    from .merge import add_cli

    add_cli(sub)


def _add_slurm_commands(sub) -> None:
    from .slurm import add_cli

    add_cli(sub)


def _optional(add):
    """Commands from modules that may be absent in a partial install are skipped, not fatal."""

    def wrapper(sub):
        try:
            add(sub)
        except ImportError as e:  # pragma: no cover - only in a broken install
            logging.getLogger("toolkit.cli").debug("commands unavailable: %s", e)

    return wrapper


def _add_retry_command(sub) -> None:
    from .retry import add_cli

    add_cli(sub)


_EXTRA_COMMANDS = [_optional(_add_slurm_commands), _optional(_add_merge_commands), _optional(_add_retry_command)]


def package_version() -> str:
    """The installed distribution's version (package metadata), or "unknown" when run from a bare source tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("toolkit")
    except PackageNotFoundError:
        return "unknown"


# Commands that run where generation does not (login node, final job): the tokenizer's load lines are detail there.
QUIET_TOKENIZER = {"check", "submit", "resubmit", "status", "logs", "merge", "audit", "export", "cancel"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    quiet = args.command in QUIET_TOKENIZER and not args.verbose
    logging.getLogger("toolkit.chat").setLevel(logging.WARNING if quiet else logging.NOTSET)
    try:
        return args.func(args)
    except _bad_input_errors() as e:
        print(f"toolkit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `toolkit status RUN | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
