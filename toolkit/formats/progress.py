"""Per-shard progress files: what a running shard has done, rewritten every few seconds for
`status`."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from toolkit.formats.files import atomic_write
from toolkit.formats.locks import flock_held, pid_alive, try_flock
from toolkit.formats.rundir import RunDir

__all__ = [
    "LocalRun",
    "Progress",
    "REFRESH_S",
    "STALE_S",
    "live_local_runs",
    "local_run",
    "read_progress",
    "write_progress",
    "slurm_context",
    "stale_for",
    "worker_gone",
]

log = logging.getLogger(__name__)

REFRESH_S = 2.0  # a generating worker rewrites its progress file this often
# a generating worker's progress file older than this (15 refreshes missed) is stale
STALE_S = 30.0


class Progress(msgspec.Struct, kw_only=True):
    shard: int
    state: str = "starting"  # starting | loading | generating | done | stopped | failed
    total: int = 0  # prompts the shard owns
    done: int = 0  # records in the shard file (ok + failed)
    resumed: int = 0  # records already in the file when this attempt started
    failed: int = 0
    output_tokens: int = 0  # recorded in the shard file: this attempt's and those resumed
    # of those, already recorded when this attempt started (tok_per_s excludes them)
    resumed_tokens: int = 0
    tok_per_s: float = 0.0
    engine: str = ""
    engine_restarts: int = 0
    host: str = ""
    pid: int = 0
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES
    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0  # SLURM_RESTART_COUNT: requeues of this task
    started: float = 0.0
    updated: float = 0.0
    error: str | None = None
    # the signal that stopped this attempt early (SIGTERM, SIGUSR2, ...)
    stop_signal: str | None = None
    # the server's load while generating (GET /v1/loads; None: not read, or the server has no such
    # endpoint)
    running: int | None = None  # requests it is generating
    queued: int | None = None  # requests waiting for a running slot
    kv_usage: float | None = None  # share of its KV cache in use
    capacity: int | None = None  # requests it can run at once
    # requests the worker keeps in flight ([client] concurrency, or "auto")
    in_flight_target: int | None = None
    partial_saved: int = 0  # partial outputs kept when this attempt stopped (continued next time)
    # outputs stopped in a repetition loop by this attempt ([client] loop_stop)
    loops_stopped: int = 0
    resumed_loops: int = 0  # such outputs already recorded when this attempt started
    # the worker that runs this attempt, which claims shards one after another with one engine
    # (worker.claims)
    # its name: the Slurm task (`12_3`) or `worker 2 (pid 4242)` of `toolkit run`
    task: str | None = None
    # engine starts of that worker so far (this attempt of it: a requeue restarts it)
    task_engine_starts: int = 0
    task_shards: int = 0  # shards that worker has taken so far, this one included
    # the workers sharing one pool of shards (a Slurm array job, one `toolkit run`)
    group: str | None = None
    # the shard whose server log (logs/NNNNN.server.log) the serving engine writes: the first its
    # worker started it for (this shard, or one claimed before)
    engine_shard: int | None = None
    # its task hands the run's tail over (worker.policy.hands_over): its requests are kept as
    # partial outputs for a task with room
    leaving: bool = False

    def per_s(self) -> float | None:
        """Records per second of this attempt, from its start (None before it has a pace): the
        pace `eta_s` uses, and `status` sums for the run's ETA."""
        made = self.done - self.resumed
        elapsed = self.updated - self.started
        if made <= 0 or elapsed <= 0 or self.state not in ("generating",):
            return None
        return made / elapsed

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


def read_progress(rd: RunDir, k: int) -> Progress | None:
    """Shard `k`'s progress file (None: it has none yet, or it is being written): the one reader of
    those files."""
    try:
        return msgspec.json.decode(rd.progress_file(k).read_bytes(), type=Progress)
    except (FileNotFoundError, msgspec.DecodeError):
        return None


def stale_for(p: Progress, now: float) -> float | None:
    """How long a generating worker's progress file has gone unwritten, when that is far past its
    refresh interval (the worker is dead or hung, whatever else says it runs); None while it is
    fresh, or not generating (an engine loading its weights writes nothing for minutes)."""
    if p.state != "generating" or not p.updated:
        return None
    age = now - p.updated
    return age if age > STALE_S else None


# a worker writing these is (or should be) alive
LIVE_STATES = ("starting", "loading", "generating")


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
    """Why the worker that writes `p` is gone (its pid is not running on this host, or is another
    process now), or None when it may still run: only a pid on this host is judged, and only in a
    live state."""
    if p.state not in LIVE_STATES or not p.pid or p.host != (host or socket.gethostname()):
        return None
    try:
        os.kill(p.pid, 0)
    except ProcessLookupError:
        return (
            f"worker gone: pid {p.pid} on {p.host} is not running (killed, or the machine "
            "restarted)"
        )
    except PermissionError:
        pass  # alive, another user's
    started = _started_at(p.pid)
    if started is not None and p.started and started > p.started + 5:
        return (
            f"worker gone: pid {p.pid} on {p.host} is another process now (started after the "
            "worker)"
        )
    return None


# --------------------------------------------------------------------------------------------------
# processes running a run's shards from the command line (not as its Slurm tasks): what `status`
# knows runs
# --------------------------------------------------------------------------------------------------
class LocalRun(msgspec.Struct, kw_only=True):
    """A process that runs shards of a run from the command line (`toolkit run`, `retry`, `worker`):
    the shards it will run, whether it merges them after. Its file is locked (flock) as long as the
    process lives."""

    host: str
    pid: int
    started: float
    shards: list[int]
    command: str  # `toolkit run`, `toolkit retry`, `toolkit worker`
    # the claiming group of its workers (a shard failed in it is not claimed again)
    group: str | None = None
    merges: bool = False  # it merges and audits the run once its shards are done


@contextlib.contextmanager
def local_run(
    rd, shards, command: str, *, group: str | None = None, merges: bool = False
) -> Iterator[None]:
    """While the block runs, this process is known to work on `shards` of run `rd`
    (`live_local_runs`): a file that names it, locked for its life, removed at its end (a process
    killed -9 releases the lock with it). Best effort: a run directory that cannot take the file
    (full, read-only) does not stop the work."""
    path = rd.local_run_file(socket.gethostname(), os.getpid())
    me = LocalRun(
        host=socket.gethostname(),
        pid=os.getpid(),
        started=time.time(),
        shards=list(shards),
        command=command,
        group=group,
        merges=merges,
    )
    fd = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        # held, and kept, while this process runs; without flock here (or with a pid reused) the
        # pid stands in (live_local_runs)
        try_flock(fd)
        os.write(fd, msgspec.json.encode(me))
    except OSError as e:
        log.warning(
            "cannot write %s (%s): `toolkit status` will not know this process runs the run",
            path,
            e.strerror or e,
        )
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                path.unlink()
            os.close(fd)


def live_local_runs(rd) -> list[LocalRun]:
    """The processes running shards of `rd` from the command line that are alive now: their file's
    lock is held (where the file system has no flock: their pid runs on this host, or they run on
    another host, which cannot be told)."""
    folder = rd.local_run_file("h", 0).parent
    try:
        files = sorted(folder.glob("*.json"))
    except OSError:
        return []
    out = []
    for path in files:
        try:
            r = msgspec.json.decode(path.read_bytes(), type=LocalRun)
        except (OSError, msgspec.DecodeError):
            continue  # gone meanwhile, or being written
        held = flock_held(path)
        here = r.host == socket.gethostname()
        if held is False or here and not pid_alive(r.pid):
            continue
        if held is None and not here:
            log.debug("%s: on another host, without flock: taken as alive", path)
        out.append(r)
    return out
