"""A run directory opened: `Run`, the one handle on a run: its paths (`rd`, formats.rundir), its
plan (run.json, formats.runplan), its prompt refs (prompts.msgpack, formats.prompts) and its shards'
states (formats.shardstate, always against the run's fingerprint).

`Run.open` opens a run read-only unless asked to finish a change a crash interrupted
(formats.pending): the commands that plan or run a run finish it (`Run.open(path, JobSpec,
finish=True)`); those that only read (status, logs, export, `toolkit.read_run`) write nothing and
read the run as the change makes it.
"""

from __future__ import annotations

import logging
import os
from typing import Generic, TypeVar

import msgspec

from toolkit.formats import pending
from toolkit.formats.files import atomic_write
from toolkit.formats.prompts import PromptIndex, ShardRefs
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import PlanError, RunPlan, damaged_run_file, plan_bytes
from toolkit.formats.shardstate import MANIFEST, Checks, ShardStatus, shard_state

log = logging.getLogger(__name__)

__all__ = ["Run"]

S = TypeVar("S")  # the job spec's type (job.spec.JobSpec)


class Run(Generic[S]):
    """A run directory opened: its paths (`rd`), its plan (run.json) and its prompt index."""

    def __init__(self, rd: RunDir, plan: RunPlan[S], prompts: bytes | None = None):
        self.rd, self.plan = rd, plan
        self._prompts = prompts  # prompts.msgpack as a pending change makes it (None: the file's)

    @classmethod
    def open(cls, run_dir: str | os.PathLike, spec: type[S], *, finish: bool = False) -> Run[S]:
        """Open the run in `run_dir`, whose job spec is of type `spec`. PlanError when it is no run
        directory or its run.json cannot be read.

        A change a crash interrupted (formats.pending) is finished first with `finish` (the commands
        that plan or run a run); without it nothing is written, and the run is read as the change
        makes it."""
        rd = RunDir(run_dir)
        if rd.root.is_file():
            hint = (
                (
                    f"; it looks like a job spec: `toolkit run {run_dir}` or `toolkit submit "
                    f"{run_dir}` plan and run it, and print the run directory to give here"
                )
                if rd.root.suffix == ".toml"
                else ""
            )
            raise PlanError(f"{run_dir}: is a file, not a run directory{hint}")
        change = _pending(rd, finish)
        data = change.plan if change is not None else None
        try:
            if data is None:
                data = rd.plan_file.read_bytes()
            plan = msgspec.json.decode(data, type=RunPlan[spec])
        except FileNotFoundError:
            raise PlanError(
                f"{rd.root}: not a run directory (no run.json); plan one with `toolkit submit` or "
                "`toolkit run`"
            ) from None
        # garbage, empty, truncated, not a plan, a folder
        except (msgspec.DecodeError, OSError) as e:
            raise damaged_run_file(rd.plan_file, e) from None
        return cls(rd, plan, change.prompts if change is not None else None)

    def prompts(self) -> PromptIndex:
        """The planned prompt refs by position (PlanError when prompts.msgpack does not hold the
        plan's)."""
        return PromptIndex(self.rd, self.plan, self._prompts)

    def shard_refs(self, k: int) -> ShardRefs:
        """The planned refs of shard `k` (PlanError when prompts.msgpack does not hold the
        plan's)."""
        return ShardRefs(self.rd, self.plan, k, self._prompts)

    def shard_state(
        self, k: int, checks: Checks = MANIFEST, *, group: str | None = None, recheck: bool = False
    ) -> ShardStatus:
        """The state of shard `k` (formats.shardstate) with `checks`: a done manifest of another run
        is never taken for this run's."""
        return shard_state(self.rd, k, self.plan.fingerprint, checks, group=group, recheck=recheck)

    def write_plan(self) -> None:
        """Write run.json from `plan` (atomically)."""
        atomic_write(self.rd.plan_file, plan_bytes(self.plan))


def _pending(rd: RunDir, finish: bool) -> pending.PendingChange | None:
    """The change a crash interrupted, when it is to be read rather than finished; finishes it with
    `finish`."""
    try:
        if finish:
            pending.finish(rd)
            return None
        change = pending.read(rd)
    except OSError as e:
        raise PlanError(
            f"{rd.root}: a change to the run was interrupted and cannot be finished here "
            f"({e.strerror or e}): run the command again as a user who can write the run directory"
        ) from None
    except msgspec.DecodeError as e:
        raise PlanError(
            f"{rd.pending_file} is damaged ({e}): a change to the run (its growth) was "
            "interrupted and cannot be finished; plan the job into a new run (`--new-run`)"
        ) from None
    if change is not None:
        log.warning(
            "run %s: a change to the run was interrupted (%s): read as it will be once finished, "
            "which the next command that runs or plans the run does",
            rd.shown,
            change.what,
        )
    return change
