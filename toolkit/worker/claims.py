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
import logging
import os
import time

import msgspec

from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardstate import ShardStatus
from toolkit.job.schema import JobSpec
from toolkit.worker.policy import pick, start_of
from toolkit.worker.poolview import (
    HANDOVER_WAIT_S,
    being_handed_over,
    busy,
    claimable,
    hand_over,
    look,
    untrusted,
)
from toolkit.worker.run import STOPPED, open_shard
from toolkit.worker.session import EngineSession
from toolkit.worker.shard import SHARD_ERRORS, ShardBusy, ShardEnd, Shards, shard_lines

__all__ = [
    "ClaimResult",
    "Claims",
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

    async def claim() -> ClaimResult:
        run = Run.open(run_dir, JobSpec, finish=True)
        rd, plan = run.rd, run.plan
        recheck = untrusted(rd, plan, pool) if verify else set()
        session = EngineSession(plan.spec, task=task, group=group)
        claims = Claims(
            rd,
            plan,
            pool,
            session,
            start=start_of(worker, workers, pool),
            group=group,
            keep_going=keep_going,
            recheck=recheck,
        )
        session.begin(claims.who)
        return await claims.run()

    return asyncio.run(claim())


class Claims(Shards):
    """One worker's claim loop: what it looks at (the run, its pool, where it starts in it), what it
    has decided (shards it skips, races lost, until when it waits for shards being handed over) and
    what it did (`result`). The engine session serves the shards it opens and calls it back at each
    turn: `next_shard` (claim and open the next one), `shard_ended` (count its end), `hand_over` (at
    the run's tail, whether this task leaves)."""

    more = True

    def __init__(
        self,
        rd: RunDir,
        plan: RunPlan,
        pool: list[int],
        session: EngineSession,
        *,
        start: int,
        group: str | None,
        keep_going: bool,
        recheck: set[int],
    ):
        self.rd, self.plan, self.pool, self.session = rd, plan, pool, session
        self.opened = Run(rd, plan)  # the run, for its shards' states
        self.start, self.group, self.keep_going = start, group, keep_going
        self.recheck = recheck  # done manifests not trusted: claimable again (see `untrusted`)
        self.who = session.task or "worker"
        self.result = ClaimResult()
        self.skip: set[int] = set()  # never claimed again by this worker
        self.races: dict[int, int] = {}  # shard -> times another worker took it the same moment
        # how long a task with nothing open waits for shards being handed over
        self.handed_until = time.monotonic() + HANDOVER_WAIT_S

    async def run(self) -> ClaimResult:
        """Claim, serve and count shards until none is left or the worker stops; the engine stopped
        at the end."""
        session, result = self.session, self.result
        try:
            while not session.stop.is_set():
                first = await self.next_shard()
                if first is None:
                    break
                await session.serve(first, self)
            if session.stop.halted is not None:
                raise session.stop.halted
            self._finish()
        finally:
            result.engine_starts = session.starts
            try:
                await session.close()
            finally:
                session.end()
                self._say_end()
        return result

    def shard_ended(self, sh, out) -> None:
        self._count(sh.shard, out)

    def _count(self, k: int, out) -> None:
        """One shard's end, in the result: failed, handed over, stopped, or done here (this worker
        has nothing more to give it: its failures that may pass are final)."""
        session, result = self.session, self.result
        if isinstance(out, SHARD_ERRORS):
            result.failed.append(k)
            if not self.keep_going:
                session.stop.halt(out)
        elif out.end == STOPPED and session.stop.leaving and out.stop_signal is None:
            result.handed_over.append(k)
        elif out.end == STOPPED:
            result.stopped = result.stopped or out.stop_signal or session.stop.signal or "stop"
        else:
            result.done.append(k)

    async def next_shard(self):
        """The next shard claimed and opened, or None when none is left (or the worker stops)."""
        session = self.session
        while not session.stop.is_set():
            states = look(self.opened, self.pool, group=self.group, recheck=self.recheck)
            k = pick(claimable(self.plan, states, self.skip), self.pool, self.start)
            if k is None and self._wait_for_handover(states):
                # a task leaving releases its shards once its requests are back
                await asyncio.sleep(0.5)
                continue
            if k is None:
                return None
            opened = self._claim(k)
            if opened is not None:
                return opened
        return None

    def _wait_for_handover(self, states: list[ShardStatus]) -> bool:
        """Nothing to claim and nothing open: whether shards are being handed over (and the wait
        for them is not over)."""
        return (
            not self.session.batch.shards
            and time.monotonic() < self.handed_until
            and being_handed_over(states)
        )

    def _claim(self, k: int):
        """Claim and open shard `k`: the shard to serve, or None (lost to another worker, failed,
        or nothing left to do in it: counted)."""
        session = self.session
        with shard_lines(k):
            log.info(
                "%s claims shard %d (its shard %d in this task; engine started %d time(s) so far)",
                self.who,
                k,
                len(session.served) + 1,
                session.starts,
            )
        self.recheck.discard(k)
        try:
            opened = open_shard(self.rd, self.plan, k, session)
        except ShardBusy:  # another worker took it the moment before
            self.races[k] = self.races.get(k, 0) + 1
            if self.races[k] >= RACES:
                self.skip.add(k)
            return None
        except SHARD_ERRORS as e:
            self.skip.add(k)
            self._count(k, e)
            return None
        self.skip.add(k)  # claimed: held by this worker from now on, never claimed again by it
        if isinstance(opened, ShardEnd):
            self._count(k, opened)
            return None
        return opened

    def hand_over(self, batch) -> bool:
        """At the run's tail: whether this task leaves, its requests handed over (`hand_over`)."""
        # what is in flight would be generated again: not worth it
        if not self.plan.spec.client.save_in_flight:
            return False
        self.handed_until = time.monotonic() + HANDOVER_WAIT_S
        return hand_over(self.opened, self.pool, self.who, batch)

    def _finish(self) -> None:
        """The result's last words: requests handed over, the stop, the shards others hold."""
        session, result = self.session, self.result
        if session.stop.leaving:
            result.requests_handed = session.stop.handed[0]
            log.warning(
                "%s handed over %d requests of shards %s at the run's tail (kept as partial "
                "outputs, continued by the task that claims them) and ends",
                self.who,
                result.requests_handed,
                result.handed_over,
            )
        if session.stop.is_set() and result.stopped is None and not session.stop.leaving:
            result.stopped = session.stop.signal or "stop"
        result.busy = busy(self.opened, self.pool) if result.stopped is None else []

    def _say_end(self) -> None:
        result, session = self.result, self.session
        log.info(
            "%s ends: %d shard(s) done, %d failed, engine started %d time(s), at most %d shard(s) "
            "open at once%s",
            self.who,
            len(result.done),
            len(result.failed),
            session.starts,
            session.most_open,
            f"; stopped by {result.stopped}" if result.stopped else "",
        )
