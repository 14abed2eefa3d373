"""What a claiming task sees of its pool: every shard's state in one look (`look`), the shards it
may claim (`claimable`), the done manifests it cannot trust (`untrusted`), and the run's tail: the
other live tasks (`tails`) and whether this one leaves, handing its requests over (`hand_over`,
decided and published under the run's handover lock). worker.claims acts on what it sees."""

from __future__ import annotations

import fcntl
import logging

from toolkit.formats.locks import try_flock
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardstate import BUSY, CLAIM, VERIFIED, ShardState, ShardStatus
from toolkit.worker.policy import Candidate, Tail, hands_over

__all__ = [
    "HANDOVER_WAIT_S",
    "being_handed_over",
    "busy",
    "claimable",
    "hand_over",
    "look",
    "tails",
    "untrusted",
]

log = logging.getLogger("toolkit.worker.claims")


def look(
    run: Run, pool: list[int], *, group: str | None = None, recheck: set[int] = frozenset()
) -> list[ShardStatus]:
    """Every shard of `pool` as a claiming task sees it, in one scan: done, held by a writer
    elsewhere, failed in this group (`group`), untrusted (in `recheck`), or claimable; with the
    progress of those not done (a done shard costs one file). One look serves the choice of the next
    shard (`claimable`) and the wait for shards being handed over; `tails` takes its own."""
    return [run.shard_state(k, CLAIM, group=group, recheck=k in recheck) for k in pool]


def claimable(plan: RunPlan, states: list[ShardStatus], skip: set[int]) -> list[Candidate]:
    """The shards of a look a free worker may claim: unfinished (no done manifest, or failures that
    may pass, or ids `toolkit retry` asked for, or in `recheck`: a done manifest its file no longer
    matches), not held by another worker right now, not failed in this group, not in `skip`; each
    with the prompts it has left, as its progress file says."""
    out = []
    for st in states:
        if st.shard in skip or st.state in (ShardState.DONE, ShardState.HELD, ShardState.FAILED):
            continue
        p = st.progress
        total = plan.shards[st.shard].count
        out.append(
            Candidate(
                st.shard, max(0, total - (p.done if p is not None and p.state != "done" else 0))
            )
        )
    return out


def untrusted(rd: RunDir, plan: RunPlan, pool: list[int]) -> set[int]:
    """Shards of `pool` whose done manifest cannot be trusted: another run's, or its file changed
    since (size, sha256). Running them again checks the file, salvages what is intact and generates
    the rest (worker.run)."""
    run = Run(rd, plan)
    return {k for k in pool if run.shard_state(k, VERIFIED).state is ShardState.UNTRUSTED}


# a task with nothing open waits this long for shards another task hands over
HANDOVER_WAIT_S = 90.0


def tails(run: Run, pool: list[int], me: str) -> list[Tail]:
    """The other live tasks at the run's tail, as the progress files of the shards they hold say
    (a fresh `look`): requests running, requests kept in flight, leaving or not (a task holding
    several shards counts once)."""
    out: dict[str, Tail] = {}
    for st in look(run, pool):
        p = st.progress
        if (
            st.state is not ShardState.HELD
            or p is None
            or p.task in (None, me)
            or p.state not in ("loading", "generating")
        ):
            continue
        was = out.get(p.task)
        out[p.task] = Tail(
            p.task,
            max(p.running or 0, was.running if was else 0),
            max(p.in_flight_target or 0, was.target if was else 0),
            p.leaving or (was.leaving if was else False),
        )
    return list(out.values())


def hand_over(run: Run, pool: list[int], me: str, batch) -> bool:
    """Whether this task leaves at the run's tail (worker.policy.hands_over), decided and published
    (its shards' progress says `leaving`) under the run's handover lock, so that two tasks never
    leave for each other. False when another task holds the lock (the next look decides)."""
    with open(run.rd.handover_lock, "a+b") as f:
        # never waited for: this runs on the event loop; the next look comes a second later
        taken = try_flock(f.fileno())
        if taken is None:  # two tasks could leave for each other: each finishes its own shards
            log.debug("%s: no flock on this file system: no handover", run.rd.handover_lock)
        if not taken:
            return False
        try:
            if not hands_over(
                Tail(me, batch.in_flight, batch.target), tails(run, pool, me), claimable=0
            ):
                return False
            for sh in batch.shards:
                sh.leave()
            return True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def being_handed_over(states: list[ShardStatus]) -> bool:
    """Some shard of a look is held by a task that is leaving: it is claimable once that task lets
    go."""
    return any(
        st.state is ShardState.HELD and st.progress is not None and st.progress.leaving
        for st in states
    )


def busy(run: Run, pool: list[int]) -> list[int]:
    return [k for k in pool if run.shard_state(k, BUSY).busy]
