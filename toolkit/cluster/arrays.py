"""A run's job arrays as submitit sends them: its executor, the tasks an array gets, the shards
still to send, the sbatch script of an array, and what an array's tasks run, in words (for what
`submit` prints and for its dry run)."""

from __future__ import annotations

from typing import Any

from toolkit.cluster.jobs import ArrayJob
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.text import ranges


def executor(rd: RunDir, params: dict[str, Any], *, script_only: bool = False):
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
    ex = executor(rd, params, script_only=True)
    if array is not None:
        ex.parameters["map_count"] = array
    return ex._make_submission_file_text(ex._submitit_command_str, "dry-run")


def workers_for(params: dict[str, Any], shards: list[int], max_array_size: int) -> int:
    """Array tasks for a pool of `shards`: as many as may run at once (`array_parallelism`), no more
    than there are shards, within the cluster's MaxArraySize."""
    return max(1, min(int(params.get("array_parallelism") or 1), len(shards), max_array_size))


def pending_shards(rd: RunDir, plan: RunPlan) -> list[int]:
    """The shards of a run no worker ended (no done manifest; all of them for a run not created
    yet)."""
    run = Run(rd, plan)
    return [k for k in range(len(plan.shards)) if not run.shard_state(k).ended]


def tasks_in_words(n: int) -> str:
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
