"""Engine starts and wall time of a run on the local Slurm cluster: 8 shards at parallelism 2, one shard per task
(a checkout from before claims) against tasks that claim shards with one engine each (this checkout).

The job: 64 prompts in 8 shards, the stub engine with a model load of `--load-s` seconds (a real load is 10 to 30
minutes; the stub's load stands for it), `array_parallelism = 2`, partition `gpu` (1 GPU, 1 CPU per task). Each
repetition submits the job from a fresh folder with `toolkit submit` run from the checkout named, waits until the
merge job has ended, and reads: engine starts (the `engine start #` lines of every server log) and the wall time
from the submission to the merged, audited run (status exit 0). Medians of `--repeat`.

    SLURM_CONF=... python benchmarks/bench_claims_slurm.py --before /path/to/checkout/before/claims [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from jobfiles import make_job  # noqa: E402


def starts(run: Path) -> int:
    return sum(
        p.read_text(errors="replace").count("===== toolkit: engine start #")
        for p in (run / "logs").glob("*.server.log")
    )


def one(checkout: Path, tmp: Path, load_s: float, tokenizer: Path) -> tuple[int, float]:
    """One run submitted with the toolkit of `checkout`: (engine starts, seconds to a merged, audited run)."""
    job = make_job(
        tmp,
        tokenizer,
        n=64,
        shards=8,
        stub={"load_delay_s": load_s, "token_delay_s": 0.002},
        sampling={"max_new_tokens": 64},
        slurm={
            "partition": "gpu",
            "gpus_per_node": 1,
            "cpus_per_task": 1,
            "time": "00:20:00",
            "merge_cpus": 1,
            "array_parallelism": 2,
        },
    )
    wall = submit_and_wait(checkout, job, tmp)
    return starts(tmp / "run"), wall


def submit_and_wait(checkout: Path, job: Path, tmp: Path) -> float:
    """`toolkit submit` the job with the toolkit of `checkout`, from `tmp`, and wait until `toolkit status` says
    the run is merged and audited (exit 0): the seconds from the submission. Exits with the output otherwise."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    t0 = time.monotonic()
    # (from `tmp`: `python -m` puts the working folder first on the path, before PYTHONPATH)
    r = subprocess.run(
        [sys.executable, "-m", "toolkit", "submit", str(job)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp,
    )
    if r.returncode:
        raise SystemExit(f"submit failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    run = tmp / "run"
    while True:
        s = subprocess.run(
            [sys.executable, "-m", "toolkit", "status", str(run)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            cwd=tmp,
        )
        if s.returncode == 0:
            break
        if s.returncode not in (4, 5) or time.monotonic() - t0 > 1200:
            raise SystemExit(f"the run did not complete (status exit {s.returncode}):\n{s.stdout}")
        time.sleep(0.5)
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--before", type=Path, required=True, help="a checkout of the toolkit before claims"
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--load-s", type=float, default=5.0, help="the stub's model load, seconds")
    a = ap.parse_args()
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("set SLURM_CONF to the local cluster's slurm.conf")
    tok = REPO / "jobs" / "demo" / "tokenizer"
    results: dict[str, list[tuple[int, float]]] = {"one shard per task": [], "claims": []}
    with tempfile.TemporaryDirectory(prefix="bench-claims-", dir=os.environ.get("BENCH_TMP")) as d:
        for i in range(a.repeat):
            for name, checkout in (("one shard per task", a.before), ("claims", REPO)):
                got = one(checkout, Path(d) / f"{name.split()[0]}-{i}", a.load_s, tok)
                results[name].append(got)
                print(
                    f"  {name:<20} repetition {i + 1}: {got[0]} engine starts, {got[1]:.1f} s",
                    flush=True,
                )
    print(
        f"\n8 shards of 8 prompts, parallelism 2, stub load {a.load_s:g} s; medians of {a.repeat}:"
    )
    print(f"{'policy':<20} {'engine starts':>13} {'wall s':>8}")
    med = {}
    for name, rs in results.items():
        med[name] = (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
        print(f"{name:<20} {med[name][0]:>13g} {med[name][1]:>8.1f}")
    b, c = med["one shard per task"], med["claims"]
    print(f"claims: {b[0] / max(c[0], 1):.1f}x fewer engine starts, wall time {c[1] / b[1]:.2f}x")


if __name__ == "__main__":
    main()
