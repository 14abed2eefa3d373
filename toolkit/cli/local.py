"""`run`, `worker`, `check` and `retry`: the commands that run a job's steps here, without Slurm
(pipeline, worker), and the check of a job before anything runs. Each command's flags stand
beside what it does."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from toolkit.cli.shared import RUN_HELP_ARG, add_allow_changed, add_command, at_least
from toolkit.cli.slurm import add_resource_flags, resources_of, resubmit_shards
from toolkit.errors import EXIT_FAILED, EXIT_OK, BadInputError, stopped_code
from toolkit.formats.files import shown_path
from toolkit.formats.text import ranges

log = logging.getLogger("toolkit.cli")


def add_check(sub) -> None:
    s = add_command(
        sub,
        "check",
        cmd_check,
        help="validate a job: spec, every prompt line, tokenizer, every prompt rendered with the "
        "chat template, reasoning mode, lengths against the context length, run directory",
    )
    s.add_argument(
        "job",
        help="job spec (TOML) to check, e.g. jobs/demo.toml; it writes only what it learned "
        "(check.msgpack in output_dir), so that `submit` renders nothing again",
    )


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
        f"{args.job}: ok — {plan.counted()} in {len(plan.datasets)} "
        f"dataset{'s' * (len(plan.datasets) != 1)}{said}, "
        f"{len(plan.shards)} shard{'s' * (len(plan.shards) != 1)}, fingerprint {plan.fingerprint}"
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
    from toolkit.cluster.resources import time_to_minutes
    from toolkit.formats.rundir import RunDir
    from toolkit.job import cost

    spec, plan = pf.spec, pf.plan
    warn, lines = cost.said(
        plan,
        RunDir(spec.output_dir),
        engines=spec.slurm.array_parallelism or len(plan.shards),
        time_minutes=time_to_minutes(spec.slurm.time),
        signal_delay_s=spec.slurm.signal_delay_s,
    )
    return lines + ([f"warning: {warn}"] if warn else [])


def add_worker(sub) -> None:
    s = add_command(
        sub,
        "worker",
        cmd_worker,
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


def cmd_worker(args) -> int:
    from toolkit.formats.run import Run
    from toolkit.job.schema import JobSpec

    at_least("--workers", args.workers, 1, "workers that share the shards")
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


def _running_here(run: str, shards, command: str, **kw):
    """`formats.progress.local_run`: `status` knows this process runs `shards` (the run's Slurm
    tasks are not this command: they run worker.claims through cluster.tasks, and Slurm tells their
    state), also inside an allocation (salloc)."""
    from toolkit.formats.progress import local_run
    from toolkit.formats.rundir import RunDir

    return local_run(RunDir(run), shards, command, **kw)


def _shards_of(flag: str, shards, plan) -> None:
    """Refuse (bad input) shard indices that are not the run's (`plan`'s), before any is run."""
    n = len(plan.shards)
    for k in shards or []:
        if not 0 <= k < n:
            raise BadInputError(
                f"{flag} {k}: no such shard; the run has {n} shard{'s' * (n != 1)}, 0..{n - 1}"
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


def add_run(sub) -> None:
    s = add_command(
        sub,
        "run",
        cmd_run,
        help="run every shard of a job here (no Slurm), then merge and audit",
        description=RUN_HELP,
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
    add_allow_changed(s)
    s.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="workers at once, each with its own engine of tp_size x dp_size GPUs (default: as "
        "many as the GPUs in CUDA_VISIBLE_DEVICES, or the machine's, hold; 1 without GPUs)",
    )


def cmd_run(args) -> int:
    from toolkit.job.prepare import prepare_run
    from toolkit.pipeline import local_group, run_shards, workers_here

    at_least("--parallel", args.parallel, 1, "workers at once, each with its own engine")
    at_least("--shards", args.shards, 0, "shard indices count from 0")

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
    left = _unfinished(rd, plan, range(len(plan.shards)))
    if not set(shards) & set(left):
        return _nothing_to_generate(rd, plan, args, left)
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
    from toolkit.formats.run import Run
    from toolkit.formats.shardstate import CHEAP

    run = Run(rd, plan)
    return [k for k in shards if not run.shard_state(k, CHEAP).finished]


def _of_run(shards: list[int], plan) -> str:
    return f"{len(shards)} of the run's {len(plan.shards)} shards ({ranges(shards, sep=',')})"


def _nothing_to_generate(rd, plan, args, others: list[int]) -> int:
    """`run` of shards that are all done (`others`: the run's shards that are not): said in those
    words; the run is merged and audited only when it is complete and its merged dataset is not the
    run as it is."""
    from toolkit.cluster.status import run_status
    from toolkit.cluster.verdicts import verdict

    which = "every shard" if args.shards is None else f"shards {ranges(args.shards, sep=',')}"
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


def add_retry(sub) -> None:
    from toolkit.cluster import retry

    s = add_command(
        sub,
        "retry",
        cmd_retry,
        help="generate failed records again in the same run (default: failures that may pass), "
        "then merge",
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
    add_resource_flags(s)


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
    print(
        f"retrying in {len(shards)} shard{'s' * (len(shards) != 1)}: {', '.join(map(str, shards))}"
    )
    if args.slurm:
        return resubmit_shards(args.run, resources_of(args))
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
