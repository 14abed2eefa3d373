"""A job run here (`toolkit run`, `toolkit retry`): `run_shards`, with as many workers as the
machine's GPUs hold engines.

Each worker starts its engine once and claims the run's unfinished shards one after another
(worker.claims), as a Slurm array task does: one worker runs in this process; several (`--parallel
N`, or by default as many as the visible GPUs hold engines of tp_size x dp_size GPUs:
engines.layout.split_gpus) run as `toolkit worker RUN
--claim ...` processes, each with its own GPUs in CUDA_VISIBLE_DEVICES. A shard another process
holds (its file locked: a second `toolkit run` of the same job) is not run twice nor called failed:
it is waited for, taken over if that process ends without finishing it, and the run is merged once
every shard is done (job.prepare starts a run, dataset.finish ends it).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

from toolkit.engines.layout import engine_gpus, split_gpus, visible_gpus
from toolkit.errors import EXIT_INTERRUPTED, EXIT_STOPPED, BadInputError
from toolkit.formats.logline import parse_relayed
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.job.check import require_engine_here
from toolkit.job.schema import JobSpec

__all__ = ["local_group", "run_shards", "workers_here"]

BUSY_POLL_S = 2.0  # how often a shard being generated elsewhere is looked at
NVIDIA_SMI_S = 10.0


def _count_gpus() -> int:
    """The GPUs nvidia-smi lists (0 where there is none, or it does not answer)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=NVIDIA_SMI_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return (
        sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        if out.returncode == 0
        else 0
    )


def workers_here(spec, parallel: int | None, env: dict[str, str] | None = None) -> list[list[str]]:
    """The GPUs of each worker this machine runs: one list per worker (empty lists: no GPU known).
    An `external` engine is one server: one worker unless `parallel` says otherwise."""
    env = os.environ if env is None else env
    if spec.engine.kind == "external":
        return [[] for _ in range(parallel or 1)]
    try:
        _, slices = split_gpus(visible_gpus(env, _count_gpus), engine_gpus(spec.engine), parallel)
    except ValueError as e:
        raise BadInputError(str(e)) from None
    return slices


def local_group() -> str:
    """The claiming group of the workers of this process's run (a shard failed in one is not claimed
    again)."""
    return f"run {os.getpid()}"


def run_shards(
    run_dir: str | os.PathLike, shards, log: logging.Logger, *, parallel: int | None = 1
) -> tuple[str | None, list[int]]:
    """Run `shards` of a run here: (the signal that stopped it, e.g. "SIGINT", or None; shards that
    failed). `parallel`: workers at once (None: as many as the GPUs hold). A shard whose file
    another process holds is waited for once the others are done, and run here if that process ends
    without finishing it."""
    run = Run.open(run_dir, JobSpec, finish=True)
    rd, plan = run.rd, run.plan
    require_engine_here(plan.spec)
    pool = list(dict.fromkeys(shards))
    slices = workers_here(plan.spec, parallel)
    group = local_group()
    if len(slices) > 1:
        log.info(
            "%d workers, each with its own engine%s, claim %d shards",
            len(slices),
            " on GPUs " + "; ".join(",".join(s) for s in slices) if any(slices) else "",
            len(pool),
        )
    failed: list[int] = []
    while True:
        if len(slices) == 1:
            stopped, busy = _claim_here(rd, pool, group, failed, slices[0], log)
        else:
            stopped, busy = _claim_in_workers(run, pool, group, failed, slices, log)
        if stopped:
            return stopped, failed
        if not busy:
            return None, failed
        freed = _wait_for(run, busy, log)
        pool = [k for k in freed if k not in failed]
        if not pool:
            return None, failed


def _claim_here(
    rd: RunDir, pool: list[int], group: str, failed: list[int], gpus: list[str], log: logging.Logger
) -> tuple[str | None, list[int]]:
    from toolkit.worker.claims import run_claims

    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus:  # the engine this process starts inherits them
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    try:
        r = run_claims(rd.root, pool, task=f"worker 0 (pid {os.getpid()})", group=group)
    finally:
        if gpus and before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        elif gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    failed += [k for k in r.failed if k not in failed]
    for k in r.busy:
        _say_busy(rd, k, log)
    return r.stopped, r.busy


def _claim_in_workers(
    run: Run,
    pool: list[int],
    group: str,
    failed: list[int],
    slices: list[list[str]],
    log: logging.Logger,
) -> tuple[str | None, list[int]]:
    """`toolkit worker RUN --claim POOL` processes, one per GPU slice; a signal this process gets is
    passed on to them (each stops its shard cleanly)."""
    from toolkit.formats.shardstate import ShardState

    rd = run.rd
    done_before = sum(run.shard_state(k).ended for k in pool)
    procs = [_start_worker(rd, pool, group, i, slices, log) for i in range(len(slices))]
    codes, told = _wait_for_workers(procs)
    for k in pool:
        st = run.shard_state(k, group=group)
        if not st.ended and st.state is ShardState.FAILED and k not in failed:
            failed.append(k)
    if told or EXIT_STOPPED in codes or EXIT_INTERRUPTED in codes:
        if signal.SIGINT in told or EXIT_INTERRUPTED in codes:
            return "SIGINT", []
        return signal.Signals(told[0]).name if told else "a signal", []
    progressed = sum(run.shard_state(k).ended for k in pool) > done_before
    return None, _left_by_workers(run, pool, failed, codes, progressed, log)


def _start_worker(
    rd: RunDir, pool: list[int], group: str, i: int, slices: list[list[str]], log: logging.Logger
) -> subprocess.Popen:
    """Worker `i`, on GPU slice `slices[i]`, its log lines relayed to `log`."""
    gpus = slices[i]
    env = dict(os.environ)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    argv = [
        sys.executable,
        "-m",
        "toolkit",
        "--log-relay",
        "worker",
        str(rd.root),
        "--claim",
        *map(str, pool),
        "--worker",
        str(i),
        "--workers",
        str(len(slices)),
        "--group",
        group,
    ]
    proc = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    threading.Thread(
        target=_relay, args=(proc.stderr, log), daemon=True, name=f"worker-{i}-log"
    ).start()
    return proc


def _wait_for_workers(procs: list[subprocess.Popen]) -> tuple[list[int], list[int]]:
    """The workers' exit codes, once all have ended, and the signals this process passed on to
    them meanwhile."""
    told: list[int] = []

    def forward(sig, _frame):
        told.append(sig)
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR2)}
    codes = []
    try:  # (Ctrl-C reaches the workers by themselves: they share this terminal's process group)
        for p in procs:
            while True:
                try:
                    codes.append(p.wait())
                    break
                except KeyboardInterrupt:  # the workers stop on theirs; wait for them
                    told.append(signal.SIGINT)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return codes, told


def _left_by_workers(
    run: Run,
    pool: list[int],
    failed: list[int],
    codes: list[int],
    progressed: bool,
    log: logging.Logger,
) -> list[int]:
    """After the workers ended without a stop: the shards other workers hold, and those left
    unfinished — claimed again when some shard finished this round (a worker died: kill -9, OOM),
    failed (added to `failed`) when none did."""
    from toolkit.formats.shardstate import BUSY

    rd = run.rd
    states = {k: run.shard_state(k, BUSY) for k in pool if k not in failed}
    busy = [k for k, st in states.items() if st.busy]
    for k in busy:
        _say_busy(rd, k, log)
    left = [k for k, st in states.items() if not st.ended and k not in busy]
    died = [
        f"worker {i} ({'killed by ' + signal.Signals(-c).name if c < 0 else f'exit {c}'})"
        for i, c in enumerate(codes)
        if c not in (0, 1)
    ]
    # a worker died (kill -9, OOM) and the others had ended: its shards are claimed again
    if left and progressed:
        log.warning(
            "shards %s were left unfinished (%s); claiming them again",
            ",".join(map(str, left)),
            "; ".join(died) or "their workers ended",
        )
        busy += left
    elif left:
        log.error(
            "shards %s were left unfinished and no shard finished this round (%s)",
            ",".join(map(str, left)),
            "; ".join(died) or "the workers ended",
        )
        failed += left
    return busy


def _relay(stream, log: logging.Logger) -> None:
    """A worker process's log records (`toolkit --log-relay worker`: one JSON line each,
    formats.logline), through this process's logging as they were written (time, level, logger,
    message), so the console shows them as its own, above the live bar when there is one."""
    for line in stream:
        got = parse_relayed(line)
        # a line that is not a log record (a crash's traceback, the error line): as this run's
        if got is None:
            log.warning("%s", line.rstrip("\n"))
            continue
        logger = logging.getLogger(got.name)
        if logger.isEnabledFor(got.level):
            logger.handle(got.record())


def _wait_for(run: Run, busy: list[int], log: logging.Logger) -> list[int]:
    """Wait until the shards other processes hold are released: those left unfinished, to run
    here."""
    from toolkit.formats.shardstate import BUSY, ShardState

    while True:
        states = {b: run.shard_state(b, BUSY) for b in busy}
        free = [b for b, st in states.items() if st.state is not ShardState.HELD]
        if free:
            left = [k for k in free if not states[k].ended]
            for k in free:
                if k in left:
                    log.info(
                        "shard %d: its other worker ended without finishing it; running it here", k
                    )
                else:
                    log.info("shard %d was done elsewhere", k)
            still = [b for b in busy if b not in free]
            if left or not still:
                return left + still
            busy = still
        time.sleep(BUSY_POLL_S)


def _say_busy(rd: RunDir, k: int, log: logging.Logger) -> None:
    from toolkit.formats.progress import read_progress

    p = read_progress(rd, k)
    who = (
        f"pid {p.pid} on {p.host}, {p.state}"
        if p is not None and p.pid and p.host
        else "another worker"
    )
    log.warning(
        "shard %d is being generated elsewhere (%s; its file is locked): not run here; this run "
        "waits for it and merges once every shard is done",
        k,
        who,
    )
