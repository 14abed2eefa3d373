"""One rank of a multi-node SGLang engine: what each task of the engine's `srun` step runs.

    python -m toolkit.engines.rank --nnodes N --dist-init-addr HOST:PORT --first-host NODE -- python
    -m sglang.launch_server ...

It reads its rank from Slurm (`SLURM_PROCID`: one task per node, so the node rank), appends
`--nnodes N
--node-rank R --dist-init-addr HOST:PORT` to the server's command line, and `--config FILE`: the
engine's API key, which reaches every node in the step's environment ($TOOLKIT_ENGINE_API_KEY),
written to a file only the user can read on this node (the first node's temporary directory is not
this one's), taken out of the server's environment, and removed when the server ends
(toolkit.engines.keys). It runs the server as its child, in a process group of its own, with SIGUSR2
ignored (Slurm's `--signal=USR2@T` reaches every process of the step; the worker decides when the
engine stops) and SIGKILL on the launcher's death. Rank 0 must run on the worker's node (it serves
HTTP on 127.0.0.1 there); it refuses to start anywhere else.

The launcher exits when its server does, with its exit code (128 + N for a signal), after killing
what is left of the server's process group. A server that exits with code 0 although nobody stopped
it is reported as a failure (exit 1), so that `srun --kill-on-bad-exit` ends the other ranks too: a
rank that is gone is an engine that is gone.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys

from toolkit.engines.keys import KEY_ENV, KeyFiles
from toolkit.engines.process_group import die_with_parent

__all__ = ["rank_argv", "main"]


def rank_argv(server_argv: list[str], *, rank: int, nnodes: int, dist_init_addr: str) -> list[str]:
    """The server command line of node `rank` of `nnodes` (the same on every node but for
    --node-rank)."""
    return [
        *server_argv,
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(rank),
        "--dist-init-addr",
        dist_init_addr,
    ]


def _redacted(argv: list[str]) -> str:
    out, hide = [], False
    for a in argv:
        out.append("***" if hide else a)
        # never on the line the toolkit makes (the key is in --config's file); a safeguard
        hide = a == "--api-key"
    return " ".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m toolkit.engines.rank")
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--dist-init-addr", required=True)
    p.add_argument("--first-host", required=True, help="the worker's node: rank 0 must run there")
    p.add_argument("server", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    server = args.server[1:] if args.server[:1] == ["--"] else args.server
    if not server:
        p.error("no server command after --")
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        rank = int(os.environ["SLURM_PROCID"])
    except (KeyError, ValueError):
        print(
            "toolkit rank: SLURM_PROCID is not set: run me as a task of `srun`",
            file=sys.stderr,
            flush=True,
        )
        return 2
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    tag = f"toolkit: engine rank {rank} of {args.nnodes} on {host}"
    if not 0 <= rank < args.nnodes:
        print(
            f"{tag}: rank out of range: the srun step has more tasks than [engine] nodes",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if rank == 0 and host != args.first_host:
        print(
            f"{tag}: rank 0 must run on the worker's node {args.first_host} (it serves HTTP on "
            "127.0.0.1 there)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        print(
            f"{tag}: no API key in the step's environment (${KEY_ENV}): srun did not pass the "
            "worker's environment on (--export); the server would be open to every user of the "
            "node",
            file=sys.stderr,
            flush=True,
        )
        return 2
    files = KeyFiles(key)
    try:
        return _serve(
            rank_argv(server, rank=rank, nnodes=args.nnodes, dist_init_addr=args.dist_init_addr)
            + ["--config", str(files.config())],
            tag,
        )
    finally:
        files.remove()


def _serve(cmd: list[str], tag: str) -> int:
    """Run the server `cmd` until it exits (forwarding SIGTERM, SIGINT, SIGHUP to its group): the
    exit code."""
    print(f"{tag}: {_redacted(cmd)}", flush=True)
    child = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_parent
    )
    stopping = []

    def forward(sig: int, _frame) -> None:
        stopping.append(sig)
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # pragma: no cover - wait() retries on EINTR itself
            continue
    try:
        os.killpg(child.pid, signal.SIGKILL)  # what outlived the server in its group
    except ProcessLookupError:
        pass
    if code < 0:
        print(
            f"{tag}: the server was killed by {signal.Signals(-code).name}",
            file=sys.stderr,
            flush=True,
        )
        return 128 - code
    if code == 0 and not stopping:
        print(
            f"{tag}: the server exited (code 0) although nobody stopped it",
            file=sys.stderr,
            flush=True,
        )
        return 1
    if code:
        print(f"{tag}: the server exited with code {code}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
