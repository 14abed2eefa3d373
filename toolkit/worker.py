"""The shard worker: what one Slurm array task does — engine → chat → client → records → shard file.

`run_shard(run_dir, shard)` resumes the shard's file (every id already written is skipped, whatever order it
was written in), starts the engine, renders prompts with the chat template while the engine loads, streams
them through `/generate` with bounded concurrency, and appends checked records in fsynced batches. An engine
that dies mid-shard is restarted (up to `engine.max_restarts`); SIGTERM / SIGUSR2 / SIGINT stop it cleanly
(nothing written is lost, in-flight prompts are generated again next time). A finished shard gets its `done`
manifest.

Nothing lost, nothing stuck: a failure that may pass (timeout, 5xx past the retries, abort, SGLang's NaN stop) is
recorded with its kind and generated again by the next run of the shard (the done manifest counts them; see
records.TRANSIENT); ids `toolkit retry` names are generated again too. A done manifest is trusted only when the
shard file still has its size and sha256; a damaged file is salvaged (shardfile.ShardWriter.open). An engine that
stops answering (requests in flight, none answered for `engine.hang_timeout_s`, `/health_generate` failing) is
restarted like one that died. The render thread stays a bounded number of prompts ahead of the requests.

Regenerated conversations (turns.py): turn k of a conversation waits until turn k-1 has a record, then is rendered
with the answers of the turns before it (`_Chains`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import threading
import time
from array import array
from collections import deque
from pathlib import Path

from . import chat
from .client import BadResponse, HttpClient, RequestRejected, ServerError, Unreachable, generate
from .engines import EngineError, make_engine
from .inputs import PromptReader
from .plan import PromptRef, RefSlice, RunDir, RunPlan, check_plan_inputs, load_run
from .files import shown_path
from .progress import Progress, read_progress, slurm_context, write_progress
from .records import (
    ABORTED, BAD_RESPONSE, FAILED, FAILURES, NAN, NAN_MATCHED, OK, PREVIOUS_TURN, REJECTED, SERVER_ERROR, TEMPLATE,
    TIMEOUT, Record, failed_record, pack_ids, split_output,
)
from .shardfile import ShardWriter, read_done, read_retry, read_shard, verify_done, write_done
from .turns import answer_of, turn_prompt

__all__ = ["run_shard", "ShardFailed", "DONE", "STOPPED"]

log = logging.getLogger(__name__)

DONE, STOPPED = "done", "stopped"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ShardFailed(Exception):
    """The shard cannot finish in this task (engine never ready, died too often, unreachable, disk full, run
    directory not writable, shard locked by another worker). `exit_code` is the command's (see cli)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class _EngineDied(Exception):
    pass


class _EngineHung(_EngineDied):
    """Alive, but answering nothing: stopped without the grace a draining server gets."""


class _Stop(Exception):
    pass


class _Budget:
    """How many rendered prompts may wait for a request: the render thread blocks in `acquire` past `cap`, the
    event loop releases one per prompt it takes. Keeps the worker's memory flat however large the shard."""

    def __init__(self, cap: int) -> None:
        self.cap, self.used, self.closed = cap, 0, False
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self.used and self.used + n > self.cap and not self.closed:
                self._cond.wait()
            self.used += n

    def release(self, n: int = 1) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


class _Feed:
    """Rendered prompts in planned order, filled by the render thread; prompts to redo come first."""

    def __init__(self, budget: _Budget | None = None) -> None:
        self.budget = budget or _Budget(1 << 62)
        self.items: deque = deque()
        self.redo: deque = deque()
        self.finished = False
        self.pending = 0  # prompts that will come later (regenerated turns waiting for the turn before them)
        self.peak = 0  # most rendered prompts waiting at once
        self.first = asyncio.get_running_loop().create_future()
        self._event = asyncio.Event()

    def put(self, items: list | None) -> None:
        """Add a batch of rendered prompts, or mark the end (None)."""
        if items is None:
            self.finished = True
        else:
            self.items.extend(items)
            self.peak = max(self.peak, len(self.items))
            if not self.first.done():
                first = next((item[2] for item in items if item[2] is not None), None)
                if first is not None:
                    self.first.set_result(first)
        if self.finished and not self.first.done():
            self.first.set_result(None)
        self._event.set()

    def later(self, item) -> None:
        """A prompt that waited (see `pending`) is ready: it goes out before the others."""
        self.redo.append(item)
        self.pending -= 1
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        if not self.first.done():
            self.first.set_exception(exc)
        self.finished = True
        self._event.set()

    async def get(self):
        while True:
            if self.redo:
                return self.redo.popleft()
            if self.items:
                self.budget.release()
                return self.items.popleft()
            if self.finished and not self.pending:
                return None
            self._event.clear()
            await self._event.wait()


class _Todo:
    """The prompts to generate as (planned position, ref) pairs, sliced a batch at a time: positions kept in a
    compact array, refs decoded on demand."""

    def __init__(self, refs: RefSlice, positions) -> None:
        self.refs, self.positions = refs, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, s: slice) -> list[tuple[int, PromptRef]]:
        first = self.refs.first
        return [(p, self.refs[p - first]) for p in self.positions[s]]


def _render_thread(loop, feed: _Feed, plan: RunPlan, todo: list[tuple[int, PromptRef]], state: dict) -> None:
    """Load the tokenizer and render every prompt to input_ids, in planned order (runs beside engine start)."""
    try:
        _render_all(loop, feed, plan, todo, state)
        loop.call_soon_threadsafe(feed.put, None)
    except BaseException as e:  # surfaced in the event loop, not lost in a thread
        loop.call_soon_threadsafe(feed.fail, e)


def _render_all(loop, feed: _Feed, plan: RunPlan, todo: list[tuple[int, PromptRef]], state: dict) -> None:
    """Load the tokenizer, then render `todo` in batches and feed them to the event loop."""
    tok = chat.load_tokenizer(plan.spec.model)
    info = chat.token_info(tok, plan.spec.model)
    state["info"], state["tok"] = info, tok
    chains: _Chains | None = state.get("chains")
    if chains is not None:
        chains.tok, chains.info = tok, info
    log.info("tokenizer ready: think-start %d, think-end %d, eos %s, tool-call start %s, template opens reasoning: %s",
             info.think_start_id, info.think_end_id, info.eos_ids, info.tool_call_start_id, info.opens_reasoning)
    with PromptReader() as reader:
        for start in range(0, len(todo), chat.BATCH_SIZE):
            batch = todo[start : start + chat.BATCH_SIZE]
            feed.budget.acquire(len(batch))  # blocks while enough is rendered ahead of the requests
            if state.get("stop"):
                break
            later = [(pos, ref) for pos, ref in batch if ref.turn]  # need the answer of the turn before
            if later:
                batch = [(pos, ref) for pos, ref in batch if not ref.turn]
                feed.budget.release(len(later))
                loop.call_soon_threadsafe(chains.arrive, later)
            prompts = []
            for pos, ref in batch:
                ds = plan.datasets[ref.dataset]
                prompt = reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
                prompts.append(turn_prompt(prompt, 0, []) if ds.regenerate else prompt)
            if not prompts:
                continue
            try:
                rendered = [(ids, None) for ids in chat.render_many(tok, plan.spec.model, prompts)]
            except chat.ChatError:  # find which prompts fail; the others still go out
                rendered = []
                for prompt in prompts:
                    try:
                        rendered.append((chat.render(tok, plan.spec.model, prompt), None))
                    except chat.ChatError as e:
                        rendered.append((None, (TEMPLATE, f"chat template: {e}")))
            items = [(pos, ref, ids, err) for (pos, ref), (ids, err) in zip(batch, rendered)]
            loop.call_soon_threadsafe(feed.put, items)  # one wake-up of the event loop per batch


class _Shard:
    """State of one shard run inside one task."""

    def __init__(self, rd: RunDir, plan: RunPlan, shard: int):
        self.rd, self.plan, self.shard = rd, plan, shard
        self.spec = plan.spec
        self.sp = plan.shards[shard]
        self.writer = ShardWriter(
            rd.shard_file(shard), plan.fingerprint, shard,
            flush_records=self.spec.sharding.flush_records, flush_seconds=self.spec.sharding.flush_seconds,
        )
        self.progress = Progress(shard=shard, total=self.sp.count, host=socket.gethostname(), pid=os.getpid(),
                                 engine=self.spec.engine.kind, started=time.time(), **slurm_context())
        self.tokens = 0
        self.t_gen = 0.0
        self.recorded = 0          # distinct ids recorded (resumed ones included)
        self.transient = 0         # of those, transient failures left (see records.TRANSIENT)
        self.in_flight = 0         # requests sent and not answered
        self.last_answer = time.monotonic()
        self.chains: _Chains | None = None  # regenerated datasets: the conversations' answers so far
        self.history: dict[str, Record] = {}  # regenerated datasets: turns recorded ok before this run
        self.stopping: str | None = None  # what a stopping worker waits for (told to a second Ctrl-C)

    def save_progress(self, state: str | None = None) -> None:
        p = self.progress
        if state:
            p.state = state
        p.done = self.recorded
        p.output_tokens = p.resumed_tokens + self.tokens  # the shard's total; the rate is this attempt's alone
        p.tok_per_s = round(self.tokens / (time.monotonic() - self.t_gen), 1) if self.t_gen else 0.0
        write_progress(self.rd.progress_file(self.shard), p)

    def add(self, record: Record) -> None:
        if record.status != OK:
            self.progress.failed += 1
            log.warning("prompt %s (%s) failed (%s): %s", record.id, record.dataset, record.failure, record.error)
        self.recorded += 1
        self.tokens += record.n_output
        self.writer.add(record)
        if self.chains is not None and self.plan.datasets[self.chains.dataset_of(record)].regenerate:
            self.chains.recorded(record)


class _Chains:
    """Multi-turn regeneration inside one shard (turns.py): turn k of a conversation is rendered with the answers
    of turns 0..k-1, so it waits until turn k-1 has a record. Lives on the event loop's thread; the renders of
    waiting turns run on an executor thread with their own prompt reader."""

    def __init__(self, sh: _Shard, feed: _Feed, refs: RefSlice, done: dict[str, Record]):
        self.sh, self.feed, self.refs = sh, feed, refs
        self.plan = sh.plan
        self.tok = self.info = None
        self.answers: dict[tuple, dict[int, Record]] = {}  # conversation -> {turn: its ok record}
        self.failed: dict[tuple, tuple[int, str, str]] = {}  # conversation -> (turn, kind, error) of a failed turn
        self.waiting: dict[tuple, dict[int, tuple[int, PromptRef]]] = {}
        self.reader = PromptReader()
        self.loop = asyncio.get_running_loop()
        for rec in done.values():  # resumed: the turns recorded ok (and not to be redone) are the history
            ref = self.ref_at(rec.index)
            self.answers.setdefault(self.key(ref), {})[ref.turn] = rec

    @staticmethod
    def key(ref: PromptRef) -> tuple[int, int, int]:
        return ref.dataset, ref.line, ref.sample

    def ref_at(self, pos: int) -> PromptRef:
        return self.refs[pos - self.refs.first]

    def dataset_of(self, rec: Record) -> int:
        return self.ref_at(rec.index).dataset

    def arrive(self, items: list[tuple[int, PromptRef]]) -> None:
        """Turns > 0 reached by the render thread: rendered now if the turn before has its answer, else later."""
        for pos, ref in items:
            self.feed.pending += 1
            self.waiting.setdefault(self.key(ref), {})[ref.turn] = (pos, ref)
            self._advance(self.key(ref))

    def recorded(self, rec: Record) -> None:
        ref = self.ref_at(rec.index)
        key = self.key(ref)
        if rec.status == OK:
            self.answers.setdefault(key, {})[ref.turn] = rec
        else:
            transient = FAILURES.get(rec.failure or "", False)
            self.failed[key] = (ref.turn, PREVIOUS_TURN if transient else (rec.failure or REJECTED),
                                f"turn {ref.turn + 1} of this conversation failed ({rec.failure}): {rec.error}")
        self._advance(key)

    def _advance(self, key: tuple) -> None:
        waiting = self.waiting.get(key)
        if not waiting:
            return
        turn = min(waiting)
        failed = self.failed.get(key)
        if failed is not None and failed[0] < turn:
            pos, ref = waiting.pop(turn)
            self.feed.pending -= 1
            _, kind, why = failed
            ds = self.plan.datasets[ref.dataset].name
            self.sh.add(failed_record(ref.id, ds, pos, [], why, 0, kind))  # cascades to the turns after it
            return
        known = self.answers.get(key, {})
        if any(t not in known for t in range(turn)):
            return
        pos, ref = waiting.pop(turn)
        history = [known[t] for t in range(turn)]
        fut = self.loop.run_in_executor(self.executor, self._render, pos, ref, history)
        fut.add_done_callback(lambda f: self.feed.later(f.result()) if not f.cancelled() else None)

    @property
    def executor(self):
        if not hasattr(self, "_executor"):
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="turns")
        return self._executor

    def _render(self, pos: int, ref: PromptRef, history: list[Record]):
        """(pos, ref, ids, err) of a turn > 0, rendered with the answers decoded from the turns before it."""
        ds = self.plan.datasets[ref.dataset]
        try:
            prompt = self.reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
            answers = [answer_of(rec, self.tok, self.info) for rec in history]
            return pos, ref, chat.render(self.tok, self.plan.spec.model, turn_prompt(prompt, ref.turn, answers)), None
        except chat.ChatError as e:
            return pos, ref, None, (TEMPLATE, f"chat template: {e}")

    def close(self) -> None:
        if hasattr(self, "_executor"):
            self._executor.shutdown(wait=True, cancel_futures=True)
        self.reader.close()


def _failure_kind(e: Exception) -> str:
    if isinstance(e, ServerError):
        return SERVER_ERROR
    if isinstance(e, BadResponse):
        return BAD_RESPONSE
    return TIMEOUT  # Unreachable that is not a timeout stops the shard instead (see _consume)


async def _generate(sh: _Shard, ids: list[int], ds: str, ref, engine):
    """One prompt's /generate, retried while the server aborts it (up to client.retries)."""
    c = sh.spec.client
    attempts = 0
    while True:
        sh.in_flight += 1
        try:
            res = await generate(
                sh.http, ids, sh.spec.request_sampling(ds, ref.sample), timeout=c.request_timeout_s, retries=c.retries,
                backoff_s=c.backoff_s, backoff_max_s=c.backoff_max_s, engine_alive=engine.alive,
            )
        finally:
            sh.in_flight -= 1
        sh.last_answer = time.monotonic()
        attempts += res.attempts
        if res.finish != "abort" or attempts > c.retries:
            res.attempts = attempts
            return res
        log.warning("prompt %s aborted by the server (%s); retrying", ref.id, res.matched)


async def _consume(sh: _Shard, feed: _Feed, engine, info) -> None:
    c = sh.spec.client
    while True:
        item = await feed.get()
        if item is None:
            return
        pos, ref, ids, err = item
        ds = sh.plan.datasets[ref.dataset].name
        if err is not None:
            kind, message = err
            sh.add(failed_record(ref.id, ds, pos, ids or [], message, 0, kind))
            continue
        try:
            res = await _generate(sh, ids, ds, ref, engine)
        except RequestRejected as e:
            sh.last_answer = time.monotonic()
            sh.add(failed_record(ref.id, ds, pos, ids, str(e), getattr(e, "attempts", 1), REJECTED))
            continue
        except (Unreachable, ServerError, BadResponse) as e:
            if not engine.alive():
                feed.redo.append(item)
                raise _EngineDied(str(e)) from None
            if isinstance(e, Unreachable) and "no answer within" not in str(e):
                feed.redo.append(item)
                raise ShardFailed(f"engine at {engine.url} unreachable after {c.retries} retries: {e}") from None
            sh.add(failed_record(ref.id, ds, pos, ids, str(e), getattr(e, "attempts", c.retries + 1), _failure_kind(e)))
            continue
        except asyncio.CancelledError:
            feed.redo.append(item)
            raise
        sh.add(_result_record(ref, ds, pos, ids, res, info))


def _result_record(ref: PromptRef, ds: str, pos: int, ids: list[int], res, info) -> Record:
    """The record of a 200 answer: ok, or failed when the server aborted it or hit SGLang's NaN stop."""
    out = res.output_ids
    reasoning_end, tool_call_at = split_output(out, info.think_end_id, info.tool_call_start_id)
    failure = error = None
    if res.finish == "abort":
        failure, error = ABORTED, "aborted by the server"
    elif res.finish == "stop" and res.matched == NAN_MATCHED:
        failure = NAN
        error = (f"SGLang's NaN stop (finish_reason matched {NAN_MATCHED!r}): a token sampled from NaN logits was "
                 f"replaced by a stop id after {len(out) - 1} tokens; the output is not the model's")
        log.warning("prompt %s: %s; recorded failed, it is generated again on the next run (`toolkit retry`)", ref.id, error)
    return Record(
        id=ref.id, dataset=ds, index=pos, status=OK if failure is None else FAILED,
        prompt_ids=pack_ids(ids), output_ids=out.tobytes(), reasoning_end=reasoning_end,
        tool_call_at=tool_call_at, finish=res.finish, matched_stop=res.matched,
        prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
        cached_tokens=res.cached_tokens, latency_s=res.latency_s, attempts=res.attempts,
        error=error, failure=failure,
    )


class _HangWatch:
    """Notices an engine that is alive but answers nothing (wedged, SIGSTOPped): when no request was answered for
    `engine.hang_timeout_s` although some are in flight, `/health_generate` is asked, with a bounded timeout, on a
    connection of its own; when it fails too, the engine is treated as dead."""

    def __init__(self, engine, hang_timeout_s: float):
        self.engine, self.hang_timeout_s = engine, hang_timeout_s
        self.probe_timeout_s = min(30.0, max(2.0, hang_timeout_s))  # SGLang answers 503 after 20 s when wedged
        self.http = HttpClient(engine.url, api_key=engine.api_key, max_connections=1)
        self.next_probe = 0.0

    async def check(self, sh: _Shard) -> None:
        now = time.monotonic()
        stall = now - sh.last_answer
        if not sh.in_flight or stall < self.hang_timeout_s or now < self.next_probe:
            return
        try:
            status, _ = await self.http.get("/health_generate", timeout=self.probe_timeout_s)
            why = None if status == 200 else f"answered {status}"
        except Unreachable as e:
            why = str(e)
        if why is None:  # generating, only slowly (long outputs): look again later
            log.info("no request answered for %.0f s (%d in flight), but /health_generate answers 200", stall, sh.in_flight)
            self.next_probe = time.monotonic() + self.hang_timeout_s
            return
        raise _EngineHung(f"engine hung: no request answered for {stall:.0f} s with {sh.in_flight} in flight, and "
                          f"/health_generate {why} (limit engine.hang_timeout_s = {self.hang_timeout_s:g})")

    def close(self) -> None:
        self.http.close()


async def _watch(sh: _Shard, engine, hang: _HangWatch) -> None:
    """Flush due batches, refresh progress, and notice an engine that died or hung."""
    last = 0.0
    while True:
        await asyncio.sleep(0.25)
        if sh.writer.due():
            sh.writer.flush()
        if time.monotonic() - last > 2.0:
            last = time.monotonic()
            sh.save_progress()
        if not engine.alive():
            raise _EngineDied(f"engine exited with code {engine.exit_code()}")
        await hang.check(sh)


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
        # The consumers finishing is the normal end; the watcher never finishes on its own.
    finally:
        for t in [*tasks, stopper]:
            t.cancel()
        await asyncio.gather(*tasks, stopper, return_exceptions=True)


async def _run(sh: _Shard, todo: list[tuple[int, PromptRef]]) -> str:
    spec = sh.spec
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: int) -> None:
        name = signal.Signals(sig).name
        if stop.is_set():
            log.warning("got %s again: still stopping, %s", name, sh.stopping or "writing what is done")
            return
        log.warning("got %s: stopping; what is done is written, prompts in flight are generated again next time", name)
        sh.progress.stop_signal = name
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    feed = _Feed(_Budget(max(4 * spec.client.concurrency, 2 * chat.BATCH_SIZE)))
    state: dict = {}
    if any(d.regenerate for d in sh.plan.datasets):
        sh.chains = state["chains"] = _Chains(sh, feed, todo.refs, sh.history)
    engine = make_engine(spec, sh.rd.server_log_file(sh.shard), probe_ids=[], shard=sh.shard)
    if not engine.is_model:
        log.warning("engine is the STUB: a stand-in for SGLang's protocol, NOT a model; its outputs are synthetic")
    renderer = threading.Thread(target=_render_thread, args=(loop, feed, sh.plan, todo, state), daemon=True, name="render")
    sh.save_progress("loading")
    try:
        engine.start()
    except EngineError as e:  # refused before launch (e.g. SGLang's parser rejects the command line)
        raise ShardFailed(str(e)) from None
    renderer.start()
    ready_once = False
    try:
        while True:
            http = sh.http = HttpClient(engine.url, api_key=engine.api_key, max_connections=spec.client.concurrency)
            hang = _HangWatch(engine, spec.engine.hang_timeout_s)
            try:
                await _race(stop, engine.wait_ready(http))
                probe = await _race_value(stop, feed.first)
                if probe is not None:
                    engine.probe_ids = probe
                    await engine.probe(http)
                ready_once = True
                if not sh.t_gen:
                    sh.t_gen = time.monotonic()
                sh.save_progress("generating")
                log.info("generating %d prompts with concurrency %d", len(todo), spec.client.concurrency)
                sh.last_answer = time.monotonic()
                consumers = [_consume(sh, feed, engine, state["info"]) for _ in range(spec.client.concurrency)]
                await _race(stop, _all(consumers), _watch(sh, engine, hang))
                return DONE
            except (_EngineDied, EngineError) as e:
                if not ready_once or isinstance(e, EngineError) and engine.alive():
                    raise ShardFailed(str(e)) from None
                sh.writer.flush()
                sh.progress.engine_restarts += 1
                if sh.progress.engine_restarts > spec.engine.max_restarts:
                    from .engines.base import log_tail

                    raise ShardFailed(
                        f"engine died {sh.progress.engine_restarts} times (limit engine.max_restarts = "
                        f"{spec.engine.max_restarts}); last: {e}. Last lines of {engine.server_log}:\n{log_tail(engine.server_log)}"
                    ) from None
                log.error("engine died mid-shard (%s): restart %d of %d", e, sh.progress.engine_restarts, spec.engine.max_restarts)
                sh.save_progress("loading")
                await _stop_engine(sh, engine, 0.0 if isinstance(e, _EngineHung) else None)
                engine.start()
            finally:
                http.close()
                hang.close()
    except _Stop:
        return STOPPED
    finally:
        log.info("at most %d rendered prompts waited for a request (bound %d)", feed.peak, feed.budget.cap)
        state["stop"] = True
        feed.budget.close()
        if sh.chains is not None:
            sh.chains.close()
        sh.writer.flush()
        await _stop_engine(sh, engine)
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _stop_engine(sh: _Shard, engine, timeout_s: float | None = None) -> None:
    """Stop the engine on a thread, so the event loop still answers signals (a second Ctrl-C is told what it waits
    for) while the engine drains."""
    grace = engine.engine.shutdown_timeout_s if timeout_s is None else timeout_s
    pid = engine.proc.pid if engine.proc is not None else None
    sh.stopping = (f"waiting for the engine (pid {pid}) to exit: SIGTERM sent, SIGKILL after {grace:g} s "
                   "([engine] shutdown_timeout_s)") if pid else None
    try:
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, timeout_s)
    finally:
        sh.stopping = None


async def _race_value(stop: asyncio.Event, fut: asyncio.Future):
    await _race(stop, asyncio.shield(fut))
    return fut.result()


async def _all(aws) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _attach_log(path: Path) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger("toolkit").addHandler(h)
    return h


def _already_complete(rd: RunDir, plan: RunPlan, shard: int) -> bool:
    """Whether the shard's done manifest can be trusted to say there is nothing to do: its file unchanged (size
    and sha256), no transient failure left, no retry asked. An untrusted manifest is removed (merge and status
    must not take the shard as complete while it is being redone)."""
    m = read_done(rd.done_file(shard))
    if m is None or m.fingerprint != plan.fingerprint:
        return False
    changed = verify_done(m, rd.shard_file(shard))
    if changed:
        log.error("shard %d: %s: the file changed after the shard finished; checking it, salvaging what is intact "
                  "and generating the rest", shard, changed)
    elif rd.retry_file(shard).exists():
        log.info("shard %d: `toolkit retry` asked for records to be generated again", shard)
    elif m.transient:
        log.info("shard %d finished with %d failures that may pass: generating them again", shard, m.transient)
    else:
        log.info("shard %d is already complete (%d records): nothing to do", shard, m.records)
        return True
    rd.done_file(shard).unlink(missing_ok=True)
    return False


def _plan_todo(rd: RunDir, sh: _Shard, done_ids: dict[str, int], redo: set[str]) -> _Todo:
    """The shard's prompts not recorded yet, or to redo; ShardFailed when the file holds ids of another shard."""
    refs = RefSlice(rd, sh.sp.first, sh.sp.count)
    positions = array("q")
    owned = 0
    for i in range(len(refs)):
        rid = refs[i].id
        if rid in done_ids:
            owned += 1
            if rid not in redo:
                continue
        positions.append(sh.sp.first + i)
    if owned != len(done_ids):
        unknown = set(done_ids) - {refs[i].id for i in range(len(refs))}
        raise ShardFailed(f"{rd.shard_file(sh.shard)} holds ids this shard does not own (e.g. {sorted(unknown)[0]!r})")
    return _Todo(refs, positions)


def _resumed_tokens(sh: _Shard, todo: _Todo) -> int:
    """Output tokens of the records this attempt keeps: every newest record but those it generates again."""
    otok = sh.writer.output_tokens_at
    if otok is None:
        return 0
    return sum(otok) - sum(otok[p - sh.sp.first] for p in todo.positions)


def _redo_ids(rd: RunDir, shard: int, writer: ShardWriter, done_ids: dict[str, int]) -> set[str]:
    """Recorded ids to generate again: transient failures, and those a retry request names that were not
    recorded again since it was made."""
    redo = set(writer.transient)
    req = read_retry(rd.retry_file(shard))
    if req is not None:
        redo.update(i for i in req.ids if done_ids.get(i, req.before) < req.before)
    return redo


def _turn_history(rd: RunDir, plan: RunPlan, shard: int, redo: set[str]) -> dict[str, Record]:
    """Regenerated datasets: the newest record of each turn already in the shard file, when it is ok and not to be
    redone — the answers later turns are rendered with."""
    regenerated = {d.name for d in plan.datasets if d.regenerate}
    if not regenerated:
        return {}
    newest: dict[str, Record] = {}
    for rec in read_shard(rd.shard_file(shard)):
        if rec.dataset in regenerated:
            newest[rec.id] = rec
    return {i: r for i, r in newest.items() if r.status == OK and i not in redo}


def run_shard(run_dir: str | os.PathLike, shard: int) -> str:
    """Generate every prompt of `shard` not yet in its shard file. Returns DONE or STOPPED; raises ShardFailed.

    After STOPPED, the progress file's `stop_signal` names the signal that stopped it. A disk that is full, a run
    directory that cannot be written, a shard file another worker holds: a ShardFailed saying what to do, and the
    shard's progress says failed (where it can still be written). Nothing written before is lost.
    """
    try:
        return _run_shard(run_dir, shard)
    except (OSError, RuntimeError) as e:
        msg, code = _io_problem(e, RunDir(run_dir), shard)
        _mark_failed(RunDir(run_dir), shard, msg)
        raise ShardFailed(msg, code) from None


_READ_ONLY = {errno.EROFS, errno.EACCES, errno.EPERM}
_FULL = {errno.ENOSPC, errno.EDQUOT}


def _io_problem(e: Exception, rd: RunDir, shard: int) -> tuple[str, int]:
    """(one-line message saying what to do, exit code) of an error from the file system or the shard's lock."""
    if not isinstance(e, OSError):
        return str(e), 1
    where = shown_path(e.filename) if e.filename else f"the shard file {shown_path(rd.shard_file(shard))}"
    what = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
    if e.errno in _FULL:
        return (f"cannot write {where}: {what}; free space (or quota) on that file system, then run the shard again: "
                "it resumes, nothing written is lost"), 1
    if e.errno in _READ_ONLY:
        return (f"cannot write {where}: {what}; the run directory {rd.shown} must be writable by this job (a "
                "read-only mount, or another user's folder): fix its permissions or move it"), 2
    return f"{where}: {what}; check the file system, then run the shard again (it resumes)", 1


def _mark_failed(rd: RunDir, shard: int, msg: str) -> None:
    """Best effort: the shard's progress file says failed and why (it may itself be unwritable)."""
    try:
        p = read_progress(rd.progress_file(shard)) or Progress(shard=shard, total=0)
        p.state, p.error = "failed", msg
        write_progress(rd.progress_file(shard), p)
    except (OSError, ValueError):
        pass


def _run_shard(run_dir: str | os.PathLike, shard: int) -> str:
    rd, plan = load_run(run_dir)
    if not 0 <= shard < len(plan.shards):
        raise ShardFailed(f"{rd.root}: no shard {shard}; the run has shards 0..{len(plan.shards) - 1}")
    handler = _attach_log(rd.log_file(shard))
    logger = logging.getLogger("toolkit")
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    sh = _Shard(rd, plan, shard)
    try:
        ctx = sh.progress
        log.info("shard %d of run %s (%s): %d prompts; host %s, GPUs %s, job %s, array %s_%s, requeues %d",
                 shard, plan.name, plan.fingerprint, sh.sp.count, ctx.host, ctx.gpus, ctx.job_id,
                 ctx.array_job_id, ctx.array_task_id, ctx.restart_count)
        if _already_complete(rd, plan, shard):
            return DONE
        check_plan_inputs(plan)
        try:
            done_ids = sh.writer.open(positions=range(sh.sp.first, sh.sp.first + sh.sp.count))
        except RuntimeError as e:  # another writer holds the shard (ShardLocked), or the file is another run's
            raise ShardFailed(str(e)) from None
        try:
            redo = _redo_ids(rd, shard, sh.writer, done_ids)
            todo = _plan_todo(rd, sh, done_ids, redo)
            sh.progress.resumed_tokens = _resumed_tokens(sh, todo)
            sh.history = _turn_history(rd, plan, shard, redo)
            sh.recorded = len(done_ids) - len(redo)
            log.info("%d of %d prompts already recorded; %d to generate (%d of them again: %d transient failures, "
                     "%d asked by `toolkit retry`)", len(done_ids), sh.sp.count, len(todo), len(redo),
                     len(redo & sh.writer.transient), len(redo - sh.writer.transient))
            sh.progress.resumed = sh.recorded
            result = DONE
            if todo:
                try:
                    result = asyncio.run(_run(sh, todo))
                except ShardFailed as e:
                    sh.progress.error = str(e)
                    sh.save_progress("failed")
                    log.error("shard %d failed: %s", shard, e)
                    raise
            sh.writer.flush()
        finally:
            sh.writer.close()
        if result == STOPPED:
            sh.save_progress("stopped")
            log.info("shard %d stopped with %d of %d prompts recorded; it resumes from here when run again",
                     shard, sh.recorded, sh.sp.count)
            return STOPPED
        m = write_done(rd.done_file(shard), rd.shard_file(shard), shard, plan.fingerprint,
                       positions=range(sh.sp.first, sh.sp.first + sh.sp.count))
        if m.records != sh.sp.count:
            raise ShardFailed(f"shard {shard} ended with {m.records} records for {sh.sp.count} prompts")
        rd.retry_file(shard).unlink(missing_ok=True)
        sh.save_progress("done")
        log.info("shard %d complete: %d records (%d failed), %d output tokens", shard, m.records, m.failed, m.output_tokens)
        if m.transient:
            log.warning("shard %d: %d failures may pass when generated again (timeouts, 5xx, aborts, NaN); the next "
                        "run of the shard generates them again: `toolkit retry %s`", shard, m.transient, rd.shown)
        return DONE
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(old_level)
