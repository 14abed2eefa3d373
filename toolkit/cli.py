"""The `toolkit` command line: parses arguments and calls the modules that do the work.

Exit codes: toolkit.errors.EXIT_MEANINGS, printed by `toolkit --help`; an error exits with the code
of its kind (toolkit.errors.KINDS) after one line, `toolkit: error: ...` (`toolkit -v`: its
traceback first). `status` exits 0 only for a run that is complete and healthy
(cluster.verdicts.verdict).
"""

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

from toolkit.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_IN_PROGRESS,
    EXIT_INTERRUPTED,
    EXIT_MEANINGS,
    EXIT_OK,
    EXIT_STOPPED,
    EXIT_UNKNOWN,
    BadInputError,
    FailedError,
    ToolkitError,
    stopped_code,
)
from toolkit.formats.files import shown_path
from toolkit.formats.logline import RelayFormatter, error_line, text_formatter
from toolkit.formats.text import ranges

__all__ = [
    "main",
    "EXIT_OK",
    "EXIT_FAILED",
    "EXIT_BAD_INPUT",
    "EXIT_STOPPED",
    "EXIT_UNKNOWN",
    "EXIT_IN_PROGRESS",
]

log = logging.getLogger("toolkit.cli")

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


RUN_HELP = """\
Run every shard of JOB here (no Slurm), then merge and audit. As many workers run as the visible
GPUs (CUDA_VISIBLE_DEVICES, else the machine's) hold engines of tp_size x pp_size x dp_size GPUs,
each on its own GPUs (one without GPUs; --parallel N chooses); each starts its engine once and
claims shards one after another.

Where the run goes: output_dir and the runs `--new-run` made beside it (<output_dir>.<time>) are
looked at, and the newest run of this same job (same fingerprint) among them is resumed, with or
without --new-run: the same job is never generated twice. With none, output_dir is used when it
holds no run; when it holds another job's run, `run` refuses, and `run --new-run` starts a new run
directory beside it.

A shard another process is generating (a second `toolkit run` of the job: its file is locked) is not
run twice and not counted failed: it is waited for (and run here if that process ends without
finishing it), and the run is merged once every shard is done."""

QUIET_HELP = (
    "hide the INFO log lines on the terminal (the shards' log files keep them): warnings, errors "
    "and the final summary only"
)

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


# --------------------------------------------------------------------------------------------------
# run, worker, check: local execution
# --------------------------------------------------------------------------------------------------


def cmd_check(args) -> int:
    from toolkit.cluster.resources import Resources, check_resources
    from toolkit.job.prepare import prepare_run

    # the [slurm] table as `submit` takes it (no cluster asked): no GPU billed and left idle
    pf = prepare_run(
        args.job,
        dry_run=True,
        print_warnings=False,
        validate=lambda plan, _rd: check_resources(plan, Resources()),
    ).preflight
    plan = pf.plan
    skipped = sum(d.skipped_lines for d in plan.datasets)
    said = f" ({skipped} line{'s' * (skipped != 1)} skipped)" if skipped else ""
    print(
        f"{args.job}: ok — {plan.counted()} in {len(plan.datasets)} datasets{said}, "
        f"{len(plan.shards)} shards, fingerprint {plan.fingerprint}"
    )
    info, m = pf.info, pf.spec.model
    if info is not None:
        print(
            f"tokenizer {shown_path(m.tokenizer_path or m.path)}: {info.vocab_size} ids; think "
            f"{m.think_start!r} {info.think_start_id} / {m.think_end!r} {info.think_end_id}, eos "
            f"{list(info.eos_ids)}"
        )
    for line in pf.summary():
        print(line)
    for line in _cost(pf):
        print(line)
    for w in pf.warnings:
        print(f"warning: {w}")
    return EXIT_OK


def _cost(pf) -> list[str]:
    """`check`'s cost estimate (job.cost): as many engines at once as Slurm tasks would run."""
    from toolkit.formats.rundir import RunDir
    from toolkit.job import cost

    spec, plan = pf.spec, pf.plan
    rd = RunDir(spec.output_dir)
    measured = cost.measured_mean(rd, plan) if rd.plan_file.exists() else None
    engines = spec.slurm.array_parallelism or len(plan.shards)
    c = cost.estimate(plan, engines=engines, measured=measured)
    from toolkit.cluster.resources import time_to_minutes

    warn = cost.time_warning(c, time_to_minutes(spec.slurm.time), spec.slurm.signal_delay_s)
    return cost.describe(c, spec.engine.kind) + ([f"warning: {warn}"] if warn else [])


def _running_here(run: str, shards, command: str, **kw):
    """`formats.progress.local_run`: `status` knows this process runs `shards` (the run's Slurm
    tasks are not this command: they run worker.claims through cluster.tasks, and Slurm tells their
    state), also inside an allocation (salloc)."""
    from toolkit.formats.progress import local_run
    from toolkit.formats.rundir import RunDir

    return local_run(RunDir(run), shards, command, **kw)


def _at_least(flag: str, values, least: int, what: str) -> None:
    """Refuse (bad input) a number flag below `least`, before anything is read or written."""
    for v in [values] if isinstance(values, int) else values or []:
        if v < least:
            raise BadInputError(f"{flag} {v}: give at least {least} ({what})")


def _shards_of(flag: str, shards, plan) -> None:
    """Refuse (bad input) shard indices that are not the run's (`plan`'s), before any is run."""
    n = len(plan.shards)
    for k in shards or []:
        if not 0 <= k < n:
            raise BadInputError(
                f"{flag} {k}: no such shard; the run has {n} shard{'s' * (n != 1)}, 0..{n - 1}"
            )


def cmd_worker(args) -> int:
    from toolkit.formats.run import Run
    from toolkit.job.spec import JobSpec

    _at_least("--workers", args.workers, 1, "workers that share the shards")
    if not 0 <= args.worker < args.workers:
        raise BadInputError(
            f"--worker {args.worker}: give 0..{args.workers - 1} (this worker's number of "
            f"--workers {args.workers})"
        )
    plan = Run.open(args.run, JobSpec).plan  # read only: a shard not the run's is refused first
    _shards_of("--claim", args.claim, plan)
    _shards_of("shard", [] if args.shard is None else [args.shard], plan)
    if args.claim is not None:
        from toolkit.worker.claims import run_claims

        if args.shard is not None:
            raise BadInputError("give a SHARD or --claim K ..., not both")
        with _running_here(args.run, args.claim, "toolkit worker", group=args.group):
            r = run_claims(
                args.run,
                args.claim,
                worker=args.worker,
                workers=args.workers,
                group=args.group,
                task=f"worker {args.worker} (pid {os.getpid()})",
            )
        return stopped_code(r.stopped) if r.stopped else EXIT_FAILED if r.failed else EXIT_OK
    if args.shard is None:
        raise BadInputError("give a SHARD, or --claim K ... to claim shards one after another")
    from toolkit.worker.run import STOPPED, run_shard

    with _running_here(args.run, [args.shard], "toolkit worker"):
        out = run_shard(args.run, args.shard)
    return stopped_code(out.stop_signal) if out.end == STOPPED else EXIT_OK


def cmd_run(args) -> int:
    from toolkit.job.prepare import prepare_run
    from toolkit.pipeline import local_group, run_shards, workers_here

    _at_least("--parallel", args.parallel, 1, "workers at once, each with its own engine")
    _at_least("--shards", args.shards, 0, "shard indices count from 0")

    def validate(plan, _rd):  # before the run directory is written
        _shards_of("--shards", args.shards, plan)
        workers_here(plan.spec, args.parallel)  # the GPUs here, split between the workers

    prep = prepare_run(
        args.job,
        new_run=args.new_run,
        local=True,
        allow_changed=args.allow_changed,
        validate=validate,
    )
    rd, plan = prep.run_dir, prep.plan
    print(f"run directory: {rd.shown}")
    shards = args.shards if args.shards is not None else range(len(plan.shards))
    from toolkit.cluster.livebar import LiveBar

    again = f"`{rd.finish_command()}`"  # the one command that resumes a run (status says it too)
    if not _unfinished(rd, plan, shards):
        return _nothing_to_generate(rd, plan, args)
    with _running_here(
        rd.root, shards, "toolkit run", group=local_group(), merges=not args.no_merge
    ):
        with LiveBar(rd, plan):  # drawn on stderr only when it is a terminal
            stopped, failed = run_shards(rd.root, shards, log, parallel=args.parallel)
        others = _unfinished(rd, plan, range(len(plan.shards)))
        if args.shards is not None and others and not (stopped or failed):
            # the shards asked for are done; the run is not, so it is not merged
            print(
                f"shards {ranges(shards, sep=',')} done; {_of_run(others, plan)} not done: "
                f"{again} generates them and merges the run"
            )
            return EXIT_OK
        code = _after_shards(rd, stopped, failed, merge=not args.no_merge, again=again)
    return code if args.no_merge else _as_status_says(rd, code)


def _unfinished(rd, plan, shards) -> list[int]:
    """The shards among `shards` with something left to generate (formats.shardstate)."""
    from toolkit.formats.shardstate import shard_state

    return [
        k
        for k in shards
        if not shard_state(rd, k, fingerprint=plan.fingerprint, verify="cheap").finished
    ]


def _of_run(shards: list[int], plan) -> str:
    return f"{len(shards)} of the run's {len(plan.shards)} shards ({ranges(shards, sep=',')})"


def _nothing_to_generate(rd, plan, args) -> int:
    """`run` of shards that are all done: said in those words; the run is merged and audited only
    when it is complete and its merged dataset is not the run as it is."""
    from toolkit.cluster.status import run_status
    from toolkit.cluster.verdicts import verdict

    which = "every shard" if args.shards is None else f"shards {ranges(args.shards, sep=',')}"
    others = _unfinished(rd, plan, range(len(plan.shards)))
    print(f"nothing to generate: {which} of {rd.shown} done")
    if others:
        print(
            f"{_of_run(others, plan)} not done: `{rd.finish_command()}` generates them and "
            "merges the run"
        )
        return EXIT_OK
    if args.no_merge:
        return EXIT_OK
    _, rows, merge = run_status(rd.root)
    code, why = verdict(rows, merge, rd.shown)
    if code == EXIT_OK:
        print(f"run: {why} (exit 0); `toolkit export {rd.shown}` writes the training file")
        return EXIT_OK
    return _as_status_says(rd, _after_shards(rd, None, [], again=f"`{rd.finish_command()}`"))


def _as_status_says(rd, code: int) -> int:
    """The exit code of `run` and `retry` once they merged and audited: `status`'s verdict on the
    run they leave (cluster.verdicts.verdict), so that a run left with failures that may pass, or
    otherwise not complete, never exits 0; said in its words when it is not complete (the audit's
    summary stays the last line of a complete run). `code`: theirs until then (kept when not 0)."""
    if code != EXIT_OK:
        return code
    from toolkit.cluster.status import run_status
    from toolkit.cluster.verdicts import verdict

    _, rows, merge = run_status(rd.root)
    code, why = verdict(rows, merge, rd.shown)
    if code != EXIT_OK:
        print(f"run: {why} (exit {code})")
    return code


def _after_shards(
    rd, stopped: str | None, failed: list[int], *, merge: bool = True, again: str = ""
) -> int:
    """The end of `run` and `retry`: the exit code of shards run here, after merging and auditing
    them. `again`: the command that resumes them."""
    if stopped:
        print(f"stopped by {stopped}: what was done is kept; {again} resumes the run")
        return stopped_code(stopped)
    if failed:
        print(
            f"shards failed: {failed}; see `toolkit logs {rd.shown} --failed`, then {again} to "
            "resume them"
        )
        return EXIT_FAILED
    if not merge:
        return EXIT_OK
    from toolkit.dataset.finish import merge_and_audit

    merge_and_audit(rd.root)
    return EXIT_OK


# --------------------------------------------------------------------------------------------------
# merge, audit, export
# --------------------------------------------------------------------------------------------------
def cmd_merge(args) -> int:
    from toolkit.dataset.finish import merge_and_audit
    from toolkit.dataset.merge import merge_run
    from toolkit.formats.rundir import RunDir

    if not args.no_audit:
        merge_and_audit(args.run, allow_incomplete=args.allow_incomplete)
        return EXIT_OK
    m = merge_run(args.run, allow_incomplete=args.allow_incomplete)
    print(
        f"merged {m.records} of {m.planned} planned records ({m.ok} ok, {m.failed} failed) into "
        f"{RunDir(args.run).merged_file}; {m.missing} missing, {m.duplicates} duplicates kept "
        f"once, {len(m.corrupt)} damaged frames"
    )
    if m.corrupt or m.foreign or not (m.complete or args.allow_incomplete):
        raise FailedError(
            f"{RunDir(args.run).shown}: merged with damaged frames or shards of another run, or "
            "incomplete: see the line above; `toolkit audit` says what each check finds"
        )
    return EXIT_OK


def cmd_audit(args) -> int:
    from toolkit.dataset.finish import audit_and_report

    audit_and_report(args.run)
    return EXIT_OK


def cmd_export(args) -> int:
    from toolkit.dataset import export

    _at_least("--sample", args.sample, 0, "sample indices count from 0")
    _at_least("--turn", args.turn, 0, "turn indices count from 0")
    fmt = export.output_format(args.output, args.format)  # a mismatch refused here
    include = set(args.include or [])
    if args.include_truncated:
        include.add("truncated")
    if "all" in include:
        include = set(export.EXPORT_REASONS)  # an unknown name is refused by export_run
    exclude = set(args.exclude or [])
    if "all" in exclude:
        exclude = set(export.EXPORT_REASONS)
    select = export.Selection(
        datasets=frozenset(args.dataset) if args.dataset else None,
        finish=frozenset(args.finish) if args.finish else None,
        mode=args.mode,
        samples=frozenset(args.sample) if args.sample is not None else None,
        turns=frozenset(args.turn) if args.turn is not None else None,
        include=frozenset(include) if include else None,
        max_length=args.max_length,
        exclude=frozenset(exclude) if exclude else None,
    )
    think = None if args.think_start is None else args.think_start == "supervised"
    s = export.export_run(
        args.run,
        fmt,
        args.output,
        include_failed=args.include_failed,
        force=args.force,
        select=select,
        trainer=args.trainer,
        supervise_think_start=think,
        check_sample=args.check_sample,
    )
    output = Path(s.output)
    for w in s.warnings:
        print(f"warning: {w}", file=sys.stderr)
    what = fmt if args.format else f"{fmt}, the default: the model's exact ids"
    if not args.format and fmt != export.DEFAULT_FORMAT:
        what = f"{fmt}, from the output's extension"
    if fmt == "tokens":
        what += (
            f"; loss mask for {s.trainer}, the template's think-start "
            f"{'supervised' if s.supervise_think_start else 'not supervised'}"
        )
    print(f"wrote {s.rows} rows ({s.exported} records) to {shown_path(output)} ({what})")
    print(s.line())
    print(
        f"left out, with the reason per id: {shown_path(s.skipped_file)}; summary: "
        f"{shown_path(export.side_file(output, 'summary', '.json'))}"
    )
    if s.lengths is not None and s.lengths.rows:
        _print_lengths(s, args)
    if fmt == "conversations":
        differ = s.roundtrip_rows - s.roundtrip_identical
        print(
            f"round trip as SpecForge renders the rows: {s.roundtrip_identical} of "
            f"{s.roundtrip_rows} rows give the model's exact ids, {differ} differ (per row: "
            f"{shown_path(s.roundtrip_file)})"
            + (
                ""
                if s.roundtrip_sample is None
                else f"; rows checked: {s.roundtrip_rows} of {s.rows} (--check-sample)"
            )
        )
        if s.arguments_reformatted:
            print(
                f"{s.arguments_reformatted} tool calls have arguments SpecForge would train "
                "re-serialised (not as json.dumps writes them)"
            )
        print(
            "SpecForge chat-template registration of this model: "
            f"{shown_path(s.registration_file)} (import it before training; data.chat_template = "
            "its name)"
        )
        if differ:
            print(
                f"warning: {differ} rows would not train on the model's ids: train on the tokens "
                f"export instead (`toolkit export {args.run}`)",
                file=sys.stderr,
            )
    return EXIT_OK


def _print_lengths(s, args) -> None:
    """The export's tokens per row, and the trainer's length that keeps every row whole."""
    n = s.lengths
    trainer = s.trainer or "specforge"
    length = args.max_length or n.needed
    cut = n.supervised_cut_by_default / n.supervised if n.supervised else 0.0
    print(
        f"tokens per row: p50 {n.p50:,}, p99 {n.p99:,}, max {n.max:,}; at its default "
        f"{n.setting} {n.default_length}, {trainer} would cut {n.rows_cut_by_default} of "
        f"{n.rows} rows ({cut:.1%} of the supervised tokens)"
    )
    where = f" (written in {shown_path(s.trainer_config)})" if s.trainer_config else ""
    sep = ":" if n.setting.startswith("data.") else ""
    print(f"every row whole: {trainer} {n.setting}{sep} {length}{where}")


# --------------------------------------------------------------------------------------------------
# submit, resubmit, cancel, retry: Slurm
# --------------------------------------------------------------------------------------------------
def _resources(args):
    """The resource flags of a command line, as the Slurm layer takes them."""
    from toolkit.cluster.resources import SBATCH_FLAGS, Resources

    return Resources(
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        time=args.time,
        gpus_per_node=args.gpus_per_node,
        cpus_per_task=args.cpus_per_task,
        mem=args.mem,
        array_parallelism=args.array_parallelism,
        signal_delay_s=args.signal_delay_s,
        setup=list(args.setup or []),
        merge_partition=args.merge_partition,
        sbatch={k: v for k in SBATCH_FLAGS if (v := getattr(args, k)) not in (None, False)},
    )


def cmd_submit(args) -> int:
    from toolkit.cluster.submit import format_dry_run, format_submission, submit
    from toolkit.formats.rundir import RunDir

    r = submit(
        args.job,
        _resources(args),
        dry_run=args.dry_run,
        new_run=args.new_run,
        allow_changed=args.allow_changed,
    )
    if r.submission is None:
        print(format_dry_run(r.dry_run))
    else:
        print(format_submission(RunDir(r.run_dir), r.submission))
    return EXIT_OK


def _resubmit(run: str, resources) -> int:
    from toolkit.cluster.submit import format_submission, resubmit, why_unfinished

    rd, sub, missing = resubmit(run, resources)
    if sub is None:
        print(
            f"nothing to resubmit: every shard of {rd.shown} has its done manifest, with no "
            "failure that may pass"
        )
        return EXIT_OK
    print(
        f"resubmitting {len(missing)} shard{'s' if len(missing) != 1 else ''}: "
        f"{why_unfinished(rd, missing)}"
    )
    print(format_submission(rd, sub))
    return EXIT_OK


def cmd_resubmit(args) -> int:
    return _resubmit(args.run, _resources(args))


def cmd_cancel(args) -> int:
    from toolkit.cluster.submit import cancel

    ids = cancel(args.run)
    print(f"cancelled {', '.join(ids)}" if ids else "nothing was submitted for this run")
    return EXIT_OK


def cmd_retry(args) -> int:
    from toolkit.cluster.retry import read_ids, request_retry
    from toolkit.formats.files import shown_path

    rd, shards = request_retry(args.run, read_ids(args.ids) if args.ids else None)
    if not shards:
        lists = [
            f"`toolkit retry {rd.shown} --ids {shown_path(f)}` generates the {what} again"
            for f, what in (
                (rd.missing_file, "ids the merge found missing"),
                (rd.failed_file, "failed ones (permanent failures too)"),
            )
            if _has_ids(f)
        ]
        print(
            f"nothing to retry: every shard of {rd.shown} is done with no failure that may pass"
            + (f"; {'; '.join(lists)}" if lists else "")
        )
        return EXIT_OK
    print(f"retrying in {len(shards)} shards: {', '.join(map(str, shards))}")
    if args.slurm:
        return _resubmit(args.run, _resources(args))
    from toolkit.pipeline import local_group, run_shards

    with _running_here(rd.root, shards, "toolkit retry", group=local_group(), merges=True):
        stopped, failed = run_shards(rd.root, shards, log, parallel=None)
        code = _after_shards(rd, stopped, failed, again=f"`{rd.finish_command()}`")
    return _as_status_says(rd, code)


def _has_ids(path: Path) -> bool:
    """Whether an id list (merged/missing_ids.txt, failed_ids.txt) names any id."""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------
# status, logs
# --------------------------------------------------------------------------------------------------
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


def cmd_logs(args) -> int:
    from toolkit.cluster.logs import logs_command

    _at_least("-n", args.lines, 0, "lines of tail to print")
    return logs_command(
        args.run,
        args.shard,
        follow=args.follow,
        server=args.server,
        failed=args.failed,
        lines=args.lines,
    )


# --------------------------------------------------------------------------------------------------
# parser
# --------------------------------------------------------------------------------------------------
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

    s = sub.add_parser(
        "run",
        help="run every shard of a job here (no Slurm), then merge and audit",
        description=RUN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("job", help="job spec (TOML), e.g. jobs/demo.toml")
    s.add_argument("--shards", type=int, nargs="+", metavar="K", help="only these shard indices")
    s.add_argument(
        "--new-run",
        action="store_true",
        help="when output_dir holds another job's run, start a new one beside it "
        "(<output_dir>.<time>); a run of this job there is resumed instead",
    )
    s.add_argument("--no-merge", action="store_true", help="stop after the shards")
    _add_allow_changed(s)
    s.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="workers at once, each with its own engine of tp_size x dp_size GPUs (default: as "
        "many as the GPUs in CUDA_VISIBLE_DEVICES, or the machine's, hold; 1 without GPUs)",
    )
    s.set_defaults(func=cmd_run)

    s = sub.add_parser(
        "worker",
        help="generate one shard of a planned run, or claim shards one after another with "
        "one engine (--claim: what each Slurm array task runs)",
    )
    s.add_argument("run", help="run directory")
    s.add_argument("shard", type=int, nargs="?", help="shard index")
    s.add_argument(
        "--claim", type=int, nargs="+", metavar="K", help="claim these shards one after another"
    )
    s.add_argument(
        "--worker", type=int, default=0, help="with --claim: this worker's number (where it starts)"
    )
    s.add_argument(
        "--workers", type=int, default=1, help="with --claim: how many workers share the shards"
    )
    s.add_argument(
        "--group",
        help="with --claim: the name of the workers sharing the shards (a shard failed in "
        "one of them is not claimed again by the others)",
    )
    s.set_defaults(func=cmd_worker)

    s = sub.add_parser(
        "check",
        help="validate a job: spec, every prompt line, tokenizer, every prompt rendered with the "
        "chat template, reasoning mode, lengths against the context length, run directory",
    )
    s.add_argument(
        "job",
        help="job spec (TOML) to check, e.g. jobs/demo.toml; it writes only what it learned "
        "(check.msgpack in output_dir), so that `submit` renders nothing again",
    )
    s.set_defaults(func=cmd_check)

    _add_slurm_commands(sub)
    _add_status_commands(sub)
    _add_merge_commands(sub)
    _add_retry_command(sub)
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


def _add_resource_flags(s) -> None:
    g = s.add_argument_group("resources (override the job's [slurm] table)")
    g.add_argument("-p", "--partition", help="Slurm partition, as sbatch -p")
    g.add_argument("-A", "--account", help="account to charge, as sbatch -A")
    g.add_argument("-q", "--qos", help="quality of service, as sbatch -q")
    g.add_argument("-t", "--time", help="time limit per array task, e.g. 24:00:00")
    g.add_argument(
        "--gpus-per-node",
        type=int,
        help="GPUs per node of each task (the engine's tp × pp × dp over its nodes)",
    )
    g.add_argument("-c", "--cpus-per-task", type=int, help="CPUs per task, as sbatch -c")
    g.add_argument("--mem", help="memory per task, e.g. 200G")
    g.add_argument(
        "--array-parallelism",
        type=int,
        help="array tasks at once (%%N): each starts its engine once "
        "and claims shards one after another",
    )
    g.add_argument(
        "--signal-delay-s",
        type=int,
        help="seconds before the time limit that the task is told to stop",
    )
    g.add_argument(
        "--setup",
        action="append",
        metavar="LINE",
        help="a line run before the task, e.g. 'module load cuda' (repeatable)",
    )
    g.add_argument(
        "--merge-partition",
        metavar="PARTITION",
        help="the merge + audit job's partition (it needs no GPU; default: -p's)",
    )
    g = s.add_argument_group(
        "more sbatch options, as sbatch spells them (any other: the job's [slurm] extra, e.g. "
        'extra = { gres = "gpu:h100:8" })'
    )
    g.add_argument("-C", "--constraint", help="node features the GPU tasks need, as sbatch -C")
    g.add_argument("-w", "--nodelist", help="nodes the GPU tasks run on, as sbatch -w")
    g.add_argument(
        "--exclusive",
        action="store_true",
        default=None,
        help="whole nodes for the GPU tasks, as sbatch --exclusive",
    )
    g.add_argument("-x", "--exclude", help="nodes not to use, as sbatch -x")
    g.add_argument("--reservation", help="the reservation to run in, as sbatch --reservation")
    g.add_argument("--mail-type", help="mail on these events, as sbatch --mail-type (END,FAIL)")
    g.add_argument("--mail-user", help="who gets that mail, as sbatch --mail-user")
    g.add_argument("--comment", help="a comment on the jobs, as sbatch --comment")


def _add_allow_changed(s) -> None:
    s.add_argument(
        "--allow-changed",
        action="store_true",
        help="prompts of the job's run whose messages or tools changed in their files (same id) "
        "are generated again, their new records replacing the old (without it they are named and "
        "refused)",
    )


def _add_slurm_commands(sub) -> None:
    s = sub.add_parser(
        "submit",
        help="validate, plan and submit a job to Slurm (sbatch-style)",
        description="Validates the spec, every prompt line, the tokenizer and chat template here, "
        "plans the run directory, then submits a job array (as many tasks as may run at once, "
        "each starting its engine once and claiming the shards one after another) and a merge + "
        "audit job after it.",
    )
    s.add_argument("job", help="job spec (TOML)")
    _add_resource_flags(s)
    s.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan and sbatch parameters, submit nothing",
    )
    s.add_argument(
        "--new-run",
        action="store_true",
        help="when output_dir holds another job's run, a new run directory beside it (as `run "
        "--new-run`)",
    )
    _add_allow_changed(s)
    s.set_defaults(func=cmd_submit)

    s = sub.add_parser(
        "resubmit",
        help="resubmit only the shards not finished (without a done manifest, or with "
        "failures that may pass), and a new merge job",
    )
    s.add_argument("run", help=RUN_HELP_ARG)
    _add_resource_flags(s)
    s.set_defaults(func=cmd_resubmit)

    s = sub.add_parser("cancel", help="cancel the run's array and merge jobs")
    s.add_argument("run", help=RUN_HELP_ARG)
    s.set_defaults(func=cmd_cancel)


def _add_status_commands(sub) -> None:
    from toolkit.cluster.status import SUMMARY_OVER, UNKNOWN_LIMIT_S

    s = sub.add_parser(
        "status",
        help="one row per shard: Slurm state, prompts done, tokens, tok/s, ETA; exit 0 only "
        "when complete and healthy",
        description=STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    s.set_defaults(func=cmd_status)

    s = sub.add_parser("logs", help="a shard's worker log (or its SGLang server log), -f to follow")
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
    s.set_defaults(func=cmd_logs)


def _add_merge_commands(sub) -> None:
    """The `merge`, `audit` and `export` subcommands."""
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "merge",
        help="merge a run's shard files into one dataset (in planned order, exactly once) and "
        "audit it",
        formatter_class=fmt,
        description="Stream every shard file of RUN into RUN/merged/records.zst in planned prompt "
        "order, keeping each\nrecord exactly once, with RUN/merged/manifest.json (counts, "
        "checksums, problems). Then audit it\n(RUN/merged/audit.json, audit.html) unless "
        "--no-audit.\n\nexit codes: 0 merged and audit passed, 1 audit failed or records "
        "missing/damaged, 2 cannot merge",
    )
    s.add_argument("run", help=RUN_HELP_ARG)
    s.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="merge even if some shards are unfinished; missing ids go to merged/missing_ids.txt",
    )
    s.add_argument("--no-audit", action="store_true", help="only merge")
    s.set_defaults(func=cmd_merge)

    s = sub.add_parser(
        "audit",
        help="check a merged run: coverage, reasoning capture, truncation, consistency; write "
        "reports",
        formatter_class=fmt,
        description="Audit RUN/merged/records.zst: every planned id present once, reasoning split "
        "on the think-end id,\ntruncation, stop tokens, token counts, prompts re-rendered from "
        "the source. Thresholds come from the\njob's [audit] table. Writes RUN/merged/audit.json, "
        "audit.html and failed_ids.txt (missing_ids.txt is the merge's).\n\nexit codes: 0 passed, "
        "1 a check failed, 2 no merged dataset or unreadable run",
    )
    s.add_argument("run", help=RUN_HELP_ARG + ", merged with `toolkit merge`")
    s.set_defaults(func=cmd_audit)

    s = sub.add_parser(
        "export",
        help="write a merged run as jsonl, parquet, tokens (input_ids + loss_mask) or "
        "conversations",
        formatter_class=fmt,
        description="Export RUN/merged/records.zst (ok records only unless --include-failed):\n  "
        "jsonl          one object per record: id, dataset, sample, turn, segments, status, "
        "error, prompt_ids,\n                 output_ids, reasoning_end, reasoning, content, "
        "finish_reason, matched_stop (token id),\n                 matched_stop_str (stop "
        "string), prompt_tokens, completion_tokens\n  parquet        the same columns and types "
        '(needs pyarrow)\n  tokens         the default: {"id", "dataset", "sample", '
        '"turn", "segments", "input_ids": prompt +\n                 output, '
        "\"loss_mask\"}, the model's exact ids, which SpecForge's and speculators' "
        "loaders\n                 take as they are; the mask: 1 on every output id, and for "
        "SpecForge also on a\n                 think-start the template wrote after its assistant "
        "header (--trainer, --think-start);\n                 outputs cut by max_new_tokens kept "
        "as the model wrote them (--exclude truncated)\n  conversations  SpecForge's chat JSONL "
        "(id, status, conversations, tools; dataset, sample, turn,\n                 "
        "segments): the source messages, then the assistant turn with `content` "
        "and\n                 "
        "`reasoning_content`; SpecForge tokenizes them again: the export measures per "
        "row\n                 whether that gives the model's ids, and writes the SpecForge "
        "registration of the template\n\ntokens and conversations leave out records that are not "
        "training data (a repetition loop, no think-end,\nan empty part, a think marker inside a "
        "part, reasoning where none is expected, a NaN stop;\nin conversations also truncated: "
        "the chat template would close the cut turn); --include REASON\nkeeps them, --exclude "
        "REASON leaves out what a format keeps. Every selected record is\naccounted for: "
        "printed, and beside the output in NAME_skipped.jsonl (each record left out,\nwith its "
        "reason) and NAME_summary.json (exported + skipped + failed + missing + filtered ==\n"
        "planned; NAME: the output's name without .jsonl, records.parquet's records_parquet). The "
        "rows are measured\n(tokens per row: p50, p99, max); tokens also writes the trainer's "
        "config with the length that\nkeeps every row whole (NAME_specforge.yaml, "
        "NAME_prepare_data.sh); --max-length N leaves longer rows out.\n\nAn "
        "ok record that fails the audit's checks of one record (token counts, max_new_tokens, "
        "vocabulary,\nfinish, reasoning split) refuses the export (exit 1, nothing written) "
        "unless --force.",
    )
    s.add_argument("run", help=RUN_HELP_ARG + ", merged with `toolkit merge`")
    s.add_argument(
        "--format",
        choices=["jsonl", "parquet", "tokens", "conversations"],
        help="tokens (the default, recommended for training): input_ids + loss_mask, the model's "
        "exact ids; jsonl or parquet: one row per record; conversations: chat rows with "
        "reasoning_content (SpecForge renders and tokenizes them again: the export says how many "
        "rows keep the exact ids). Without it, the output's extension says it: .parquet writes "
        "parquet, .jsonl or .json tokens; a --format the extension does not hold is refused",
    )
    s.add_argument(
        "--trainer",
        choices=["specforge", "speculators"],
        default="specforge",
        help="tokens: the trainer whose loss-mask rule to follow (default specforge; speculators "
        "leaves the template's think-start unsupervised) and the default file name",
    )
    s.add_argument(
        "--think-start",
        choices=["supervised", "unsupervised"],
        help="tokens: whether a think-start the chat template wrote at the end of the prompt is "
        "in the loss mask (default: the trainer's rule)",
    )
    s.add_argument(
        "-o",
        "--output",
        help="output file, or a folder (existing, or ending with /) to write the default "
        "name into (default: RUN/export/tokens.jsonl, tokens_speculators.jsonl, records.jsonl, "
        "records.parquet or conversations.jsonl)",
    )
    s.add_argument("--include-failed", action="store_true", help="also export failed records")
    s.add_argument(
        "--include-truncated",
        action="store_true",
        help="keep outputs cut by max_new_tokens in conversations too (--include truncated; "
        "tokens keeps them unless --exclude truncated)",
    )
    s.add_argument(
        "--include",
        action="append",
        metavar="REASON",
        help="keep records left out for REASON (repeatable; `all` keeps every ok record): nan, "
        "degenerate, truncated, no_think_end, empty_reasoning, empty_content, think_marker, "
        "reasoning, other_turn, text_think_marker, unreadable_tool_call, empty_answer, "
        "tool_call_only",
    )
    s.add_argument(
        "--exclude",
        action="append",
        metavar="REASON",
        help="leave out records of REASON that the format keeps (repeatable; `all`): "
        "`--exclude truncated` leaves the outputs cut by max_new_tokens out of tokens; in jsonl "
        "and parquet any reason",
    )
    s.add_argument(
        "--max-length",
        type=int,
        metavar="N",
        help="leave out rows of more than N ids (prompt + output), each with the reason "
        "longer_than_max_length, instead of letting the trainer cut them; the trainer's config "
        "written beside a tokens export then says N",
    )
    s.add_argument(
        "--check-sample",
        type=int,
        metavar="N",
        help="conversations: check the round trip of about N rows, one every planned/N, "
        "instead of every row (for very large exports; the summary says how many were checked "
        "and how many give the model's ids)",
    )
    s.add_argument(
        "--dataset", action="append", metavar="NAME", help="only this dataset (repeatable)"
    )
    s.add_argument(
        "--finish",
        action="append",
        choices=["stop", "length", "loop"],
        help="only ok outputs with this "
        "finish reason (repeatable; loop: stopped in a repetition loop by [client] loop_stop)",
    )
    s.add_argument(
        "--mode",
        choices=["reasoning", "non-reasoning"],
        help="only ok outputs in this reasoning mode "
        "(reasoning: the prompt or the model opened it, or the output holds the think-end id)",
    )
    s.add_argument(
        "--sample",
        action="append",
        type=int,
        metavar="K",
        help="only sample K of each prompt (repeatable)",
    )
    s.add_argument(
        "--turn",
        action="append",
        type=int,
        metavar="K",
        help="only turn K (from 0) of regenerated "
        "conversations (repeatable); a conversations row then ends at that turn",
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="export ok records that fail the audit's record checks (counts, max_new_tokens, "
        "vocabulary, finish, reasoning split) too, with a warning; without it such records refuse "
        "the export",
    )
    s.set_defaults(func=cmd_export)


def _add_retry_command(sub) -> None:
    from toolkit.cluster import retry

    s = sub.add_parser(
        "retry",
        help="generate failed records again in the same run (default: failures that may pass), "
        "then merge",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=retry.__doc__.split("\n", 2)[2],
    )
    s.add_argument("run", help=RUN_HELP_ARG)
    s.add_argument(
        "--ids",
        metavar="FILE",
        help="retry exactly these ids (one per line, e.g. merged/failed_ids.txt), "
        "permanent failures and ok records included",
    )
    s.add_argument(
        "--slurm",
        action="store_true",
        help="submit the shards as a Slurm array (like `toolkit resubmit`)",
    )
    _add_resource_flags(s)
    s.set_defaults(func=cmd_retry)


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
RUN_HELP_ARG = "run directory, or the job file (its newest run in output_dir)"


def _run_arg(arg: str) -> str:
    """A run directory as given, or the newest run of a job file (said on stderr, so scripts can
    tell)."""
    from toolkit.formats.files import shown_path
    from toolkit.job.plan import run_of_job

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


if __name__ == "__main__":
    sys.exit(main())
