"""Parses its command line with SGLang's flags (`sglang.srt.server_args`, the stand-in built from the flag data)
as SGLang does (allow_abbrev), starts a child that ignores SIGTERM (like a scheduler that would outlive its
parent), records what it saw, then becomes the toolkit's stub server (given the same --config file, which holds
the API key). $FAKE_SGLANG_FAIL: print it as an error
and exit 2 at once (a server that dies before it is ready). $FAKE_SGLANG_STUB_ARGS: more stub_server flags.

Multi-node (`--nnodes N > 1`), as SGLang 0.5.23 behaves: rank 0 listens on the port of --dist-init-addr (the
rendezvous) and waits until every other rank has joined there, as torch.distributed's init does, before it serves
anything: until then its HTTP port is closed, so /ready and /health_generate do not answer 200. Then it serves the
HTTP API; the listening socket and the ranks' connections survive the exec into the stub server, so they live
exactly as long as rank 0. A rank >= 1 connects to --dist-init-addr over the network (retrying for 60 s, as
torch.distributed does; a rank that never reaches it exits 1), says its rank, and serves only a dummy health server
on --host/--port answering 200 to everything (not on rank 0's node, where the port is rank 0's). Like SGLang, a
rank >= 1 only logs SIGTERM and exits once rank 0 is gone (code 0 if it was told to stop, 1 otherwise).
$FAKE_SGLANG_RECORD may hold `{rank}`: each rank records to its own file. Rank 0 records again once every rank
has joined, with the address each joined from (`joined`: {rank: peer IP}).
"""

import argparse
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from sglang.srt.server_args import ServerArgs

p = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(p)
args = p.parse_args()
if os.environ.get("FAKE_SGLANG_FAIL"):
    sys.stderr.write(f"sglang serve: error: {os.environ['FAKE_SGLANG_FAIL']}\n")
    sys.exit(2)
rank, nnodes = args.node_rank or 0, args.nnodes or 1

child = subprocess.Popen(
    [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)",
    ]
)
record = {
    "argv": sys.argv[1:],
    "scheduler_pid": child.pid,
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "no_proxy": os.environ.get("NO_PROXY"),
    "env_marker": os.environ.get("ENGINE_MARKER"),
    "usr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN,
    "rank": rank,
    "slurm_procid": os.environ.get("SLURM_PROCID"),
    "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "host": socket.gethostname(),
    "config_mode": oct(os.stat(args.config).st_mode & 0o777) if args.config else None,
    "key_in_env": any(k == "TOOLKIT_ENGINE_API_KEY" for k in os.environ),
    "python": sys.executable,
    "prefix": sys.prefix,
}


def write_record(**more) -> None:
    with open(os.environ["FAKE_SGLANG_RECORD"].replace("{rank}", str(rank)), "w") as f:
        json.dump({**record, **more}, f)


if nnodes > 1 and rank >= 1:
    told = []
    signal.signal(
        signal.SIGTERM,
        lambda *_: (
            told.append(1),
            print(
                f"[rank {rank}] SIGTERM: waiting for the rank-0 ShutdownReq broadcast", flush=True
            ),
        ),
    )
    host, port = args.dist_init_addr.rsplit(":", 1)
    deadline = time.monotonic() + 60
    while True:
        try:
            rendezvous = socket.create_connection((host, int(port)), timeout=5)
            rendezvous.sendall(f"{rank}\n".encode())
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"[rank {rank}] no rank 0 at {args.dist_init_addr}")
            time.sleep(0.2)

    class Dummy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    try:  # the rendezvous address is local: rank 0 runs on this node and the port is its (one-node tests)
        socket.socket().bind((host, 0))
        dummy = False
    except OSError:
        server = http.server.ThreadingHTTPServer((args.host, args.port), Dummy)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        dummy = True
    write_record(dummy_health_server=dummy)
    print(f"[rank {rank}] joined rank 0 at {args.dist_init_addr}", flush=True)
    rendezvous.settimeout(None)
    while True:
        try:
            if not rendezvous.recv(1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    print(f"[rank {rank}] rank 0 is gone", flush=True)
    sys.exit(0 if told else 1)


def rendezvous_rank0(port: int) -> dict[str, str]:
    """Listen on `port` (every address, as torch's TCPStore) until each rank 1..nnodes-1 has joined: {rank: peer}.
    The sockets are kept across the exec below, so they close when rank 0 does."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("", port))
    listener.listen(64)
    listener.set_inheritable(True)
    keep.append(listener)
    print(f"[rank 0] waiting at {args.dist_init_addr} for ranks 1..{nnodes - 1}", flush=True)
    joined: dict[str, str] = {}
    while len(joined) < nnodes - 1:
        conn, (peer, _) = listener.accept()
        conn.settimeout(10)
        try:
            said = conn.makefile().readline().strip()
        except OSError:
            said = ""
        if not said.isdigit() or not 1 <= int(said) < nnodes or said in joined:
            conn.close()
            continue
        conn.settimeout(None)
        conn.set_inheritable(True)
        keep.append(conn)
        joined[said] = peer
        print(f"[rank 0] rank {said} joined from {peer}", flush=True)
    return joined


keep: list[socket.socket] = []  # open across the exec
write_record()
if nnodes > 1:  # rank 0: not ready before every rank has joined
    write_record(joined=rendezvous_rank0(int(args.dist_init_addr.rsplit(":", 1)[1])))
argv = [
    sys.executable,
    "-m",
    "toolkit.stub",
    "--model-path",
    args.model_path,
    "--host",
    args.host,
    "--port",
    str(args.port),
    "--context-length",
    str(args.context_length or 8192),
    "--warmup-delay",
    "0.5",
    "--load-delay",
    "0.5",
    *os.environ.get("FAKE_SGLANG_STUB_ARGS", "").split(),
]
if args.api_key:
    argv += ["--api-key", args.api_key]
if args.config:  # SGLang reads its server arguments (the toolkit's: the API key) from it; the stub reads it the same
    argv += ["--config", args.config]
os.execv(sys.executable, argv)
