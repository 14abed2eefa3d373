"""Start a job's engine through the toolkit's own launch path and keep it serving, for tests that probe it.

    python tests/real_sglang/serve.py JOB_TOML

Starts the engine of [engine] (kind sglang or stub) exactly as a worker does (engines.kinds.make_engine: its argv,
environment, process group, API key), waits until it is really ready, then prints one JSON line on stdout:
{"url", "api_key", "pid", "version", "ready_s"}. It serves until its stdin closes, then stops the engine as a
worker does and prints {"stop_s", "exit_code"}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from toolkit.engines.client import HttpClient
from toolkit.engines.kinds import make_engine
from toolkit.job.spec import load_spec


def main() -> None:
    spec = load_spec(sys.argv[1])
    log = sys.argv[2] if len(sys.argv) > 2 else "server.log"
    engine = make_engine(spec, log, probe_ids=[5, 6, 7])
    t0 = time.monotonic()
    engine.start()

    async def ready():
        http = HttpClient(engine.url, api_key=engine.api_key)
        try:
            await engine.wait_ready(http, poll_s=0.5)
            await engine.probe(http)
        finally:
            http.close()

    try:
        asyncio.run(ready())
        print(
            json.dumps(
                {
                    "url": engine.url,
                    "api_key": engine.api_key,
                    "pid": engine.proc.pid,
                    "version": engine.version,
                    "ready_s": round(time.monotonic() - t0, 1),
                }
            ),
            flush=True,
        )
        sys.stdin.read()
    finally:
        proc = engine.proc
        t0 = time.monotonic()
        engine.stop()
        print(
            json.dumps({"stop_s": round(time.monotonic() - t0, 2), "exit_code": proc.returncode}),
            flush=True,
        )


if __name__ == "__main__":
    main()
