"""Running Slurm's commands from the login node: every call bounded, every failure a typed answer.

`call(argv)` runs one Slurm command (`squeue`, `sacct`, `scontrol`, `sinfo`, ...) with a timeout and
returns a `SlurmAnswer` instead of raising: `ok` and its output, or what went wrong in one line
(`problem` is one of "timeout", "missing", "failed"). A command that hangs (slurmdbd wedged,
slurmctld unreachable and retrying) is killed with its whole process group when the timeout passes,
so no call outlives its bound.

`sacct` needs slurmdbd; `squeue` and `scontrol show job` answer from slurmctld. Callers that can
fall back from one to the other (cluster.status) do so; the others turn a failed answer into an
error (`cluster.resources.slurm_output`).
"""

from __future__ import annotations

import os
import signal
import subprocess

import msgspec

__all__ = ["SlurmAnswer", "call", "TIMEOUT_S", "TIMEOUT", "MISSING", "FAILED"]

TIMEOUT_S = 5.0  # a status refresh waits at most this long for each Slurm command
TIMEOUT, MISSING, FAILED = "timeout", "missing", "failed"


class SlurmAnswer(msgspec.Struct):
    command: str  # the program, e.g. "sacct"
    ok: bool
    out: str = ""  # stdout when ok
    problem: str | None = None  # TIMEOUT | MISSING | FAILED
    why: str = ""  # one line for the user, e.g. "sacct did not answer in 5 s"


def _one_line(text: str, command: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "no message"
    last = lines[-1]
    for prefix in (f"{command}: error: ", f"{command}: "):
        if last.startswith(prefix):
            last = last[len(prefix) :]
    return last


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)  # the command and whatever it started (its own session)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.communicate(timeout=2)
    # a grandchild left the group and holds the pipes: stop reading them
    except subprocess.TimeoutExpired:
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()
        p.wait(2)


def call(argv: list[str], timeout: float | None = None) -> SlurmAnswer:
    """Run one Slurm command, at most `timeout` seconds (TIMEOUT_S by default)."""
    timeout = TIMEOUT_S if timeout is None else timeout
    cmd = argv[0]
    conf = os.environ.get("SLURM_CONF")
    # Slurm's commands would retry for a minute before saying so
    if conf and not os.path.exists(conf):
        return SlurmAnswer(cmd, False, problem=FAILED, why=f"SLURM_CONF={conf} does not exist")
    try:
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except FileNotFoundError:
        return SlurmAnswer(
            cmd,
            False,
            problem=MISSING,
            why=f"`{cmd}` not found: run this on a Slurm login node (or export SLURM_CONF for the "
            "local cluster)",
        )
    except OSError as e:
        return SlurmAnswer(
            cmd, False, problem=FAILED, why=f"`{cmd}` could not be started: {e.strerror}"
        )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(p)
        return SlurmAnswer(
            cmd, False, problem=TIMEOUT, why=f"{cmd} did not answer in {timeout:g} s"
        )
    if p.returncode != 0:
        return SlurmAnswer(
            cmd,
            False,
            problem=FAILED,
            why=f"{cmd} failed (exit {p.returncode}): {_one_line(err or out, cmd)}",
        )
    return SlurmAnswer(cmd, True, out=out)
