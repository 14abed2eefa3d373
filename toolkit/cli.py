"""The `toolkit` command line: parses arguments and calls the modules that do the work.

Exit codes: 0 success; 1 a run, shard or audit failed; 2 bad input (spec, prompt file, tokenizer, run dir)
or usage; 3 a shard stopped early on a signal and wants to be requeued; 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 3

log = logging.getLogger("toolkit.cli")

EPILOG = """\
typical session:
  toolkit run jobs/demo.toml                 run every shard here, then merge and audit (no Slurm)
  toolkit submit jobs/kimi-k2.5.toml -p gpu  plan, then one Slurm array task per shard + a merge job
  toolkit status RUN --watch                 one row per shard
  toolkit logs RUN 3 -f                      follow shard 3's worker log (--server: SGLang's own log)
  toolkit resubmit RUN                       only the shards without a done manifest
  toolkit retry RUN                          generate failures that may pass (timeouts, 5xx, NaN) again
  toolkit export RUN --format jsonl -o out.jsonl

exit codes: 0 ok, 1 failed, 2 bad input or usage, 3 stopped early (requeue), 130 interrupted
"""


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from .chat import ChatError
    from .inputs import InputError
    from .plan import PlanError
    from .spec import SpecError

    return (SpecError, InputError, PlanError, ChatError)


# ---------------------------------------------------------------------------------------------------
# run, worker, check: local execution
# ---------------------------------------------------------------------------------------------------
def prepare_run(job: str, *, new_run: bool = False, check_tokenizer: bool = True):
    """Validate a job completely (spec, every prompt line, tokenizer, template) and pin its run directory."""
    from .plan import create_run, plan_job
    from .spec import load_spec

    spec = load_spec(job)
    plan, refs = plan_job(spec)
    if check_tokenizer:
        check_model(plan)
    rd = create_run(plan, refs, new_run=new_run)
    return rd, plan


def check_model(plan) -> None:
    """Load the tokenizer and render the first prompt of every dataset: template errors surface before GPU time."""
    from . import chat
    from .inputs import scan_dataset

    tok = chat.load_tokenizer(plan.spec.model)
    chat.token_info(tok, plan.spec.model)
    for d in plan.datasets:
        chat.render(tok, plan.spec.model, next(scan_dataset(d.path, d.name)))


def cmd_check(args) -> int:
    from .plan import plan_job
    from .spec import load_spec

    spec = load_spec(args.job)
    plan, _ = plan_job(spec)
    check_model(plan)
    print(f"{args.job}: ok — {plan.total} prompts in {len(plan.datasets)} datasets, {len(plan.shards)} shards, "
          f"fingerprint {plan.fingerprint}")
    return EXIT_OK


def cmd_worker(args) -> int:
    from .worker import STOPPED, ShardFailed, run_shard

    try:
        result = run_shard(args.run, args.shard)
    except ShardFailed as e:
        log.error("%s", e)
        return EXIT_FAILED
    return EXIT_STOPPED if result == STOPPED else EXIT_OK


def cmd_run(args) -> int:
    from .worker import STOPPED, ShardFailed, run_shard

    rd, plan = prepare_run(args.job, new_run=args.new_run)
    print(f"run directory: {rd.shown}")
    shards = args.shards if args.shards is not None else range(len(plan.shards))
    failed = []
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

    s = sub.add_parser("check", help="validate a job: spec, every prompt line, tokenizer and chat template")
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return args.func(args)
    except _bad_input_errors() as e:
        print(f"toolkit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
