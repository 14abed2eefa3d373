"""The callables Slurm runs, pickled by submitit: `ShardTask` (one array task: a shard, resumed after a requeue)
and `MergeTask` (the run's final job: merge and audit)."""

from __future__ import annotations

import logging
import signal
import sys

from toolkit.errors import ToolkitError
from toolkit.formats.rundir import RunDir

log = logging.getLogger(__name__)


def _log_to_stderr() -> None:
    """Inside a Slurm task: the toolkit's log lines go to the task's output (submitit's log file) too."""
    logger = logging.getLogger("toolkit")
    if not any(getattr(h, "_toolkit_stderr", False) for h in logger.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        h._toolkit_stderr = True  # type: ignore[attr-defined]
        logger.addHandler(h)
        logger.setLevel(logging.INFO)


class ShardTask:
    """Runs one shard in an array task; on SIGUSR2 (time limit or preemption) stops cleanly and requeues."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self, shard: int) -> str:
        from toolkit.formats.progress import read_progress
        from toolkit.worker.run import STOPPED, run_shard

        _log_to_stderr()
        submitit_handler = signal.getsignal(signal.SIGUSR2)
        result = run_shard(self.run_dir, shard)  # raises ShardFailed: the task fails, Slurm shows FAILED
        if result == STOPPED:
            rd = RunDir(self.run_dir)
            p = read_progress(rd.progress_file(shard))
            if p is not None and p.stop_signal == "SIGUSR2" and callable(submitit_handler):
                # Let submitit do what it does on its signal: checkpoint (this same call) and requeue.
                signal.signal(signal.SIGUSR2, submitit_handler)
                submitit_handler(signal.SIGUSR2, None)
        return result

    def checkpoint(self, shard: int):
        import submitit

        return submitit.helpers.DelayedSubmission(ShardTask(self.run_dir), shard)


class MergeTask:
    """The run's final job: merge every shard and audit the result (fails the job when the audit fails)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> int:
        from toolkit.dataset.finish import merge_and_audit

        _log_to_stderr()
        try:
            code = merge_and_audit(self.run_dir)
        except ToolkitError as e:  # the job's own `toolkit: error:` line, which `logs --failed` shows as why
            sys.stderr.write(f"toolkit: error: {e}\n")
            raise RuntimeError(f"merge of {self.run_dir} refused (exit {e.exit_code})") from None
        if code != 0:
            rd = RunDir(self.run_dir)
            raise RuntimeError(f"merge/audit of {self.run_dir} failed (exit {code}); see "
                               f"{rd.audit_json.relative_to(rd.root).as_posix()}")
        return code
