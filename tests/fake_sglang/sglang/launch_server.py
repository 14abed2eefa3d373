"""Parses its command line with SGLang's flags (`sglang.srt.server_args`, the stand-in built from the flag data)
as SGLang does (allow_abbrev), starts a child that ignores SIGTERM (like a scheduler that would outlive its
parent), records what it saw, then becomes the toolkit's stub server. $FAKE_SGLANG_FAIL: print it as an error
and exit 2 at once (a server that dies before it is ready)."""

import argparse
import json
import os
import signal
import subprocess
import sys

from sglang.srt.server_args import ServerArgs

p = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(p)
args = p.parse_args()
if os.environ.get("FAKE_SGLANG_FAIL"):
    sys.stderr.write(f"sglang serve: error: {os.environ['FAKE_SGLANG_FAIL']}\n")
    sys.exit(2)

child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(os.environ["FAKE_SGLANG_RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "scheduler_pid": child.pid, "pid": os.getpid(), "pgid": os.getpgid(0),
               "no_proxy": os.environ.get("NO_PROXY"), "env_marker": os.environ.get("ENGINE_MARKER"),
               "usr2_ignored": signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN}, f)
argv = [sys.executable, "-m", "toolkit.engines.stub_server", "--model-path", args.model_path, "--host", args.host,
        "--port", str(args.port), "--context-length", str(args.context_length or 8192), "--warmup-delay", "0.5",
        "--load-delay", "0.5"]
if args.api_key:
    argv += ["--api-key", args.api_key]
os.execv(sys.executable, argv)
