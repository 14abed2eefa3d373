"""Which shard a free worker claims next: one pure function, `pick`, that the worker (worker.claims) and the
mission-scale simulation (benchmarks/bench_claims_sim.py) both call.

A worker that has finished a shard (or has just started its engine) is offered the shards nobody holds and that
still have work; it takes the one with the most prompts left (the longest job first keeps the run's tail short:
a shard half done by a preempted task waits until the fresh ones are taken), and among equals the first in its
own order, which starts at its own place in the pool: worker i of n starts with the i-th shard, so that n workers
starting at once take n different shards without racing for the same lock.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Candidate", "pick", "start_of"]


class Candidate(NamedTuple):
    shard: int
    remaining: int   # prompts of the shard without a record yet (the whole shard when it never ran)


def start_of(worker: int, workers: int, pool: list[int]) -> int:
    """Where worker `worker` of `workers` starts in `pool`: spread evenly over it (worker i at slot i when there
    are as many shards as workers or more)."""
    if not pool or workers <= 0:
        return 0
    return worker * len(pool) // workers % len(pool) if workers > 1 else 0


def pick(candidates: list[Candidate], pool: list[int], start: int) -> int | None:
    """The shard to claim among `candidates` (shards of `pool` unheld and unfinished): the most prompts left,
    ties broken by the pool's order rotated to begin at index `start`. None when there is none."""
    if not candidates:
        return None
    where = {k: i for i, k in enumerate(pool)}
    n = len(pool) or 1
    return min(candidates, key=lambda c: (-c.remaining, (where.get(c.shard, 0) - start) % n)).shard
