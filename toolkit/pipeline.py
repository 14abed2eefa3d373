"""The end of every run: merge the shards, audit the merged records in the same pass, write the reports.

One place above `merge`, `audit` and `report` that `run`, `retry`, the final Slurm job and the `merge` and
`audit` commands share.
"""

from __future__ import annotations

import os
import sys

from . import audit, report
from .merge import MergeError, finished_shards, merge_run
from .plan import load_run

__all__ = ["audit_and_report", "merge_and_audit", "run_shards"]


def run_shards(run_dir: str | os.PathLike, shards, log) -> tuple[bool, list[int]]:
    """Run `shards` of a run here, one after the other: (stopped by a signal, shards that failed)."""
    from .worker import STOPPED, ShardFailed, run_shard

    failed = []
    for k in shards:
        log.info("shard %d", k)
        try:
            if run_shard(run_dir, k) == STOPPED:
                return True, failed
        except ShardFailed as e:
            log.error("shard %d failed: %s", k, e)
            failed.append(k)
    return False, failed


def merge_and_audit(run_dir: str | os.PathLike, *, allow_incomplete: bool = False, out=None) -> int:
    """The final job of a run: merge, audit in the same pass, write the reports, print the summary.

    Returns 0 when the run merged completely and the audit passed, 1 otherwise, 2 when it cannot merge (e.g.
    unfinished shards without `allow_incomplete`; the message says what to do).
    """
    out = out or sys.stdout
    rd, plan = load_run(run_dir)
    try:
        finished_shards(rd, plan, allow_incomplete=allow_incomplete)  # refuse before loading the tokenizer
        auditor = audit.Auditor(rd, plan)
        manifest = merge_run(rd.root, allow_incomplete=allow_incomplete, on_record=auditor.add)
    except MergeError as e:
        print(f"toolkit: error: {e}", file=sys.stderr)
        return 2
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
