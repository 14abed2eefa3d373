"""What was submitted for a run: `RUN/slurm/jobs.json`, appended at every submission, read by
`status`, `logs`, `resubmit` and `cancel`."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from toolkit.cluster import resources  # Slurm is asked through the module: tests replace its calls
from toolkit.errors import BadInputError
from toolkit.formats.files import atomic_write
from toolkit.formats.rundir import RunDir

log = logging.getLogger(__name__)


class ArrayJob(msgspec.Struct):
    job_id: str
    # claims: the pool its tasks claim shards from; else array task i runs shards[i]
    shards: list[int]
    # Slurm id of each task: "123_4", or "123" when submitit sent a single job
    tasks: list[str] = []
    # its tasks claim shards one after another (worker.claims); False: one shard per task
    claims: bool = False


class Submission(msgspec.Struct):
    submitted: str
    arrays: list[ArrayJob]
    merge_job_id: str | None
    sbatch: dict[str, Any] = {}


class Jobs(msgspec.Struct):
    submissions: list[Submission] = []


def read_jobs(rd: RunDir) -> Jobs:
    try:
        return msgspec.json.decode(rd.jobs_file.read_bytes(), type=Jobs)
    except FileNotFoundError:
        return Jobs()
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        # not what the toolkit wrote: which Slurm jobs belong to the run is unknown
        raise BadInputError(
            f"{rd.jobs_file} is damaged ({e}): it is the record of which Slurm jobs this run "
            "submitted. Restore it (e.g. from a backup), or move it aside: the shard files and "
            "progress are unaffected, but the jobs it listed are then unknown to the toolkit "
            "(find them with `squeue --me`, `scancel` those still running)"
        ) from None


def append_submission(rd: RunDir, sub: Submission) -> None:
    jobs = read_jobs(rd)
    jobs.submissions.append(sub)
    atomic_write(rd.jobs_file, msgspec.json.format(msgspec.json.encode(jobs), indent=2))


def job_ids(rd: RunDir) -> list[str]:
    ids = []
    for s in read_jobs(rd).submissions:
        ids += [a.job_id for a in s.arrays]
        if s.merge_job_id:
            ids.append(s.merge_job_id)
    return ids


def live_jobs(rd: RunDir) -> dict[str, str]:
    """Array tasks and jobs of this run that are still pending or running, from squeue: {id:
    state}."""
    ids = job_ids(rd)
    if not ids:
        return {}
    from toolkit.cluster.slurmview import parse_squeue

    # the rows status reads too
    out = resources.slurm_output(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i|%T|%N|%r"])
    return {jid: job.state for jid, job in parse_squeue(out.splitlines()).items()}


class JobsIndex(msgspec.Struct):
    """jobs.json arranged for status (later submissions win): the task that runs each shard of an
    array of one shard per task, the array whose tasks claim each shard of a claiming array (its
    pool), and the merge job."""

    task_of: dict[int, str]  # {shard: Slurm task id}
    submitted_at: dict[str, str]  # {task or array job id: ISO time of its submission}
    merge_job: str | None = None
    merge_submitted: str = ""
    pool_of: dict[int, str] = {}  # {shard: array job id whose tasks claim it}
    pool_tasks: dict[str, list[str]] = {}  # {array job id: its task ids}

    @property
    def job_ids(self) -> list[str]:
        """The jobs to ask Slurm about: each array once, and the merge job."""
        return sorted(
            {t.split("_")[0] for t in self.task_of.values()}
            | set(self.pool_of.values())
            | ({self.merge_job} if self.merge_job else set())
        )


def index_jobs(submissions) -> JobsIndex:
    """`submissions`: slurm.Jobs.submissions, oldest first."""
    idx = JobsIndex(task_of={}, submitted_at={}, pool_of={}, pool_tasks={})
    for sub in submissions:
        for a in sub.arrays:
            if a.claims:
                idx.pool_tasks[a.job_id] = list(a.tasks) or [a.job_id]
                idx.submitted_at[a.job_id] = sub.submitted
                for k in a.shards:
                    idx.pool_of[k] = a.job_id
                    idx.task_of.pop(k, None)
                for t in idx.pool_tasks[a.job_id]:
                    idx.submitted_at[t] = sub.submitted
                continue
            for i, k in enumerate(a.shards):
                idx.task_of[k] = a.tasks[i] if a.tasks else f"{a.job_id}_{i}"
                idx.submitted_at[idx.task_of[k]] = sub.submitted
                idx.pool_of.pop(k, None)
        if sub.merge_job_id:
            idx.merge_job, idx.merge_submitted = sub.merge_job_id, sub.submitted
    return idx
