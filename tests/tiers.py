"""The suite as `make test` runs it: its tiers side by side, each in a pytest of its own.

    .venv/bin/python tests/tiers.py [PYTEST ARGS...]

- `slurm`: the tests of the local cluster, one after another (they share its nodes and GPUs);
- `sglang`: the tests of real SGLang, one after another (one server and one tiny model, built once);
- `rest`: everything else, in TEST_PROCESSES processes (pytest-xdist; default 2).

Each tier writes its output to .test-logs/TIER.log; what a tier printed is shown when it ends. The exit code is 0
when every tier passed (or had no test to run), else the first failing tier's. `python -m pytest` still runs the
whole suite in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / ".test-logs"
NO_TESTS = 5  # pytest's exit code when a tier has no test to run (e.g. under -k)


def tiers(processes: int) -> dict[str, list[str]]:
    return {
        "slurm": ["-m", "slurm"],
        "sglang": ["-m", "sglang and not slurm"],
        "rest": ["-m", "not slurm and not sglang", "-n", str(processes)],
    }


def main(args: list[str]) -> int:
    processes = int(os.environ.get("TEST_PROCESSES", "2"))
    LOGS.mkdir(exist_ok=True)
    started = time.monotonic()
    running = {}
    for name, select in tiers(processes).items():
        log = (LOGS / f"{name}.log").open("w")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *select, *args]
        running[name] = (
            subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT),
            log,
        )
        print(f"tiers: {name}: {' '.join(command[1:])}", flush=True)
    codes: dict[str, int] = {}
    try:
        while running:
            for name, (proc, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[name]
                codes[name] = 0 if proc.returncode == NO_TESTS else proc.returncode
                minutes = (time.monotonic() - started) / 60
                print(f"\n===== tier {name}: exit {proc.returncode} after {minutes:.1f} min =====")
                print((LOGS / f"{name}.log").read_text(errors="replace"), flush=True)
            time.sleep(1)
    except KeyboardInterrupt:
        for proc, _ in running.values():
            proc.terminate()
        for proc, _ in running.values():
            proc.wait()
        return 130
    failed = [name for name, code in codes.items() if code]
    total = (time.monotonic() - started) / 60
    print(f"tiers: {', '.join(failed) + ' failed' if failed else 'all passed'} in {total:.1f} min")
    return codes[failed[0]] if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
