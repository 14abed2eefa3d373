"""How many requests to keep in flight and whether the engine still answers: one `Batch` per engine
(the requests kept in flight across every shard it serves), its target for concurrency "auto" from
the server's load (/v1/loads) and capacity (/server_info), each open shard's pool of request slots
within it, and the watch that flushes due batches, refreshes progress, hands freed memory back and
notices an engine that died or hung."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time

from toolkit.engines.base import EngineDied, EngineHung
from toolkit.engines.client import HttpClient
from toolkit.engines.endpoints import health_generate, read_load
from toolkit.formats.progress import REFRESH_S
from toolkit.worker.exitguard import cancel_and_wait
from toolkit.worker.feed import Feed
from toolkit.worker.inflight import consume
from toolkit.worker.openshard import Shard
from toolkit.worker.shard import AUTO_START, Batch, health_timeout

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

LOAD_POLL_S = 1.0  # how often /v1/loads is read while generating
# how often the memory the worker freed is handed back to the OS (malloc_trim)
TRIM_S = 5.0


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS). The rendered prompts
    and the answers churn through malloc's arenas (from the render thread, the tokenizer's threads
    and the event loop); what they free stays there, a few MB more as the shard goes on, unless it
    is handed back."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_TRIM = _malloc_trim()


class HangWatch:
    """Notices an engine that is alive but answers nothing (wedged, SIGSTOPped): when no request was
    answered for `engine.hang_timeout_s` although some are in flight, `/health_generate` is asked,
    with a bounded timeout, on the session's probe client (`http`); when it fails too, the engine is
    treated as dead."""

    def __init__(self, engine, http: HttpClient, hang_timeout_s: float):
        self.engine, self.http, self.hang_timeout_s = engine, http, hang_timeout_s
        self.probe_timeout_s = health_timeout(hang_timeout_s)
        self.next_probe = 0.0

    async def check(self, batch: Batch) -> None:
        now = time.monotonic()
        stall = now - batch.last_answer
        n = batch.in_flight
        if not n or stall < self.hang_timeout_s or now < self.next_probe:
            return
        why = await health_generate(self.http, timeout=self.probe_timeout_s)
        if why is None:  # generating, only slowly (long outputs): look again later
            log.info(
                "no request answered for %.0f s (%d in flight), but /health_generate answers 200",
                stall,
                n,
            )
            self.next_probe = time.monotonic() + self.hang_timeout_s
            return
        raise EngineHung(
            f"engine hung: no request answered for {stall:.0f} s with {n} in flight, "
            f"and "
            f"/health_generate {why} (limit engine.hang_timeout_s = "
            f"{self.hang_timeout_s:g})"
        )


async def watch(batch: Batch, engine, hang: HangWatch) -> None:
    """Flush the open shards' due batches, refresh their progress, hand freed memory back to the OS,
    and notice an engine that died or hung."""
    last = trimmed = time.monotonic()
    while True:
        await asyncio.sleep(0.25)
        for sh in batch.shards:
            if sh.writer.due():
                try:
                    sh.writer.flush()
                except OSError:  # (a full disk): kept by the writer, the shard's next write fails
                    pass  # the shard with it, not the others this engine serves
        now = time.monotonic()
        if now - last > REFRESH_S:
            last = now
            for sh in batch.shards:
                sh.save_progress()
        if _TRIM is not None and now - trimmed > TRIM_S:
            trimmed = now
            _TRIM(0)
        if not engine.alive():
            raise EngineDied(f"engine exited with code {engine.exit_code()}")
        await hang.check(batch)


def auto_target(capacity: int, running: int, waiting: int, cap: int) -> int:
    """Requests to keep in flight for concurrency "auto": what the server can run, plus a small
    waiting queue so a finished request is replaced at once (margin: an eighth of the capacity, at
    least 2). When requests wait although fewer than `capacity` run, the server runs what its KV
    cache holds: `running` is its capacity then."""
    if capacity <= 0:
        return min(cap, AUTO_START)
    base = running if waiting > 0 and 0 < running < capacity else capacity
    return max(1, min(cap, base + max(2, capacity // 8)))


async def watch_load(batch: Batch, http: HttpClient) -> None:
    """Read the server's load (/v1/loads, on the session's probe client) into the open shards'
    progress files; with concurrency "auto", resize the requests in flight from it. Without
    /v1/loads (older servers), only /server_info's capacity is used."""
    c = batch.client
    auto, cap = c.concurrency == "auto", c.max_concurrency
    while True:
        load = await read_load(http)
        if load is not None:
            batch.capacity = load.capacity or batch.capacity
            if auto:
                resize(batch, auto_target(batch.capacity, load.running, load.waiting, cap))
        for sh in batch.shards:
            sh.loaded(load, batch.capacity, batch.target)
        await asyncio.sleep(LOAD_POLL_S)


def resize(batch: Batch, target: int) -> None:
    if target != batch.target:
        log.info("requests in flight: %d -> %d (concurrency auto)", batch.target, target)
        batch.target = target
        batch.notify()


async def pool(sh: Shard, feed: Feed, engine, info) -> None:
    """Run consumers (one request each) for shard `sh` while its engine's batch has room
    (`Batch.target` across every open shard); a consumer leaves when the batch holds more than its
    target, more start when it has room again. Returns when the shard's last consumer is done (its
    prompts all sent and answered, or stopping)."""
    batch = sh.batch
    tasks: set[asyncio.Task] = set()

    async def consumer() -> None:
        try:
            await consume(sh, feed, engine, info)
        finally:
            batch.live -= 1
            batch.notify()

    room: asyncio.Future | None = None
    try:
        while True:
            while batch.live < batch.target and not sh.stopping and feed.unsent():
                batch.live += 1
                tasks.add(asyncio.ensure_future(consumer()))
            if not tasks and (sh.stopping or not feed.unsent()):
                return
            room = batch.changed()
            done, _ = await asyncio.wait([*tasks, room], return_when=asyncio.FIRST_COMPLETED)
            room.cancel()
            for t in done - {room}:
                tasks.discard(t)
                t.result()
    finally:  # cancelled while it waits (the engine died): its consumers end with it
        await cancel_and_wait([*tasks, *([room] if room is not None else [])])
