"""What the benchmarks share: the job text of an `external` engine and the CPU time of a child process (for those
that run `toolkit worker` against an engine in its own process), and the median time and peak memory of a call
made in this process."""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "jobs" / "demo" / "tokenizer"
KEY_ENV = "BENCH_SERVER_KEY"  # the workers read the server's key from this variable

_JOB = """
name = "bench"
output_dir = "{run}"
[model]
path = "{model}"
[engine]
kind = "external"
url = "{url}"
api_key_env = "{key_env}"
[client]
concurrency = {concurrency}
{client}
[sampling]
max_new_tokens = {max_new}
{sampling}
[[datasets]]
name = "bench"
path = "{prompts}"
"""


def external_job(
    path: Path,
    *,
    run: Path,
    url: str,
    prompts: Path,
    concurrency: int,
    max_new: int,
    model: Path = TOKENIZER,
    client: dict | None = None,
    sampling: dict | None = None,
) -> Path:
    """Write a job file at `path` whose engine is the server at `url` (kind "external"), the key read from
    $BENCH_SERVER_KEY; `client` and `sampling`: more keys of those tables (TOML scalars)."""

    def lines(table: dict | None) -> str:
        return "\n".join(
            f"{k} = {str(v).lower() if isinstance(v, bool) else v}"
            for k, v in (table or {}).items()
        )

    path.write_text(
        _JOB.format(
            run=run,
            model=model,
            url=url,
            key_env=KEY_ENV,
            concurrency=concurrency,
            client=lines(client),
            max_new=max_new,
            sampling=lines(sampling),
            prompts=prompts,
        )
    )
    return path


def run_child(
    argv: list[str], env: dict | None = None, log: Path | None = None
) -> tuple[float, float]:
    """(wall seconds, CPU seconds user + system) of one child process run to completion, the children it waited
    for included; its output goes to `log` (else nowhere)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with open(log or os.devnull, "w") as out:
        r = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(
            f"{argv[:4]} exited {r.returncode}" + (f"; its output: {log}" if log else "")
        )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def child_cpu(argv: list[str], env: dict | None = None) -> float:
    """CPU seconds (user + system) of one child process run to completion."""
    return run_child(argv, env)[1]


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a running process has used so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_and_peak(run, repeat: int) -> tuple[float, float]:
    """(median seconds of `repeat` calls, peak MB of Python memory (tracemalloc) of one more) of `run()`."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    try:
        run()
        peak = tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()
    return statistics.median(times), peak
