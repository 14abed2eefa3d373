"""The readers of prompts.msgpack (formats/prompts.py), timed on one file: which is fastest, and what each holds.

A run's prompt index of 100,000 refs over 1,000 shards (realistic ids, digests and offsets) is written with
`refs_bytes`, then read every way the toolkit reads it:

- `PromptIndex`: msgspec splits the whole file into its shards' chunks in one C pass, refs decoded a shard at
  a time (merge, audit, export, `toolkit.read_run`, retry, grow); all refs, every shard, and 10,000 random
  positions.
- `ShardRefs`: a worker's shard read a chunk at a time (each chunk decoded by msgspec in one call), one chunk
  kept; one shard of 100 refs and one of 100,000 (a plan of one shard); and the same shard looked up by
  position (regenerated conversations: its chunks kept as bytes).

Each figure is the median of --repeat runs, with the peak Python memory (tracemalloc) of one run.

    python benchmarks/bench_prompt_index.py [--prompts 100000] [--shards 1000] [--repeat 5]
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

from toolkit.formats.prompts import PromptIndex, PromptRef, ShardRefs, refs_bytes  # noqa: E402
from toolkit.formats.rundir import RunDir  # noqa: E402
from toolkit.formats.runplan import RunPlan, ShardPlan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=100_000)
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n, s = args.prompts, args.shards
    refs = [
        PromptRef(f"math-{i:07d}", i % 8, i + 1, i * 311, 290, 0, 0, f"{i * 7919:016x}")
        for i in range(n)
    ]
    per = n // s
    shards = [ShardPlan(k, k * per, per if k < s - 1 else n - k * per) for k in range(s)]

    def plan_of(shards: list[ShardPlan]) -> RunPlan:
        return RunPlan(
            format=2,
            name="bench",
            fingerprint="0" * 16,
            parts={},
            created="",
            total=n,
            spec={},
            datasets=[],
            shards=shards,
        )

    plan, one = plan_of(shards), plan_of([ShardPlan(0, 0, n)])
    with tempfile.TemporaryDirectory(prefix="bench-prompt-index-") as tmp:
        rd, whole = RunDir(Path(tmp) / "shards"), RunDir(Path(tmp) / "one")
        whole.make_dirs()
        whole.prompts_file.write_bytes(refs_bytes(one, refs))
        rd.make_dirs()
        data = refs_bytes(plan, refs)
        rd.prompts_file.write_bytes(data)
        print(
            f"prompts.msgpack: {n:,} refs in {s:,} shards, {len(data) / 1e6:.2f} MB "
            f"({len(data) / n:.1f} B a ref); median of {args.repeat}, peak Python memory of one run"
        )
        positions = random.Random(0).sample(range(n), min(10_000, n))
        index = PromptIndex(rd, plan)
        assert index.refs() == refs

        def every_shard() -> None:
            ix = PromptIndex(rd, plan)
            for k in range(s):
                ix.shard(k)

        def random_positions() -> None:
            ix = PromptIndex(rd, plan)
            for p in positions:
                ix.at(p)

        window = ShardRefs(whole, one, 0)
        window[0]  # its chunks kept
        cases = [  # (what, refs it reads, how)
            ("PromptIndex: open (the C split into raw refs)", n, lambda: PromptIndex(rd, plan)),
            ("PromptIndex: every ref decoded (.refs())", n, lambda: PromptIndex(rd, plan).refs()),
            ("PromptIndex: every shard in turn (.shard(k))", n, every_shard),
            (
                f"PromptIndex: {len(positions):,} random positions (.at)",
                len(positions),
                random_positions,
            ),
            (
                f"ShardRefs: one shard of {per:,} refs, streamed",
                per,
                lambda: list(ShardRefs(rd, plan, s // 2)),
            ),
            (
                f"ShardRefs: one shard of {n:,} refs, streamed",
                n,
                lambda: sum(1 for _ in ShardRefs(whole, one, 0)),
            ),
            (f"ShardRefs: {n:,} refs kept by position", n, lambda: ShardRefs(whole, one, 0)[0]),
            (
                f"ShardRefs: every one of {n:,} refs looked up",
                n,
                lambda: [window[i] for i in range(len(window))],
            ),
        ]
        width = max(len(name) for name, _, _ in cases)
        for name, count, run in cases:
            sec, peak = median_and_peak(run, args.repeat)
            print(
                f"  {name:<{width}}  {sec * 1e3:9.1f} ms  {sec / count * 1e6:6.2f} µs/ref  peak {peak:7.2f} MB"
            )


if __name__ == "__main__":
    main()
