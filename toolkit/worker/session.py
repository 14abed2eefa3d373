"""The engine session: what one worker keeps while it runs shards — the engine process and its
restarts, the tokenizer, the HTTP client, the stop signal, the bound on its end (exitguard) and ONE
concurrency controller (a `Batch`) for the engine, shared by every shard it serves at once.

`EngineSession.serve(first, opener)` generates the shard `first` and, while an `opener` gives more,
the shards it opens: when the open shards have nothing left to send and the engine has room
(worker.policy.opens_next), the next shard is claimed and its prompts go out while the previous
shards' last requests finish. Each shard stays the unit of storage, resume and status (worker.run):
its own requests, records, log lines and end. An engine that dies is restarted once for all open
shards (up to [engine] max_restarts each); a stop signal stops and saves what is in flight for every
open shard; the engine is stopped when the session closes, after the last shard is out. At the
run's tail (nothing left to claim), a `handover` callback may decide that this task leaves: its open
shards stop as at a stop signal (what is in flight kept) for a task with room to continue.

How many shards are open at once: a shard is opened only when every open one has nothing left to
send and fewer requests than the target are in flight, so every open shard but the newest holds at
least one request in flight: at most target + 1 shards are open, and never more than MAX_OPEN."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from toolkit.engines.answer import Expect
from toolkit.engines.base import EngineDied, EngineError, EngineHung, EngineUnreachable, log_tail
from toolkit.engines.client import HttpClient
from toolkit.engines.endpoints import server_limits
from toolkit.engines.kinds import make_engine
from toolkit.errors import BadInputError
from toolkit.formats.files import shown_path
from toolkit.job.chat import model_vocab_size
from toolkit.worker.concurrency import HangWatch, auto_target, pool, resize, watch, watch_load
from toolkit.worker.enginecheck import EngineCheck
from toolkit.worker.exitguard import ExitGuard, cancel_and_wait, describe_tasks
from toolkit.worker.inflight import ABORT_GRACE_S, save_in_flight
from toolkit.worker.policy import opens_next
from toolkit.worker.shard import SHARD, Batch, Shard, ShardFailed, count, health_timeout

__all__ = ["EngineSession", "MAX_OPEN", "exit_bound"]

log = logging.getLogger("toolkit.worker")

MAX_OPEN = 16  # shards open at once on one engine, whatever its batch holds
TICK_S = 0.2  # how often the session looks whether to open the next shard
CLAIM_POLL_S = 1.0  # with nothing to claim, how often it looks again while its shards run
TAIL_POLL_S = 1.0  # at the run's tail, how often it asks whether to hand its requests over
SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)


class _Stop(Exception):
    pass


def exit_bound(spec) -> float:
    """Seconds the worker may take to end once its work is over: stop its tasks, flush, stop the
    engine."""
    return spec.engine.shutdown_timeout_s + spec.engine.exit_grace_s


class EngineSession:
    """The engine one worker keeps across the shards it runs (see the module's docstring). It owns
    the stop request: a signal stops every open shard and the worker after them."""

    def __init__(self, spec, *, task: str | None = None, group: str | None = None):
        self.spec = spec
        self.task = (
            task  # who works (`12_3` on Slurm, `worker 2` here): written into progress files
        )
        self.group = (
            group  # the workers sharing its pool (worker.claims): written into progress files
        )
        self.engine = None  # engines.base.Engine, once a shard needed one
        self.served: list[int] = []  # shards run in this session, in order
        self.first_shard: int | None = None  # the shard whose server log the engine writes
        self.stop = asyncio.Event()
        self.stop_signal: str | None = None
        self.halted: BaseException | None = (
            None  # a failure that ends the session (the others stop)
        )
        self.waiting_for: str | None = None
        self.batch = Batch(spec.client)
        self.tokenizer: tuple[bytes, Any, Any] | None = (
            None  # (key, tokenizer, token info) once loaded
        )
        self.limits = None  # engines.endpoints.ServerLimits of the engine's current start
        # whose failure a failed request is, the engine's or its prompt's (one per engine start)
        self.check: EngineCheck | None = None
        self.guard: ExitGuard | None = None
        self.most_open = 0  # most shards open at once on the engine
        # The run's tail (worker.policy.hands_over): `handover(batch)` decides and publishes that
        # this task leaves, giving its requests away; set by a claiming worker.
        self.handover: Callable[[Batch], bool] | None = None
        self.leaving = False  # it hands its requests over: its open shards stop, then it ends
        self.handed: tuple[int, list[int]] = (0, [])  # requests and shards it handed over
        self.at_tail = False  # the opener found nothing to claim
        self.next_claim = self.next_tail = 0.0
        self.tail: logging.Handler | None = (
            None  # the log of the shard closed last, while none is open
        )
        self._old_level = logging.NOTSET

    # -- the session's life: signals, the log level, the exit guard ------------------------------

    def begin(self, name: str) -> None:
        """Install the signal handlers and the exit guard (armed only once the work is over:
        `ending`)."""
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.guard = ExitGuard(name, loop)
        self.guard.before_exit += [self._flush_open, self._kill]
        logger = logging.getLogger("toolkit")
        self._old_level = logger.level
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)

    def end(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        if self.guard is not None:
            self.guard.disarm()
        self.set_tail(None)
        logging.getLogger("toolkit").setLevel(self._old_level)

    def ending(self, why: str, extra_s: float = 0.0) -> None:
        """The work is over (`why`): from now on the process ends within the exit bound."""
        if self.guard is not None:
            self.guard.arm(extra_s + exit_bound(self.spec), why)

    def set_tail(self, handler: logging.Handler | None) -> None:
        """Keep `handler` (a closed shard's log) for the session's own lines until a shard opens or
        it ends."""
        if self.tail is not None and self.tail is not handler:
            logging.getLogger("toolkit").removeHandler(self.tail)
            self.tail.close()
        self.tail = handler

    def _flush_open(self) -> None:
        for sh in list(self.batch.shards):
            sh.writer.flush_within(5.0)

    def _kill(self) -> None:
        """The exit guard's last word to the engine: SIGKILL to everything it runs (its GPUs are
        free at once)."""
        if self.engine is not None and self.engine.proc is not None:
            self.engine.kill()

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.stop.is_set():
            if self.stop_signal is None:  # stopping for a handover: the signal counts too
                self.stop_signal = name
            log.warning(
                "got %s again: still stopping, %s",
                name,
                self.waiting_for or "saving and writing what is done",
            )
            return
        self.stop_signal = name
        shards = self.batch.shards
        if not shards:  # between shards: no shard is claimed after this
            log.warning("got %s: stopping; no further shard is started", name)
            self.stop.set()
            return
        log.warning(
            "got %s: stopping; what is done is written, prompts in flight %s",
            name,
            "are saved as partial outputs and continued next time"
            if self.spec.client.save_in_flight
            else "are generated again next time",
        )
        for sh in shards:
            sh.progress.stop_signal = name
        self.stop.set()
        self.ending(f"{name} asked it to stop", ABORT_GRACE_S)

    def _leave(self) -> None:
        """Hand the run's tail over: every open shard stops as at a stop signal (what is in flight
        kept as partial outputs, its lock released), for a task with room to claim and continue;
        then this one ends."""
        b = self.batch
        self.leaving = True
        self.handed = (b.in_flight, [sh.shard for sh in b.shards])
        log.warning(
            "handing the run's tail over: %d requests in flight of shards %s, kept as partial "
            "outputs "
            "for a task with room to continue; this task then ends",
            *self.handed,
        )
        self.stop.set()
        self.ending("it handed its requests over", ABORT_GRACE_S)

    def halt(self, e: BaseException) -> None:
        """A shard failed and the worker must not go on (claims without keep_going): the others
        stop."""
        if self.halted is None:
            self.halted = e
        self.stop.set()

    @property
    def starts(self) -> int:
        """Engine starts in this session (restarts after a crash included)."""
        return self.engine.starts if self.engine is not None else 0

    def kept_tokenizer(self, plan) -> tuple[Any, Any]:
        """(tokenizer, token info) loaded for an earlier shard of this session with the same model,
        tokenizer and template, or (None, None): the render thread loads it then."""
        if self.tokenizer is not None and self.tokenizer[0] == _tokenizer_key(plan):
            return self.tokenizer[1], self.tokenizer[2]
        return None, None

    def keep_tokenizer(self, plan, tok, info) -> None:
        if tok is not None and info is not None:
            self.tokenizer = (_tokenizer_key(plan), tok, info)

    # -- serving shards --------------------------------------------------------------------------

    async def serve(
        self,
        first: Shard,
        opener: Callable[[], Awaitable[Shard | None]] | None = None,
        on_end: Callable[[Shard, Any], None] | None = None,
    ) -> None:
        """Generate the opened shard `first` and the shards `opener` opens while this runs (None: no
        more). Each shard's end — its ShardEnd, or the ShardFailed it failed with — goes to
        `on_end`."""
        ended = on_end or (lambda sh, out: None)
        spec = self.spec
        if self.stop.is_set():  # a signal came while the shard was being opened: nothing started
            first.batch = self.batch
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
                "are "
                "synthetic"
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
        more = [opener]  # the opener, until it has nothing more
        while self.batch.shards:
            http = HttpClient(
                engine.url, api_key=engine.api_key, max_connections=_max_in_flight(spec)
            )
            hang = HangWatch(engine, spec.engine.hang_timeout_s)
            self.check = EngineCheck(
                engine, self.stop, probe_timeout_s=health_timeout(spec.engine.hang_timeout_s)
            )
            try:
                await _race(self.stop, engine.wait_ready(http))
                await self._probe(engine, http)
                ready_once = True
                for sh in self.batch.shards:
                    sh.http = http
                await self._generate(engine, http, hang, more, ended)
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
            except _Stop:
                for sh in list(self.batch.shards):
                    self._close(sh, ended, stopped=True)
            finally:
                http.close()
                hang.close()
                self.check.close()
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        if left:  # nothing the shards started may still run
            log.error(
                "%d task(s) still running at the end of the shard: %s; cancelling them",
                len(left),
                describe_tasks(left),
            )
            for t in left:
                t.cancel()

    async def _probe(self, engine, http) -> None:
        """At each start: the server's limits, and the probe with a rendered prompt of the oldest
        open shard."""
        lim = HttpClient(engine.url, api_key=engine.api_key, max_connections=1)
        try:  # what the server can run, and its length limit, before the first request goes out
            self.limits = await server_limits(lim)
        finally:
            lim.close()
        b = self.batch
        b.capacity = self.limits.capacity or 0
        c = self.spec.client
        if c.concurrency == "auto":
            resize(b, auto_target(b.capacity, 0, 0, c.max_concurrency))
        try:
            probe = await _race_value(self.stop, b.shards[0].feed.first)
        except BadInputError:  # the shard's own task says it and fails the shard
            return
        # the tokenizer is loaded once the first prompt is rendered: its size, for the check
        info = b.shards[0].render.info if b.shards[0].render is not None else None
        await engine.check_model(http, getattr(info, "vocab_size", None), model_vocab_size)
        if probe is not None:
            engine.probe_ids = probe
            await engine.probe(http)

    async def _generate(self, engine, http, hang, more: list, ended) -> None:
        """Run every open shard's requests, open the next shards while there is room, and end each
        shard as its own requests are over; returns when no shard is open and none is left to open.
        """
        b, stop = self.batch, self.stop
        saving = self.spec.client.save_in_flight
        watchers = [
            asyncio.ensure_future(watch(b, engine, hang)),
            asyncio.ensure_future(watch_load(b, engine)),
        ]
        stopper = asyncio.ensure_future(save_in_flight(b, stop, engine) if saving else stop.wait())
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
                    more[0] is not None
                    and not stop.is_set()
                    and len(b.shards) < self.max_open()
                    and opens_next(b.unsent, b.in_flight, b.target)
                    and (not b.shards or now >= self.next_claim)
                ):
                    sh = await more[0]()
                    if sh is None:  # nothing to claim now: asked again in a while, while shards run
                        self.next_claim, self.at_tail = now + CLAIM_POLL_S, True
                        if not b.shards:
                            return
                    else:
                        self._open(sh)
                        self._say_running(sh)
                        sh.http = http
                        sh.save_progress("loading")
                        continue
                if not work:
                    return
                if (
                    self.at_tail
                    and self.handover is not None
                    and not stop.is_set()
                    and not b.unsent
                    and now >= self.next_tail
                ):
                    self.next_tail = now + TAIL_POLL_S
                    if self.handover(b):
                        self._leave()
                done, _ = await asyncio.wait(
                    [*work, *watchers, stopper], timeout=TICK_S, return_when=asyncio.FIRST_COMPLETED
                )
                for w in watchers:
                    if w in done:
                        w.result()  # the engine died or hung (a watcher never returns otherwise)
                if stopper in done:  # the grace after the abort is over, or a stop without saving
                    raise _Stop()
                for t in [t for t in done if t in work]:
                    sh = work.pop(t)
                    e = t.exception()
                    if isinstance(e, EngineError):
                        raise e
                    if e is not None:
                        self._close(sh, ended, error=e)
                        continue
                    if len(b.shards) == 1 and (more[0] is None or stop.is_set()):
                        last = sh  # the session's end: closed once its watchers are stopped
                        return
                    self._close(sh, ended, stopped=stop.is_set())
        finally:
            if last is not None and not stop.is_set():
                self.ending("its prompts were all answered")
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
        self.keep_tokenizer(sh.plan, sh.render.tok, sh.render.info)
        info = sh.render.info
        lim = self.limits
        sh.progress.capacity = self.batch.capacity or None
        sh.expect = Expect(
            vocab_size=info.vocab_size if info is not None else None,
            max_req_len=lim.max_req_len if lim is not None else None,
        )
        sh.dp_ranks = lim.ranks if lim is not None else 0
        if not sh.t_gen:
            sh.t_gen = time.monotonic()
        sh.save_progress("generating")
        log.info(
            "generating %d %ss (%d to continue from a partial output) with concurrency %s",
            sh.todo_count,
            sh.plan.noun,
            len(sh.partial),
            self.spec.client.concurrency,
        )
        sh.last_answer = time.monotonic()
        await pool(sh, sh.feed, engine, info)

    def _say_running(self, sh: Shard) -> None:
        engine = self.engine
        pid = f"pid {engine.proc.pid}, " if engine.proc is not None else ""
        token = SHARD.set(sh.shard)
        try:
            log.info(
                "engine %s already running (%sstarted %s in this task, its log %s): no new start",
                engine.kind,
                pid,
                count(engine.starts, "time"),
                shown_path(engine.server_log),
            )
        finally:
            SHARD.reset(token)

    def max_open(self) -> int:
        return min(self.batch.target + 1, MAX_OPEN)

    def _open(self, sh: Shard) -> None:
        sh.batch, sh.session = self.batch, self
        self.set_tail(None)
        self.batch.shards.append(sh)
        self.most_open = max(self.most_open, len(self.batch.shards))
        self.served.append(sh.shard)
        sh.start(self)

    def _close(
        self, sh: Shard, ended, *, stopped: bool = False, error: BaseException | None = None
    ) -> None:
        """End one shard (its requests are over): its file, manifest, progress; said to `ended`."""
        self.batch.shards.remove(sh)
        self.batch.notify()
        out = sh.fail(error) if error is not None else sh.finish(stopped)
        handler = sh.detach()
        if not self.batch.shards and handler is not None:
            # the session's last lines (the engine's stop) are said there too
            self.set_tail(handler)
        elif handler is not None:
            logging.getLogger("toolkit").removeHandler(handler)
            handler.close()
        ended(sh, out)

    def _fail_all(self, e: ShardFailed, ended) -> None:
        for sh in list(self.batch.shards):
            self._close(sh, ended, error=e)

    async def _restart(self, engine, e: EngineError, ended) -> None:
        """One restart for every open shard; a shard past [engine] max_restarts fails (all of them
        do)."""
        spec = self.spec
        shards = self.batch.shards
        for sh in shards:
            sh.writer.flush()
            sh.progress.engine_restarts += 1
        n = max(sh.progress.engine_restarts for sh in shards)
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
        self.waiting_for = (
            f"waiting for the engine (pid {engine.proc.pid}) to exit: SIGTERM sent, SIGKILL "
            f"after {grace:g} s ([engine] shutdown_timeout_s)"
        )
        try:
            ctx = contextvars.copy_context()
            await asyncio.get_running_loop().run_in_executor(None, ctx.run, engine.stop, timeout_s)
        finally:
            self.waiting_for = None

    async def close(self) -> None:
        """Stop the engine if it still runs, within the exit bound (armed here when nothing armed it
        before)."""
        engine = self.engine
        if engine is None or engine.proc is None or not engine.alive():
            return
        self.ending("its last shard ended")
        await self._stop_engine(engine)


def _tokenizer_key(plan) -> bytes:
    """What a loaded tokenizer and its token info depend on: the [model] table and the digests of
    its folders."""
    return msgspec.json.encode([plan.spec.model, plan.parts["tokenizer"], plan.parts["template"]])


def _max_in_flight(spec) -> int:
    c = spec.client
    return c.max_concurrency if c.concurrency == "auto" else c.concurrency


async def _race(stop: asyncio.Event, *aws) -> None:
    """Run `aws` until the first finishes (raising its error); a stop request cancels them all."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    stopper = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
        if stopper in done:
            raise _Stop()
        for t in done:
            t.result()
    finally:
        await cancel_and_wait([*tasks, stopper])


async def _race_value(stop: asyncio.Event, fut: asyncio.Future):
    await _race(stop, asyncio.shield(fut))
    return fut.result()
