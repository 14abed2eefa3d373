"""The callables Slurm runs, pickled by submitit: `ClaimTask` (one array task: starts its engine
once and claims shards of the run's pool one after another, worker.claims; requeued on a time limit
or preemption), `ShardTask` (one task, one shard: what runs submitted before claims ran) and
`MergeTask` (the run's final job: merge and audit)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys

from toolkit.formats.logline import text_formatter

log = logging.getLogger(__name__)


def _log_to_stderr() -> None:
    """Inside a Slurm task: the toolkit's log lines go to the task's output (submitit's log file)
    too."""
    logger = logging.getLogger("toolkit")
    if not any(getattr(h, "_toolkit_stderr", False) for h in logger.handlers):
        h = logging.StreamHandler()
        h.setFormatter(text_formatter())
        h._toolkit_stderr = True  # type: ignore[attr-defined]
        logger.addHandler(h)
        logger.setLevel(logging.INFO)


class ShardTask:
    """Runs one shard in an array task; on SIGUSR2 (time limit or preemption) stops cleanly and
    requeues."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self, shard: int) -> str:
        from toolkit.worker.run import run_shard

        _log_to_stderr()
        submitit_handler = signal.getsignal(signal.SIGUSR2)
        # raises ShardFailed: the task fails, Slurm shows FAILED
        result = run_shard(self.run_dir, shard)
        _requeue_if_stopped(result.stop_signal, submitit_handler)
        return result.end.value

    def checkpoint(self, shard: int):
        import submitit

        return submitit.helpers.DelayedSubmission(ShardTask(self.run_dir), shard)


def _requeue_if_stopped(stop_signal: str | None, submitit_handler) -> None:
    if stop_signal == "SIGUSR2" and callable(submitit_handler):
        # Let submitit do what it does on its signal: checkpoint (this same call) and requeue.
        signal.signal(signal.SIGUSR2, submitit_handler)
        submitit_handler(signal.SIGUSR2, None)


class ClaimTask:
    """Array task `worker` of `workers`: one engine, the shards of `pool` claimed one after another
    until none is left; on SIGUSR2 (time limit or preemption) stops cleanly and requeues (the
    requeued task claims again: its shard is free, and resumed by whichever task takes it). A shard
    that fails fails the task."""

    def __init__(self, run_dir: str, pool: list[int], workers: int):
        self.run_dir, self.pool, self.workers = run_dir, list(pool), workers

    def __call__(self, worker: int) -> str:
        from toolkit.worker.claims import run_claims, slurm_group, slurm_task

        _log_to_stderr()
        submitit_handler = signal.getsignal(signal.SIGUSR2)
        result = run_claims(
            self.run_dir,
            self.pool,
            worker=worker,
            workers=self.workers,
            task=slurm_task(),
            group=slurm_group(),
            keep_going=False,  # a failed shard raises ShardFailed: Slurm shows FAILED
            # the shards submitted are those without a done manifest, and failures that may pass
            verify=False,
        )
        _requeue_if_stopped(result.stopped, submitit_handler)
        return f"shards done: {result.done}; engine starts: {result.engine_starts}"

    def checkpoint(self, worker: int):
        import submitit

        return submitit.helpers.DelayedSubmission(
            ClaimTask(self.run_dir, self.pool, self.workers), worker
        )


class MergeTask:
    """The run's final job: `toolkit merge RUN` (merge every shard, then audit), run as the command
    line runs it, so that what goes wrong is said once, as the command says it, in the job's log;
    its exit code fails the job (Slurm shows FAILED) when the merge is refused or the audit
    fails."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir

    def __call__(self) -> int:
        code = subprocess.run(
            [sys.executable, "-m", "toolkit", "merge", self.run_dir], stdin=subprocess.DEVNULL
        ).returncode
        if code:
            print(
                f"merge job: `toolkit merge {self.run_dir}` exited {code} (the lines above say "
                f"why); once that is fixed, `toolkit merge {self.run_dir}` merges here, or "
                f"`toolkit resubmit {self.run_dir}` on Slurm",
                file=sys.stderr,
                flush=True,
            )
            # SystemExit is no Exception: submitit lets it pass without its traceback; the job exits
            # with the code
            raise SystemExit(code)
        return 0
