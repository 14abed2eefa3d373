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


class DamagedJobs(BadInputError):
    """jobs.json is not what the toolkit wrote: which Slurm jobs belong to the run is unknown."""


def read_jobs(rd: RunDir) -> Jobs:
    try:
        return msgspec.json.decode(rd.jobs_file.read_bytes(), type=Jobs)
    except FileNotFoundError:
        return Jobs()
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise DamagedJobs(
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
    from toolkit.cluster.verdicts import parse_squeue

    # the rows status reads too
    out = resources.slurm_output(["squeue", "-h", "-r", "-j", ",".join(ids), "-o", "%i|%T|%N|%r"])
    return {jid: job.state for jid, job in parse_squeue(out.splitlines()).items()}
