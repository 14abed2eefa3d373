"""The steps every way of running a job shares: its start and its end.

`prepare_run` is the start that `run`, `check` and `submit` share: the pre-flight (spec, every prompt line,
tokenizer, every prompt rendered, reasoning, lengths), then the run directory pinned (not with `dry_run`).
`merge_and_audit` is the end that `run`, `retry`, the final Slurm job and the `merge` and `audit` commands
share: merge the shards, audit the merged records in the same pass, write the reports. `run_shards` runs shards
here, one after the other; a shard another worker is generating (its file locked: a second `toolkit run` of the
same job) is not run twice nor called failed: it is waited for, taken over if that worker ends without finishing
it, and the run is merged once every shard is done (two merges of one run wait for each other).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import audit, report
from .merge import finished_shards, io_error, merge_run
from .plan import PlanError, RunPlan, create_run, find_run, load_run
from .preflight import Preflight, preflight, require_engine_here
from .rundir import RunDir
from .spec import JobSpec

__all__ = ["PreparedRun", "audit_and_report", "merge_and_audit", "prepare_run", "run_shards"]


@dataclass(frozen=True)
class PreparedRun:
    """A job that passed the pre-flight, and its run directory (created unless prepared with `dry_run`)."""

    preflight: Preflight
    run_dir: RunDir
    created: bool          # False with dry_run: `run_dir` is where the run would be, nothing was written
    validated: Any = None  # what the caller's `validate` returned

    @property
    def plan(self) -> RunPlan:
        return self.preflight.plan

    @property
    def spec(self) -> JobSpec:
        return self.preflight.spec


def prepare_run(job: str | os.PathLike, *, new_run: bool = False, dry_run: bool = False,
                check_tokenizer: bool = True, validate: Callable[[RunPlan, RunDir], Any] | None = None,
                print_warnings: bool = True, as_submitted: bool = False, local: bool = False) -> PreparedRun:
    """The pre-flight of `job`, then `validate(plan, run_dir)` (e.g. the resources against the cluster; `run_dir`
    is where the run is or would go: plan.find_run), then its run directory created or resumed (the newest run of
    this job in output_dir; a new one beside it with `new_run` when output_dir holds another job's run). Every
    refusal comes before anything is written.

    With `dry_run` nothing is written, and another job's run in output_dir is a warning (creating the run refuses
    it), unless `as_submitted` (submit's dry run refuses what submit refuses). With `local` (the shards run here),
    an engine this Python cannot start is refused. Raises the pre-flight's errors
    (ToolkitError, exit 2) and whatever `validate` raises."""
    pf = preflight(job, check_tokenizer=check_tokenizer, warn_other_run=dry_run and not as_submitted)
    if local:  # run here: the engine must start here
        require_engine_here(pf.spec)
    if print_warnings:
        pf.print_warnings()
    try:
        root, _ = find_run(pf.plan, new_run=new_run)
    except PlanError:
        if not dry_run or as_submitted:
            raise
        root = Path(pf.spec.output_dir)  # `check`: the pre-flight has warned
    validated = validate(pf.plan, RunDir(root)) if validate is not None else None
    if dry_run:
        return PreparedRun(pf, RunDir(root), created=False, validated=validated)
    return PreparedRun(pf, create_run(pf.plan, pf.refs, new_run=new_run), created=True, validated=validated)


BUSY_POLL_S = 2.0  # how often a shard being generated elsewhere is looked at


def run_shards(run_dir: str | os.PathLike, shards, log: logging.Logger) -> tuple[bool, list[int]]:
    """Run `shards` of a run here, one after the other: (stopped by a signal, shards that failed). A shard whose
    file another worker holds is waited for once the others are done, and run here if that worker ends without
    finishing it."""
    from .shardfile import held_elsewhere, read_done
    from .worker import STOPPED, ShardBusy, ShardFailed, run_shard

    rd, plan = load_run(run_dir)
    require_engine_here(plan.spec)
    todo, busy, failed = deque(shards), [], []
    while todo or busy:
        if not todo:  # every other shard is done here: wait for those generated elsewhere
            time.sleep(BUSY_POLL_S)
            for k in [b for b in busy if not held_elsewhere(rd.shard_file(b))]:
                busy.remove(k)
                if read_done(rd.done_file(k)) is None:
                    log.info("shard %d: its other worker ended without finishing it; running it here", k)
                    todo.append(k)
                else:
                    log.info("shard %d was finished elsewhere", k)
            continue
        k = todo.popleft()
        if held_elsewhere(rd.shard_file(k)):
            _say_busy(rd, k, log, busy)
            continue
        log.info("shard %d", k)
        try:
            if run_shard(run_dir, k) == STOPPED:
                return True, failed
        except ShardBusy:  # taken the moment before this worker tried
            _say_busy(rd, k, log, busy)
        except ShardFailed:  # the worker has logged why
            failed.append(k)
    return False, failed


def _say_busy(rd: RunDir, k: int, log: logging.Logger, busy: list[int]) -> None:
    from .progress import read_progress

    p = read_progress(rd.progress_file(k))
    who = f"pid {p.pid} on {p.host}, {p.state}" if p is not None and p.pid and p.host else "another worker"
    log.warning("shard %d is being generated elsewhere (%s; its file is locked): not run here; this run waits for "
                "it and merges once every shard is done", k, who)
    busy.append(k)


def merge_and_audit(run_dir: str | os.PathLike, *, allow_incomplete: bool = False, out=None) -> int:
    """The final job of a run: merge, audit in the same pass, write the reports, print the summary.

    Returns 0 when the run merged completely and the audit passed, 1 otherwise. Raises MergeError when it
    cannot merge (e.g. unfinished shards without `allow_incomplete`; the message says what to do).
    """
    out = out or sys.stdout
    rd, plan = load_run(run_dir)
    finished_shards(rd, plan, allow_incomplete=allow_incomplete)  # refuse before loading the tokenizer
    with _merge_lock(rd):
        auditor = audit.Auditor(rd, plan)
        manifest = merge_run(rd.root, allow_incomplete=allow_incomplete, on_record=auditor.add)
        try:
            result = auditor.finish(manifest)
            report.write_reports(rd, result)
        except OSError as e:
            raise io_error(e, rd, "merge") from None
    print(report.summary_table(result), file=out)
    return 0 if result.passed else 1


class _merge_lock:
    """Held while a run is merged and audited: a second merge of the run (another `toolkit run` finishing at the
    same time) waits for the first, then merges again, instead of failing."""

    def __init__(self, rd: RunDir):
        self.path = rd.merge_lock

    def __enter__(self):
        self.fd: int | None = None
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.getLogger("toolkit.merge").info("another merge of this run is under way: waiting for it to end")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:
            pass  # no flock here, or a run directory not writable: merge_run says what it cannot do
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def audit_and_report(run_dir: str | os.PathLike, *, out=None) -> int:
    """Audit a merged run, write the reports, print the summary: 0 when the audit passed, 1 otherwise.

    Raises MergeError when the run has no readable merged dataset.
    """
    rd, _ = load_run(run_dir)
    try:
        result = audit.audit_run(rd.root)
        report.write_reports(rd, result)
    except OSError as e:
        raise io_error(e, rd, "audit") from None
    print(report.summary_table(result), file=out or sys.stdout)
    return 0 if result.passed else 1
