"""What GPU-node time goes to at mission scale: one shard per Slurm task (each task loads the model) against tasks
that start their engine once and claim shards, simulated with the toolkit's own scheduling decisions
(toolkit.worker.policy: `pick` the shard to claim, `opens_next` to open one more shard while the others drain,
`hands_over` to give the run's tail away). Pure Python, no Slurm, a few seconds per policy.

The mission: 88,000 prompts; output lengths lognormal (median 5,000 tokens, sigma 0.9: mean about 7,200, a heavy
tail of long reasoning traces), capped at max_new_tokens = 32,768; 16 nodes; a model load of 20 minutes per engine
start; 5 preemptions (at seeded random times, each hitting the task on a seeded random node, which is requeued at
once and loads again; partial outputs are kept, as `[client] save_in_flight` does).

The engine of a node, with continuous batching: up to 256 sequences run at once (what the KV cache holds); one
decode step of all running sequences takes 25 ms + 0.15 ms per sequence, so one sequence alone gets 40 tok/s and a
full batch 4,040 tok/s (the issue's ~4k tok/s per node). A finished sequence's slot is refilled at once while the
task has prompts left to send (the worker keeps the engine's queue fed); prefill is not modelled (prompts are short
against 7,200-token outputs), nor, unless `--prefill-tok-s` is given, that of a partial output continued on
another node: with it, the node's whole batch waits while the partial is prefilled (pessimistic: SGLang's chunked
prefill runs beside the decode).

Node time, summed over every task's allocation (a task that has nothing left to claim exits and frees its node):
- loading: an engine starting (20 min),
- generating: the tokens made, at the full-batch rate (node-hours of a fully used engine),
- idle: the rest: a batch not full (a shard's tail, when its last long traces run almost alone) or empty.
`ceiling` is generating / (generating + loading): the share with no idle time at all, given the run's loads.

Policies:
- `one shard per task` (today before claims: task i runs shard i, 16 at a time, a free node takes the next task
  at once — optimistic: no queue wait);
- `claims` (today: 16 tasks, one engine each, shards claimed with `pick`, a shard done before the next is claimed);
- `claims + overlap`: a task claims one more shard whenever `opens_next(unsent, in flight, 256)` says so (its
  shards have nothing left to send and its batch has room): several shards open per node;
- `claims + overlap + handover`: also, every `--decide-s` seconds (10) with no shard left to claim, each live task
  in turn asks `hands_over(its Tail, the others' Tails, 0, --share)`; the task it says leaves aborts its sequences,
  which go back to the pool as partial outputs (continued from where they stopped), releases its shards and ends
  its allocation; the tasks with room claim them at once (`opens_next`, `pick`).
Each at 64 and 512 shards (more shards cost no load with claims); `--sweep` adds the handover at other shares,
decision intervals and prefill rates, and without preemptions.

Loops: `--loop-rate` of the outputs (default 2 %) fall into a repetition loop where they would otherwise have ended
(their drawn length is where the loop sets in). Without the loop stop they run to max_new_tokens; with it
(`[client] loop_stop`) they end at the first segment end (`--segment-tokens`, 4,096) at least 512 tokens (the
detector's window) after the loop set in. Printed for the claiming policies: node-hours, wall time and the share
of node time generating outputs that are not loops.

    python benchmarks/bench_claims_sim.py [--seed 0] [--prompts 88000] [--nodes 16] [--loop-rate 0.02]
        [--share 0.25] [--decide-s 10] [--prefill-tok-s 0] [--sweep]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.worker.policy import (
    HANDOVER_SHARE,
    Candidate,
    Tail,
    hands_over,
    opens_next,
    pick,
    start_of,
)  # noqa: E402

LOAD_S = 20 * 60
MAX_NEW = 32_768
MEDIAN, SIGMA = 5_000, 0.9
BATCH = 256
STEP_S, PER_SEQ_S = 0.025, 0.00015
GOAL = 0.86  # within 3 points of the one-load ceiling (89.1 % at the mission's figures)
DECIDE_S = 10.0  # how often a task at the tail weighs a handover (seconds)
# policy: (tasks claim shards, the next shard opens while the last ones drain, the tail is handed over)
POLICIES = {
    "one shard per task": (False, False, False),
    "claims": (True, False, False),
    "claims + overlap": (True, True, False),
    "claims + overlap + handover": (True, True, True),
}


def step_s(b: int) -> float:
    return STEP_S + PER_SEQ_S * b


class Engine(NamedTuple):
    """An engine's pace: up to `batch` sequences at once, a decode step of `step_s` + `per_seq_s` per sequence,
    a model load of `load_s` (the mission's by default; benchmarks/bench_occupancy.py models the stub's)."""

    batch: int = BATCH
    step_s: float = STEP_S
    per_seq_s: float = PER_SEQ_S
    load_s: float = LOAD_S

    def step(self, b: int) -> float:
        return self.step_s + self.per_seq_s * b

    @property
    def full_rate(self) -> float:
        return self.batch / self.step(self.batch)


FULL_RATE = BATCH / step_s(BATCH)  # tokens/s of a full batch


class Pool:
    """The shards: the prompts each has left (remaining tokens of each), who holds it, which are done."""

    def __init__(self, lengths: list[int], shards: int):
        size = math.ceil(len(lengths) / shards)
        self.left = [list(lengths[i * size : (i + 1) * size]) for i in range(shards)]
        self.order = list(range(shards))
        self.held: dict[int, int] = {}
        self.done: set[int] = set()
        self.open_count = [len(x) for x in self.left]  # prompts not finished
        self.prefill = [
            0
        ] * shards  # tokens of the partial outputs released with the shard, to prefill again

    def candidates(self) -> list[Candidate]:
        return [
            Candidate(k, len(self.left[k]))
            for k in self.order
            if k not in self.held and k not in self.done and self.left[k]
        ]


class Node:
    """One Slurm slot: the task running on it and its engine, advanced in a fluid model between events."""

    def __init__(self, i: int, engine: Engine):
        self.i = i
        self.engine = engine
        self.alloc_start: float | None = None
        self.ready_at: float | None = None  # engine ready (None: no engine)
        self.shard: int | None = None  # the shard whose prompts it sends
        self.holds: set[int] = set()  # the shards it holds (two while one's tail overlaps the next)
        self.queue: list[int] = []  # remaining tokens of the prompts of its shard not sent yet
        self.run: list[
            tuple[float, int, float]
        ] = []  # (virtual progress at which it finishes, shard, at which begun)
        self.v = 0.0  # tokens each running sequence has made since the engine started
        self.t = 0.0
        self.tokens = 0.0
        self.loading = 0.0
        self.alloc = 0.0
        self.starts = 0
        self.stall_until = 0.0  # the batch waits for a continuation's prefill until then

    def next_event(self) -> float | None:
        if self.alloc_start is None:
            return None
        if self.ready_at is not None and self.t < self.ready_at:
            return self.ready_at
        if not self.run:
            return self.t
        return max(self.t, self.stall_until) + (self.run[0][0] - self.v) * self.engine.step(
            len(self.run)
        )

    def advance(self, t: float) -> None:
        begin = max(self.t, self.stall_until)
        if self.run and t > begin:
            dv = (t - begin) / self.engine.step(len(self.run))
            self.v += dv
            self.tokens += dv * len(self.run)
        self.t = max(self.t, t)


def simulate(
    lengths: list[int],
    *,
    nodes: int,
    shards: int,
    policy: str,
    preemptions: list[tuple[float, int]],
    share: float = HANDOVER_SHARE,
    decide_s: float = DECIDE_S,
    prefill_tok_s: float = 0.0,
    engine: Engine = Engine(),
) -> dict:
    """One run under `policy` (a key of POLICIES): node-hours loading, generating and idle, engine starts, wall
    time, and the handovers at the tail (tasks that gave their work away, sequences and tokens handed over)."""
    claims, overlap, handover = POLICIES[policy]
    pool = Pool(lengths, shards)
    ns = [Node(i, engine) for i in range(nodes)]
    batch = engine.batch
    next_task = iter(range(shards))  # one shard per task: the array's order
    requeued: dict[int, int] = {}  # one shard per task: node -> the shard its requeued task resumes
    pre = sorted(preemptions)
    handed = {"tasks": 0, "sequences": 0, "tokens": 0}

    def start_task(n: Node, t: float) -> None:
        n.alloc_start, n.t, n.ready_at, n.shard, n.queue, n.run, n.v = t, t, None, None, [], [], 0.0
        n.holds = set()

    def end_task(n: Node, t: float) -> None:
        n.alloc += t - n.alloc_start
        n.alloc_start = None

    def ready(n: Node) -> bool:
        return n.ready_at is not None and n.t >= n.ready_at

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
            n.ready_at = t + engine.load_s
            n.loading += engine.load_s
            n.starts += 1
        if (
            prefill_tok_s > 0 and pool.prefill[k]
        ):  # the whole batch waits while the partials are prefilled
            n.stall_until = max(n.t, n.stall_until, n.ready_at) + pool.prefill[k] / prefill_tok_s
        pool.prefill[k] = 0
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
        while n.queue and len(n.run) < batch:
            heapq.heappush(n.run, (n.v + n.queue.pop(), n.shard, n.v))

    def give_back(n: Node, t: float) -> int:
        """Node n's task lets go of its shards (preempted, or handing over): what it had not sent and the rest of
        each sequence in flight (partial outputs continue) go back to the pool. The tokens of those partials."""
        n.advance(t)
        partial = 0
        for k in n.holds:
            made = sum(round(n.v - b) for _, j, b in n.run if j == k)
            partial += made
            pool.prefill[k] += made
            pool.left[k] = (n.queue if k == n.shard else []) + [
                max(1, round(f - n.v)) for f, j, _ in n.run if j == k
            ]
            del pool.held[k]
            if not claims:
                requeued[n.i] = k
        end_task(n, t)
        n.shard, n.queue, n.run, n.holds = None, [], [], set()
        return partial

    def preempt(n: Node, t: float) -> None:
        give_back(n, t)
        if claims:
            start_task(n, t)  # the requeued task comes back at once, with no engine
            n.assigned = None
        else:
            assign_next(n, t)

    def step(n: Node, t: float) -> None:
        """Node n at time t: its finished sequences leave the batch, free slots take prompts, and its task claims
        the next shard (claims: when its shards are done; overlap: when `opens_next` says so) or ends."""
        n.advance(t)
        while n.run and n.run[0][0] <= n.v + 1e-9:
            _, k, _ = heapq.heappop(n.run)
            pool.open_count[k] -= 1
            if not pool.open_count[k]:
                pool.done.add(k)
                del pool.held[k]
                n.holds.discard(k)
        if n.alloc_start is None:
            return
        if ready(n):
            fill(n)
        if not claims:
            if n.shard is not None and not n.queue and not n.run and ready(n):
                n.shard = None
                end_task(n, t)
                assign_next(n, t)
            return
        if overlap:
            while opens_next(len(n.queue), len(n.run), batch) and claim(n, t):
                if ready(n):
                    fill(n)
        elif not n.queue and not n.run and claim(n, t) and ready(n):
            fill(n)
        if not n.queue and not n.run:
            end_task(n, t)  # nothing left to claim: the task exits and frees its node

    def tail(n: Node) -> Tail:
        # requests in flight; a task whose engine still loads counts the prompts it waits to send
        return Tail(f"task{n.i:03d}", min(batch, len(n.run) + len(n.queue)), batch)

    def decide(t: float) -> list[Node]:
        """The handover decisions at time t, each live task in turn: the task that `hands_over` says leaves (its
        work back to the pool), and the tasks with room claim it at once. The nodes whose state changed."""
        changed: list[Node] = []
        for n in ns:
            live = [m for m in ns if m.alloc_start is not None]
            claimable = len(pool.candidates())
            if n.alloc_start is None or claimable:
                continue
            me = tail(n)
            if not hands_over(me, [tail(m) for m in live if m is not n], claimable, share):
                continue
            handed["tasks"] += 1
            handed["sequences"] += me.running
            handed["tokens"] += give_back(n, t)
            changed.append(n)
            for m in live:
                if m is not n and m.alloc_start is not None:
                    step(m, t)
                    changed.append(m)
        return changed

    for n in ns:
        if claims:
            start_task(n, 0.0)
            n.assigned = None
        else:
            assign_next(n, 0.0)
    events = [(e, n.i) for n in ns if (e := n.next_event()) is not None]
    if handover:
        events.append((decide_s, -1))
    heapq.heapify(events)
    end = 0.0
    while events:
        t, i = heapq.heappop(events)
        if i < 0:  # a decision round
            for m in decide(t):
                if (e := m.next_event()) is not None:
                    heapq.heappush(events, (e, m.i))
            if any(m.alloc_start is not None for m in ns):
                heapq.heappush(events, (t + decide_s, -1))
            continue
        n = ns[i]
        if n.next_event() != t:  # stale
            continue
        while pre and pre[0][0] <= t:
            pt, victim = pre.pop(0)
            v = ns[victim % nodes]
            if v.alloc_start is not None and v.holds:
                preempt(v, pt)
                if (e := v.next_event()) is not None:
                    heapq.heappush(events, (e, v.i))
        if n.next_event() != t:
            continue
        step(n, t)
        end = max(end, t)
        if (e := n.next_event()) is not None:
            heapq.heappush(events, (e, n.i))
    assert len(pool.done) == shards, f"{len(pool.done)} of {shards} shards done"
    alloc = sum(n.alloc for n in ns)
    loading = sum(n.loading for n in ns)
    generating = sum(n.tokens for n in ns) / engine.full_rate
    return dict(
        alloc_h=alloc / 3600,
        loading_h=loading / 3600,
        generating_h=generating / 3600,
        idle_h=(alloc - loading - generating) / 3600,
        starts=sum(n.starts for n in ns),
        wall_h=end / 3600,
        tokens=sum(n.tokens for n in ns),
        handed=handed,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=88_000)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--preemptions", type=int, default=5)
    ap.add_argument("--loop-rate", type=float, default=0.02)
    ap.add_argument("--segment-tokens", type=int, default=4096)
    ap.add_argument(
        "--share",
        type=float,
        default=HANDOVER_SHARE,
        help="the handover share (worker.policy.HANDOVER_SHARE by default)",
    )
    ap.add_argument(
        "--decide-s", type=float, default=DECIDE_S, help="seconds between handover decisions"
    )
    ap.add_argument(
        "--prefill-tok-s",
        type=float,
        default=0.0,
        help="prefill of a continued partial output: the node's whole batch waits its tokens at this rate "
        "(0: not modelled)",
    )
    ap.add_argument(
        "--load-min",
        type=float,
        default=LOAD_S / 60,
        help="minutes an engine start takes (the model load; 20 at the mission's sizes)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also the handover at other shares and decision intervals (64 and 512 shards)",
    )
    a = ap.parse_args()
    a.engine = Engine(load_s=a.load_min * 60)
    rng = random.Random(a.seed)
    lengths = [
        min(MAX_NEW, max(1, round(rng.lognormvariate(math.log(MEDIAN), SIGMA))))
        for _ in range(a.prompts)
    ]
    mean = sum(lengths) / len(lengths)
    ideal_h = sum(lengths) / FULL_RATE / 3600 / a.nodes
    pre = [
        (rng.uniform(0.1, 0.9) * ideal_h * 3600, rng.randrange(a.nodes))
        for _ in range(a.preemptions)
    ]
    print(
        f"{a.prompts:,} prompts, output tokens lognormal(median {MEDIAN:,}, sigma {SIGMA}) capped at {MAX_NEW:,}: "
        f"mean {mean:,.0f}, p99 {sorted(lengths)[int(0.99 * len(lengths))]:,}, {sum(lengths) / 1e6:,.0f} M tokens"
    )
    print(
        f"{a.nodes} nodes; load {a.load_min:g} min; engine: up to {BATCH} sequences, step {STEP_S * 1000:g} ms + "
        f"{PER_SEQ_S * 1000:g} ms/sequence ({FULL_RATE:,.0f} tok/s full, {1 / step_s(1):.0f} tok/s alone); "
        f"{a.preemptions} preemptions; generation alone needs {ideal_h:.2f} h per node"
    )
    print(
        f"best possible with one load per node: {ideal_h / (ideal_h + a.engine.load_s / 3600):.1%} generating; handover "
        f"share {a.share:g}, decided every {a.decide_s:g} s\n"
    )
    print(
        f"{'policy':<44} {'starts':>6} {'node-h':>8} {'loading':>8} {'generating':>11} {'idle':>7} "
        f"{'gen share':>9} {'ceiling':>7} {'wall h':>7}  handed over"
    )
    t0 = time.perf_counter()
    base: dict[int, dict] = {}
    for policy, shards in (
        ("one shard per task", 64),
        ("claims", 64),
        ("claims", 256),
        ("claims", 512),
        ("claims + overlap", 64),
        ("claims + overlap", 512),
        ("claims + overlap + handover", 64),
        ("claims + overlap + handover", 512),
    ):
        r = simulate(
            lengths,
            nodes=a.nodes,
            shards=shards,
            policy=policy,
            preemptions=pre,
            share=a.share,
            decide_s=a.decide_s,
            prefill_tok_s=a.prefill_tok_s,
            engine=a.engine,
        )
        if policy == "claims":
            base[shards] = r
        print(
            row(f"{policy}, {shards} shards", r, base.get(shards) if policy != "claims" else None)
        )
    print(
        f"\n(goal: {GOAL:.0%} of allocated node time generating; against: node-hours and wall time as a ratio of "
        f"today's claims at the same shards; simulated in {time.perf_counter() - t0:.1f} s)"
    )
    if a.sweep:
        sweep(a, lengths, pre, base)
    if a.loop_rate > 0:
        loops(a, rng, lengths, pre)


def row(name: str, r: dict, base: dict | None) -> str:
    share = r["generating_h"] / r["alloc_h"]
    h = r["handed"]
    line = (
        f"{name:<44} {r['starts']:>6} {r['alloc_h']:>8.1f} {r['loading_h']:>8.1f} {r['generating_h']:>11.1f} "
        f"{r['idle_h']:>7.1f} {share:>9.1%} {r['generating_h'] / (r['generating_h'] + r['loading_h']):>7.1%} "
        f"{r['wall_h']:>7.2f}"
    )
    if h["tasks"]:
        line += (
            f"  {h['tasks']} tasks, {h['sequences']:,} sequences, {h['tokens'] / 1e6:.1f} M tokens"
        )
    if base is not None:
        line += f"  [node-h {r['alloc_h'] / base['alloc_h']:.2f}x, wall {r['wall_h'] / base['wall_h']:.2f}x]"
    return line


def sweep(a, lengths: list[int], pre, base: dict[int, dict]) -> None:
    """Where the handover's gain comes from: the share below which a task hands over, and how often it decides."""
    print(
        f"\n{'claims + overlap + handover':<44} {'starts':>6} {'node-h':>8} {'loading':>8} {'generating':>11} "
        f"{'idle':>7} {'gen share':>9} {'ceiling':>7} {'wall h':>7}"
    )
    for shards in (64, 512):
        for share, decide_s, prefill in (
            [(x, a.decide_s, 0.0) for x in (0.05, 0.1, 0.25, 0.5, 1.0)]
            + [(a.share, x, 0.0) for x in (1.0, 60.0, 300.0)]
            + [(x, a.decide_s, p) for p in (20_000.0, 5_000.0) for x in (0.25, 0.5, 1.0)]
        ):
            r = simulate(
                lengths,
                nodes=a.nodes,
                shards=shards,
                policy="claims + overlap + handover",
                preemptions=pre,
                share=share,
                decide_s=decide_s,
                prefill_tok_s=prefill,
                engine=a.engine,
            )
            how = f", prefill {prefill:,.0f} tok/s" if prefill else ""
            print(row(f"share {share:g}, every {decide_s:g} s{how}, {shards} sh.", r, base[shards]))
    for n in (0, a.preemptions):
        pre_n = pre[:n]
        r = simulate(
            lengths,
            nodes=a.nodes,
            shards=512,
            policy="claims + overlap + handover",
            preemptions=pre_n,
            share=a.share,
            decide_s=a.decide_s,
            prefill_tok_s=a.prefill_tok_s,
            engine=a.engine,
        )
        print(row(f"{n} preemptions, 512 sh.", r, None))


def loops(a, rng: random.Random, lengths: list[int], pre) -> None:
    """The claiming policies again, with a.loop_rate of the outputs in a loop: run to max_new_tokens, or stopped."""
    looping = set(rng.sample(range(len(lengths)), round(a.loop_rate * len(lengths))))
    seg = a.segment_tokens
    full = [MAX_NEW if i in looping else n for i, n in enumerate(lengths)]
    stopped = [
        min(MAX_NEW, math.ceil((n + 512) / seg) * seg) if i in looping else n
        for i, n in enumerate(lengths)
    ]
    useful = sum(n for i, n in enumerate(lengths) if i not in looping) / FULL_RATE / 3600
    spent_full = sum(full[i] for i in looping)
    spent_stopped = sum(stopped[i] for i in looping)
    print(
        f"\nwith {len(looping):,} outputs ({a.loop_rate:.0%}) in a loop: tokens decoded on them "
        f"{spent_full / 1e6:,.0f} M run to max_new_tokens ({spent_full / sum(full):.1%} of all decoded), "
        f"{spent_stopped / 1e6:,.1f} M stopped in segments of {seg:,} ({spent_stopped / spent_full:.1%} of that)"
    )
    print(
        f"{'policy':<44} {'loops':<8} {'node-h':>8} {'generating':>11} {'useful share':>12} {'gen share':>9} "
        f"{'wall h':>7}"
    )
    for policy, shards in (
        ("claims", 64),
        ("claims + overlap", 512),
        ("claims + overlap + handover", 64),
        ("claims + overlap + handover", 512),
    ):
        for how, ls in (("run", full), ("stopped", stopped)):
            r = simulate(
                ls,
                nodes=a.nodes,
                shards=shards,
                policy=policy,
                preemptions=pre,
                share=a.share,
                decide_s=a.decide_s,
                prefill_tok_s=a.prefill_tok_s,
                engine=a.engine,
            )
            print(
                f"{policy + f', {shards} shards':<44} {how:<8} {r['alloc_h']:>8.1f} {r['generating_h']:>11.1f} "
                f"{useful / r['alloc_h']:>12.1%} {r['generating_h'] / r['alloc_h']:>9.1%} {r['wall_h']:>7.2f}"
            )


if __name__ == "__main__":
    main()
