"""The steps every way of running a job shares: its start and its end.

`prepare_run` is the start that `run`, `check` and `submit` share: the pre-flight (spec, every prompt line,
tokenizer, every prompt rendered, reasoning, lengths), then the run directory pinned (not with `dry_run`).
`merge_and_audit` is the end that `run`, `retry`, the final Slurm job and the `merge` and `audit` commands
share: merge the shards, audit the merged records in the same pass, write the reports.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import audit, report
from .merge import finished_shards, merge_run
from .plan import RunPlan, create_run, load_run
from .preflight import Preflight, preflight
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
                check_tokenizer: bool = True, validate: Callable[[RunPlan], Any] | None = None,
                print_warnings: bool = True) -> PreparedRun:
    """The pre-flight of `job`, then `validate(plan)` (e.g. the resources against the cluster), then its run
    directory created (a new one with `new_run` when output_dir holds another run).

    With `dry_run` nothing is written, and another run in output_dir is a warning (creating the run refuses it).
    Raises the pre-flight's errors (ToolkitError, exit 2) and whatever `validate` raises."""
    pf = preflight(job, check_tokenizer=check_tokenizer, warn_other_run=dry_run)
    if print_warnings:
        pf.print_warnings()
    validated = validate(pf.plan) if validate is not None else None
    if dry_run:
        return PreparedRun(pf, RunDir(pf.spec.output_dir), created=False, validated=validated)
    return PreparedRun(pf, create_run(pf.plan, pf.refs, new_run=new_run), created=True, validated=validated)


def run_shards(run_dir: str | os.PathLike, shards, log) -> tuple[bool, list[int]]:
    """Run `shards` of a run here, one after the other: (stopped by a signal, shards that failed)."""
    from .worker import STOPPED, ShardFailed, run_shard

    failed = []
    for k in shards:
        log.info("shard %d", k)
        try:
            if run_shard(run_dir, k) == STOPPED:
                return True, failed
        except ShardFailed:  # the worker has logged why
            failed.append(k)
    return False, failed


def merge_and_audit(run_dir: str | os.PathLike, *, allow_incomplete: bool = False, out=None) -> int:
    """The final job of a run: merge, audit in the same pass, write the reports, print the summary.

    Returns 0 when the run merged completely and the audit passed, 1 otherwise. Raises MergeError when it
    cannot merge (e.g. unfinished shards without `allow_incomplete`; the message says what to do).
    """
    out = out or sys.stdout
    rd, plan = load_run(run_dir)
    finished_shards(rd, plan, allow_incomplete=allow_incomplete)  # refuse before loading the tokenizer
    auditor = audit.Auditor(rd, plan)
    manifest = merge_run(rd.root, allow_incomplete=allow_incomplete, on_record=auditor.add)
    result = auditor.finish(manifest)
    report.write_reports(rd, result)
    print(report.summary_table(result), file=out)
    return 0 if result.passed else 1


def audit_and_report(run_dir: str | os.PathLike, *, out=None) -> int:
    """Audit a merged run, write the reports, print the summary: 0 when the audit passed, 1 otherwise.

    Raises MergeError when the run has no readable merged dataset.
    """
    rd, _ = load_run(run_dir)
    result = audit.audit_run(rd.root)
    report.write_reports(rd, result)
    print(report.summary_table(result), file=out or sys.stdout)
    return 0 if result.passed else 1
