"""A shard's run: what a worker does with one shard it holds — engine → chat → client → records →
shard file.

`open_shard` resumes the shard's file (every id already written is skipped, whatever order it was
written in), takes its lock, works out what is left to generate and opens the shard's own log; the
engine session (worker.session) then renders its prompts with the chat template (`Shard.start`,
while the engine loads or while the previous shard's last requests finish), streams them through
`/generate` with the engine's bounded concurrency, and appends checked records in fsynced batches.
`Shard.finish` writes a finished shard's `done` manifest, or says where a stopped one resumes;
`Shard.fail` says why a shard cannot finish here.

SIGTERM / SIGUSR2 / SIGINT stop it cleanly (nothing written is lost; the requests in flight are
aborted and their partial outputs kept as PARTIAL records, continued from where they stopped next
time: see inflight.save_in_flight and generate.generate_output).

Nothing lost, nothing stuck: a failure that may pass (timeout, 5xx past the retries, abort, SGLang's
NaN stop) is recorded with its kind and tried again in the same run of the shard, up to
`client.max_tries` tries counted in the records (inflight.consume), then final for the run
(records.is_given_up); ids `toolkit retry` names are generated again, with a fresh count. A done
manifest is trusted only when the shard file still has its size and sha256; a damaged file is
salvaged (formats.shardfile.ShardWriter.open). The render thread stays a bounded number of prompts
ahead of the requests.

Regenerated conversations (turns.py): turn k of a conversation waits until turn k-1 has a record,
then is rendered with the answers of the turns before it (worker.turn_order).

The parts: session.py keeps the engine, its clients and the shards open on it; openshard.py is an
open shard (its file, progress and render) and requests.py its requests in flight; feed.py renders
prompts on a thread and hands them to the event loop; inflight.py sends them (generate.py: one
prompt's requests, continued across aborts; answers.py: their records); concurrency.py sizes and
watches the requests in flight; worker.shard holds what they share. This module opens a shard
(its log, its file's lock, what is left to generate), and `run_shard`, a session of one shard."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from toolkit.formats.files import LogFile
from toolkit.formats.locks import ShardLocked
from toolkit.formats.logline import text_formatter
from toolkit.formats.newest import newest_records, scan_shard
from toolkit.formats.progress import Progress
from toolkit.formats.prompts import ShardRefs
from toolkit.formats.records import OK, Record
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan
from toolkit.formats.shardfile import ForeignShard, Recovered
from toolkit.formats.shardstate import VERIFIED, ShardState, retry_request
from toolkit.job.inputs import check_plan_inputs
from toolkit.job.schema import JobSpec
from toolkit.worker.feed import Todo
from toolkit.worker.openshard import Resumed, Shard
from toolkit.worker.session import EngineSession
from toolkit.worker.shard import (
    SHARD,
    SHARD_ERRORS,
    End,
    ShardBusy,
    ShardEnd,
    ShardFailed,
    ShardRefused,
    Shards,
    count,
    disk_failure,
    shard_lines,
)

__all__ = [
    "run_shard",
    "open_shard",
    "DONE",
    "STOPPED",
]

log = logging.getLogger("toolkit.worker")  # the shard's log names one logger

DONE, STOPPED = End.DONE, End.STOPPED
_count = count


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


def open_shard(rd: RunDir, plan: RunPlan, shard: int, session: EngineSession) -> Shard | ShardEnd:
    """Open `shard` in this task: its log, its file's lock, what is left to generate. A Shard for
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
            raise disk_failure(e, rd, shard) from None
        sh = Shard(rd, plan, shard, session, handler)
        keep = False
        try:
            out = _open(sh)
            keep = isinstance(out, Shard)
            return out
        except SHARD_ERRORS as e:  # said once, in the shard's log (ShardBusy too)
            log.error("shard %d failed: %s", shard, e)
            raise
        except OSError as e:
            raise disk_failure(e, rd, shard) from None
        finally:
            if not keep:
                logging.getLogger("toolkit").removeHandler(handler)
                handler.close()


def _open(sh: Shard) -> Shard | ShardEnd:
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
        found = sh.writer.open(positions=range(sh.sp.first, sh.sp.first + sh.sp.count))
    except ShardLocked as e:  # another writer holds the shard
        raise ShardBusy(str(e)) from None
    except ForeignShard as e:  # the file is another run's
        raise ShardRefused(str(e)) from None
    try:
        resumed = _resumed(rd, sh, found)
        sh.resume(resumed)
        if resumed.todo:
            return sh
        sh.close_writer()
    except BaseException:
        sh.close_writer()
        raise
    return sh.complete()


def _resumed(rd: RunDir, sh: Shard, found: Recovered) -> Resumed:
    """What the shard's file, just opened (`found`), leaves for this run (said in its log)."""
    plan, done_ids = sh.plan, found.done
    redo, tries = _redo_ids(rd, sh.shard, found)
    todo = _plan_todo(rd, sh, found, redo)
    log.info(
        "%s",
        _resume_line(
            sh.sp.count,
            len(done_ids),
            len(todo),
            len(redo & found.transient),
            len(redo - found.transient),
            plan.noun,
        ),
    )
    return Resumed(
        todo=todo or None,
        recorded=len(done_ids) - len(redo),
        history=_turn_history(rd, plan, sh.shard, redo),
        tries=tries,
        partial={i: r for i, r in found.partial.items() if i in redo},
        tokens=_resumed_tokens(found, todo),
        loops=sum(pos not in todo for pos in found.loops_at),
    )


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
        raise disk_failure(e, RunDir(run_dir), shard) from None
    session = EngineSession(plan.spec)
    session.begin(f"shard {shard}")
    try:
        opened = open_shard(rd, plan, shard, session)
        if isinstance(opened, ShardEnd):
            return opened
        if session.stop.is_set():  # a signal came while the shard was being opened: nothing started
            opened.stopped_by(session.stop.signal)
        one = Shards()
        await session.serve(opened, one)
        out = one.ends[0]
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


def _plan_todo(rd: RunDir, sh: Shard, found: Recovered, redo: set[str]) -> Todo:
    """The shard's prompts not recorded yet, or to redo; ShardFailed when the file holds ids of
    another shard."""
    refs = ShardRefs(rd, sh.plan, sh.shard)
    done_ids = found.done
    if not done_ids and not found.foreign:  # a fresh shard: every prompt, without reading a ref
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
    if owned != len(done_ids) or found.foreign:
        unknown = sorted(set(done_ids) - {ref.id for ref in refs}) + found.foreign_ids
        raise ShardFailed(
            f"{rd.shard_file(sh.shard)} holds ids this shard does not own (e.g. {unknown[0]!r}): "
            "a file put here from another shard or run; move it aside and run the shard again"
        )
    return Todo(refs, chosen, count)


def _resumed_tokens(found: Recovered, todo: Todo) -> int:
    """Output tokens of the records this attempt keeps: every newest record but those it generates
    again."""
    otok = found.output_tokens_at
    if otok is None:
        return 0
    return sum(n for i, n in enumerate(otok) if i not in todo)


def _redo_ids(rd: RunDir, shard: int, found: Recovered) -> tuple[set[str], dict[str, int]]:
    """Recorded ids to generate again: transient failures, and those a retry request names that were
    not recorded again since it was made; and the failed tries each has had in its budget
    (Record.tries): none for those the retry request names (a fresh budget), the newest record's
    count for the others."""
    redo = set(found.transient)
    asked: set[str] = set()
    req = retry_request(rd, shard)
    if req is not None:
        asked = {i for i in req.ids if found.done.get(i, req.before) < req.before}
        redo |= asked
    return redo, {i: found.tries[i] for i in redo if i in found.tries and i not in asked}


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
