"""A shard's requests: `consume` is one request slot of a shard — it takes prompts from the shard's
feed until the feed is empty or the shard stops, sends each (worker.generate), records what comes
back (worker.answers), tries a failure that may pass again up to [client] max_tries, tells a failed
request's engine from its prompt (worker.enginecheck, and a poisoned request from an unreachable
engine), and keeps at a stop the time a prompt waited without an answer; `save_in_flight` keeps the
partial outputs of every open shard at a stop."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from toolkit.engines.base import EngineDied, EngineUnreachable
from toolkit.engines.client import (
    ClientError,
    HttpClient,
    RequestRejected,
    ServerError,
    TimedOut,
    Unreachable,
)
from toolkit.engines.endpoints import abort_requests, health_generate
from toolkit.formats.records import (
    OK,
    TIMEOUT,
    TRANSIENT,
    Record,
    failed_record,
    pack_ids,
)
from toolkit.worker.answers import empty_partial, partial_record, result_record
from toolkit.worker.feed import Feed
from toolkit.worker.generate import Unanswered, generate_output
from toolkit.worker.openshard import Shard
from toolkit.worker.shard import Batch, health_timeout

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

ABORT_GRACE_S = 30.0  # after a stop's abort, how long the partial outputs may take to come back
# _answer: the request failed while the engine failed every request; no try, the prompt goes again
AGAIN = "again"


async def consume(sh: Shard, feed: Feed, engine, info) -> None:
    """One request slot: take prompts from the feed and record what comes back, until the feed is
    empty or the shard stops. A prompt whose failure may pass is tried again here, after a backoff,
    up to client.max_tries tries in all (counted in its records: `_settle`); then its failure is
    final for the run."""
    while True:
        # stopping, or fewer in flight wanted (pool)
        if sh.stopping or sh.batch.live > sh.batch.target:
            return
        item = await feed.get()
        if item is None or sh.stopping:
            return
        if item.error is not None:
            kind, message = item.error
            ds = sh.plan.datasets[item.ref.dataset].name
            sh.add(failed_record(item.ref.id, ds, item.pos, item.ids or [], message, 0, kind))
            continue
        try:
            # bounded: every failed try counts (sh.tries), the last one is final (_settle)
            while True:
                rec = await _answer(sh, item, engine, info)
                if rec is AGAIN:  # the engine's failure, not the prompt's: no try counted
                    if _stopped(sh):
                        break
                    continue
                if rec is None or not await _settle(sh, rec):
                    break
        # cancelled, or the engine died: the prompt goes out again after the restart
        except BaseException:
            feed.redo.append(item)
            raise


async def _answer(sh: Shard, item, engine, info) -> Record | str | None:
    """One try of a prompt: its record, None when what came back is a partial output (recorded
    here), or AGAIN when its request failed because the engine failed every request at the time
    (worker.enginecheck): that is no try of the prompt."""
    pos, ref, ids = item.pos, item.ref, item.ids
    ds = sh.plan.datasets[ref.dataset].name
    prior = _prior(sh, ref.id, ids)
    wait = Unanswered()
    try:
        res = await generate_output(sh, ids, ds, ref, engine, pos, prior, wait, item.dp_rank)
    except asyncio.CancelledError:
        if _stopped(sh):  # a stop cut the try short: its time without an answer is kept
            keep_unanswered(sh, ref, ds, pos, ids, prior, wait)
        raise
    except RequestRejected as e:
        sh.requests.heard()
        return failed_record(ref.id, ds, pos, ids, str(e), e.attempts, e.kind)
    except ClientError as e:  # not answered, a 5xx, or an answer that breaks the protocol
        if not engine.alive():
            raise EngineDied(str(e)) from None  # (the item goes back to the feed: see consume)
        check = getattr(sh.session, "check", None)
        engine_wide = isinstance(e, ServerError) or (
            isinstance(e, Unreachable) and not isinstance(e, TimedOut)
        )
        if engine_wide and check is not None and await check.unwell(f"prompt {ref.id}: {e}"):
            return AGAIN
        message = str(e)
        if isinstance(e, Unreachable) and not isinstance(e, TimedOut):
            # raises EngineUnreachable for a dead engine
            message = await _poisoned(sh, engine, ref.id, e)
        # unreachable: one request's connection cut
        return failed_record(ref.id, ds, pos, ids, message, e.attempts, e.kind)
    # the server's aborts ran out without progress: a failed try (aborted)
    if res.partial and not sh.stopping:
        return result_record(ref, ds, pos, ids, res, info)
    if res.partial:
        if res.res.completion_tokens > (prior.n_output if prior else 0):
            rec = partial_record(ref, ds, pos, ids, res, info)
            rec.tries = sh.requests.tried(ref.id)
            sh.partial_saved(rec)
        else:  # aborted at the stop with nothing new: its time without an answer is kept
            keep_unanswered(sh, ref, ds, pos, ids, prior, wait)
        return None
    return result_record(ref, ds, pos, ids, res, info)


def _stopped(sh: Shard) -> bool:
    """Whether the shard is stopping (a stop signal, a handover), with or without saving."""
    return sh.session.stop.is_set()


def keep_unanswered(
    sh: Shard, ref, ds: str, pos: int, ids: list[int], prior: Record | None, wait: Unanswered
) -> None:
    """At a stop, a prompt whose try was cut short without an answer: the time it waited (added to
    what its partial record carried, unless output came meanwhile) counts — each try's bound of it
    (retries + 1 request timeouts) as one try — and what is left is carried by a PARTIAL record
    (Record.unanswered_s) to the next run of the shard, in whatever task. Past [client] max_tries it
    is a final timeout, as a try that ran to its end would have been."""
    c = sh.spec.client
    carried = 0.0 if wait.answered or prior is None else prior.unanswered_s
    waited = carried + time.monotonic() - wait.since
    if wait.try_s <= 0 or waited < 1.0:
        return
    kept = sh.requests.take_partial(ref.id) or prior
    tries = sh.requests.tried(ref.id)
    counted = int(waited // wait.try_s)
    if tries + counted >= c.max_tries:
        rec = failed_record(
            ref.id,
            ds,
            pos,
            ids,
            f"failed {_times(c.max_tries)}: timeout; last: no answer in {waited:.0f} s in flight, "
            f"cut short by a stop; every {wait.try_s:g} s in flight without an answer (a try's "
            "bound), across stops, counts as a try",
            kept.attempts if kept else 0,
            TIMEOUT,
        )
        rec.tries, rec.final = c.max_tries, True
        sh.requests.settled(ref.id)
        log.warning(
            "prompt %s (%s): no answer in %.0f s in flight across stops: final for this "
            "run after %s",
            ref.id,
            ds,
            waited,
            _times(c.max_tries),
        )
    else:
        rec = empty_partial(ref, ds, pos, ids) if kept is None else msgspec.structs.replace(kept)
        rec.tries, rec.unanswered_s = tries + counted, round(waited - counted * wait.try_s, 3)
        if counted:
            sh.requests.count_tries(ref.id, rec.tries)
            log.warning(
                "prompt %s (%s): no answer in %.0f s in flight, its try cut short by a "
                "stop: counted as %s ([client] max_tries = %d)",
                ref.id,
                ds,
                waited,
                f"try {rec.tries}" if counted == 1 else f"tries up to {rec.tries}",
                c.max_tries,
            )
    sh.add(rec)


async def _settle(sh: Shard, rec: Record) -> bool:
    """Record one try's outcome; whether to try the prompt again (after the backoff, already
    waited). A failure that may pass counts one more try of its id (Record.tries); at
    client.max_tries it is final for this run. A stop during the backoff leaves the try recorded as
    it is: the next run of the shard goes on counting from it."""
    c = sh.spec.client
    if rec.status == OK or rec.failure not in TRANSIENT:
        sh.add(rec)
        sh.requests.settled(rec.id)
        return False
    tries = rec.tries = sh.requests.tried(rec.id) + 1
    if tries >= c.max_tries:
        rec.final = True
        rec.error = f"failed {_times(tries)}: {rec.failure}; last: {rec.error}"
        sh.add(rec)
        sh.requests.settled(rec.id)
        return False
    sh.requests.count_tries(rec.id, tries)
    delay = min(c.backoff_max_s, c.backoff_s * 2 ** (tries - 1))
    sh.add(rec, settled=False)
    log.warning(
        "prompt %s (%s) failed (%s), try %d of %d ([client] max_tries): %s; trying again in %.1f s",
        rec.id,
        rec.dataset,
        rec.failure,
        tries,
        c.max_tries,
        rec.error,
        delay,
    )
    return await _backoff(sh, delay)


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


async def _backoff(sh: Shard, seconds: float) -> bool:
    """Wait `seconds` unless the shard stops meanwhile; whether it did not stop."""
    deadline = time.monotonic() + seconds
    while not sh.stopping and (left := deadline - time.monotonic()) > 0:  # bounded by the deadline
        await asyncio.sleep(min(0.1, left))
    return not sh.stopping


async def _poisoned(sh: Shard, engine, id: str, e: Unreachable) -> str:
    """A request whose connection failed past its retries: one poisoned request (the engine still
    generates: /health_generate answers 200), whose failure is recorded and the shard goes on — the
    message saying so — or an engine that cannot be reached (EngineUnreachable: the shard cannot
    finish in this task)."""
    timeout = health_timeout(sh.spec.engine.hang_timeout_s)
    why = await health_generate(sh.session.probes, timeout=timeout)
    if why is not None:
        if await _ends_within(engine, DYING_S):
            raise EngineDied(f"engine exited with code {engine.exit_code()}") from None
        raise EngineUnreachable(
            f"engine at {engine.url} unreachable: prompt {id} got no answer after {e.attempts} "
            f"attempts ({e}), and /health_generate {why}"
        ) from None
    return (
        f"no complete answer after {e.attempts} attempts ({e}), while the engine answers "
        "/health_generate: only this request fails"
    )


# A dying engine refuses connections before its process ends: a multi-node engine whose rank died is
# ended by srun (--kill-on-bad-exit), seconds after rank 0 closed its port. Waited for before
# calling it unreachable.
DYING_S = 30.0


async def _ends_within(engine, seconds: float) -> bool:
    """Whether the engine's process ends within `seconds` (at once if it has ended)."""
    deadline = time.monotonic() + seconds
    while engine.alive():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.2)
    return True


def _prior(sh: Shard, id: str, ids: list[int]) -> Record | None:
    """The PARTIAL record to continue for this prompt, if any (and if it was made from the same
    prompt ids)."""
    prior = sh.requests.take_partial(id)
    if prior is not None and prior.prompt_ids != pack_ids(ids):
        log.warning(
            "prompt %s: its partial output was made from other prompt ids; generating it from "
            "scratch",
            id,
        )
        return None
    return prior


async def save_in_flight(batch: Batch, stop, engine, probes: HttpClient) -> None:
    """On a stop request (the session's `Stop`): send nothing new from any open shard (`saving`),
    abort every request in flight so that each comes back with its partial output (recorded PARTIAL
    by the consumers of its own shard, continued next time), and return after ABORT_GRACE_S (the
    session's loop ends earlier, once every shard's consumers are back). The engine is still up (it
    ignores SIGUSR2; the worker stops it afterwards)."""
    await stop.wait()
    stop.saving = True
    for sh in batch.shards:
        if sh.feed is not None:
            sh.feed.close()
    n = batch.in_flight
    if n:
        # abort_all would also end other clients' requests on a shared server
        owned = engine.kind != "external"
        log.warning(
            "stopping: aborting the %d requests in flight (%s) to keep their partial outputs",
            n,
            "abort_all" if owned else "by rid",
        )
        try:
            rids = None if owned else sorted(r for sh in batch.shards for r in sh.requests.rids)
            await abort_requests(probes, rids)
        except Unreachable as e:
            log.warning(
                "could not abort the requests in flight (%s): their outputs are generated again", e
            )
            return
    deadline = time.monotonic() + ABORT_GRACE_S
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    log.warning(
        "%d requests still unanswered %.0f s after the abort: generated again next time",
        batch.in_flight,
        ABORT_GRACE_S,
    )
