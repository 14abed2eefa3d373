"""Putting a run on the cluster: `submit` (a submitit array of as many tasks as may run at once,
each claiming the run's unfinished shards one after another with one engine, and a merge-and-audit
job with an `afterany` dependency on it), `resubmit` and `cancel`, and what they print; its dry
run is cluster.dryrun, the arrays themselves cluster.arrays.

The run is validated and planned first (spec, every prompt line, tokenizer and template; sglang is
never imported here). What was submitted is appended to `RUN/slurm/jobs.json` (cluster.jobs). Time
limits and preemption: tasks get `--signal=USR2@<signal_delay_s>` and `--requeue`; the task objects
(cluster.tasks) stop, write what they have and hand over to submitit's checkpointing, which requeues
them; a requeued task claims again, and its shard is resumed by whichever task is free first.
"""

from __future__ import annotations

import logging
import os

import msgspec

from toolkit.cluster import resources  # Slurm is asked through the module: tests replace its calls
from toolkit.cluster.arrays import (
    describe_array,
    executor,
    one_shard_each,
    pending_shards,
    workers_for,
)
from toolkit.cluster.dryrun import DryRun, plan_dry_run
from toolkit.cluster.jobs import (
    ArrayJob,
    Submission,
    append_submission,
    job_ids,
    live_jobs,
    read_jobs,
)
from toolkit.cluster.resources import (
    Resources,
    SlurmError,
    SubmitRefused,
    check_resources,
    merge_params,
    refuse,
    shard_params,
    validate_resources,
)
from toolkit.cluster.tasks import ClaimTask, MergeTask
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardstate import REPAIRED, ShardState
from toolkit.formats.text import ranges, utc_now
from toolkit.job.schema import JobSpec

log = logging.getLogger(__name__)


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


def _submit_arrays_unguarded(
    rd: RunDir, plan: RunPlan, shards: list[int], o: Resources
) -> Submission:
    params = shard_params(plan, o)
    n = workers_for(params, shards, resources.max_array_size())
    ex = executor(rd, params)
    jobs = ex.map_array(ClaimTask(str(rd.root), shards, n), list(range(n)))
    arrays = [
        ArrayJob(jobs[0].job_id.split("_")[0], shards, [str(j.job_id) for j in jobs], claims=True)
    ]
    dep = "afterany:" + ":".join(a.job_id for a in arrays)
    mex = executor(rd, merge_params(plan, o, dep))
    merge_job = mex.submit(MergeTask(str(rd.root)))
    sub = Submission(
        submitted=utc_now(),
        arrays=arrays,
        merge_job_id=str(merge_job.job_id),
        sbatch={k: v for k, v in params.items() if k != "setup"},
    )
    append_submission(rd, sub)
    return sub


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
    pending = pending_shards(rd, plan)
    # the job's prompt files changed, but neither new nor changed prompts: nothing to generate
    if not pending:
        raise _all_done(rd)
    return SubmitResult(str(rd.root), plan, submission=_submit_arrays(rd, plan, pending, o))


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
        live, shown = _live(rd)
        if live:
            raise refuse(
                f"the job's prompt files gained prompts, but {live} jobs of its run {rd.root} "
                f"are still pending or running ({shown}); wait for them or `toolkit cancel "
                f"{rd.root}`, then submit again"
            )
    if not grows and not pending_shards(rd, plan):
        raise _all_done(rd)


def _live(rd: RunDir) -> tuple[int, str]:
    """How many jobs of the run are still pending or running, and the first 8 of them with their
    state, for a refusal: (2, `7_0 running, 8 pending`)."""
    live = live_jobs(rd)
    return len(live), ", ".join(f"{j} {s.lower()}" for j, s in sorted(live.items())[:8])


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
    live, shown = _live(rd)
    if live:
        raise SlurmError(
            f"{live} jobs of this run are still pending or running ({shown}); wait for them "
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
