"""`submit`, `resubmit` and `cancel`: a job's shards as a Slurm array and a merge job after it
(cluster.submit), with the resource flags that override the job's [slurm] table."""

from __future__ import annotations

from toolkit.cli.shared import RUN_HELP_ARG, add_allow_changed, add_command
from toolkit.errors import EXIT_OK


def add_submit(sub) -> None:
    s = add_command(
        sub,
        "submit",
        cmd_submit,
        help="validate, plan and submit a job to Slurm (sbatch-style)",
        description="Validates the spec, every prompt line, the tokenizer and chat template here, "
        "plans the run directory, then submits a job array (as many tasks as may run at once, "
        "each starting its engine once and claiming the shards one after another) and a merge + "
        "audit job after it.",
        wrap=True,
    )
    s.add_argument("job", help="job spec (TOML)")
    add_resource_flags(s)
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
    add_allow_changed(s)


def cmd_submit(args) -> int:
    from toolkit.cluster.dryrun import format_dry_run
    from toolkit.cluster.submit import format_submission, submit
    from toolkit.formats.rundir import RunDir

    r = submit(
        args.job,
        resources_of(args),
        dry_run=args.dry_run,
        new_run=args.new_run,
        allow_changed=args.allow_changed,
    )
    if r.submission is None:
        print(format_dry_run(r.dry_run))
    else:
        print(format_submission(RunDir(r.run_dir), r.submission))
    return EXIT_OK


def add_resource_flags(s) -> None:
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


def resources_of(args):
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


def add_resubmit(sub) -> None:
    s = add_command(
        sub,
        "resubmit",
        cmd_resubmit,
        help="resubmit only the shards not finished (without a done manifest, or with "
        "failures that may pass), and a new merge job",
    )
    s.add_argument("run", help=RUN_HELP_ARG)
    add_resource_flags(s)


def cmd_resubmit(args) -> int:
    return resubmit_shards(args.run, resources_of(args))


def resubmit_shards(run: str, resources) -> int:
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


def add_cancel(sub) -> None:
    s = add_command(sub, "cancel", cmd_cancel, help="cancel the run's array and merge jobs")
    s.add_argument("run", help=RUN_HELP_ARG)


def cmd_cancel(args) -> int:
    from toolkit.cluster.submit import cancel

    ids = cancel(args.run)
    print(f"cancelled {', '.join(ids)}" if ids else "nothing was submitted for this run")
    return EXIT_OK
