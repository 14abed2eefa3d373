"""Putting a run on the cluster: `submit` (a submitit array of as many tasks as may run at once,
each claiming the run's unfinished shards one after another with one engine, and a merge-and-audit
job with an `afterany` dependency on it), its dry run, `resubmit` and `cancel`, and what they print.

The run is validated and planned first (spec, every prompt line, tokenizer and template; sglang is
never imported here). What was submitted is appended to `RUN/slurm/jobs.json` (cluster.jobs). Time
limits and preemption: tasks get `--signal=USR2@<signal_delay_s>` and `--requeue`; the task objects
(cluster.tasks) stop, write what they have and hand over to submitit's checkpointing, which requeues
them; a requeued task claims again, and its shard is resumed by whichever task is free first.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import msgspec

from toolkit.cluster import resources  # Slurm is asked through the module: tests replace its calls
from toolkit.cluster.jobs import (
    ArrayJob,
    Submission,
    append_submission,
    job_ids,
    live_jobs,
    read_jobs,
)
from toolkit.cluster.resources import (
    PartitionInfo,
    Resources,
    SlurmError,
    SubmitRefused,
    check_resources,
    merge_params,
    refuse,
    shard_params,
    validate_on_cluster,
    validate_resources,
)
from toolkit.cluster.tasks import ClaimTask, MergeTask
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardstate import REPAIRED, ShardState
from toolkit.formats.text import ranges, utc_now
from toolkit.job.spec import JobSpec

log = logging.getLogger(__name__)


def _executor(rd: RunDir, params: dict[str, Any], *, script_only: bool = False):
    """submitit's executor for the run; `script_only`: one that only renders scripts (no Slurm
    needed)."""
    import submitit

    cls = submitit.SlurmExecutor
    if script_only:

        class _ScriptOnly(cls):  # submitit refuses to build an executor where `srun` is missing
            @classmethod
            def affinity(cls) -> int:
                return 1

        cls = _ScriptOnly
    ex = cls(folder=str(rd.job_folder()), max_num_timeout=20)
    ex.update_parameters(**params)
    return ex


def sbatch_script(rd: RunDir, params: dict[str, Any], *, array: int | None = None) -> str:
    """The sbatch script submitit writes for these parameters (an array of `array` tasks, or one
    job), rendered by submitit itself (as `map_array` and `submit` do), so what a dry run shows is
    what is submitted."""
    ex = _executor(rd, params, script_only=True)
    if array is not None:
        ex.parameters["map_count"] = array
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def _submit_arrays(rd: RunDir, plan: RunPlan, shards: list[int], o: Resources) -> Submission:
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    try:
        return _submit_arrays_unguarded(rd, plan, shards, o)
    # sbatch itself refused (submitit's error holds its output)
    except (FailedJobError, FailedSubmissionError) as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        said = next(
            (x for x in reversed(lines) if "error" in x.lower()),
            lines[-1] if lines else "no message",
        )
        raise SlurmError(
            f"sbatch failed: {said}; check `squeue --me` for jobs this command may already have "
            "submitted"
        ) from None


def workers_for(params: dict[str, Any], shards: list[int], max_array_size: int) -> int:
    """Array tasks for a pool of `shards`: as many as may run at once (`array_parallelism`), no more
    than there are shards, within the cluster's MaxArraySize."""
    return max(1, min(int(params.get("array_parallelism") or 1), len(shards), max_array_size))


def _submit_arrays_unguarded(
    rd: RunDir, plan: RunPlan, shards: list[int], o: Resources
) -> Submission:
    params = shard_params(plan, o)
    n = workers_for(params, shards, resources.max_array_size())
    ex = _executor(rd, params)
    jobs = ex.map_array(ClaimTask(str(rd.root), shards, n), list(range(n)))
    arrays = [
        ArrayJob(jobs[0].job_id.split("_")[0], shards, [str(j.job_id) for j in jobs], claims=True)
    ]
    dep = "afterany:" + ":".join(a.job_id for a in arrays)
    mex = _executor(rd, merge_params(plan, o, dep))
    merge_job = mex.submit(MergeTask(str(rd.root)))
    sub = Submission(
        submitted=utc_now(),
        arrays=arrays,
        merge_job_id=str(merge_job.job_id),
        sbatch={k: v for k, v in params.items() if k != "setup"},
    )
    append_submission(rd, sub)
    return sub


DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's default MaxArraySize, assumed when no cluster answers


DEPENDENCY_PLACEHOLDER = "ARRAY_JOB_ID"


PROBE_TIMEOUT_S = 20  # a dry run waits this long for a cluster to answer


class ClusterCheck(msgspec.Struct):
    reachable: bool
    why: str = ""  # why not reachable
    partition: PartitionInfo | None = None  # as validated
    max_array_size: int = DEFAULT_MAX_ARRAY_SIZE


class DryRun(msgspec.Struct):
    run_dir: str
    prompts: int
    datasets: int
    shards: int
    fingerprint: str
    cluster: ClusterCheck
    arrays: list[list[int]]  # the pool of shards each array's tasks claim
    array_scripts: list[str]  # the sbatch script of each array, as submitit writes it
    merge_script: str
    tasks: list[int] = []  # the tasks of each array (the run's parallelism)
    # `prompts` in words: `60 outputs (30 prompts × 2 samples)` with samples
    counted: str = ""
    cost: list[str] = []  # job.cost's estimate, in lines; a warning on the time limit first


def check_cluster(plan: RunPlan, options: Resources) -> tuple[Resources, ClusterCheck]:
    """Validate against the cluster when one answers (a bad partition or size still raises
    SlurmError)."""
    try:  # (a SLURM_CONF that does not exist is said at once: cluster.commands.call)
        config = resources.slurm_config(timeout=PROBE_TIMEOUT_S)
    except SlurmError as e:
        return options, ClusterCheck(reachable=False, why=str(e).splitlines()[0])
    o, part = validate_on_cluster(plan, options)
    return o, ClusterCheck(
        reachable=True, partition=part, max_array_size=resources.max_array_size(config)
    )


def plan_dry_run(plan: RunPlan, options: Resources, rd: RunDir | None = None) -> DryRun:
    """What `submit` would send, without submitting or writing anything: submitit's scripts for each
    array and for the merge job (its dependency on the arrays shown as ARRAY_JOB_ID, known only once
    they are submitted), for the shards submit would send (those without a done manifest of run
    directory `rd`). An array of one task is a plain job, as submitit sends it."""
    rd = rd or RunDir(plan.spec.output_dir)
    check_resources(plan, options)
    o, cluster = check_cluster(plan, options)
    pool = _pending(rd, plan)
    params = shard_params(plan, o)
    arrays = [pool] if pool else []
    tasks = [workers_for(params, a, cluster.max_array_size) for a in arrays]
    scripts = [sbatch_script(rd, params, array=n if n > 1 else None) for n in tasks]
    merge = sbatch_script(rd, merge_params(plan, o, "afterany:" + DEPENDENCY_PLACEHOLDER))
    cost = _cost_lines(plan, rd, params, sum(tasks) or params["array_parallelism"])
    return DryRun(
        run_dir=rd.shown,
        prompts=plan.total,
        datasets=len(plan.datasets),
        shards=len(plan.shards),
        fingerprint=plan.fingerprint,
        cluster=cluster,
        arrays=arrays,
        array_scripts=scripts,
        merge_script=merge,
        tasks=tasks,
        counted=plan.counted(),
        cost=cost,
    )


def _cost_lines(plan: RunPlan, rd: RunDir, params: dict[str, Any], engines: int) -> list[str]:
    """job.cost's estimate for the tasks `params` describes, with a warning first when their time
    limit cannot hold a model load and one shard."""
    from toolkit.job import cost

    warn, lines = cost.said(
        plan,
        rd,
        engines=engines,
        time_minutes=params["time"],
        signal_delay_s=params["signal_delay_s"],
    )
    return ([f"warning: {warn}"] if warn else []) + lines


def format_dry_run(d: DryRun) -> str:
    c = d.cluster
    lines = [
        f"dry run: {d.counted or f'{d.prompts} prompts'} in {d.datasets} "
        f"dataset{'s' * (d.datasets != 1)} -> {d.shards} shard{'s' * (d.shards != 1)}, "
        f"fingerprint {d.fingerprint}",
        f"run directory would be: {d.run_dir}",
    ]
    if c.reachable and c.partition:
        p = c.partition
        lines.append(
            f"validated against the cluster: partition {p.name} (nodes with up to "
            f"{p.gpus_per_node} GPUs, {p.cpus_per_node or '?'} CPUs), MaxArraySize "
            f"{c.max_array_size}"
        )
    else:
        lines.append(
            f"Slurm not reachable: not validated against a cluster ({c.why}); MaxArraySize assumed "
            f"{c.max_array_size}"
        )
    lines.append(
        f"{len(d.arrays)} job array(s) (MaxArraySize {c.max_array_size}): "
        + "; ".join(
            f"{_tasks(n)} claiming shards {ranges(a, sep=',')}" for a, n in zip(d.arrays, d.tasks)
        )
    )
    lines += [note for a, n in zip(d.arrays, d.tasks) if (note := one_shard_each(n, len(a)))]
    lines += d.cost
    lines.append("nothing submitted. The scripts submitit will write and sbatch:")
    for i, (shards, script, n) in enumerate(zip(d.arrays, d.array_scripts, d.tasks)):
        runs = (
            "one job, sent as a plain job (not an array): it starts"
            if n == 1
            else f"{n} tasks at once: each task starts"
        )
        lines.append(
            f"\n==> array {i + 1} of {len(d.arrays)}: shards {ranges(shards, sep=',')} ({runs} its "
            "engine once and claims unfinished shards one after another until none is left) <=="
        )
        lines.append(script.rstrip("\n"))
    lines.append(
        f"\n==> merge + audit job, after the array(s); {DEPENDENCY_PLACEHOLDER} is the array's job "
        "id, known once it is submitted <=="
    )
    lines.append(d.merge_script.rstrip("\n"))
    return "\n".join(lines)


class SubmitResult(msgspec.Struct):
    """What `submit` did: the run, and its submission (None with dry_run: `dry_run` says what it
    would send)."""

    run_dir: str
    plan: RunPlan
    submission: Submission | None = None
    dry_run: DryRun | None = None


def submit(
    job: str,
    resources: Resources | None = None,
    *,
    dry_run: bool = False,
    new_run: bool = False,
    allow_changed: bool = False,
) -> SubmitResult:
    """Validate and plan `job` (the pre-flight `run` and `check` share), then submit its arrays and
    merge job, or with dry_run only render them (another run in output_dir is then a warning; a real
    submission is refused there)."""
    from toolkit.job.prepare import prepare_run

    o = resources or Resources()

    def validate(plan: RunPlan, rd: RunDir):
        _check_submittable(rd, plan)
        check_resources(plan, o)
        return plan_dry_run(plan, o, rd) if dry_run else validate_resources(plan, o)

    prep = prepare_run(
        job,
        new_run=new_run,
        dry_run=dry_run,
        validate=validate,
        as_submitted=True,
        allow_changed=allow_changed,
        keep_learned=False,
    )  # a dry run writes nothing
    if dry_run:
        return SubmitResult(str(prep.run_dir.root), prep.plan, dry_run=prep.validated)
    rd, plan, o = prep.run_dir, prep.plan, prep.validated
    pending = _pending(rd, plan)
    # the job's prompt files changed, but neither new nor changed prompts: nothing to generate
    if not pending:
        raise _all_done(rd)
    return SubmitResult(str(rd.root), plan, submission=_submit_arrays(rd, plan, pending, o))


def _pending(rd: RunDir, plan: RunPlan) -> list[int]:
    """The shards of a run no worker ended (no done manifest; all of them for a run not created
    yet)."""
    return [k for k in range(len(plan.shards)) if not Run(rd, plan).shard_state(k).ended]


def _check_submittable(rd: RunDir, plan: RunPlan) -> None:
    """`submit` (and its dry run) refuses a run already submitted, or with every shard done. A run
    whose job's prompt files changed (`plan` is the run's plan grown by them: job.grow) is submitted
    again for its new shards and those left, once no job of it is pending or running."""
    if not RunDir.is_run(rd.root):
        return
    pinned = Run.open(rd.root, JobSpec, finish=True).plan
    grows = plan.aliases != pinned.aliases
    if read_jobs(rd).submissions:
        if not grows:
            raise refuse(
                f"{rd.root} was already submitted; use `toolkit resubmit {rd.root}` for what is "
                "left"
            )
        live = live_jobs(rd)
        if live:
            shown = ", ".join(f"{j} {s.lower()}" for j, s in sorted(live.items())[:8])
            raise refuse(
                f"the job's prompt files gained prompts, but {len(live)} jobs of its run {rd.root} "
                f"are still pending or running ({shown}); wait for them or `toolkit cancel "
                f"{rd.root}`, then submit again"
            )
    if not grows and not _pending(rd, plan):
        raise _all_done(rd)


def _all_done(rd: RunDir) -> SubmitRefused:
    return refuse(
        f"every shard of {rd.root} is already done; `toolkit merge {rd.root}` if it is not merged "
        "yet"
    )


def resubmit(
    run_dir: str | os.PathLike, resources: Resources | None = None
) -> tuple[RunDir, Submission | None, list[int]]:
    """Submit one array over exactly the shards not finished (formats.shardstate: no done manifest,
    failures that may pass left, a retry asked, or a done manifest of another run or whose file
    changed since, which is removed), and a new merge job."""
    run = Run.open(run_dir, JobSpec, finish=True)
    rd, plan = run.rd, run.plan
    live = live_jobs(rd)
    if live:
        shown = ", ".join(f"{j} {s.lower()}" for j, s in sorted(live.items())[:8])
        raise SlurmError(
            f"{len(live)} jobs of this run are still pending or running ({shown}); wait for them "
            f"or `toolkit cancel {rd.root}` first"
        )
    # (a shard file changed since its done manifest: not finished)
    missing = [k for k in range(len(plan.shards)) if not run.shard_state(k, REPAIRED).finished]
    if not missing:
        return rd, None, []
    o = validate_resources(plan, resources or Resources())
    return rd, _submit_arrays(rd, plan, missing, o), missing


def why_unfinished(rd: RunDir, shards: list[int]) -> str:
    """Why each of `shards` is (re)submitted, grouped: `0-2 without a done manifest; 4 with ids
    `toolkit retry --ids` asked for; 5 with 3 failures that may pass` (a done manifest that counts
    transient failures: see formats.shardstate)."""
    missing, asked, transient = [], [], {}
    run = Run.open(rd.root, JobSpec)
    for k in shards:
        st = run.shard_state(k)
        if st.done is not None:
            transient[k] = st.done.transient
        else:
            (asked if st.state is ShardState.RETRY else missing).append(k)
    parts = [f"{ranges(missing, sep=',')} without a done manifest"] if missing else []
    if asked:
        parts.append(f"{ranges(asked, sep=',')} with ids `toolkit retry --ids` asked for")
    if transient:
        n = sum(transient.values())
        parts.append(
            f"{ranges(list(transient), sep=',')} with {n} failure{'s' if n != 1 else ''} that may "
            "pass"
        )
    return "; ".join(parts)


def cancel(run_dir: str | os.PathLike) -> list[str]:
    rd = Run.open(run_dir, JobSpec, finish=True).rd
    ids = job_ids(rd)
    if ids:
        resources.slurm_output(["scancel", *ids])
    return ids


JOBS_FILE = RunDir(".").jobs_file.as_posix()  # as a run directory holds it: slurm/jobs.json


def _tasks(n: int) -> str:
    return f"{n} task" + ("" if n == 1 else "s")


def describe_array(a: ArrayJob) -> str:
    """What an array's tasks run, in words: `Submitted batch job 7 (array of 2 tasks 7_[0-1]
    claiming shards 0-7: ...)`."""
    n, shards = len(a.tasks) or 1, ranges(a.shards, sep=",")
    claim = (
        "each starts its engine once and claims unfinished shards one after another until "
        "none is left"
    )
    if n == 1:  # submitit sends a single task as a plain job
        return (
            f"Submitted batch job {a.job_id} (1 task claiming shards {shards}: it starts its "
            "engine once and runs them one after another)"
        )
    return (
        f"Submitted batch job {a.job_id} (array of {n} tasks {a.job_id}_[0-{n - 1}] claiming "
        f"shards {shards}: {claim})"
    )


def one_shard_each(tasks: int, shards: int) -> str:
    """A note when an array has a task per shard: each task loads the model for a single shard."""
    if tasks < 2 or tasks < shards:
        return ""
    return (
        f"note: {tasks} tasks for {shards} shards: each loads the model for one shard. To load it "
        "once per node, set --array-parallelism (or [slurm] array_parallelism) to the nodes the "
        "run may hold at once"
    )


def format_submission(rd: RunDir, sub: Submission) -> str:
    """What `submit` and `resubmit` print: the jobs, like sbatch, then how to watch them."""
    lines = [describe_array(a) for a in sub.arrays]
    lines += [note for a in sub.arrays if (note := one_shard_each(len(a.tasks), len(a.shards)))]
    lines.append(
        f"Submitted batch job {sub.merge_job_id} (merge + audit, after "
        f"{', '.join(a.job_id for a in sub.arrays)})"
    )
    lines += [
        f"run directory: {rd.shown}",
        "watch it with:",
        f"  toolkit status {rd.shown} --watch",
        f"  toolkit logs {rd.shown} {sub.arrays[0].shards[0]} -f",
        f"  toolkit logs {rd.shown} --failed",
    ]
    return "\n".join(lines)
