"""The end that `run`, `retry`, the final Slurm job and the `merge` and `audit` commands share:
merge the shards, audit the merged records in the same pass, write the reports, print the summary.
Two merges of one run wait for each other (the run's merge lock)."""

from __future__ import annotations

import fcntl
import logging
import os
import sys

from toolkit.dataset import audit, report
from toolkit.dataset.audit_report import AuditReport
from toolkit.dataset.merge import finished_shards, io_error, merge_run
from toolkit.errors import FailedError
from toolkit.formats.files import shown_path
from toolkit.formats.locks import try_flock
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.job.schema import JobSpec

__all__ = ["AuditFailed", "audit_and_report", "merge_and_audit"]


class AuditFailed(FailedError):
    """The run was audited and the audit failed: the summary printed before says which checks, and
    why."""


def _passed(rd: RunDir, result: AuditReport) -> AuditReport:
    if not result.passed:
        failed = [c.name for c in result.checks if not c.passed]
        raise AuditFailed(
            f"the audit of run {result.run} failed ({', '.join(failed) or 'incomplete'}); what "
            f"each check found is above and in {shown_path(rd.audit_html)}"
        )
    return result


def merge_and_audit(
    run_dir: str | os.PathLike, *, allow_incomplete: bool = False, out=None
) -> AuditReport:
    """The final job of a run: merge, audit in the same pass, write the reports, print the summary.

    Returns the audit's report when it passed; raises AuditFailed when it did not, MergeError when
    the run cannot be merged (e.g. unfinished shards without `allow_incomplete`; the message says
    what to do).
    """
    out = out or sys.stdout
    run = Run.open(run_dir, JobSpec, finish=True)
    rd, plan = run.rd, run.plan
    # refuse before loading the tokenizer
    finished_shards(rd, plan, allow_incomplete=allow_incomplete)
    with _merge_lock(rd):
        auditor = audit.Auditor(rd, plan)
        manifest = merge_run(rd.root, allow_incomplete=allow_incomplete, on_record=auditor.add)
        try:
            result = auditor.finish(manifest)
            report.write_reports(rd, result)
        except OSError as e:
            raise io_error(e, rd, "merge") from None
    print(report.summary_table(result), file=out)
    return _passed(rd, result)


class _merge_lock:
    """Held while a run is merged and audited: a second merge of the run (another `toolkit run`
    finishing at the same time) waits for the first, then merges again, instead of failing."""

    def __init__(self, rd: RunDir):
        self.path = rd.merge_lock

    def __enter__(self):
        self.fd: int | None = None
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if try_flock(self.fd) is False:
                logging.getLogger("toolkit.dataset.merge").info(
                    "another merge of this run is under way: waiting for it to end"
                )
                fcntl.flock(self.fd, fcntl.LOCK_EX)
        # without flock here, the merge's temporary file is locked by its writer (merge._clear_stale
        # refuses a live one); a run directory not writable: merge_run says what it cannot do
        except OSError:
            pass
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)


def audit_and_report(run_dir: str | os.PathLike, *, out=None) -> AuditReport:
    """Audit a merged run, write the reports, print the summary; the report when the audit passed.

    Raises AuditFailed when it did not, MergeError when the run has no readable merged dataset.
    """
    rd = Run.open(run_dir, JobSpec, finish=True).rd
    try:
        result = audit.audit_run(rd.root)
        report.write_reports(rd, result)
    except OSError as e:
        raise io_error(e, rd, "audit") from None
    print(report.summary_table(result), file=out or sys.stdout)
    return _passed(rd, result)
