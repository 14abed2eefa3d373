"""Batch occupancy of each engine on the local Slurm cluster: 8 shards with heavy-tailed output lengths on the stub,
parallelism 2 (two array tasks claiming shards, one engine each).

The job: 8 shards of 40 prompts; the stub runs at most `--slots` (8) sequences at once (`--max-running-requests`),
decodes a token every `--token-delay` seconds per sequence, draws output lengths lognormal (median 60 tokens,
sigma 0.9) cut at max_new_tokens 400, and loads in `--load-s` seconds; the worker keeps the batch fed
(`concurrency = "auto"`). That is the mission's shape at a small scale: a heavy tail of long traces, the cut at
about 4.5 times the mean output (32,768 against 7,200), each shard five times what the batch holds (64 shards of
1,375 prompts for 256 sequences). Each repetition submits the job from a
fresh folder with `toolkit submit` of the checkout named, waits until the run is merged and audited, and reads from
every engine's log the batch occupancy it wrote at shutdown (time-weighted running / max running from its first
request to its last answer: 1.0 is a batch full throughout; it drops while a shard's last long traces run alone),
the engine starts, and the wall time from the submission to the merged, audited run. Medians of `--repeat`.
Beside them, what the simulation (bench_claims_sim.simulate, its engine set to the stub's: `--slots` sequences,
`--token-delay` per token whatever the batch) gives for such a job under each policy, medians of 5 seeds.

    SLURM_CONF=... python benchmarks/bench_occupancy.py [--checkout PATH] [--repeat 3]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_claims_sim as sim  # noqa: E402
from bench_claims_slurm import starts, submit_and_wait  # noqa: E402

from jobfiles import make_job  # noqa: E402

MEDIAN, SIGMA = 60, 0.9  # the stub's output lengths (--lognormal-lengths)
OCCUPANCY = re.compile(
    r"Batch occupancy (\d+\.\d+) \(time-weighted running / max running (\d+)\) over "
    r"(\d+\.\d+) s"
)


def occupancies(run: Path) -> list[tuple[str, float, float]]:
    """(server log, occupancy, seconds from its first request to its last answer) of every engine that served."""
    got = []
    for log in sorted((run / "logs").glob("*.server.log")):
        for m in OCCUPANCY.finditer(log.read_text(errors="replace")):
            got.append((log.name.removesuffix(".server.log"), float(m.group(1)), float(m.group(3))))
    return got


def one(checkout: Path, tmp: Path, a: argparse.Namespace, tokenizer: Path) -> dict:
    job = make_job(
        tmp,
        tokenizer,
        n=8 * a.prompts_per_shard,
        shards=8,
        stub={
            "load_delay_s": a.load_s,
            "token_delay_s": a.token_delay,
            "extra_args": [
                "--lognormal-lengths",
                f"{MEDIAN}:{SIGMA}",
                "--max-running-requests",
                str(a.slots),
            ],
        },
        sampling={"max_new_tokens": a.max_new_tokens},
        client={"concurrency": "auto", "request_timeout_s": 120},
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
    engines = occupancies(tmp / "run")
    if not engines:
        raise SystemExit(
            f"no engine log of {tmp / 'run'} says its batch occupancy: does the stub of {checkout} "
            "report it at shutdown?"
        )
    span = sum(s for _, _, s in engines)
    mean = sum(o * s for _, o, s in engines) / span if span else 0.0
    return {"engines": engines, "mean": mean, "wall": wall, "starts": starts(tmp / "run")}


def modelled(a: argparse.Namespace) -> dict[str, float]:
    """The simulation's occupancy for such a job (generating over the engines' time from ready to their end),
    per claiming policy: medians over 5 seeds of lengths drawn as the stub draws them."""
    engine = sim.Engine(batch=a.slots, step_s=a.token_delay, per_seq_s=0.0, load_s=a.load_s)
    got: dict[str, list[float]] = {}
    for seed in range(5):
        rng = random.Random(seed)
        lengths = [
            min(a.max_new_tokens, max(1, round(rng.lognormvariate(math.log(MEDIAN), SIGMA))))
            for _ in range(8 * a.prompts_per_shard)
        ]
        for policy in ("claims", "claims + overlap", "claims + overlap + handover"):
            r = sim.simulate(
                lengths,
                nodes=2,
                shards=8,
                policy=policy,
                preemptions=[],
                decide_s=1.0,
                engine=engine,
            )
            got.setdefault(policy, []).append(r["generating_h"] / (r["alloc_h"] - r["loading_h"]))
    return {p: statistics.median(v) for p, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--checkout",
        type=Path,
        default=REPO,
        help="the toolkit checkout that submits (default: this)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8, help="sequences each engine runs at once")
    ap.add_argument("--prompts-per-shard", type=int, default=40)
    ap.add_argument(
        "--max-new-tokens", type=int, default=400, help="where the lognormal output lengths are cut"
    )
    ap.add_argument(
        "--token-delay", type=float, default=0.01, help="seconds per token of a sequence"
    )
    ap.add_argument("--load-s", type=float, default=2.0, help="the stub's model load, seconds")
    a = ap.parse_args()
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit("set SLURM_CONF to the local cluster's slurm.conf")
    tok = REPO / "jobs" / "demo" / "tokenizer"
    runs = []
    with tempfile.TemporaryDirectory(
        prefix="bench-occupancy-", dir=os.environ.get("BENCH_TMP")
    ) as d:
        for i in range(a.repeat):
            r = one(a.checkout.resolve(), Path(d) / f"run-{i}", a, tok)
            runs.append(r)
            each = ", ".join(
                f"{name} {occ:.3f} over {span:.1f} s" for name, occ, span in r["engines"]
            )
            print(
                f"  repetition {i + 1}: occupancy {each}; span-weighted {r['mean']:.3f}; "
                f"{r['starts']} engine starts; wall {r['wall']:.1f} s",
                flush=True,
            )
    print(
        f"\n8 shards of {a.prompts_per_shard} prompts, parallelism 2, {a.slots} slots per engine, output lengths "
        f"lognormal (median {MEDIAN}, sigma {SIGMA}) cut at {a.max_new_tokens:,}, {a.token_delay * 1000:g} ms per "
        f"token; medians of {a.repeat}:"
    )
    print(
        f"batch occupancy (span-weighted over the engines) {statistics.median(r['mean'] for r in runs):.3f}; "
        f"lowest engine {statistics.median(min(o for _, o, _ in r['engines']) for r in runs):.3f}; "
        f"engine starts {statistics.median(r['starts'] for r in runs):g}; "
        f"wall {statistics.median(r['wall'] for r in runs):.1f} s"
    )
    print(
        "the simulation for such a job: "
        + ", ".join(f"{p} {v:.3f}" for p, v in modelled(a).items())
    )


if __name__ == "__main__":
    main()
