"""A shard's run: what a worker does with one shard it holds — engine → chat → client → records →
shard file.

`open_shard` resumes the shard's file (every id already written is skipped, whatever order it was
written in), takes its lock, works out what is left to generate and opens the shard's own log; the
engine session (worker.session) then renders its prompts with the chat template (`ShardRun.start`,
while the engine loads or while the previous shard's last requests finish), streams them through
`/generate` with the engine's bounded concurrency, and appends checked records in fsynced batches.
`ShardRun.finish` writes a finished shard's `done` manifest, or says where a stopped one resumes;
`ShardRun.fail` says why a shard cannot finish here.

SIGTERM / SIGUSR2 / SIGINT stop it cleanly (nothing written is lost; the requests in flight are
aborted and their partial outputs kept as PARTIAL records, continued from where they stopped next
time: see inflight.save_in_flight and inflight._generate).

Nothing lost, nothing stuck: a failure that may pass (timeout, 5xx past the retries, abort, SGLang's
NaN stop) is recorded with its kind and tried again in the same run of the shard, up to
`client.max_tries` tries counted in the records (inflight.consume), then final for the run
(records.is_given_up); ids `toolkit retry` names are generated again, with a fresh count. A done
manifest is trusted only when the shard file still has its size and sha256; a damaged file is
salvaged (formats.shardfile.ShardWriter.open). The render thread stays a bounded number of prompts
ahead of the requests.

Regenerated conversations (turns.py): turn k of a conversation waits until turn k-1 has a record,
then is rendered with the answers of the turns before it (worker.turn_order).

The parts: session.py keeps the engine and the shards open on it; feed.py renders prompts on a
thread and hands them to the event loop; inflight.py sends them (rids, continuations, partial
outputs at a stop, records); concurrency.py sizes and watches the requests in flight; worker.shard
holds what they share. This module keeps one shard's lifecycle, and `run_shard`, a session of one
shard."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import logging
import os
import threading
from pathlib import Path

from toolkit.errors import BadInputError
from toolkit.formats.files import FULL, READ_ONLY, LogFile, shown_path
from toolkit.formats.locks import ShardLocked
from toolkit.formats.logline import text_formatter
from toolkit.formats.manifests import write_done
from toolkit.formats.newest import newest_records, scan_shard
from toolkit.formats.progress import Progress, read_progress, write_progress
from toolkit.formats.prompts import ShardRefs
from toolkit.formats.records import MAY_PASS, OK, Record
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardfile import ForeignShard, ShardWriter
from toolkit.formats.shardstate import VERIFIED, ShardState, retry_request
from toolkit.job import chat
from toolkit.job.inputs import check_plan_inputs
from toolkit.job.spec import JobSpec
from toolkit.worker.feed import Budget, Feed, RenderState, Todo, render_thread
from toolkit.worker.session import EngineSession, _max_in_flight
from toolkit.worker.shard import (
    SHARD,
    SHARD_ERRORS,
    End,
    Shard,
    ShardBusy,
    ShardEnd,
    ShardFailed,
    ShardRefused,
    count,
)
from toolkit.worker.turn_order import Chains

__all__ = [
    "run_shard",
    "open_shard",
    "ShardRun",
    "ShardEnd",
    "End",
    "ShardBusy",
    "ShardFailed",
    "DONE",
    "STOPPED",
]

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

DONE, STOPPED = End.DONE, End.STOPPED
RENDER_JOIN_S = 10.0  # how long the end of a shard waits for its render thread
_count = count


@contextlib.contextmanager
def shard_lines(shard: int):
    """Log lines said inside are about `shard`: they go to its log only."""
    token = SHARD.set(shard)
    try:
        yield
    finally:
        SHARD.reset(token)


class ShardLog(logging.Filter):
    """A shard's log keeps its own lines and the engine's (no shard named), never another's."""

    def __init__(self, shard: int):
        super().__init__()
        self.shard = shard

    def filter(self, record: logging.LogRecord) -> bool:
        k = SHARD.get()
        return k is None or k == self.shard


def _attach_log(path: Path, shard: int) -> logging.Handler:
    path.parent.mkdir(parents=True, exist_ok=True)
    h = LogFile(path)
    h.setFormatter(text_formatter())
    h.addFilter(ShardLog(shard))
    logging.getLogger("toolkit").addHandler(h)
    return h


class ShardRun(Shard):
    """One shard open in this task: its file (writer), its log, what it has to generate, and — once
    the session starts it — its feed and render thread."""

    def __init__(self, rd: RunDir, plan: RunPlan, shard: int):
        super().__init__(rd, plan, shard)
        self.handler: logging.Handler | None = None
        self.todo: Todo | None = None
        self.todo_count = 0
        self.render: RenderState | None = None
        self.renderer: threading.Thread | None = None
        self.closed = False

    def start(self, session: EngineSession) -> None:
        """Start rendering its prompts (on a thread of its own), for the session to send."""
        loop = asyncio.get_running_loop()
        most = _max_in_flight(self.spec)
        feed = self.feed = Feed(Budget(max(4 * most, 2 * chat.BATCH_SIZE)))
        state = self.render = RenderState()
        state.tok, state.info = session.kept_tokenizer(self.plan)
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
                    "daemon "
                    "thread)",
                    RENDER_JOIN_S,
                )

    def finish(self, stopped: bool) -> ShardEnd | ShardFailed | ShardRefused:
        """Its requests are over: write what is left, and its done manifest (or say where a stopped
        shard resumes)."""
        with shard_lines(self.shard):
            try:
                self._stop_render()
                return _finish(self, stopped)
            except (*SHARD_ERRORS, OSError, BadInputError) as e:
                return self._failed(e)

    def fail(self, e: BaseException) -> ShardFailed | ShardRefused:
        with shard_lines(self.shard):
            self._stop_render()
            return self._failed(e)

    def _failed(self, e: BaseException) -> ShardFailed | ShardRefused:
        if isinstance(e, OSError):
            try:
                self._close_writer()
            except OSError:
                pass  # (the disk that failed fails again: `e` says what to do)
            return _failed(e, self.rd, self.shard)
        if isinstance(e, BadInputError) and not isinstance(e, SHARD_ERRORS):
            e = ShardRefused(str(e))
        elif not isinstance(e, SHARD_ERRORS):
            e = ShardFailed(f"{type(e).__name__}: {e}")
        try:
            self.progress.error = str(e)
            self.save_progress("failed")
            self._close_writer()
        except OSError:
            pass
        log.error("shard %d failed: %s", self.shard, e)
        return e

    def _close_writer(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.writer.flush()
            finally:
                self.writer.close()

    def detach(self) -> logging.Handler | None:
        """Its log handler, no longer its own (the session keeps or closes it)."""
        h, self.handler = self.handler, None
        return h


def _finish(sh: ShardRun, stopped: bool) -> ShardEnd:
    shard = sh.shard
    sh._close_writer()
    if stopped and sh.progress.leaving:
        sh.save_progress("stopped")
        log.info(
            "shard %d handed over with %d of %d prompts recorded and %d partial outputs kept: a "
            "task "
            "with room claims it and continues them",
            shard,
            sh.recorded,
            sh.sp.count,
            sh.progress.partial_saved,
        )
        return ShardEnd(shard, STOPPED, None)
    if stopped:
        sh.save_progress("stopped")
        log.info(
            "shard %d stopped with %d of %d prompts recorded; it resumes from here when run again",
            shard,
            sh.recorded,
            sh.sp.count,
        )
        return ShardEnd(shard, STOPPED, sh.progress.stop_signal)
    return _complete(sh)


def _complete(sh: Shard) -> ShardEnd:
    rd, shard, plan = sh.rd, sh.shard, sh.plan
    m = write_done(
        rd.done_file(shard),
        rd.shard_file(shard),
        shard,
        plan.fingerprint,
        positions=range(sh.sp.first, sh.sp.first + sh.sp.count),
    )
    if m.records != sh.sp.count:
        raise ShardFailed(f"shard {shard} ended with {m.records} records for {sh.sp.count} prompts")
    rd.retry_file(shard).unlink(missing_ok=True)
    sh.save_progress("done")
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
            plan.spec.client.max_tries,
            rd.shown,
        )
    return ShardEnd(shard, DONE)


def open_shard(
    rd: RunDir, plan: RunPlan, shard: int, session: EngineSession
) -> ShardRun | ShardEnd:
    """Open `shard` in this task: its log, its file's lock, what is left to generate. A ShardRun for
    the session to generate, or the ShardEnd of a shard with nothing left to do; raises ShardBusy
    (another worker holds it), ShardFailed or ShardRefused (said in its log, its progress marked
    failed)."""
    if not 0 <= shard < len(plan.shards):
        raise ShardFailed(
            f"{rd.root}: no shard {shard}; the run has shards 0..{len(plan.shards) - 1}"
        )
    with shard_lines(shard):
        try:
            handler = _attach_log(rd.log_file(shard), shard)
        except OSError as e:  # the shard's log cannot be opened
            raise _failed(e, rd, shard) from None
        sh = ShardRun(rd, plan, shard)
        sh.handler, sh.session = handler, session
        keep = False
        try:
            out = _open(sh)
            keep = isinstance(out, ShardRun)
            return out
        except SHARD_ERRORS as e:  # said once, in the shard's log (ShardBusy too)
            log.error("shard %d failed: %s", shard, e)
            raise
        except OSError as e:
            raise _failed(e, rd, shard) from None
        finally:
            if not keep:
                logging.getLogger("toolkit").removeHandler(handler)
                handler.close()


def _open(sh: ShardRun) -> ShardRun | ShardEnd:
    rd, plan, shard = sh.rd, sh.plan, sh.shard
    log.info(
        "shard %d of run %s (%s): %s; %s",
        shard,
        plan.name,
        plan.fingerprint,
        _count(sh.sp.count, plan.noun),
        _where(sh.progress),
    )
    if _already_complete(rd, plan, shard):
        return ShardEnd(shard, DONE)
    check_plan_inputs(plan)
    try:
        done_ids = sh.writer.open(positions=range(sh.sp.first, sh.sp.first + sh.sp.count))
    except ShardLocked as e:  # another writer holds the shard
        raise ShardBusy(str(e)) from None
    except ForeignShard as e:  # the file is another run's
        raise ShardRefused(str(e)) from None
    try:
        redo, sh.tries = _redo_ids(rd, shard, sh.writer, done_ids)
        todo = _plan_todo(rd, sh, done_ids, redo)
        sh.progress.resumed_tokens = _resumed_tokens(sh, todo)
        sh.progress.resumed_loops = sum(pos not in todo for pos in sh.writer.loops_at)
        sh.history = _turn_history(rd, plan, shard, redo)
        sh.recorded = len(done_ids) - len(redo)
        sh.partial = {i: r for i, r in sh.writer.partial.items() if i in redo}
        log.info(
            "%s",
            _resume_line(
                sh.sp.count,
                len(done_ids),
                len(todo),
                len(redo & sh.writer.transient),
                len(redo - sh.writer.transient),
                plan.noun,
            ),
        )
        sh.progress.resumed = sh.recorded
        if todo:
            sh.todo, sh.todo_count = todo, len(todo)
            return sh
        sh._close_writer()
    except BaseException:
        sh._close_writer()
        raise
    return _complete(sh)


def run_shard(run_dir: str | os.PathLike, shard: int) -> ShardEnd:
    """Generate every prompt of `shard` not yet in its shard file, with an engine of its own.
    Returns its ShardEnd (DONE, or STOPPED with the signal that stopped it, as its progress file
    says); raises ShardFailed.

    A disk that is full, a run directory that cannot be written, a shard file another worker holds:
    a ShardFailed saying what to do, and the shard's progress says failed (where it can still be
    written). Nothing written before is lost."""
    return asyncio.run(_run_one(run_dir, shard))


async def _run_one(run_dir: str | os.PathLike, shard: int) -> ShardEnd:
    try:
        run = Run.open(run_dir, JobSpec, finish=True)
        rd, plan = run.rd, run.plan
    except OSError as e:  # before the shard's log is open, or it cannot be
        raise _failed(e, RunDir(run_dir), shard) from None
    session = EngineSession(plan.spec)
    session.begin(f"shard {shard}")
    try:
        opened = open_shard(rd, plan, shard, session)
        if isinstance(opened, ShardEnd):
            return opened
        if session.stop.is_set():  # a signal came while the shard was being opened: nothing started
            opened.progress.stop_signal = session.stop_signal
        ends: list = []
        await session.serve(opened, None, lambda sh, out: ends.append(out))
        out = ends[0]
        if isinstance(out, SHARD_ERRORS):
            raise out
        return out
    finally:
        try:
            await session.close()
        finally:
            session.end()


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


def _resume_line(
    total: int, recorded: int, todo: int, transient: int, asked: int, noun: str = "prompt"
) -> str:
    """What this attempt finds and does: e.g. `30 prompts: 26 have a record, 18 kept; 12 to
    generate: 4 never generated and 8 again (8 failures that may pass)`."""
    if not recorded:
        return f"{_count(total, noun)} to generate"
    again = transient + asked
    kept = recorded - again
    if not todo:
        return f"{_count(total, noun)}: all have a record; nothing to generate"
    why = ", ".join(
        x
        for x in (
            f"{transient} failure{'s' if transient != 1 else ''} that may pass"
            if transient
            else "",
            f"{asked} asked for by `toolkit retry`" if asked else "",
        )
        if x
    )
    parts = [
        f"{todo - again} never generated" if todo - again else "",
        f"{again} again ({why})" if again else "",
    ]
    return (
        f"{_count(total, noun)}: {recorded} {'has' if recorded == 1 else 'have'} a record, {kept} "
        f"kept; "
        f"{todo} to generate: " + " and ".join(x for x in parts if x)
    )


def _already_complete(rd: RunDir, plan: RunPlan, shard: int) -> bool:
    """Whether the shard's done manifest can be trusted to say there is nothing to do: its file
    unchanged (size and sha256), no transient failure left, no retry asked. An untrusted manifest is
    removed (merge and status must not take the shard as complete while it is being redone)."""
    st = Run(rd, plan).shard_state(shard, VERIFIED)
    if st.foreign or st.state is not ShardState.UNTRUSTED and st.done is None:
        return False
    if st.state is ShardState.UNTRUSTED:
        log.error(
            "shard %d: %s: the file changed after the shard finished; checking it, salvaging what "
            "is intact "
            "and generating the rest",
            shard,
            st.why,
        )
    elif st.state is ShardState.RETRY:
        log.info("shard %d: `toolkit retry` asked for records to be generated again", shard)
    elif st.state is ShardState.MAY_PASS:
        log.info(
            "shard %d finished with %d failures that may pass: generating them again",
            shard,
            st.done.transient,
        )
    else:
        log.info("shard %d is already complete (%d records): nothing to do", shard, st.done.records)
        return True
    rd.done_file(shard).unlink(missing_ok=True)
    return False


def _plan_todo(rd: RunDir, sh: Shard, done_ids: dict[str, int], redo: set[str]) -> Todo:
    """The shard's prompts not recorded yet, or to redo; ShardFailed when the file holds ids of
    another shard."""
    refs = ShardRefs(rd, sh.plan, sh.shard)
    if not done_ids and not sh.writer.foreign:  # a fresh shard: every prompt, without reading a ref
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
    if owned != len(done_ids) or sh.writer.foreign:
        unknown = sorted(set(done_ids) - {ref.id for ref in refs}) + sh.writer.foreign_ids
        raise ShardFailed(
            f"{rd.shard_file(sh.shard)} holds ids this shard does not own (e.g. {unknown[0]!r}): "
            "a file put here from another shard or run; move it aside and run the shard again"
        )
    return Todo(refs, chosen, count)


def _resumed_tokens(sh: Shard, todo: Todo) -> int:
    """Output tokens of the records this attempt keeps: every newest record but those it generates
    again."""
    otok = sh.writer.output_tokens_at
    if otok is None:
        return 0
    return sum(n for i, n in enumerate(otok) if i not in todo)


def _redo_ids(
    rd: RunDir, shard: int, writer: ShardWriter, done_ids: dict[str, int]
) -> tuple[set[str], dict[str, int]]:
    """Recorded ids to generate again: transient failures, and those a retry request names that were
    not recorded again since it was made; and the failed tries each has had in its budget
    (Record.tries): none for those the retry request names (a fresh budget), the newest record's
    count for the others."""
    redo = set(writer.transient)
    asked: set[str] = set()
    req = retry_request(rd, shard)
    if req is not None:
        asked = {i for i in req.ids if done_ids.get(i, req.before) < req.before}
        redo |= asked
    return redo, {i: writer.tries[i] for i in redo if i in writer.tries and i not in asked}


def _turn_history(rd: RunDir, plan: RunPlan, shard: int, redo: set[str]) -> dict[str, Record]:
    """Regenerated datasets: the newest record of each turn already in the shard file, when it is ok
    and not to be redone — the answers later turns are rendered with."""
    regenerated = {d.name for d in plan.datasets if d.regenerate}
    if not regenerated:
        return {}
    sp, path = plan.shards[shard], rd.shard_file(shard)
    sc = scan_shard(path if path.exists() else None, sp.first, sp.count)
    return {
        r.id: r
        for r in newest_records(path, sc)
        if r is not None and r.dataset in regenerated and r.status == OK and r.id not in redo
    }


def _failed(e: OSError, rd: RunDir, shard: int) -> ShardFailed | ShardRefused:
    """The ShardFailed of a file-system error, saying what to do (ShardRefused, exit 2, for a run
    directory this job cannot write), logged, and the shard's progress marked failed."""
    where = (
        shown_path(e.filename)
        if e.filename
        else f"the shard file {shown_path(rd.shard_file(shard))}"
    )
    what = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})"
    if e.errno in FULL:
        failed = ShardFailed(
            f"cannot write {where}: {what}; free space (or quota) on that file system, then "
            f"`{rd.finish_command()}` resumes the shard: nothing written is lost"
        )
    elif e.errno in READ_ONLY:
        failed = ShardRefused(
            f"cannot write {where}: {what}; the run directory {rd.shown} must be writable by this "
            "job (a read-only mount, or another user's folder): fix its permissions or move it"
        )
    else:
        failed = ShardFailed(
            f"{where}: {what}; check the file system, then `{rd.finish_command()}` resumes the "
            "shard"
        )
    _mark_failed(rd, shard, str(failed))
    log.error("shard %d failed: %s", shard, failed)
    return failed


def _mark_failed(rd: RunDir, shard: int, msg: str) -> None:
    """Best effort: the shard's progress file says failed and why (it may itself be unwritable)."""
    try:
        p = read_progress(rd, shard) or Progress(shard=shard, total=0)
        p.state, p.error = "failed", msg
        write_progress(rd.progress_file(shard), p)
    except (OSError, ValueError):
        pass
