"""An engine's process group, as the worker sees it from outside: its live members (from /proc),
the wait until a killed group is gone, and what the engine's first process does before exec so that
it dies with the worker and only the worker stops it (`die_with_parent`)."""

from __future__ import annotations

import os
import signal
import time

__all__ = ["die_with_parent", "group_members", "wait_group_gone"]


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`, from /proc (Linux)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def wait_group_gone(pgid: int, timeout_s: float = 5.0) -> list[int]:
    """Wait until a SIGKILLed process group has no live process left (a SIGKILL takes effect when
    the process next runs, which a busy node may delay): the pids still there after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


def die_with_parent() -> None:
    """In the engine's process, before exec: get SIGKILL when the worker dies, even by kill -9
    (Linux); and ignore SIGUSR2 and SIGTERM, so that only the worker decides when the engine stops.

    Slurm signals every process of the job step: `--signal=USR2@T` before the time limit, SIGTERM at
    `scancel`, `scontrol requeue` and preemption. SGLang has no USR2 handler (the default action
    kills it), and its scheduler processes have no SIGTERM handler: they would die at once, and the
    server with them, before the worker had aborted the requests in flight and recorded their
    partial outputs. Ignored signals stay ignored across exec and in every child, so SGLang's
    schedulers ignore both, while its HTTP process installs its own SIGTERM handler once it serves:
    a drain (it ends when no request is left in flight). The worker aborts what is in flight,
    records it, then stops the engine (Engine.stop).
    """
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
