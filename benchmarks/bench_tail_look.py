"""What a claiming task reads each second at the run's tail: one `look` at its pool (the next shard to claim, the
wait for shards being handed over) and one `tails` (whether to hand its requests over), worker.claims.

A run of --shards shards is planned with the demo tokenizer; all but --unfinished of them are done (a done
manifest and a progress file each), the unfinished ones are held by other tasks (their files locked, their
progress generating). The figures are per tail second, medians of --repeat: wall time, and files opened (Python's
audit hook: every open of a done manifest, a progress file, a lock probe). On a shared file system each open is a
metadata operation, and every task at the tail makes them.

    python benchmarks/bench_tail_look.py [--shards 512] [--unfinished 12] [--repeat 20]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.formats.manifests import write_done  # noqa: E402
from toolkit.formats.progress import Progress, write_progress  # noqa: E402
from toolkit.formats.run import Run  # noqa: E402
from toolkit.formats.shardfile import ShardWriter  # noqa: E402
from toolkit.job.plan import create_run, plan_job  # noqa: E402
from toolkit.job.schema import JobSpec
from toolkit.job.spec import load_spec
from toolkit.worker.poolview import look, tails  # noqa: E402

TOKENIZER = REPO / "jobs" / "demo" / "tokenizer"
opened = [0]


def _count_opens(event: str, args) -> None:
    if event == "open":
        opened[0] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=int, default=512)
    ap.add_argument("--unfinished", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tail-") as tmp:
        root = Path(tmp)
        prompts = root / "p.jsonl"
        prompts.write_text(
            "".join(
                json.dumps({"id": f"q{i}", "prompt": f"say {i}"}) + "\n"
                for i in range(2 * a.shards)
            )
        )
        (root / "job.toml").write_text(
            f'name = "bench"\noutput_dir = "{root / "run"}"\n[model]\npath = "{TOKENIZER}"\n'
            f'[engine]\nkind = "stub"\n[sampling]\nmax_new_tokens = 64\n[sharding]\nshards = {a.shards}\n'
            f'[[datasets]]\nname = "bench"\npath = "{prompts}"\n'
        )
        plan, refs = plan_job(load_spec(root / "job.toml"))
        rd = create_run(plan, refs)
        run = Run.open(rd.root, JobSpec, finish=True)
        rd, plan = run.rd, run.plan
        held = []
        for sp in plan.shards:
            k = sp.index
            w = ShardWriter(rd.shard_file(k), plan.fingerprint, k)
            w.open(range(sp.first, sp.first + sp.count))
            w.close()
            if k < a.shards - a.unfinished:
                write_done(
                    rd.done_file(k),
                    rd.shard_file(k),
                    k,
                    plan.fingerprint,
                    positions=range(sp.first, sp.first + sp.count),
                )
                write_progress(rd.progress_file(k), Progress(shard=k, total=sp.count, state="done"))
            else:
                f = open(rd.shard_file(k), "rb")
                fcntl.flock(f, fcntl.LOCK_EX)  # another task's writer
                held.append(f)
                write_progress(
                    rd.progress_file(k),
                    Progress(
                        shard=k,
                        total=sp.count,
                        state="generating",
                        task=f"9_{k}",
                        running=3,
                        in_flight_target=16,
                    ),
                )
        pool = list(range(a.shards))
        sys.addaudithook(_count_opens)
        times, opens = [], []
        for _ in range(a.repeat):
            opened[0] = 0
            t0 = time.perf_counter()
            states = look(run, pool, group="9")
            others = tails(run, pool, "9_0")
            times.append(time.perf_counter() - t0)
            opens.append(opened[0])
        assert (
            len(others) == a.unfinished
            and sum(st.progress is not None for st in states) == a.unfinished
        )
        print(
            f"{a.shards} shards, {a.unfinished} held by other tasks; per tail second (look + tails), "
            f"median of {a.repeat}: {statistics.median(times) * 1e3:.1f} ms, "
            f"{statistics.median(opens):.0f} files opened ({statistics.median(opens) / a.shards:.2f} a shard)"
        )
        for f in held:
            f.close()


if __name__ == "__main__":
    main()
