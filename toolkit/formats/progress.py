"""Per-shard progress files: what a running shard has done, rewritten every few seconds for `status`."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import msgspec

from toolkit.formats.files import atomic_write

__all__ = ["Progress", "REFRESH_S", "STALE_S", "read_progress", "write_progress", "slurm_context", "stale_for",
           "worker_gone"]

REFRESH_S = 2.0   # a generating worker rewrites its progress file this often
STALE_S = 30.0    # a generating worker's progress file older than this (15 refreshes missed) is stale


class Progress(msgspec.Struct, kw_only=True):
    shard: int
    state: str = "starting"          # starting | loading | generating | done | stopped | failed
    total: int = 0                   # prompts the shard owns
    done: int = 0                    # records in the shard file (ok + failed)
    resumed: int = 0                 # records already in the file when this attempt started
    failed: int = 0
    output_tokens: int = 0           # recorded in the shard file: this attempt's and those resumed
    resumed_tokens: int = 0          # of those, already recorded when this attempt started (tok_per_s excludes them)
    tok_per_s: float = 0.0
    engine: str = ""
    engine_restarts: int = 0
    host: str = ""
    pid: int = 0
    gpus: str | None = None          # CUDA_VISIBLE_DEVICES
    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0           # SLURM_RESTART_COUNT: requeues of this task
    started: float = 0.0
    updated: float = 0.0
    error: str | None = None
    stop_signal: str | None = None   # the signal that stopped this attempt early (SIGTERM, SIGUSR2, ...)
    # the server's load while generating (GET /v1/loads; None: not read, or the server has no such endpoint)
    running: int | None = None       # requests it is generating
    queued: int | None = None        # requests waiting for a running slot
    kv_usage: float | None = None    # share of its KV cache in use
    capacity: int | None = None      # requests it can run at once
    in_flight_target: int | None = None  # requests the worker keeps in flight ([client] concurrency, or "auto")
    partial_saved: int = 0           # partial outputs kept when this attempt stopped (continued next time)
    loops_stopped: int = 0           # outputs stopped in a repetition loop by this attempt ([client] loop_stop)
    # the worker that runs this attempt, which claims shards one after another with one engine (worker.claims)
    task: str | None = None          # its name: the Slurm task (`12_3`) or `worker 2 (pid 4242)` of `toolkit run`
    task_engine_starts: int = 0      # engine starts of that worker so far (this attempt of it: a requeue restarts it)
    task_shards: int = 0             # shards that worker has taken so far, this one included
    group: str | None = None         # the workers sharing one pool of shards (a Slurm array job, one `toolkit run`)

    def eta_s(self) -> float | None:
        """Seconds left at this attempt's pace (None before it has a pace)."""
        made = self.done - self.resumed
        elapsed = self.updated - self.started
        if made <= 0 or elapsed <= 0 or self.state not in ("generating",):
            return None
        return (self.total - self.done) * elapsed / made


def slurm_context() -> dict:
    """Where this process runs, as Slurm tells it (empty values outside Slurm)."""
    env = os.environ
    return dict(
        gpus=env.get("CUDA_VISIBLE_DEVICES"),
        job_id=env.get("SLURM_JOB_ID"),
        array_job_id=env.get("SLURM_ARRAY_JOB_ID"),
        array_task_id=env.get("SLURM_ARRAY_TASK_ID"),
        restart_count=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
    )


def write_progress(path: Path, p: Progress) -> None:
    p.updated = time.time()
    atomic_write(path, msgspec.json.encode(p), durable=False)


def read_progress(path: Path) -> Progress | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=Progress)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def stale_for(p: Progress, now: float) -> float | None:
    """How long a generating worker's progress file has gone unwritten, when that is far past its refresh
    interval (the worker is dead or hung, whatever else says it runs); None while it is fresh, or not generating
    (an engine loading its weights writes nothing for minutes)."""
    if p.state != "generating" or not p.updated:
        return None
    age = now - p.updated
    return age if age > STALE_S else None


LIVE_STATES = ("starting", "loading", "generating")  # a worker writing these is (or should be) alive


def _started_at(pid: int) -> float | None:
    """When process `pid` started (epoch seconds), from /proc; None where /proc does not say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of proc(5), counted after the command name
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        pass
    return None


def worker_gone(p: Progress, host: str | None = None) -> str | None:
    """Why the worker that writes `p` is gone (its pid is not running on this host, or is another process now),
    or None when it may still run: only a pid on this host is judged, and only in a live state."""
    if p.state not in LIVE_STATES or not p.pid or p.host != (host or socket.gethostname()):
        return None
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        return f"worker gone: pid {p.pid} on {p.host} is not running (killed, or the machine restarted)"
    except PermissionError:
        pass  # alive, another user's
    started = _started_at(p.pid)
    if started is not None and p.started and started > p.started + 5:
        return f"worker gone: pid {p.pid} on {p.host} is another process now (started after the worker)"
    return None
