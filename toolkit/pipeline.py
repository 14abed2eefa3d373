"""A job run here, shard after shard (`toolkit run`, `toolkit retry`): `run_shards`.

A shard another worker is generating (its file locked: a second `toolkit run` of the same job) is not run twice
nor called failed: it is waited for, taken over if that worker ends without finishing it, and the run is merged
once every shard is done (job.prepare starts a run, dataset.finish ends it).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque

from toolkit.formats.rundir import RunDir
from toolkit.job.check import require_engine_here
from toolkit.job.plan import load_run

__all__ = ["run_shards"]

BUSY_POLL_S = 2.0  # how often a shard being generated elsewhere is looked at


def run_shards(run_dir: str | os.PathLike, shards, log: logging.Logger) -> tuple[bool, list[int]]:
    """Run `shards` of a run here, one after the other: (stopped by a signal, shards that failed). A shard whose
    file another worker holds is waited for once the others are done, and run here if that worker ends without
    finishing it."""
    from toolkit.formats.locks import held_elsewhere
    from toolkit.formats.manifests import read_done
    from toolkit.worker.run import STOPPED, ShardBusy, ShardFailed, run_shard

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
    from toolkit.formats.progress import read_progress

    p = read_progress(rd.progress_file(k))
    who = f"pid {p.pid} on {p.host}, {p.state}" if p is not None and p.pid and p.host else "another worker"
    log.warning("shard %d is being generated elsewhere (%s; its file is locked): not run here; this run waits for "
                "it and merges once every shard is done", k, who)
    busy.append(k)
