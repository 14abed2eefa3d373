"""A worker's resume, timed: `ShardWriter.open` recovering a shard file a killed attempt left.

A shard file of --records records (outputs of --output-tokens tokens, flushed in frames of 64) is written with a
tenth of its positions written twice (retries, partials continued), then opened again as a resuming worker opens
it: the newest record of each planned position read (formats.newest: pass 1 over every frame, pass 2 over the
newest records), the writer's state (done ids, transient, partial, output tokens) set from them. Against it, one
plain pass decoding every frame (`read_shard`): the least any recovery reads.

Each figure is the median of --repeat runs, with the ratio to the plain pass and the peak Python memory
(tracemalloc) of one recovery.

    python benchmarks/bench_recover.py [--records 200 20000] [--output-tokens 1000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _common import median_and_peak  # noqa: E402

from toolkit.formats.frames import read_shard  # noqa: E402
from toolkit.formats.records import OK, PARTIAL, Record, pack_ids  # noqa: E402
from toolkit.formats.shardfile import ShardWriter  # noqa: E402

FINGERPRINT = "b" * 16


def record(pos: int, rng: random.Random, n_out: int, status: str = OK) -> Record:
    out = [rng.randrange(150_000) for _ in range(n_out)]
    return Record(
        id=f"p{pos:07d}",
        dataset="bench",
        index=pos,
        status=status,
        prompt_ids=pack_ids(out[:200]),
        output_ids=pack_ids(out),
        reasoning_end=n_out // 2,
        tool_call_at=None,
        finish="stop" if status == OK else None,
        matched_stop=out[-1],
        prompt_tokens=200,
        completion_tokens=n_out,
        cached_tokens=0,
        latency_s=1.0,
        attempts=1,
    )


def write_file(path: Path, n: int, n_out: int) -> None:
    rng = random.Random(n)
    again = set(rng.sample(range(n), n // 10))
    w = ShardWriter(path, FINGERPRINT, 0, flush_records=64)
    w.open(range(n))
    for pos in range(n):
        w.add(record(pos, rng, n_out, PARTIAL if pos in again else OK))
    for pos in sorted(again):
        w.add(record(pos, rng, n_out))
    w.close()


def recover(path: Path, n: int) -> int:
    w = ShardWriter(path, FINGERPRINT, 0)
    done = w.open(range(n)).done
    w.close()
    return len(done)


def plain_pass(path: Path) -> int:
    return sum(1 for _ in read_shard(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, nargs="+", default=[200, 20_000])
    ap.add_argument("--output-tokens", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    print(
        f"{'records':>8} {'file MB':>8} {'recover s':>10} {'plain pass s':>13} {'ratio':>6} {'peak MB':>8}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n in a.records:
            path = Path(tmp) / f"{n}.zst"
            write_file(path, n, a.output_tokens)
            assert recover(path, n) == n
            rec_s, peak = median_and_peak(lambda: recover(path, n), a.repeat)
            plain_s, _ = median_and_peak(lambda: plain_pass(path), a.repeat)
            mb = path.stat().st_size / 1e6
            print(
                f"{n:>8} {mb:>8.1f} {rec_s:>10.3f} {plain_s:>13.3f} {rec_s / plain_s:>6.2f} {peak:>8.1f}"
            )


if __name__ == "__main__":
    main()
