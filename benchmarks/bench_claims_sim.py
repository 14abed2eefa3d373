"""What GPU-node time goes to at mission scale: one shard per Slurm task (each task loads the model) against tasks
that start their engine once and claim shards as they come, simulated with the toolkit's own claiming policy
(toolkit.worker.policy.pick). Pure Python, no Slurm, a few seconds.

The mission: 88,000 prompts; output lengths lognormal (median 5,000 tokens, sigma 0.9: mean about 7,500, a heavy
tail of long reasoning traces), capped at max_new_tokens = 32,768; 16 nodes; a model load of 20 minutes per engine
start; 5 preemptions (at seeded random times, each hitting the task on a seeded random node, which is requeued at
once and loads again; partial outputs are kept, as `[client] save_in_flight` does).

The engine of a node, with continuous batching: up to 256 sequences run at once (what the KV cache holds); one
decode step of all running sequences takes 25 ms + 0.15 ms per sequence, so one sequence alone gets 40 tok/s and a
full batch 4,040 tok/s (the issue's ~4k tok/s per node). A finished sequence's slot is refilled at once while the
shard has prompts left (the worker keeps the engine's queue fed); prefill is not modelled (prompts are short
against 7,500-token outputs).

Node time, summed over every task's allocation (a task that has nothing left to claim exits and frees its node):
- loading: an engine starting (20 min),
- generating: the tokens made, at the full-batch rate (node-hours of a fully used engine),
- idle: the rest: a batch not full (a shard's tail, when its last long traces run almost alone) or empty.

Policies: `one shard per task` (today before claims: 64 shards, task i runs shard i, 16 at a time, a free node
takes the next task at once — optimistic: no queue wait); `claims` (16 tasks, one engine each, shards claimed
with worker.policy.pick, a shard done before the next is claimed: what the worker does), at 64 and at 512
shards (more shards cost no load now, and shorten the tail).

Loops: `--loop-rate` of the outputs (default 2 %) fall into a repetition loop where they would otherwise have ended
(their drawn length is where the loop sets in). Without the loop stop they run to max_new_tokens; with it
(`[client] loop_stop`) they end at the first segment end (`--segment-tokens`, 4,096) at least 512 tokens (the
detector's window) after the loop set in. Printed for the claiming policies: node-hours, wall time and the share
of node time generating outputs that are not loops.

    python benchmarks/bench_claims_sim.py [--seed 0] [--prompts 88000] [--nodes 16] [--loop-rate 0.02]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.worker.policy import Candidate, pick, start_of  # noqa: E402

LOAD_S = 20 * 60
MAX_NEW = 32_768
MEDIAN, SIGMA = 5_000, 0.9
BATCH = 256
STEP_S, PER_SEQ_S = 0.025, 0.00015
GOAL = 0.95


def step_s(b: int) -> float:
    return STEP_S + PER_SEQ_S * b


FULL_RATE = BATCH / step_s(BATCH)  # tokens/s of a full batch


class Pool:
    """The shards: the prompts each has left (remaining tokens of each), who holds it, which are done."""

    def __init__(self, lengths: list[int], shards: int):
        size = math.ceil(len(lengths) / shards)
        self.left = [list(lengths[i * size:(i + 1) * size]) for i in range(shards)]
        self.order = list(range(shards))
        self.held: dict[int, int] = {}
        self.done: set[int] = set()
        self.open_count = [len(x) for x in self.left]  # prompts not finished

    def candidates(self) -> list[Candidate]:
        return [Candidate(k, len(self.left[k])) for k in self.order if k not in self.held and k not in self.done
                and self.left[k]]


class Node:
    """One Slurm slot: the task running on it and its engine, advanced in a fluid model between events."""

    def __init__(self, i: int):
        self.i = i
        self.alloc_start: float | None = None
        self.ready_at: float | None = None    # engine ready (None: no engine)
        self.shard: int | None = None         # the shard whose prompts it sends
        self.holds: set[int] = set()          # the shards it holds (two while one's tail overlaps the next)
        self.queue: list[int] = []            # remaining tokens of the prompts of its shard not sent yet
        self.run: list[tuple[float, int]] = []  # (virtual progress at which it finishes, shard)
        self.v = 0.0                          # tokens each running sequence has made since the engine started
        self.t = 0.0
        self.tokens = 0.0
        self.loading = 0.0
        self.alloc = 0.0
        self.starts = 0

    def next_event(self) -> float | None:
        if self.alloc_start is None:
            return None
        if self.ready_at is not None and self.t < self.ready_at:
            return self.ready_at
        if not self.run:
            return self.t
        return self.t + (self.run[0][0] - self.v) * step_s(len(self.run))

    def advance(self, t: float) -> None:
        if self.run and t > self.t:
            dv = (t - self.t) / step_s(len(self.run))
            self.v += dv
            self.tokens += dv * len(self.run)
        self.t = max(self.t, t)


def simulate(lengths: list[int], *, nodes: int, shards: int, claims: bool, preemptions: list[tuple[float, int]],
             overlap: bool = False) -> dict:
    pool = Pool(lengths, shards)
    ns = [Node(i) for i in range(nodes)]
    next_task = iter(range(shards))   # one shard per task: the array's order
    requeued: dict[int, int] = {}     # one shard per task: node -> the shard its requeued task resumes
    pre = sorted(preemptions)

    def start_task(n: Node, t: float) -> None:
        n.alloc_start, n.t, n.ready_at, n.shard, n.queue, n.run, n.v = t, t, None, None, [], [], 0.0
        n.holds = set()

    def end_task(n: Node, t: float) -> None:
        n.alloc += t - n.alloc_start
        n.alloc_start = None

    def claim(n: Node, t: float) -> bool:
        """Give node n's task a shard (claims: the policy's pick; else its own). False: nothing to claim."""
        if claims:
            k = pick(pool.candidates(), pool.order, start_of(n.i, nodes, pool.order))
        else:
            k = n.assigned
        if k is None:
            return False
        n.shard, n.queue = k, list(pool.left[k])
        pool.left[k] = []
        pool.held[k] = n.i
        n.holds.add(k)
        if n.ready_at is None:  # the engine starts for this shard
            n.ready_at = t + LOAD_S
            n.loading += LOAD_S
            n.starts += 1
        return True

    def assign_next(n: Node, t: float) -> None:
        """One shard per task: the next task (a requeued one first) starts on the free node."""
        k = requeued.pop(n.i, None)
        if k is None:
            k = next(next_task, None)
        if k is None:
            return
        start_task(n, t)
        n.assigned = k
        claim(n, t)

    def fill(n: Node) -> None:
        while n.queue and len(n.run) < BATCH:
            heapq.heappush(n.run, (n.v + n.queue.pop(), n.shard))

    def preempt(n: Node, t: float) -> None:
        n.advance(t)
        for k in n.holds:
            pool.left[k] = (n.queue if k == n.shard else []) + [max(1, round(f - n.v)) for f, j in n.run if j == k]
            del pool.held[k]  # (partial outputs continue)
            if not claims:
                requeued[n.i] = k
        end_task(n, t)
        n.shard = None
        if claims:
            start_task(n, t)  # the requeued task comes back at once, with no engine
            n.assigned = None
        else:
            assign_next(n, t)

    for n in ns:
        if claims:
            start_task(n, 0.0)
            n.assigned = None
        else:
            assign_next(n, 0.0)
    events = [(e, n.i) for n in ns if (e := n.next_event()) is not None]
    heapq.heapify(events)
    end = 0.0
    while events:
        t, i = heapq.heappop(events)
        n = ns[i]
        if n.next_event() != t:  # stale
            continue
        while pre and pre[0][0] <= t:
            pt, victim = pre.pop(0)
            v = ns[victim % nodes]
            if v.alloc_start is not None and v.shard is not None:
                preempt(v, pt)
                if (e := v.next_event()) is not None:
                    heapq.heappush(events, (e, v.i))
        if n.next_event() != t:
            continue
        n.advance(t)
        while n.run and n.run[0][0] <= n.v + 1e-9:
            _, k = heapq.heappop(n.run)
            pool.open_count[k] -= 1
            if not pool.open_count[k]:
                pool.done.add(k)
                del pool.held[k]
                n.holds.discard(k)
        if n.ready_at is not None and n.t >= n.ready_at:
            fill(n)
        if n.shard is not None and not n.queue and (overlap or not n.run) and (n.ready_at is None or n.t >= n.ready_at):
            n.shard = None  # every prompt of its shard sent (overlap) or answered: the next is claimed
            if not claims and not n.run:
                end_task(n, t)
                assign_next(n, t)
        if n.shard is None and n.alloc_start is not None:
            if claim(n, t):
                if n.ready_at is not None and n.t >= n.ready_at:
                    fill(n)
            elif not n.run:
                end_task(n, t)
        end = max(end, t)
        if (e := n.next_event()) is not None:
            heapq.heappush(events, (e, n.i))
    assert len(pool.done) == shards, f"{len(pool.done)} of {shards} shards done"
    alloc = sum(n.alloc for n in ns)
    loading = sum(n.loading for n in ns)
    generating = sum(n.tokens for n in ns) / FULL_RATE
    return dict(alloc_h=alloc / 3600, loading_h=loading / 3600, generating_h=generating / 3600,
                idle_h=(alloc - loading - generating) / 3600, starts=sum(n.starts for n in ns), wall_h=end / 3600,
                tokens=sum(n.tokens for n in ns))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=88_000)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--preemptions", type=int, default=5)
    ap.add_argument("--loop-rate", type=float, default=0.02)
    ap.add_argument("--segment-tokens", type=int, default=4096)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    lengths = [min(MAX_NEW, max(1, round(rng.lognormvariate(math.log(MEDIAN), SIGMA)))) for _ in range(a.prompts)]
    mean = sum(lengths) / len(lengths)
    ideal_h = sum(lengths) / FULL_RATE / 3600 / a.nodes
    pre = [(rng.uniform(0.1, 0.9) * ideal_h * 3600, rng.randrange(a.nodes)) for _ in range(a.preemptions)]
    print(f"{a.prompts:,} prompts, output tokens lognormal(median {MEDIAN:,}, sigma {SIGMA}) capped at {MAX_NEW:,}: "
          f"mean {mean:,.0f}, p99 {sorted(lengths)[int(0.99 * len(lengths))]:,}, {sum(lengths) / 1e6:,.0f} M tokens")
    print(f"{a.nodes} nodes; load {LOAD_S // 60} min; engine: up to {BATCH} sequences, step {STEP_S * 1000:g} ms + "
          f"{PER_SEQ_S * 1000:g} ms/sequence ({FULL_RATE:,.0f} tok/s full, {1 / step_s(1):.0f} tok/s alone); "
          f"{a.preemptions} preemptions; generation alone needs {ideal_h:.2f} h per node")
    print(f"best possible with one load per node: {ideal_h / (ideal_h + LOAD_S / 3600):.1%} generating\n")
    print(f"{'policy':<34} {'starts':>6} {'node-h':>8} {'loading':>8} {'generating':>11} {'idle':>7} "
          f"{'gen share':>9} {'wall h':>7}")
    t0 = time.perf_counter()
    for name, shards, claims, overlap in (("one shard per task, 64 shards", 64, False, False),
                                          ("claims, 64 shards", 64, True, False),
                                          ("claims, 256 shards", 256, True, False),
                                          ("claims + overlap, 64 shards", 64, True, True),
                                          ("claims + overlap, 512 shards", 512, True, True)):
        r = simulate(lengths, nodes=a.nodes, shards=shards, claims=claims, preemptions=pre, overlap=overlap)
        share = r["generating_h"] / r["alloc_h"]
        print(f"{name:<34} {r['starts']:>6} {r['alloc_h']:>8.1f} {r['loading_h']:>8.1f} {r['generating_h']:>11.1f} "
              f"{r['idle_h']:>7.1f} {share:>9.1%} {r['wall_h']:>7.2f}")
    print(f"\n(goal: {GOAL:.0%} of allocated node time generating; simulated in {time.perf_counter() - t0:.1f} s)")
    if a.loop_rate > 0:
        loops(a, rng, lengths, pre)


def loops(a, rng: random.Random, lengths: list[int], pre) -> None:
    """The claiming policies again, with a.loop_rate of the outputs in a loop: run to max_new_tokens, or stopped."""
    looping = set(rng.sample(range(len(lengths)), round(a.loop_rate * len(lengths))))
    seg = a.segment_tokens
    full = [MAX_NEW if i in looping else n for i, n in enumerate(lengths)]
    stopped = [min(MAX_NEW, math.ceil((n + 512) / seg) * seg) if i in looping else n for i, n in enumerate(lengths)]
    useful = sum(n for i, n in enumerate(lengths) if i not in looping) / FULL_RATE / 3600
    spent_full = sum(full[i] for i in looping)
    spent_stopped = sum(stopped[i] for i in looping)
    print(f"\nwith {len(looping):,} outputs ({a.loop_rate:.0%}) in a loop: tokens decoded on them "
          f"{spent_full / 1e6:,.0f} M run to max_new_tokens ({spent_full / sum(full):.1%} of all decoded), "
          f"{spent_stopped / 1e6:,.1f} M stopped in segments of {seg:,} ({spent_stopped / spent_full:.1%} of that)")
    print(f"{'policy':<34} {'loops':<8} {'node-h':>8} {'generating':>11} {'useful share':>12} {'wall h':>7}")
    for name, shards, overlap in (("claims, 64 shards", 64, False), ("claims + overlap, 512 shards", 512, True)):
        for how, ls in (("run", full), ("stopped", stopped)):
            r = simulate(ls, nodes=a.nodes, shards=shards, claims=True, preemptions=pre, overlap=overlap)
            print(f"{name:<34} {how:<8} {r['alloc_h']:>8.1f} {r['generating_h']:>11.1f} "
                  f"{useful / r['alloc_h']:>12.1%} {r['wall_h']:>7.2f}")


if __name__ == "__main__":
    main()
