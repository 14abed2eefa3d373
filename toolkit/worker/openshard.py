"""One shard open in this task (`Shard`): its declared interface — `resume` (what its file left),
`start` (render its prompts for the session to send), `finish` (→ its end: done manifest written, or
where a stopped shard resumes), `fail`, `detach` (its log handed to the session) — and its state in
parts that each have one writer: its file (the writer, the records counted, the conversations'
answers so far), its requests in flight (worker.requests, written by worker.inflight), its progress
(written here only, through the methods its callers name: `leave`, `stopped_by`, `restarted`,
`generating`, `loaded`, `loop_stopped`, `partial_saved`), its render (feed, thread) and what the
engine session gives it (batch, session, answer checks)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
import threading
import time

import msgspec

from toolkit.engines.answer import Expect
from toolkit.errors import BadInputError
from toolkit.formats.manifests import write_done
from toolkit.formats.progress import Progress, slurm_context, write_progress
from toolkit.formats.prompts import ShardRefs
from toolkit.formats.records import MAY_PASS, OK, PARTIAL, Record
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardfile import ShardWriter
from toolkit.job import chat
from toolkit.worker.feed import Budget, Feed, RenderState, Todo, render_thread
from toolkit.worker.requests import Requests
from toolkit.worker.shard import (
    SHARD_ERRORS,
    Batch,
    End,
    ShardEnd,
    ShardFailed,
    ShardRefused,
    disk_failure,
    shard_lines,
)
from toolkit.worker.turn_order import Chains

__all__ = ["Resumed", "Shard"]

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

RENDER_JOIN_S = 10.0  # how long the end of a shard waits for its render thread


class Resumed(msgspec.Struct, frozen=True):
    """What a shard's file left for this run of it (worker.run): the prompts to generate, the ids
    recorded and kept, the turns regenerated conversations continue from, the failed tries and
    partial outputs of the ids redone, and the output tokens and loops of the records kept."""

    todo: Todo | None
    recorded: int
    history: dict[str, Record]
    tries: dict[str, int]
    partial: dict[str, Record]
    tokens: int
    loops: int


class Shard:
    """One shard open in this task (see the module's docstring)."""

    def __init__(self, rd: RunDir, plan: RunPlan, shard: int, session, handler: logging.Handler):
        self.rd, self.plan, self.shard = rd, plan, shard
        self.spec = plan.spec
        self.sp = plan.shards[shard]
        self.session = session  # session.EngineSession: the engine this worker keeps
        self.handler: logging.Handler | None = handler  # its log, until `detach`
        # its file
        self.writer = ShardWriter(
            rd.shard_file(shard),
            plan.fingerprint,
            shard,
            flush_records=self.spec.sharding.flush_records,
            flush_seconds=self.spec.sharding.flush_seconds,
        )
        self.closed = False
        self.recorded = 0  # distinct ids recorded (resumed ones included)
        self.chains: Chains | None = None  # regenerated datasets: the conversations' answers so far
        self.history: dict[str, Record] = {}  # regenerated datasets: turns recorded ok before
        # its requests in flight
        self.requests = Requests(shard)
        # its progress
        self.progress = Progress(
            shard=shard,
            total=self.sp.count,
            host=socket.gethostname(),
            pid=os.getpid(),
            engine=self.spec.engine.kind,
            started=time.time(),
            **slurm_context(),
        )
        self.t_gen = 0.0  # when its generation started
        # its render
        self.todo: Todo | None = None
        self.todo_count = 0
        self.feed: Feed | None = None  # its rendered prompts, once started
        self.render: RenderState | None = None
        self.renderer: threading.Thread | None = None
        # what the engine gives it: the batch it shares, what every answer is checked against (the
        # vocabulary, SGLang's limit), the data-parallel ranks a continuation may be pinned to
        self.batch: Batch | None = None
        self.expect: Expect | None = None
        self.dp_ranks = 0

    @property
    def stopping(self) -> bool:
        """A stop came and what is in flight is being saved: nothing new is sent."""
        return self.session.stop.saving

    @property
    def in_flight(self) -> int:
        return self.requests.in_flight

    @property
    def last_answer(self) -> float:
        return self.requests.last_answer

    # -- its life ----------------------------------------------------------------------------

    def resume(self, found: Resumed) -> None:
        """What its file left (worker.run): the prompts to generate and what this run keeps."""
        self.todo, self.todo_count = found.todo, len(found.todo) if found.todo else 0
        self.recorded = found.recorded
        self.history = found.history
        self.requests = Requests(self.shard, found.tries, found.partial)
        self.progress.resumed_tokens = found.tokens
        self.progress.resumed_loops = found.loops
        self.progress.resumed = found.recorded

    def start(self, batch: Batch) -> None:
        """Open on the session's engine, sharing `batch`: its prompts rendered on a thread of its
        own, for the session to send."""
        self.batch = batch
        loop = asyncio.get_running_loop()
        most = self.session.max_in_flight()
        feed = self.feed = Feed(Budget(max(4 * most, 2 * chat.BATCH_SIZE)))
        state = self.render = RenderState()
        state.tok, state.info = self.session.tokenizer.get(self.plan)
        with shard_lines(self.shard):
            if any(d.regenerate for d in self.plan.datasets):
                self.chains = state.chains = Chains(
                    self, feed, ShardRefs(self.rd, self.plan, self.shard), self.history
                )
            ctx = contextvars.copy_context()  # the render thread's lines are the shard's
        self.renderer = threading.Thread(
            target=ctx.run,
            args=(render_thread, loop, feed, self.plan, self.todo, state),
            daemon=True,
            name=f"render-{self.shard}",
        )
        self.renderer.start()

    def generating(self, limits, capacity: int) -> None:
        """Its prompts are rendered and go out on the engine whose `limits` (engines.client.
        ServerLimits, None: not said) and capacity are given."""
        info = self.render.info
        self.progress.capacity = capacity or None
        self.expect = Expect(
            vocab_size=info.vocab_size if info is not None else None,
            max_req_len=limits.max_req_len if limits is not None else None,
        )
        self.dp_ranks = limits.ranks if limits is not None else 0
        if not self.t_gen:
            self.t_gen = time.monotonic()
        self.save_progress("generating")
        self.requests.heard()

    def finish(self, stopped: bool) -> ShardEnd | ShardFailed | ShardRefused:
        """Its requests are over: write what is left, and its done manifest (or say where a stopped
        shard resumes)."""
        with shard_lines(self.shard):
            try:
                self._stop_render()
                return self._end(stopped)
            except (*SHARD_ERRORS, OSError, BadInputError) as e:
                return self._failed(e)

    def fail(self, e: BaseException) -> ShardFailed | ShardRefused:
        with shard_lines(self.shard):
            self._stop_render()
            return self._failed(e)

    def detach(self) -> logging.Handler | None:
        """Its log handler, no longer its own (the session keeps or closes it)."""
        h, self.handler = self.handler, None
        return h

    # -- its records and progress ------------------------------------------------------------

    def add(self, record: Record, *, settled: bool = True) -> None:
        """Write `record`. Not `settled`: a failed try that is tried again in this run
        (inflight.consume), written so that its count survives a kill, but neither counted as done
        nor told to the turns after it."""
        if record.status not in (OK, PARTIAL) and settled:
            self.progress.failed += 1
            log.warning(
                "prompt %s (%s) failed (%s): %s",
                record.id,
                record.dataset,
                record.failure,
                record.error,
            )
        # a partial record is continued, not done
        self.recorded += record.status != PARTIAL and settled
        self.writer.add(record)
        # a partial turn is no answer yet
        if (
            settled
            and self.chains is not None
            and record.status != PARTIAL
            and self.plan.datasets[self.chains.dataset_of(record)].regenerate
        ):
            self.chains.recorded(record)

    def partial_saved(self, record: Record) -> None:
        """Write the partial output a stop left (continued by the next run of the shard)."""
        self.add(record)
        self.progress.partial_saved += 1

    def loop_stopped(self) -> None:
        self.progress.loops_stopped += 1

    def leave(self) -> None:
        """This task hands the shard over at the run's tail: its progress says so."""
        self.progress.leaving = True
        self.save_progress()

    def stopped_by(self, signal: str | None) -> None:
        self.progress.stop_signal = signal

    def restarted(self) -> int:
        """The engine restarts: what is written is flushed; the restarts of the engine it saw."""
        self.writer.flush()
        self.progress.engine_restarts += 1
        return self.progress.engine_restarts

    def loaded(self, load, capacity: int, target: int) -> None:
        """The server's load (engines.endpoints.read_load: None if not said), the batch target."""
        p = self.progress
        if load is not None:
            p.running, p.queued = load.running, load.waiting
            p.kv_usage = round(load.token_usage, 4)
            p.capacity = capacity or None
        p.in_flight_target = target

    def save_progress(self, state: str | None = None) -> None:
        p = self.progress
        if state:
            p.state = state
        p.done = self.recorded
        # the shard's total; the rate is this attempt's alone
        tokens = self.requests.tokens
        p.output_tokens = p.resumed_tokens + tokens
        p.tok_per_s = round(tokens / (time.monotonic() - self.t_gen), 1) if self.t_gen else 0.0
        s = self.session
        p.task, p.group = s.task, s.group
        p.task_engine_starts = s.starts
        p.task_shards = len(s.served)
        p.engine_shard = s.first_shard
        write_progress(self.rd.progress_file(self.shard), p)

    # -- its end -----------------------------------------------------------------------------

    def _stop_render(self) -> None:
        """Its render thread told to stop and joined (bounded); its feed's prompts released."""
        if self.render is not None:
            self.render.stop = True
        if self.feed is not None:
            log.info(
                "at most %d rendered prompts waited for a request (bound %d)",
                self.feed.peak,
                self.feed.budget.cap,
            )
            self.feed.budget.close()
        if self.chains is not None:
            self.chains.close()
        r = self.renderer
        if r is not None and r.ident is not None:
            r.join(RENDER_JOIN_S)
            if r.is_alive():
                log.warning(
                    "the render thread has not ended %g s after the shard's end; left behind (a "
                    "daemon thread)",
                    RENDER_JOIN_S,
                )

    def _failed(self, e: BaseException) -> ShardFailed | ShardRefused:
        if isinstance(e, OSError):
            try:
                self.close_writer()
            except OSError:
                pass  # (the disk that failed fails again: `e` says what to do)
            return disk_failure(e, self.rd, self.shard)
        if isinstance(e, BadInputError) and not isinstance(e, SHARD_ERRORS):
            e = ShardRefused(str(e))
        elif not isinstance(e, SHARD_ERRORS):
            e = ShardFailed(f"{type(e).__name__}: {e}")
        try:
            self.progress.error = str(e)
            self.save_progress("failed")
            self.close_writer()
        except OSError:
            pass
        log.error("shard %d failed: %s", self.shard, e)
        return e

    def close_writer(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.writer.flush()
            finally:
                self.writer.close()

    def _end(self, stopped: bool) -> ShardEnd:
        shard = self.shard
        self.close_writer()
        if not stopped:
            return self.complete()
        self.save_progress("stopped")
        if self.progress.leaving:
            log.info(
                "shard %d handed over with %d of %d prompts recorded and %d partial outputs kept: "
                "a task with room claims it and continues them",
                shard,
                self.recorded,
                self.sp.count,
                self.progress.partial_saved,
            )
            return ShardEnd(shard, End.STOPPED, None)
        log.info(
            "shard %d stopped with %d of %d prompts recorded; it resumes from here when run again",
            shard,
            self.recorded,
            self.sp.count,
        )
        return ShardEnd(shard, End.STOPPED, self.progress.stop_signal)

    def complete(self) -> ShardEnd:
        """Its file holds a record of every prompt: its done manifest written."""
        rd, shard, plan, sp = self.rd, self.shard, self.plan, self.sp
        m = write_done(
            rd.done_file(shard),
            rd.shard_file(shard),
            shard,
            plan.fingerprint,
            positions=range(sp.first, sp.first + sp.count),
        )
        if m.records != sp.count:
            raise ShardFailed(
                f"shard {shard} ended with {m.records} records for {sp.count} prompts"
            )
        rd.retry_file(shard).unlink(missing_ok=True)
        self.save_progress("done")
        _say_complete(self, m)
        return ShardEnd(shard, End.DONE)


def _say_complete(sh: Shard, m) -> None:
    shard, rd = sh.shard, sh.rd
    log.info(
        "shard %d complete: %d records (%d failed), %d output tokens%s",
        shard,
        m.records,
        m.failed,
        m.output_tokens,
        f"; {sh.progress.loops_stopped} repetition loops stopped in flight by this "
        "attempt ([client] loop_stop)"
        if sh.progress.loops_stopped
        else "",
    )
    if m.transient:
        log.warning(
            "shard %d: %d failures may pass when generated again (%s); the next run of the shard "
            "generates them again: `toolkit retry %s`",
            shard,
            m.transient,
            MAY_PASS,
            rd.shown,
        )
    if m.given_up:
        log.warning(
            "shard %d: %d failures that may pass (%s) failed every one of their tries ([client] "
            "max_tries = %d) and are final for this run: `toolkit retry %s` generates them again",
            shard,
            m.given_up,
            MAY_PASS,
            sh.spec.client.max_tries,
            rd.shown,
        )
