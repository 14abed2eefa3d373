"""The shard worker: what a Slurm array task does for each shard it claims — engine → chat → client → records →
shard file.

`run_shard(run_dir, shard)` resumes the shard's file (every id already written is skipped, whatever order it
was written in), starts the engine, renders prompts with the chat template while the engine loads, streams
them through `/generate` with bounded concurrency, and appends checked records in fsynced batches. An engine
that dies mid-shard is restarted (up to `engine.max_restarts`); SIGTERM / SIGUSR2 / SIGINT stop it cleanly
(nothing written is lost; the requests in flight are aborted and their partial outputs kept as PARTIAL records,
continued from where they stopped next time: see inflight.save_in_flight and inflight._generate). A finished
shard gets its `done` manifest.

Nothing lost, nothing stuck: a failure that may pass (timeout, 5xx past the retries, abort, SGLang's NaN stop) is
recorded with its kind and tried again in the same run of the shard, up to `client.max_tries` tries counted in the
records (inflight.consume), then final for the run (records.is_given_up); ids `toolkit retry` names are generated
again, with a fresh count. A done manifest is trusted only when the
shard file still has its size and sha256; a damaged file is salvaged (formats.shardfile.ShardWriter.open). An engine that
stops answering (requests in flight, none answered for `engine.hang_timeout_s`, `/health_generate` failing) is
restarted like one that died. The render thread stays a bounded number of prompts ahead of the requests.

Regenerated conversations (turns.py): turn k of a conversation waits until turn k-1 has a record, then is rendered
with the answers of the turns before it (worker.turn_order).

The parts: feed.py renders prompts on a thread and hands them to the event loop; inflight.py sends them (rids,
continuations, partial outputs at a stop, records); concurrency.py sizes and watches the requests in flight;
worker.shard holds what they share. This module keeps the shard's lifecycle.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from toolkit.engines.base import EngineDied, EngineError, EngineHung, EngineUnreachable
from toolkit.engines.client import Expect, HttpClient, server_limits
from toolkit.engines.kinds import make_engine
from toolkit.errors import BadInputError, FailedError
from toolkit.formats.files import FULL, READ_ONLY, LogFile, shown_path
from toolkit.formats.locks import ShardLocked
from toolkit.formats.logline import text_formatter
from toolkit.formats.manifests import write_done
from toolkit.formats.newest import newest_records, scan_shard
from toolkit.formats.progress import Progress, read_progress, write_progress
from toolkit.formats.records import MAY_PASS, OK, Record
from toolkit.formats.run import RefSlice, RunPlan, ShardRefs
from toolkit.formats.rundir import RunDir
from toolkit.formats.shardfile import ForeignShard, ShardWriter
from toolkit.formats.shardstate import ShardState, retry_request, shard_state
from toolkit.job import chat
from toolkit.job.inputs import check_plan_inputs
from toolkit.job.plan import load_run
from toolkit.worker.concurrency import HangWatch, auto_target, pool, resize, watch, watch_load
from toolkit.worker.exitguard import ExitGuard, cancel_and_wait, describe_tasks
from toolkit.worker.feed import Budget, Feed, RenderState, Todo, render_thread
from toolkit.worker.inflight import ABORT_GRACE_S, save_in_flight
from toolkit.worker.shard import Shard
from toolkit.worker.turn_order import Chains

__all__ = ["run_shard", "run_shard_in", "EngineSession", "Outcome", "ShardBusy", "ShardFailed", "ShardRefused", "DONE",
           "STOPPED"]

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

DONE, STOPPED = "done", "stopped"


class Outcome(str):
    """How a shard's run ended: DONE or STOPPED (a str: `run_shard(...) == DONE` reads as it says), with the signal
    that stopped it (`stop_signal`: SIGUSR2, SIGTERM, SIGINT; None when done)."""

    stop_signal: str | None = None

    @classmethod
    def stopped(cls, signal_name: str | None) -> Outcome:
        out = cls(STOPPED)
        out.stop_signal = signal_name
        return out
RENDER_JOIN_S = 10.0   # how long the end of a shard waits for its render thread


class ShardFailed(FailedError):
    """The shard cannot finish in this task (engine never ready, died too often, unreachable, disk full, shard
    locked by another worker): exit 1."""


class ShardRefused(BadInputError):
    """The shard cannot run on this input (a run directory this job cannot write, a shard file of another run, a
    tokenizer or model folder the render thread refuses): exit 2. It ends the shard as ShardFailed does."""


class ShardBusy(ShardFailed):
    """Another worker holds the shard's file (its lock): the shard is being generated elsewhere."""


class _Stop(Exception):
    pass


async def _generate_shard(sh: Shard, stop: asyncio.Event, feed: Feed, engine, hang, info) -> None:
    """Send every prompt, watching the engine and its load; raises _Stop on a stop request. With
    client.save_in_flight the requests in flight are first aborted and their partial outputs recorded."""
    http = HttpClient(engine.url, api_key=engine.api_key, max_connections=1)
    try:  # what the server can run, and its length limit, before the first request goes out
        limits = await server_limits(http)
    finally:
        http.close()
    sh.progress.capacity = limits.capacity or None
    sh.expect = Expect(vocab_size=info.vocab_size if info is not None else None, max_req_len=limits.max_req_len)
    c = sh.spec.client
    if c.concurrency == "auto":
        resize(sh, auto_target(sh.progress.capacity or 0, 0, 0, c.max_concurrency))
    jobs = [_answer_all(sh, feed, engine, info), watch(sh, engine, hang), watch_load(sh, engine)]
    if not sh.spec.client.save_in_flight:
        await _race(stop, *jobs)
        return
    # The stopper finishing (the grace over) or the consumers all returning ends the race.
    await _race(asyncio.Event(), *jobs, save_in_flight(sh, stop, feed, engine))
    if stop.is_set():
        raise _Stop()


async def _answer_all(sh: Shard, feed: Feed, engine, info) -> None:
    """Every prompt sent and answered (or the stop's aborts back): the shard's work is over, and the worker's end
    is bounded from here (exitguard)."""
    await pool(sh, feed, engine, info)
    sh.exit_guard.arm(_exit_bound(sh.spec), "its prompts were all answered")


def _exit_bound(spec) -> float:
    """Seconds the worker may take to end once its work is over: stop its tasks, flush, stop the engine."""
    return spec.engine.shutdown_timeout_s + spec.engine.exit_grace_s


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
        await cancel_and_wait([*tasks, stopper])


class EngineSession:
    """The engine one worker keeps across the shards it runs: started for the first shard with prompts to generate,
    restarted when it dies, and — with `keep` (a worker claiming shards one after another, worker.claims) — left
    running when a shard is done, for the next; stopped when a shard stops or fails, or when the worker closes the
    session. It also owns the stop request: a signal stops the shard being run and the worker after it."""

    def __init__(self, *, keep: bool = False, task: str | None = None, group: str | None = None):
        self.keep = keep
        self.task = task              # who works (`12_3` on Slurm, `worker 2` here): written into progress files
        self.group = group            # the workers sharing its pool (worker.claims): written into progress files
        self.engine = None            # engines.base.Engine, once a shard needed one
        self.served: list[int] = []   # shards run in this session, in order
        self.first_shard: int | None = None  # the shard whose server log the engine writes
        self.stop: asyncio.Event | None = None
        self.stop_signal: str | None = None
        self.current: Shard | None = None
        self.waiting_for: str | None = None
        self.last_log: Path | None = None  # the log of the shard run last: the engine's final stop is said there
        self.tokenizer: tuple[bytes, Any, Any] | None = None  # (key, tokenizer, token info) of the last shard's run

    def kept_tokenizer(self, plan) -> tuple[Any, Any]:
        """(tokenizer, token info) loaded for an earlier shard of this session with the same model, tokenizer and
        template, or (None, None): the render thread loads it then."""
        if self.tokenizer is not None and self.tokenizer[0] == _tokenizer_key(plan):
            return self.tokenizer[1], self.tokenizer[2]
        return None, None

    def keep_tokenizer(self, plan, tok, info) -> None:
        if tok is not None and info is not None:
            self.tokenizer = (_tokenizer_key(plan), tok, info)

    @property
    def starts(self) -> int:
        """Engine starts in this session (restarts after a crash included)."""
        return self.engine.starts if self.engine is not None else 0

    def engine_for(self, sh: Shard):
        if self.engine is None:
            self.first_shard = sh.shard
            self.engine = make_engine(sh.spec, sh.rd.server_log_file(sh.shard), probe_ids=[], shard=sh.shard)
        return self.engine

    def install_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        self.stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def remove_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        sh = self.current
        if self.stop.is_set():
            waiting = (sh.waiting_for if sh is not None else None) or self.waiting_for
            log.warning("got %s again: still stopping, %s", name, waiting or "saving and writing what is done")
            return
        self.stop_signal = name
        if sh is None:  # between shards: no shard is claimed after this
            log.warning("got %s: stopping; no further shard is started", name)
            self.stop.set()
            return
        spec = sh.spec
        log.warning("got %s: stopping; what is done is written, prompts in flight %s", name,
                    "are saved as partial outputs and continued next time" if spec.client.save_in_flight
                    else "are generated again next time")
        sh.progress.stop_signal = name
        self.stop.set()
        if sh.exit_guard is not None:
            sh.exit_guard.arm(ABORT_GRACE_S + _exit_bound(spec), f"{name} asked it to stop")

    async def close(self, spec, shard: int) -> None:
        """Stop the engine if it still runs, within the exit bound (exitguard); said in the last shard's log too."""
        engine = self.engine
        if engine is None or engine.proc is None or not engine.alive():
            return
        handler = _attach_log(self.last_log) if self.last_log is not None else None
        try:
            await self._stop(spec, shard, engine)
        finally:
            if handler is not None:
                logging.getLogger("toolkit").removeHandler(handler)
                handler.close()

    async def _stop(self, spec, shard: int, engine) -> None:
        guard = ExitGuard(shard, asyncio.get_running_loop())
        guard.before_exit.append(lambda: _kill(engine))
        guard.arm(_exit_bound(spec), "its last shard ended")
        grace = spec.engine.shutdown_timeout_s
        self.waiting_for = (f"waiting for the engine (pid {engine.proc.pid}) to exit: SIGTERM sent, SIGKILL after "
                            f"{grace:g} s ([engine] shutdown_timeout_s)")
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.stop, None)
        finally:
            self.waiting_for = None
            guard.disarm()


def _tokenizer_key(plan) -> bytes:
    """What a loaded tokenizer and its token info depend on: the [model] table and the digests of its folders."""
    return msgspec.json.encode([plan.spec.model, plan.parts["tokenizer"], plan.parts["template"]])


async def _run(sh: Shard, todo: Todo, session: EngineSession) -> str:
    spec = sh.spec
    loop = asyncio.get_running_loop()
    stop = session.stop
    if stop.is_set():  # a signal came while the shard was being opened: nothing started
        sh.progress.stop_signal = session.stop_signal
        return STOPPED
    guard = sh.exit_guard = ExitGuard(sh.shard, loop)
    session.current = sh
    most = _max_in_flight(spec)
    feed = Feed(Budget(max(4 * most, 2 * chat.BATCH_SIZE)))
    state = RenderState()
    state.tok, state.info = session.kept_tokenizer(sh.plan)
    if any(d.regenerate for d in sh.plan.datasets):
        sh.chains = state.chains = Chains(sh, feed, RefSlice(sh.rd, sh.sp.first, sh.sp.count), sh.history)
    engine = session.engine_for(sh)
    if not engine.is_model:
        log.warning("engine is the STUB: a stand-in for SGLang's protocol, NOT a model; its outputs are synthetic")
    renderer = threading.Thread(target=render_thread, args=(loop, feed, sh.plan, todo, state), daemon=True, name="render")
    guard.before_exit += [lambda: sh.writer.flush_within(5.0), lambda: _kill(engine)]
    running = engine.starts > 0 and engine.alive()
    keep = False
    if running:  # claimed after another shard: the engine serves on
        pid = f"pid {engine.proc.pid}, " if engine.proc is not None else ""
        log.info("engine %s already running (%sstarted %s in this task, its log %s): no new start",
                 engine.kind, pid, _count(engine.starts, "time"), shown_path(engine.server_log))
        sh.save_progress("loading")
    else:
        sh.save_progress("loading")
        try:
            engine.start()
        except EngineError as e:  # refused before launch (e.g. SGLang's parser rejects the command line)
            raise ShardFailed(str(e)) from None
    renderer.start()
    ready_once = running
    try:
        while True:
            http = sh.http = HttpClient(engine.url, api_key=engine.api_key, max_connections=most)
            hang = HangWatch(engine, spec.engine.hang_timeout_s)
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
                log.info("generating %d %ss (%d to continue from a partial output) with concurrency %s",
                         len(todo), sh.plan.noun, len(sh.partial), spec.client.concurrency)
                sh.last_answer = time.monotonic()
                await _generate_shard(sh, stop, feed, engine, hang, state.info)
                keep = session.keep and engine.alive()
                return DONE
            except EngineUnreachable as e:
                raise ShardFailed(str(e)) from None
            except EngineError as e:  # died or hung: restarted; refused or never ready: the shard cannot go on here
                if not ready_once or not isinstance(e, EngineDied) and engine.alive():
                    raise ShardFailed(str(e)) from None
                sh.writer.flush()
                sh.progress.engine_restarts += 1
                if sh.progress.engine_restarts > spec.engine.max_restarts:
                    from toolkit.engines.base import log_tail

                    raise ShardFailed(
                        f"engine died {sh.progress.engine_restarts} times (limit engine.max_restarts = "
                        f"{spec.engine.max_restarts}); last: {e}. Last lines of {engine.server_log}:\n{log_tail(engine.server_log)}"
                    ) from None
                log.error("engine died mid-shard (%s): restart %d of %d", e, sh.progress.engine_restarts, spec.engine.max_restarts)
                sh.save_progress("loading")
                await _stop_engine(sh, engine, 0.0 if isinstance(e, EngineHung) else None)
                engine.start()
            finally:
                http.close()
                hang.close()
    except _Stop:
        return STOPPED
    finally:
        guard.arm(_exit_bound(spec), "the shard's work ended")
        log.info("at most %d rendered prompts waited for a request (bound %d)", feed.peak, feed.budget.cap)
        state.stop = True
        session.keep_tokenizer(sh.plan, state.tok, state.info)
        feed.budget.close()
        if sh.chains is not None:
            sh.chains.close()
        sh.writer.flush()
        if not keep:
            await _stop_engine(sh, engine)
        session.current = None
        _account_for(renderer)


def _account_for(renderer: threading.Thread) -> None:
    """At the shard's end nothing it started may still run: no task but this one, the render thread ended."""
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if left:
        log.error("%d task(s) still running at the end of the shard: %s; cancelling them", len(left),
                  describe_tasks(left))
        for t in left:
            t.cancel()
    if renderer.ident is not None:
        renderer.join(RENDER_JOIN_S)
        if renderer.is_alive():
            log.warning("the render thread has not ended %g s after the shard's end; left behind (a daemon thread)",
                        RENDER_JOIN_S)


def _kill(engine) -> None:
    """The exit guard's last word to the engine: SIGKILL to everything it runs (its GPUs are free at once)."""
    if engine.proc is not None:
        engine.kill()


async def _stop_engine(sh: Shard, engine, timeout_s: float | None = None) -> None:
    """Stop the engine on a thread, so the event loop still answers signals (a second Ctrl-C is told what it waits
    for) while the engine drains."""
    grace = engine.engine.shutdown_timeout_s if timeout_s is None else timeout_s
    pid = engine.proc.pid if engine.proc is not None else None
    sh.waiting_for = (f"waiting for the engine (pid {pid}) to exit: SIGTERM sent, SIGKILL after {grace:g} s "
                   "([engine] shutdown_timeout_s)") if pid else None
    try:
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, timeout_s)
    finally:
        sh.waiting_for = None


def _max_in_flight(spec) -> int:
    c = spec.client
    return c.max_concurrency if c.concurrency == "auto" else c.concurrency


async def _race_value(stop: asyncio.Event, fut: asyncio.Future):
    await _race(stop, asyncio.shield(fut))
    return fut.result()


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _where(p: Progress) -> str:
    """Where this attempt runs, in words: host, GPUs, and the Slurm job when there is one."""
    out = f"on {p.host}" + (f", GPUs {p.gpus}" if p.gpus else "")
    if p.array_job_id and p.array_task_id is not None:
        out += f", Slurm job {p.job_id} (array {p.array_job_id}, task {p.array_task_id})"
    elif p.job_id:
        out += f", Slurm job {p.job_id}"
    else:
        out += ", not under Slurm"
    if p.restart_count:
        out += f", requeued {_count(p.restart_count, 'time')}"
    return out


def _resume_line(total: int, recorded: int, todo: int, transient: int, asked: int, noun: str = "prompt") -> str:
    """What this attempt finds and does: e.g. `30 prompts: 26 have a record, 18 kept; 12 to generate: 4 never
    generated and 8 again (8 failures that may pass)`."""
    if not recorded:
        return f"{_count(total, noun)} to generate"
    again = transient + asked
    kept = recorded - again
    if not todo:
        return f"{_count(total, noun)}: all have a record; nothing to generate"
    why = ", ".join(x for x in (f"{transient} failure{'s' if transient != 1 else ''} that may pass" if transient else "",
                                f"{asked} asked for by `toolkit retry`" if asked else "") if x)
    parts = [f"{todo - again} never generated" if todo - again else "", f"{again} again ({why})" if again else ""]
    return (f"{_count(total, noun)}: {recorded} {'has' if recorded == 1 else 'have'} a record, {kept} kept; "
            f"{todo} to generate: "
            + " and ".join(x for x in parts if x))


def _attach_log(path: Path) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    h = LogFile(path)
    h.setFormatter(text_formatter())
    logging.getLogger("toolkit").addHandler(h)
    return h


def _already_complete(rd: RunDir, plan: RunPlan, shard: int) -> bool:
    """Whether the shard's done manifest can be trusted to say there is nothing to do: its file unchanged (size
    and sha256), no transient failure left, no retry asked. An untrusted manifest is removed (merge and status
    must not take the shard as complete while it is being redone)."""
    st = shard_state(rd, shard, fingerprint=plan.fingerprint, verify=True)
    if st.foreign or st.state is not ShardState.UNTRUSTED and st.done is None:
        return False
    if st.state is ShardState.UNTRUSTED:
        log.error("shard %d: %s: the file changed after the shard finished; checking it, salvaging what is intact "
                  "and generating the rest", shard, st.why)
    elif st.state is ShardState.RETRY:
        log.info("shard %d: `toolkit retry` asked for records to be generated again", shard)
    elif st.state is ShardState.MAY_PASS:
        log.info("shard %d finished with %d failures that may pass: generating them again", shard, st.done.transient)
    else:
        log.info("shard %d is already complete (%d records): nothing to do", shard, st.done.records)
        return True
    rd.done_file(shard).unlink(missing_ok=True)
    return False


def _plan_todo(rd: RunDir, sh: Shard, done_ids: dict[str, int], redo: set[str]) -> Todo:
    """The shard's prompts not recorded yet, or to redo; ShardFailed when the file holds ids of another shard."""
    refs = ShardRefs(rd, sh.sp)
    if not done_ids:  # a fresh shard: every prompt, without reading a ref
        return Todo(refs)
    chosen = bytearray((len(refs) + 7) // 8)
    owned = count = 0
    for i, ref in enumerate(refs):
        if ref.id in done_ids:
            owned += 1
            if ref.id not in redo:
                continue
        chosen[i >> 3] |= 1 << (i & 7)
        count += 1
    if owned != len(done_ids):
        unknown = set(done_ids) - {ref.id for ref in refs}
        raise ShardFailed(f"{rd.shard_file(sh.shard)} holds ids this shard does not own (e.g. {sorted(unknown)[0]!r})")
    return Todo(refs, chosen, count)


def _resumed_tokens(sh: Shard, todo: Todo) -> int:
    """Output tokens of the records this attempt keeps: every newest record but those it generates again."""
    otok = sh.writer.output_tokens_at
    if otok is None:
        return 0
    return sum(n for i, n in enumerate(otok) if i not in todo)


def _redo_ids(rd: RunDir, shard: int, writer: ShardWriter, done_ids: dict[str, int]) -> tuple[set[str], dict[str, int]]:
    """Recorded ids to generate again: transient failures, and those a retry request names that were not
    recorded again since it was made; and the failed tries each has had in its budget (Record.tries): none for
    those the retry request names (a fresh budget), the newest record's count for the others."""
    redo = set(writer.transient)
    asked: set[str] = set()
    req = retry_request(rd, shard)
    if req is not None:
        asked = {i for i in req.ids if done_ids.get(i, req.before) < req.before}
        redo |= asked
    return redo, {i: writer.tries[i] for i in redo if i in writer.tries and i not in asked}


def _turn_history(rd: RunDir, plan: RunPlan, shard: int, redo: set[str]) -> dict[str, Record]:
    """Regenerated datasets: the newest record of each turn already in the shard file, when it is ok and not to be
    redone — the answers later turns are rendered with."""
    regenerated = {d.name for d in plan.datasets if d.regenerate}
    if not regenerated:
        return {}
    sp, path = plan.shards[shard], rd.shard_file(shard)
    sc = scan_shard(path if path.exists() else None, sp.first, sp.count)
    return {r.id: r for r in newest_records(path, sc)
            if r is not None and r.dataset in regenerated and r.status == OK and r.id not in redo}


def run_shard(run_dir: str | os.PathLike, shard: int) -> Outcome:
    """Generate every prompt of `shard` not yet in its shard file. Returns DONE or STOPPED; raises ShardFailed
    (exit 1) or ShardRefused (exit 2).

    A STOPPED outcome names the signal that stopped it (so does the progress file). A disk that is full, a shard
    file another worker holds (ShardFailed), a run directory that cannot be written (ShardRefused): an error saying
    what to do, and the shard's progress says failed (where it can still be written). Nothing written before is
    lost.
    """
    async def one() -> Outcome:
        session = EngineSession()
        loop = asyncio.get_running_loop()
        session.install_signals(loop)
        try:
            return await run_shard_in(run_dir, shard, session)
        finally:
            session.remove_signals(loop)

    return asyncio.run(one())


async def run_shard_in(run_dir: str | os.PathLike, shard: int, session: EngineSession) -> Outcome:
    """`run_shard` inside a running event loop, with the engine of `session` (started here when it has none;
    left running after a shard done when the session keeps it)."""
    try:
        return await _run_shard(run_dir, shard, session)
    except OSError as e:  # before the shard's log is open, or it cannot be
        raise _failed(e, RunDir(run_dir), shard) from None


def _failed(e: OSError, rd: RunDir, shard: int) -> ShardFailed | ShardRefused:
    """The ShardFailed of a file-system error, saying what to do (ShardRefused, exit 2, for a run directory this
    job cannot write), logged, and the shard's progress marked failed."""
    where = shown_path(e.filename) if e.filename else f"the shard file {shown_path(rd.shard_file(shard))}"
    what = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
    if e.errno in FULL:
        failed = ShardFailed(f"cannot write {where}: {what}; free space (or quota) on that file system, then run the "
                             "shard again: it resumes, nothing written is lost")
    elif e.errno in READ_ONLY:
        failed = ShardRefused(f"cannot write {where}: {what}; the run directory {rd.shown} must be writable by this "
                              "job (a read-only mount, or another user's folder): fix its permissions or move it")
    else:
        failed = ShardFailed(f"{where}: {what}; check the file system, then run the shard again (it resumes)")
    _mark_failed(rd, shard, str(failed))
    log.error("shard %d failed: %s", shard, failed)
    return failed


def _mark_failed(rd: RunDir, shard: int, msg: str) -> None:
    """Best effort: the shard's progress file says failed and why (it may itself be unwritable)."""
    try:
        p = read_progress(rd.progress_file(shard)) or Progress(shard=shard, total=0)
        p.state, p.error = "failed", msg
        write_progress(rd.progress_file(shard), p)
    except (OSError, ValueError):
        pass


async def _run_shard(run_dir: str | os.PathLike, shard: int, session: EngineSession) -> Outcome:
    rd, plan = load_run(run_dir)
    if not 0 <= shard < len(plan.shards):
        raise ShardFailed(f"{rd.root}: no shard {shard}; the run has shards 0..{len(plan.shards) - 1}")
    handler = _attach_log(rd.log_file(shard))
    session.last_log = rd.log_file(shard)
    logger = logging.getLogger("toolkit")
    old_level = logger.level
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    sh = Shard(rd, plan, shard)
    sh.session = session
    try:
        ctx = sh.progress
        log.info("shard %d of run %s (%s): %s; %s", shard, plan.name, plan.fingerprint, _count(sh.sp.count, plan.noun),
                 _where(ctx))
        if _already_complete(rd, plan, shard):
            return Outcome(DONE)
        check_plan_inputs(plan)
        try:
            done_ids = sh.writer.open(positions=range(sh.sp.first, sh.sp.first + sh.sp.count))
        except ShardLocked as e:  # another writer holds the shard
            raise ShardBusy(str(e)) from None
        except ForeignShard as e:  # the file is another run's
            raise ShardRefused(str(e)) from None
        session.served.append(shard)
        try:
            redo, sh.tries = _redo_ids(rd, shard, sh.writer, done_ids)
            todo = _plan_todo(rd, sh, done_ids, redo)
            sh.progress.resumed_tokens = _resumed_tokens(sh, todo)
            sh.history = _turn_history(rd, plan, shard, redo)
            sh.recorded = len(done_ids) - len(redo)
            sh.partial = {i: r for i, r in sh.writer.partial.items() if i in redo}
            log.info("%s", _resume_line(sh.sp.count, len(done_ids), len(todo), len(redo & sh.writer.transient),
                                        len(redo - sh.writer.transient), plan.noun))
            sh.progress.resumed = sh.recorded
            result = DONE
            if todo:
                try:
                    result = await _run(sh, todo, session)
                except ShardFailed as e:
                    sh.progress.error = str(e)
                    sh.save_progress("failed")
                    raise
                except BadInputError as e:  # the tokenizer or model folder, found by the render thread
                    sh.progress.error = str(e)
                    sh.save_progress("failed")
                    raise ShardRefused(str(e)) from None
                finally:
                    if sh.exit_guard is not None:  # the shard's event loop has returned: its end is not stuck
                        sh.exit_guard.disarm()
            sh.writer.flush()
        finally:
            sh.writer.close()
        if result == STOPPED:
            sh.save_progress("stopped")
            log.info("shard %d stopped with %d of %d prompts recorded; it resumes from here when run again",
                     shard, sh.recorded, sh.sp.count)
            return Outcome.stopped(sh.progress.stop_signal)
        m = write_done(rd.done_file(shard), rd.shard_file(shard), shard, plan.fingerprint,
                       positions=range(sh.sp.first, sh.sp.first + sh.sp.count))
        if m.records != sh.sp.count:
            raise ShardFailed(f"shard {shard} ended with {m.records} records for {sh.sp.count} prompts")
        rd.retry_file(shard).unlink(missing_ok=True)
        sh.save_progress("done")
        log.info("shard %d complete: %d records (%d failed), %d output tokens%s", shard, m.records, m.failed,
                 m.output_tokens, f"; {sh.progress.loops_stopped} repetition loops stopped in flight by this attempt "
                 "([client] loop_stop)" if sh.progress.loops_stopped else "")
        if m.transient:
            log.warning("shard %d: %d failures may pass when generated again (%s); the next "
                        "run of the shard generates them again: `toolkit retry %s`", shard, m.transient, MAY_PASS, rd.shown)
        if m.given_up:
            log.warning("shard %d: %d failures that may pass (%s) failed every one of their tries ([client] "
                        "max_tries = %d) and are final for this run: `toolkit retry %s` generates them again",
                        shard, m.given_up, MAY_PASS, plan.spec.client.max_tries, rd.shown)
        return Outcome(DONE)
    except (ShardFailed, ShardRefused) as e:  # said once, in the shard's log
        log.error("shard %d failed: %s", shard, e)
        raise
    except OSError as e:
        raise _failed(e, rd, shard) from None
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(old_level)
