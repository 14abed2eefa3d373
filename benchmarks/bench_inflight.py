"""No generated token wasted: what share of the tokens an engine generates reaches the dataset when a worker is
stopped again and again, and how often the engine's waiting queue runs dry while prompts remain.

Against the stub engine (a stand-in for SGLang's protocol, not a model) started once as an `external` server, so
its counters (`GET /stub/counters`: every token it decoded, also those of requests aborted or dropped by their
client) span every worker run. Per-token delay, `--max-running-requests` slots and a waiting queue as in SGLang.

1. Stops. One shard; the worker is stopped with SIGUSR2 at 5 random moments and resumed each time, then run to
   the end. Reported: tokens in the dataset (the newest record of each id, ok) / tokens the engine generated.
   `save_in_flight = false` is today's behaviour (requests in flight are dropped and generated again from
   scratch); `true` aborts them, keeps their partial outputs and continues them on resume.
2. Saturation. One shard, no stops: `/v1/loads` sampled every 50 ms; reported: the share of samples with an
   empty waiting queue while prompts were still to be sent, mean running requests, and output tokens/s;
   a fixed concurrency of 4 against concurrency "auto".

    python benchmarks/bench_inflight.py [--prompts 120] [--stops 5] [--seed 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TOKENIZER = REPO / "jobs" / "demo" / "tokenizer"
SLOTS = 16
TOKEN_DELAY = 0.01
TARGET_SHARE = 0.99


def job_file(tmp: Path, name: str, prompts: Path, url: str, client: dict) -> Path:
    from tests.jobfiles import toml_value  # noqa: PLC0415

    d = tmp / name
    d.mkdir(parents=True)
    lines = [
        f'name = "{name}"',
        f'output_dir = "{d / "run"}"',
        "[model]",
        f'path = "{TOKENIZER}"',
        "[engine]",
        'kind = "external"',
        f'url = "{url}"',
        "[sampling]",
        "max_new_tokens = 400",
        "[client]",
    ]
    lines += [
        f"{k} = {toml_value(v)}"
        for k, v in {"request_timeout_s": 120, "retries": 3, "backoff_s": 0.1, **client}.items()
    ]
    lines += [
        "[sharding]",
        "shards = 1",
        "flush_records = 8",
        "flush_seconds = 1",
        "[[datasets]]",
        'name = "d"',
        f'path = "{prompts}"',
    ]
    job = d / "job.toml"
    job.write_text("\n".join(lines) + "\n")
    return job


def get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return json.loads(r.read())


def worker(run: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "toolkit", "worker", str(run), "0"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def dataset_tokens(run: Path) -> tuple[int, int]:
    from toolkit.formats.frames import read_shard  # noqa: PLC0415

    newest = {r.id: r for r in read_shard(run / "shards" / "00000.zst")}
    return sum(r.n_output for r in newest.values() if r.status == "ok"), max(
        r.segments for r in newest.values()
    )


def stops(tmp: Path, prompts: Path, url: str, save: bool, n_stops: int, rng: random.Random) -> dict:
    from toolkit.job.prepare import prepare_run  # noqa: PLC0415

    rd = prepare_run(
        job_file(
            tmp, f"stops-{save}", prompts, url, {"concurrency": "auto", "save_in_flight": save}
        )
    ).run_dir
    before = get(url, "/stub/counters")["generated_tokens"]
    landed = 0
    t0 = time.monotonic()
    for _ in range(n_stops):
        proc = worker(rd.root)
        time.sleep(rng.uniform(3.0, 6.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR2)
            landed += 1
        proc.wait()
    proc = worker(rd.root)
    assert proc.wait() == 0, "the last run should finish the shard"
    wall = time.monotonic() - t0
    generated = get(url, "/stub/counters")["generated_tokens"] - before
    kept, segments = dataset_tokens(rd.root)
    return {
        "stops": landed,
        "generated": generated,
        "kept": kept,
        "share": kept / generated,
        "wall_s": wall,
        "max_segments": segments,
    }


def saturation(tmp: Path, prompts: Path, url: str, n: int, concurrency) -> dict:
    from toolkit.job.prepare import prepare_run  # noqa: PLC0415

    rd = prepare_run(
        job_file(tmp, f"sat-{concurrency}", prompts, url, {"concurrency": concurrency})
    ).run_dir
    c0 = get(url, "/stub/counters")
    samples: list[tuple[int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            c = get(url, "/stub/counters")
            remain = (
                n - (c["answered"] - c0["answered"]) - c["running"] - c["waiting"]
            )  # prompts not sent yet
            if c["running"] and remain > 0:
                samples.append((c["running"], c["waiting"]))

    t = threading.Thread(target=sample)
    t0 = time.monotonic()
    proc = worker(rd.root)
    t.start()
    assert proc.wait() == 0
    wall = time.monotonic() - t0
    done.set()
    t.join()
    tokens = get(url, "/stub/counters")["generated_tokens"] - c0["generated_tokens"]
    empty = sum(1 for _, w in samples if w == 0) / max(1, len(samples))
    return {
        "empty_share": empty,
        "mean_running": sum(r for r, _ in samples) / max(1, len(samples)),
        "tok_s": tokens / wall,
        "wall_s": wall,
        "samples": len(samples),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument("--stops", type=int, default=5)
    ap.add_argument("--seed", type=int, default=10)
    args = ap.parse_args()
    from tests.jobfiles import write_prompts  # noqa: PLC0415
    from toolkit.engines.stub import start_standalone  # noqa: PLC0415

    stub, url = start_standalone(
        str(TOKENIZER),
        "--context-length",
        "32768",
        "--token-delay",
        str(TOKEN_DELAY),
        "--max-running-requests",
        str(SLOTS),
    )
    try:
        with tempfile.TemporaryDirectory(prefix="bench-inflight-") as d:
            tmp = Path(d)
            prompts = write_prompts(tmp / "prompts.jsonl", args.prompts)
            print(
                f"stub engine: {SLOTS} running slots, {TOKEN_DELAY * 1000:g} ms per token; {args.prompts} prompts, "
                f"max_new_tokens 400; {args.stops} SIGUSR2 stops at random moments, each resumed"
            )
            print(
                f"{'save_in_flight':<15} {'stops':>5} {'generated':>10} {'in dataset':>10} {'share':>7} "
                f"{'segments':>8} {'wall s':>7}"
            )
            results = {}
            for save in (False, True):
                r = results[save] = stops(
                    tmp, prompts, url, save, args.stops, random.Random(args.seed)
                )
                print(
                    f"{str(save).lower():<15} {r['stops']:>5} {r['generated']:>10,} {r['kept']:>10,} "
                    f"{r['share']:>7.3f} {r['max_segments']:>8} {r['wall_s']:>7.1f}"
                )
            print()
            print(
                f"{'concurrency':<15} {'queue empty while prompts remain':>32} {'mean running':>12} {'tok/s':>7} "
                f"{'wall s':>7}"
            )
            for conc in (4, "auto"):
                r = saturation(tmp, prompts, url, args.prompts, conc)
                print(
                    f"{str(conc):<15} {r['empty_share']:>32.1%} {r['mean_running']:>9.1f}/{SLOTS:<2} "
                    f"{r['tok_s']:>7.0f} {r['wall_s']:>7.1f}"
                )
            ok = results[True]["share"] >= TARGET_SHARE
            print(
                f"\nsaved share {results[True]['share']:.3f} (target >= {TARGET_SHARE}): {'PASS' if ok else 'FAIL'}"
            )
            return 0 if ok else 1
    finally:
        os.killpg(stub.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
