"""The worker's scheduling decisions, as pure functions that the worker (worker.claims) and the
mission-scale simulation (benchmarks/bench_claims_sim.py) both call: which shard to claim (`pick`),
when to open one more shard while the others finish (`opens_next`), and when a task at the run's
tail gives its work away (`hands_over`).

A worker that has finished a shard (or has just started its engine) is offered the shards nobody
holds and that still have work; it takes the one with the most prompts left (the longest job first
keeps the run's tail short: a shard half done by a preempted task waits until the fresh ones are
taken), and among equals the first in its own order, which starts at its own place in the pool:
worker i of n starts with the i-th shard, so that n workers starting at once take n different shards
without racing for the same lock.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["HANDOVER_SHARE", "Candidate", "Tail", "hands_over", "opens_next", "pick", "start_of"]

# a task at the tail running at most this share of what it keeps in flight gives it away
HANDOVER_SHARE = 0.25


class Candidate(NamedTuple):
    shard: int
    remaining: int  # prompts of the shard without a record yet (the whole shard when it never ran)


def start_of(worker: int, workers: int, pool: list[int]) -> int:
    """Where worker `worker` of `workers` starts in `pool`: spread evenly over it (worker i at slot
    i when there are as many shards as workers or more)."""
    if not pool or workers <= 0:
        return 0
    return worker * len(pool) // workers % len(pool) if workers > 1 else 0


def pick(candidates: list[Candidate], pool: list[int], start: int) -> int | None:
    """The shard to claim among `candidates` (shards of `pool` unheld and unfinished): the most
    prompts left, ties broken by the pool's order rotated to begin at index `start`. None when there
    is none."""
    if not candidates:
        return None
    where = {k: i for i, k in enumerate(pool)}
    n = len(pool) or 1
    return min(candidates, key=lambda c: (-c.remaining, (where.get(c.shard, 0) - start) % n)).shard


def opens_next(unsent: int, in_flight: int, target: int) -> bool:
    """Keep the batch full across shards: a worker claims one more shard when the shards it holds
    have no prompt left to send (their last ones are in flight) and its engine has room (fewer
    requests in flight than the `target` it keeps). Each shard stays the unit of storage, resume and
    status; only the sending overlaps."""
    return unsent <= 0 and in_flight < target


class Tail(NamedTuple):
    """One live task at the run's tail, as its progress says."""

    task: str
    running: int  # requests it has in flight
    target: int  # requests it keeps in flight (its batch's room)
    leaving: bool = False  # it is handing its work over already

    @property
    def room(self) -> int:
        return 0 if self.leaving else max(0, self.target - self.running)


def hands_over(me: Tail, others: list[Tail], claimable: int, share: float = HANDOVER_SHARE) -> bool:
    """Hand the run's tail over: with no shard left to claim, a task whose engine runs few sequences
    (at most `share` of its target, at least one) gives them away, when the tasks staying have room
    for all of them, and it runs the fewest of the tasks at the tail (ties: the first name), so that
    two tasks never leave for each other and each handover ends a task (at most one per task: the
    decisions are bounded). The task that leaves aborts its requests, keeps them as partial records,
    releases its shards and ends; a task with room claims them (`opens_next`) and continues the
    partials."""
    if claimable > 0 or me.leaving or me.running <= 0 or me.running > share * me.target:
        return False
    staying = [o for o in others if not o.leaving and o.task != me.task]
    if not staying or sum(o.room for o in staying) < me.running:
        return False
    return all((me.running, me.task) < (o.running, o.task) for o in staying)
