"""Parses the flags the toolkit passes exactly as SGLang names them, starts a child that ignores SIGTERM (like a
scheduler that would outlive its parent), records what it saw, then becomes the toolkit's stub server."""

import argparse
import json
import os
import subprocess
import sys

p = argparse.ArgumentParser(prog="sglang serve", allow_abbrev=False)
p.add_argument("--model-path", required=True)
p.add_argument("--tokenizer-path")
p.add_argument("--tp-size", type=int, default=1)
p.add_argument("--dp-size", type=int, default=1)
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, default=30000)
p.add_argument("--api-key")
p.add_argument("--trust-remote-code", action="store_true")
p.add_argument("--nccl-port", type=int)
p.add_argument("--mem-fraction-static", type=float)
p.add_argument("--context-length", type=int, default=8192)
args = p.parse_args()

child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(os.environ["FAKE_SGLANG_RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "scheduler_pid": child.pid, "pid": os.getpid(), "pgid": os.getpgid(0),
               "no_proxy": os.environ.get("NO_PROXY"), "env_marker": os.environ.get("ENGINE_MARKER")}, f)
argv = [sys.executable, "-m", "toolkit.engines.stub_server", "--model-path", args.model_path, "--host", args.host,
        "--port", str(args.port), "--context-length", str(args.context_length), "--warmup-delay", "0.5", "--load-delay", "0.5"]
if args.api_key:
    argv += ["--api-key", args.api_key]
os.execv(sys.executable, argv)
