"""A worker that claims shards: one engine, started once, serving the shards of a pool until none is
left.

The unit of work is the shard (resume, exactly-once, status); the unit of allocation is the worker
(a Slurm array task, or one of `toolkit run`'s workers). A worker starts its engine for the first
shard it claims and keeps it running: as soon as the shards it holds have nothing left to send and
its engine has room (worker.policy.opens_next), it claims the next unfinished shard nobody holds
(worker.policy.pick chooses which) and sends its prompts while the previous shards' last requests
finish (worker.session), until none is left, and exits. To claim a shard is to take its file's lock
(formats.locks): a second worker is refused it, and a worker that dies (kill -9, a node lost, a
requeue) releases it with its process, so the shard is claimed again by whichever worker is free
next, and resumed from what its file holds.

A shard that fails in a worker is not claimed again by the workers of the same group (one Slurm
array job, or one `toolkit run`): it waits for `toolkit resubmit` or the next `toolkit run`, as a
failed one-shard task did. A stop signal (time limit, preemption, Ctrl-C) stops every shard open in
the worker (what is in flight saved) and the worker after them; the requeued task claims again.

The run's tail: when nothing is left to claim, a task whose engine runs few requests while the
other tasks have room for them hands them over (`hand_over`, worker.policy.hands_over, decided and
published under the run's handover lock): its shards stop as at a stop signal, their requests kept
as partial records, their locks released, and it ends (exit 0); a task with room claims them and
continues the partials. A task with nothing open waits, bounded (HANDOVER_WAIT_S), for shards a
leaving task still holds. A task hands over at most once: it ends after.

The claim loop ends: each turn either finishes a shard (never claimed again by this worker: a shard
run ends with no failure that may pass left, each tried at most [client] max_tries times, see
worker.inflight), fails it (not claimed again in the group), loses it to another worker (left to it
after RACES such races), or stops; so a worker claims each shard of its pool at most RACES times."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import time

import msgspec

from toolkit.formats.locks import try_flock
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardstate import BUSY, CLAIM, VERIFIED, ShardState, ShardStatus
from toolkit.job.spec import JobSpec
from toolkit.worker.policy import Candidate, Tail, hands_over, pick, start_of
from toolkit.worker.run import STOPPED, ShardEnd, open_shard, shard_lines
from toolkit.worker.session import EngineSession
from toolkit.worker.shard import SHARD_ERRORS, ShardBusy

__all__ = [
    "ClaimResult",
    "claimable",
    "look",
    "run_claims",
    "slurm_group",
    "slurm_task",
]

log = logging.getLogger("toolkit.worker.claims")

RACES = 3  # a shard lost this many times to another worker taking it the same moment is left to it


class ClaimResult(msgspec.Struct):
    """What one claiming worker did."""

    done: list[int] = []  # shards it finished (or found finished)
    failed: list[int] = []  # shards that failed in it
    busy: list[int] = []  # unfinished shards other workers held when it found nothing left to claim
    stopped: str | None = None  # the signal that stopped it (None: it ran out of shards, or failed)
    # shards it handed over at the run's tail (their requests kept as partials)
    handed_over: list[int] = []
    requests_handed: int = 0  # requests in flight it handed over
    engine_starts: int = 0


def slurm_task() -> str | None:
    """This Slurm task's name, `12_3` for an array task, `12` for a job; None outside Slurm."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


def slurm_group() -> str | None:
    """The group of workers sharing a pool under Slurm: the array job (or the job)."""
    env = os.environ
    return env.get("SLURM_ARRAY_JOB_ID") or env.get("SLURM_JOB_ID")


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
    return {k for k in pool if Run(rd, plan).shard_state(k, VERIFIED).state is ShardState.UNTRUSTED}


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
                sh.progress.leaving = True
                sh.save_progress()
            return True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _being_handed_over(states: list[ShardStatus]) -> bool:
    """Some shard of a look is held by a task that is leaving: it is claimable once that task lets
    go."""
    return any(
        st.state is ShardState.HELD and st.progress is not None and st.progress.leaving
        for st in states
    )


def _busy(run: Run, pool: list[int]) -> list[int]:
    return [k for k in pool if run.shard_state(k, BUSY).busy]


def run_claims(
    run_dir: str | os.PathLike,
    pool: list[int],
    *,
    worker: int = 0,
    workers: int = 1,
    task: str | None = None,
    group: str | None = None,
    keep_going: bool = True,
    verify: bool = True,
) -> ClaimResult:
    """Claim shards of `pool` with one engine, until none is left or a signal stops it: the next
    shard is claimed as soon as the open ones have nothing left to send (worker.session), so several
    may be open at once. Worker `worker` of `workers` starts at its own place in the pool
    (worker.policy.start_of). With `keep_going` a failed shard does not end the worker (it claims
    the next); without, the first failure ends it (raised, once the other open shards have stopped).
    With `verify`, done manifests are first checked against their files (`untrusted`: read once, at
    the start)."""
    return asyncio.run(
        _claims(
            run_dir,
            pool,
            worker=worker,
            workers=workers,
            task=task,
            group=group,
            keep_going=keep_going,
            verify=verify,
        )
    )


async def _claims(
    run_dir,
    pool: list[int],
    *,
    worker: int,
    workers: int,
    task: str | None,
    group: str | None,
    keep_going: bool,
    verify: bool,
) -> ClaimResult:
    run = Run.open(run_dir, JobSpec, finish=True)
    rd, plan = run.rd, run.plan
    recheck = untrusted(rd, plan, pool) if verify else set()
    session = EngineSession(plan.spec, task=task, group=group)
    session.begin(task or "worker")
    start = start_of(worker, workers, pool)
    result = ClaimResult()
    skip: set[int] = set()
    races: dict[int, int] = {}
    who = task or "worker"

    def ended(sh, out) -> None:
        said(sh.shard, out)

    def said(k: int, out) -> None:
        if isinstance(out, SHARD_ERRORS):
            result.failed.append(k)
            if not keep_going:
                session.halt(out)
        elif out.end == STOPPED and session.leaving and out.stop_signal is None:
            result.handed_over.append(k)
        elif out.end == STOPPED:
            result.stopped = result.stopped or out.stop_signal or session.stop_signal or "stop"
        else:
            # done here: this worker has nothing more to give it (its failures that may
            result.done.append(k)
            # pass are final)

    async def claim_next():
        """The next shard claimed and opened, or None when none is left (or the worker stops)."""
        while not session.stop.is_set():
            states = look(run, pool, group=group, recheck=recheck)
            k = pick(claimable(plan, states, skip), pool, start)
            if (
                k is None
                and not session.batch.shards
                and time.monotonic() < handed_until[0]
                and _being_handed_over(states)
            ):
                # a task leaving releases its shards once its requests are back
                await asyncio.sleep(0.5)
                continue
            if k is None:
                return None
            with shard_lines(k):
                log.info(
                    "%s claims shard %d (its shard %d in this task; engine started %d time(s) so "
                    "far)",
                    who,
                    k,
                    len(session.served) + 1,
                    session.starts,
                )
            recheck.discard(k)
            try:
                opened = open_shard(rd, plan, k, session)
            except ShardBusy:  # another worker took it the moment before
                races[k] = races.get(k, 0) + 1
                if races[k] >= RACES:
                    skip.add(k)
                continue
            except SHARD_ERRORS as e:
                skip.add(k)
                said(k, e)
                if not keep_going:
                    return None
                continue
            skip.add(k)  # claimed: held by this worker from now on, never claimed again by it
            if isinstance(opened, ShardEnd):
                said(k, opened)
                continue
            return opened
        return None

    # how long a task with nothing open waits for shards being handed over
    handed_until = [float("inf")]

    def tail_check(batch) -> bool:
        # what is in flight would be generated again: not worth it
        if not plan.spec.client.save_in_flight:
            return False
        handed_until[0] = time.monotonic() + HANDOVER_WAIT_S
        return hand_over(run, pool, who, batch)

    session.handover = tail_check
    handed_until[0] = time.monotonic() + HANDOVER_WAIT_S
    try:
        while not session.stop.is_set():
            first = await claim_next()
            if first is None:
                break
            await session.serve(first, claim_next, ended)
        if session.halted is not None:
            raise session.halted
        if session.leaving:
            result.requests_handed = session.handed[0]
            log.warning(
                "%s handed over %d requests of shards %s at the run's tail (kept as partial "
                "outputs, "
                "continued by the task that claims them) and ends",
                who,
                result.requests_handed,
                result.handed_over,
            )
        if session.stop.is_set() and result.stopped is None and not session.leaving:
            result.stopped = session.stop_signal or "stop"
        result.busy = _busy(run, pool) if result.stopped is None else []
    finally:
        result.engine_starts = session.starts
        try:
            await session.close()
        finally:
            session.end()
            log.info(
                "%s ends: %d shard(s) done, %d failed, engine started %d time(s), at most %d "
                "shard(s) "
                "open at once%s",
                who,
                len(result.done),
                len(result.failed),
                session.starts,
                session.most_open,
                f"; stopped by {result.stopped}" if result.stopped else "",
            )
    return result
