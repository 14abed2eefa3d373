"""`submit --dry-run`: what `submit` would send, without submitting or writing anything: the cluster
checked when one answers, submitit's script of each array and of the merge job, and job.cost's
estimate, and how they are printed."""

from __future__ import annotations

from typing import Any

import msgspec

from toolkit.cluster import resources  # Slurm is asked through the module: tests replace its calls
from toolkit.cluster.arrays import (
    one_shard_each,
    pending_shards,
    sbatch_script,
    tasks_in_words,
    workers_for,
)
from toolkit.cluster.resources import (
    PartitionInfo,
    Resources,
    SlurmError,
    check_resources,
    merge_params,
    shard_params,
    validate_on_cluster,
)
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.text import ranges

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
    pool = pending_shards(rd, plan)
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
            f"{tasks_in_words(n)} claiming shards {ranges(a, sep=',')}"
            for a, n in zip(d.arrays, d.tasks)
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
