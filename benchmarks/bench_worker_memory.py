"""Worker peak memory against the shard's size: 10,000, 100,000 and 300,000 prompts in one shard.

The stub runs in instant mode with fixed small outputs (16 tokens), as a separate process (an `external` engine
for the worker), so what is measured is the worker alone: the plan's slice of the prompt index, the ids already
recorded, the rendered prompts waiting for a request (bounded: the render thread blocks when it is far enough
ahead), the requests in flight, the records waiting for their batch. Peak RSS is the worker's kernel high-water
mark (VmHWM) at exit.

    python benchmarks/bench_worker_memory.py [--sizes 10000 100000 300000] [--concurrency 64]

Target: every larger shard within 5 % of the smallest one's peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(
    0, str(REPO)
)  # this checkout's toolkit, in this process and in the worker (PYTHONPATH below)
TOKENIZER = REPO / "jobs" / "demo" / "tokenizer"

JOB = """
name = "bench-memory"
output_dir = "{run}"
[model]
path = "{tokenizer}"
[engine]
kind = "external"
url = "{url}"
api_key_env = "BENCH_SERVER_KEY"
[client]
concurrency = {concurrency}
[sampling]
max_new_tokens = 64
[sharding]
shards = 1
flush_records = 256
[[datasets]]
name = "bench"
path = "{prompts}"
"""

MEASURED = """
import sys
from toolkit.cli import main
rc = main(sys.argv[1:])
print("VmHWM", [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0], file=sys.stderr)
sys.exit(rc)
"""


def peak_rss_mb(args: list[str]) -> tuple[float, float]:
    """(peak RSS in MB, wall seconds) of one `toolkit` process."""
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", MEASURED, *args], env=env, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return int(proc.stderr.rsplit("VmHWM", 1)[1].split()[0]) / 1024, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 300_000])
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    import pydoc_data.topics

    from toolkit.engines.stub import start_standalone
    from toolkit.job.prepare import prepare_run

    words = " ".join(pydoc_data.topics.topics.values()).split()
    work = Path(tempfile.mkdtemp(prefix="bench-worker-memory-"))
    key = "benchkey"
    os.environ["BENCH_SERVER_KEY"] = key  # the workers read the server's key from their environment
    stub, url = start_standalone(
        str(TOKENIZER), "--api-key", key, "--fixed-output-tokens", "16", "--context-length", "32768"
    )
    try:
        peaks = {}
        for n in args.sizes:
            prompts = work / f"prompts{n}.jsonl"
            with open(prompts, "w") as f:
                for i in range(n):
                    k = (i * 13) % (len(words) - 40)
                    f.write(
                        json.dumps({"id": f"p{i}", "prompt": " ".join(words[k : k + 40])}) + "\n"
                    )
            run = work / f"run{n}"
            job = work / f"job{n}.toml"
            job.write_text(
                JOB.format(
                    run=run,
                    tokenizer=TOKENIZER,
                    url=url,
                    concurrency=args.concurrency,
                    prompts=prompts,
                )
            )
            prepare_run(str(job))  # planning happens on the login node: not the worker's memory
            peaks[n] = peak_rss_mb(["worker", str(run), "0"])
            print(
                f"  {n:>7,} prompts in one shard: worker peak RSS {peaks[n][0]:6.1f} MB ({peaks[n][1]:.0f} s wall)"
            )
        small = min(args.sizes)
        for large in sorted(args.sizes)[1:]:
            print(
                f"  ratio {large:,} / {small:,}: {peaks[large][0] / peaks[small][0]:.3f} (target <= 1.05)"
            )
    finally:
        os.killpg(stub.pid, 9)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
