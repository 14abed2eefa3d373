"""The engine session: what one worker keeps while it runs shards — the engine process and its
restarts, its HTTP clients (a pair per engine start), the tokenizer, the stop (worker.stop) and ONE
concurrency controller (a `Batch`) for the engine, shared by every shard it serves at once.

`EngineSession.serve(first, shards)` generates the shard `first` and, while `shards` (its one
collaborator, a `Shards`: a claim loop, worker.claims.Claims) opens more, those too: when the open
shards have nothing left to send and the engine has room (worker.policy.opens_next), the next shard
is claimed and its prompts go out while the previous shards' last requests finish. Each shard stays
the unit of storage, resume and status (worker.run): its own requests, records, log lines and end.
An engine that dies is restarted once for all open shards (up to [engine] max_restarts each); a stop
signal stops and saves what is in flight for every open shard; the engine is stopped when the
session closes, after the last shard is out. At the run's tail (nothing left to claim),
`shards.hand_over` may decide that this task leaves: its open shards stop as at a stop signal (what
is in flight kept) for a task with room to continue.

How many shards are open at once: a shard is opened only when every open one has nothing left to
send and fewer requests than the target are in flight, so every open shard but the newest holds at
least one request in flight: at most target + 1 shards are open, and never more than MAX_OPEN."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from toolkit.engines.base import EngineDied, EngineError, EngineHung, EngineUnreachable, log_tail
from toolkit.engines.client import HttpClient
from toolkit.engines.endpoints import server_limits
from toolkit.engines.kinds import make_engine
from toolkit.errors import BadInputError
from toolkit.formats.files import shown_path
from toolkit.job.chat import model_vocab_size
from toolkit.worker.concurrency import HangWatch, auto_target, pool, resize, watch, watch_load
from toolkit.worker.enginecheck import EngineCheck
from toolkit.worker.exitguard import cancel_and_wait, cancel_left
from toolkit.worker.feed import KeptTokenizer
from toolkit.worker.inflight import save_in_flight
from toolkit.worker.openshard import Shard
from toolkit.worker.policy import opens_next
from toolkit.worker.shard import (
    SHARD,
    Batch,
    ShardFailed,
    Shards,
    TailLog,
    count,
    health_timeout,
    shard_lines,
)
from toolkit.worker.stop import Stop, Stopped, race, race_value

__all__ = ["EngineSession", "MAX_OPEN"]

log = logging.getLogger("toolkit.worker")

MAX_OPEN = 16  # shards open at once on one engine, whatever its batch holds
TICK_S = 0.2  # how often the session looks whether to open the next shard
CLAIM_POLL_S = 1.0  # with nothing to claim, how often it looks again while its shards run
TAIL_POLL_S = 1.0  # at the run's tail, how often it asks whether to hand its requests over


class EngineSession:
    """The engine one worker keeps across the shards it runs (see the module's docstring). It owns
    the stop (worker.stop): a signal stops every open shard and the worker after them."""

    def __init__(self, spec, *, task: str | None = None, group: str | None = None):
        self.spec = spec
        # who works (`12_3` on Slurm, `worker 2` here), and the workers sharing its pool
        # (worker.claims): written into progress files
        self.task, self.group = task, group
        self.engine = None  # engines.base.Engine, once a shard needed one
        self.served: list[int] = []  # shards run in this session, in order
        self.first_shard: int | None = None  # the shard whose server log the engine writes
        self.batch = Batch(spec.client)
        self.stop = Stop(spec, self.batch)  # the worker's stop: signals, handover, failure
        self.tokenizer = KeptTokenizer()  # loaded for a shard, kept for the next ones
        self.limits = None  # engines.endpoints.ServerLimits of the engine's current start
        # its clients, one pair per engine start: the requests', and the probes' and aborts'
        self.http: HttpClient | None = None
        self.probes: HttpClient | None = None
        # whose failure a failed request is, the engine's or its prompt's (one per engine start)
        self.check: EngineCheck | None = None
        self.most_open = 0  # most shards open at once on the engine
        self.shards: Shards = Shards()  # what it serves (serve): one shard, or a claim loop
        self.at_tail = False  # the opener found nothing to claim
        self.next_claim = self.next_tail = 0.0
        self.tail = TailLog()  # the log of the shard closed last, while none is open
        self._old_level = logging.NOTSET

    # -- the session's life: signals, the log level, the exit guard ------------------------------

    def begin(self, name: str) -> None:
        """Install the stop's signal handlers and exit guard (worker.stop), and the log level."""
        self.stop.begin(name, [self._flush_open, self._kill])
        logger = logging.getLogger("toolkit")
        self._old_level = logger.level
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)

    def end(self) -> None:
        self.stop.end()
        self.tail.keep(None)
        logging.getLogger("toolkit").setLevel(self._old_level)

    def _flush_open(self) -> None:
        for sh in list(self.batch.shards):
            sh.writer.flush_within(5.0)

    def _kill(self) -> None:
        """The exit guard's last word to the engine: SIGKILL to everything it runs (its GPUs are
        free at once)."""
        if self.engine is not None and self.engine.proc is not None:
            self.engine.kill()

    @property
    def starts(self) -> int:
        """Engine starts in this session (restarts after a crash included)."""
        return self.engine.starts if self.engine is not None else 0

    # -- serving shards --------------------------------------------------------------------------

    async def serve(self, first: Shard, shards: Shards) -> None:
        """Generate the opened shard `first` and the shards `shards` opens while this runs; each
        shard's end goes to `shards.shard_ended`."""
        self.shards = shards
        ended = shards.shard_ended
        spec = self.spec
        if self.stop.is_set():  # a signal came while the shard was being opened: nothing started
            self.batch.shards.append(first)
            self._close(first, ended, stopped=True)
            return
        if self.engine is None:
            self.first_shard = first.shard
            self.engine = make_engine(
                spec, first.rd.server_log_file(first.shard), probe_ids=[], shard=first.shard
            )
        engine = self.engine
        self._open(first)
        if not engine.is_model:
            log.warning(
                "engine is the STUB: a stand-in for SGLang's protocol, NOT a model; its outputs "
                "are synthetic"
            )
        running = engine.starts > 0 and engine.alive()
        first.save_progress("loading")
        if running:  # claimed after another shard: the engine serves on
            self._say_running(first)
        else:
            try:
                engine.start()
            # refused before launch (e.g. SGLang's parser rejects the command line)
            except EngineError as e:
                self._fail_all(ShardFailed(str(e)), ended)
                return
        ready_once = running
        while self.batch.shards:
            http, probes = self._connect(engine)
            hang = HangWatch(engine, probes, spec.engine.hang_timeout_s)
            self.check = EngineCheck(
                engine,
                self.stop,
                probes,
                probe_timeout_s=health_timeout(spec.engine.hang_timeout_s),
            )
            try:
                await race(self.stop, engine.wait_ready(http))
                await self._probe(engine, http)
                ready_once = True
                await self._generate(engine, hang, ended)
            except EngineUnreachable as e:
                self._fail_all(ShardFailed(str(e)), ended)
                await self._stop_engine(engine)
            # died or hung: restarted; refused or never ready: cannot go on here
            except EngineError as e:
                if not ready_once or not isinstance(e, EngineDied) and engine.alive():
                    self._fail_all(ShardFailed(str(e)), ended)
                    await self._stop_engine(engine)
                else:
                    await self._restart(engine, e, ended)
            except Stopped:
                for sh in list(self.batch.shards):
                    self._close(sh, ended, stopped=True)
            finally:
                self.check.close()
                http.close()
                probes.close()
        cancel_left()  # nothing the shards started may still run

    def _connect(self, engine) -> tuple[HttpClient, HttpClient]:
        """The clients of this engine start: one for the requests (as many connections as requests
        may be in flight), one for the probes, the load and the aborts (as many again, and one for
        each watch: none waits for another)."""
        most = self.max_in_flight()
        self.http = HttpClient(engine.url, api_key=engine.api_key, max_connections=most)
        self.probes = HttpClient(engine.url, api_key=engine.api_key, max_connections=most + 4)
        return self.http, self.probes

    def max_in_flight(self) -> int:
        """The most requests this engine may have in flight."""
        c = self.spec.client
        return c.max_concurrency if c.concurrency == "auto" else c.concurrency

    async def _probe(self, engine, http) -> None:
        """At each start: the server's limits, and the probe with a rendered prompt of the oldest
        open shard."""
        # what the server can run, and its length limit, before the first request goes out
        self.limits = await server_limits(self.probes)
        b = self.batch
        b.capacity = self.limits.capacity or 0
        c = self.spec.client
        if c.concurrency == "auto":
            resize(b, auto_target(b.capacity, 0, 0, c.max_concurrency))
        try:
            probe = await race_value(self.stop, b.shards[0].feed.first)
        except BadInputError:  # the shard's own task says it and fails the shard
            return
        # the tokenizer is loaded once the first prompt is rendered: its size, for the check
        info = b.shards[0].render.info if b.shards[0].render is not None else None
        await engine.check_model(http, getattr(info, "vocab_size", None), model_vocab_size)
        if probe is not None:
            engine.probe_ids = probe
            await engine.probe(http)

    async def _generate(self, engine, hang, ended) -> None:
        """Run every open shard's requests, open the next shards while there is room, and end each
        shard as its own requests are over; returns when no shard is open and none is left to open.
        """
        b, stop = self.batch, self.stop
        saving = self.spec.client.save_in_flight
        watchers = [
            asyncio.ensure_future(watch(b, engine, hang)),
            asyncio.ensure_future(watch_load(b, self.probes)),
        ]
        stopper = asyncio.ensure_future(
            save_in_flight(b, stop, engine, self.probes) if saving else stop.wait()
        )
        work: dict[asyncio.Task, Shard] = {}
        last: Shard | None = None
        try:
            while True:
                running = set(work.values())
                for sh in b.shards:
                    if sh not in running:
                        work[asyncio.ensure_future(self._shard_work(sh, engine))] = sh
                now = time.monotonic()
                if (
                    self.shards.more
                    and not stop.is_set()
                    and len(b.shards) < self.max_open()
                    and opens_next(b.unsent, b.in_flight, b.target)
                    and (not b.shards or now >= self.next_claim)
                ):
                    sh = await self.shards.next_shard()
                    if sh is None:  # nothing to claim now: asked again in a while, while shards run
                        self.next_claim, self.at_tail = now + CLAIM_POLL_S, True
                        if not b.shards:
                            return
                    else:
                        self._open(sh)
                        self._say_running(sh)
                        sh.save_progress("loading")
                        continue
                if not work:
                    return
                if self.at_tail and not stop.is_set() and not b.unsent and now >= self.next_tail:
                    self.next_tail = now + TAIL_POLL_S
                    if self.shards.hand_over(b):
                        self.stop.leave()
                done, _ = await asyncio.wait(
                    [*work, *watchers, stopper], timeout=TICK_S, return_when=asyncio.FIRST_COMPLETED
                )
                for w in watchers:
                    if w in done:
                        w.result()  # the engine died or hung (a watcher never returns otherwise)
                if stopper in done:  # the grace after the abort is over, or a stop without saving
                    raise Stopped()
                for t in [t for t in done if t in work]:
                    sh = work.pop(t)
                    e = t.exception()
                    if isinstance(e, EngineError):
                        raise e
                    if e is not None:
                        self._close(sh, ended, error=e)
                        continue
                    if len(b.shards) == 1 and (not self.shards.more or stop.is_set()):
                        last = sh  # the session's end: closed once its watchers are stopped
                        return
                    self._close(sh, ended, stopped=stop.is_set())
        finally:
            if last is not None and not stop.is_set():
                self.stop.ending("its prompts were all answered")
            await cancel_and_wait([*work, *watchers, stopper])
            if last is not None:
                self._close(last, ended, stopped=stop.is_set())

    async def _shard_work(self, sh: Shard, engine) -> None:
        """One open shard's requests, in its own log context, until its prompts are all answered or
        it stops."""
        SHARD.set(sh.shard)
        if sh.stopping:
            return
        await asyncio.shield(sh.feed.first)  # rendered (or its render failed: BadInputError)
        self.tokenizer.keep(sh.plan, sh.render.tok, sh.render.info)
        sh.generating(self.limits, self.batch.capacity)
        log.info(
            "generating %d %ss (%d to continue from a partial output) with concurrency %s",
            sh.todo_count,
            sh.plan.noun,
            len(sh.requests.partial),
            self.spec.client.concurrency,
        )
        await pool(sh, sh.feed, engine, sh.render.info)

    def _say_running(self, sh: Shard) -> None:
        engine = self.engine
        pid = f"pid {engine.proc.pid}, " if engine.proc is not None else ""
        with shard_lines(sh.shard):
            log.info(
                "engine %s already running (%sstarted %s in this task, its log %s): no new start",
                engine.kind,
                pid,
                count(engine.starts, "time"),
                shown_path(engine.server_log),
            )

    def max_open(self) -> int:
        return min(self.batch.target + 1, MAX_OPEN)

    def _open(self, sh: Shard) -> None:
        self.tail.keep(None)
        self.batch.shards.append(sh)
        self.most_open = max(self.most_open, len(self.batch.shards))
        self.served.append(sh.shard)
        sh.start(self.batch)

    def _close(
        self, sh: Shard, ended, *, stopped: bool = False, error: BaseException | None = None
    ) -> None:
        """End one shard (its requests are over): its file, manifest, progress; said to `ended`."""
        self.batch.shards.remove(sh)
        self.batch.notify()
        out = sh.fail(error) if error is not None else sh.finish(stopped)
        self.tail.closed(sh.detach(), last=not self.batch.shards)
        ended(sh, out)

    def _fail_all(self, e: ShardFailed, ended) -> None:
        for sh in list(self.batch.shards):
            self._close(sh, ended, error=e)

    async def _restart(self, engine, e: EngineError, ended) -> None:
        """One restart for every open shard; a shard past [engine] max_restarts fails (all of them
        do)."""
        spec = self.spec
        shards = self.batch.shards
        n = max([sh.restarted() for sh in shards])
        if n > spec.engine.max_restarts:
            self._fail_all(
                ShardFailed(
                    f"engine died {n} times (limit engine.max_restarts = "
                    f"{spec.engine.max_restarts}); last: {e}. "
                    f"Last lines of {engine.server_log}:\n{log_tail(engine.server_log)}"
                ),
                ended,
            )
            await self._stop_engine(engine)
            return
        log.error("engine died mid-shard (%s): restart %d of %d", e, n, spec.engine.max_restarts)
        for sh in shards:
            sh.save_progress("loading")
        await self._stop_engine(engine, 0.0 if isinstance(e, EngineHung) else None)
        engine.start()

    async def _stop_engine(self, engine, timeout_s: float | None = None) -> None:
        """Stop the engine on a thread, so the event loop still answers signals (a second Ctrl-C is
        told what it waits for) while the engine drains."""
        if engine.proc is None or not engine.alive():
            return
        grace = engine.engine.shutdown_timeout_s if timeout_s is None else timeout_s
        self.stop.waiting_for = (
            f"waiting for the engine (pid {engine.proc.pid}) to exit: SIGTERM sent, SIGKILL "
            f"after {grace:g} s ([engine] shutdown_timeout_s)"
        )
        try:
            ctx = contextvars.copy_context()
            await asyncio.get_running_loop().run_in_executor(None, ctx.run, engine.stop, timeout_s)
        finally:
            self.stop.waiting_for = None

    async def close(self) -> None:
        """Stop the engine if it still runs, within the exit bound (armed here when nothing armed it
        before)."""
        engine = self.engine
        if engine is None or engine.proc is None or not engine.alive():
            return
        self.stop.ending("its last shard ended")
        await self._stop_engine(engine)
