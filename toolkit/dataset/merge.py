"""Merge: the shard files of a run into one dataset, in planned order, exactly once by id, with a
manifest.

The merged dataset, `RUN/merged/records.zst`, has the format of a shard file (`read_shard` reads it)
with shard number MERGED. Memory stays flat whatever the run's size: shards are merged one at a
time, in two passes. The first pass reads every frame and keeps, per planned position, where its
record lives (frame number and index in the frame, in compact arrays); it resolves duplicates (an id
written again, by a retry of a failed record or a task that ran twice: the record written last
supersedes the earlier ones; a partial output kept at a stop and superseded by its continuation is
counted apart, as continued, not as a duplicate) and notes damaged frames, reading on past them to
the next intact frame. The second pass writes the records in planned order, decoding frames through
a small cache bounded in bytes and reading a frame again when it was evicted. Every problem
(duplicate, damaged or torn frame, record that is not the shard's, missing record) is counted and
named in `merged/manifest.json`, never skipped in silence.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from toolkit.errors import BadInputError, FailedError
from toolkit.formats.files import atomic_write, fsync_dir, io_problem, sha256_file
from toolkit.formats.frames import CorruptShard, damaged_fingerprint, read_header
from toolkit.formats.locks import LockFile, ShardLocked, try_flock
from toolkit.formats.manifests import DoneManifest
from toolkit.formats.newest import CACHE_BYTES, SAMPLE_IDS, newest_records, scan_shard
from toolkit.formats.prompts import PromptIndex, PromptRef
from toolkit.formats.records import OK, Record
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import PlanError, RunPlan, ShardPlan
from toolkit.formats.shardfile import ShardWriter
from toolkit.formats.text import ranges, utc_now
from toolkit.job.spec import JobSpec

__all__ = [
    "MERGED",
    "FrameProblem",
    "MergeError",
    "MergeManifest",
    "finished_shards",
    "load_manifest",
    "merge_run",
    "planned_refs",
]

log = logging.getLogger(__name__)

MERGED = 2**32 - 1  # shard number in the merged file's header
MANIFEST_FORMAT = 1
MERGED_FLUSH_RECORDS = 128  # records per frame of the merged file


class MergeError(BadInputError):
    """A run that cannot be merged as asked; the message says why and what to do."""


class FrameProblem(msgspec.Struct):
    shard: int
    file: str
    offset: int  # byte offset of the frame in the shard file
    why: str


class ShardMerge(msgspec.Struct):
    index: int
    file: str
    done: bool  # has a done manifest of this run
    frames: int = 0
    records: int = 0  # records read (duplicates and foreign ones included)
    kept: int = 0
    # records superseded by a later one of their id (partial outputs continued apart)
    duplicates: int = 0
    foreign: int = 0  # records whose id or position this shard does not own
    missing: int = 0
    bytes: int = 0
    sha256: str | None = None
    # the file's sha256 equals its done manifest's (None: no manifest)
    matches_done: bool | None = None
    # partial outputs (kept at a stop) superseded by the record that continued them
    continued: int = 0


class DatasetCounts(msgspec.Struct):
    planned: int
    ok: int = 0
    failed: int = 0
    missing: int = 0


class MergeManifest(msgspec.Struct):
    format: int
    run: str
    fingerprint: str
    created: str
    allow_incomplete: bool
    complete: bool  # every planned prompt present exactly once and no damaged frame
    planned: int
    records: int
    ok: int
    failed: int
    missing: int
    duplicates: int
    foreign: int
    prompt_tokens: int
    output_tokens: int
    datasets: dict[str, DatasetCounts]
    shards: list[ShardMerge]
    corrupt: list[FrameProblem]  # damaged frames inside a file (their records are missing)
    torn: list[FrameProblem]  # incomplete last frames (a write cut short)
    file: str
    bytes: int
    sha256: str
    missing_ids: list[str] = []  # the first SAMPLE_IDS; all are in missing_ids.txt
    duplicate_ids: list[str] = []
    foreign_ids: list[str] = []
    # partial outputs superseded by their continuation: not duplicates
    continued: int = 0
    # what made the records, as the run pinned it (RunPlan.synthetic): "stub" (synthetic text, not
    # a model's) or "model"; "" in a manifest written before it was recorded
    engine: str = ""


# --------------------------------------------------------------------------------------------------
# merging
# --------------------------------------------------------------------------------------------------
class _MergeCounts:
    def __init__(self, plan: RunPlan):
        self.datasets = {d.name: DatasetCounts(planned=d.planned) for d in plan.datasets}
        self.records = self.ok = self.failed = self.prompt_tokens = self.output_tokens = 0
        self.duplicates = self.foreign = self.missing = self.continued = 0
        self.duplicate_ids: list[str] = []
        self.foreign_ids: list[str] = []
        self.missing_ids: list[str] = []


def _merge_shard(
    sp: ShardPlan,
    sm: ShardMerge,
    path: Path | None,
    refs: list[PromptRef],
    plan: RunPlan,
    t: _MergeCounts,
    corrupt: list[FrameProblem],
    torn: list[FrameProblem],
    emit: Callable[[Record], None],
    missing_out,
    cache_bytes: int,
    *,
    header: bool = True,
) -> None:
    sc = scan_shard(path, sp.first, refs, header=header)
    sm.frames, sm.records, sm.foreign = len(sc.offsets), sc.records, sc.foreign
    sm.duplicates, sm.continued = sc.duplicates, sc.continued
    t.foreign_ids += sc.foreign_ids[: SAMPLE_IDS - len(t.foreign_ids)]
    t.duplicate_ids += sc.duplicate_ids[: SAMPLE_IDS - len(t.duplicate_ids)]
    for d in sc.damage:
        (torn if d.torn else corrupt).append(FrameProblem(sp.index, str(path), d.offset, d.why))
    for ref, rec in zip(refs, newest_records(path, sc, cache_bytes)):
        if rec is None:
            sm.missing += 1
            t.datasets[plan.datasets[ref.dataset].name].missing += 1
            if len(t.missing_ids) < SAMPLE_IDS:
                t.missing_ids.append(ref.id)
            missing_out.write(ref.id + "\n")
            continue
        sm.kept += 1
        emit(rec)


def planned_refs(rd: RunDir, plan: RunPlan) -> PromptIndex:
    """The plan's prompt refs; MergeError when the run directory does not hold them."""
    try:
        return PromptIndex(rd, plan)
    except PlanError as e:
        raise MergeError(str(e)) from None


def finished_shards(
    rd: RunDir, plan: RunPlan, *, allow_incomplete: bool = False
) -> dict[int, DoneManifest]:
    """The done manifests of this run's shards; MergeError naming the unfinished ones unless
    `allow_incomplete`."""
    not_done, done = [], {}
    for s in plan.shards:
        m = Run(rd, plan).shard_state(s.index).done
        if m is not None:
            done[s.index] = m
        else:
            not_done.append(s.index)
    if not_done and not allow_incomplete:
        raise MergeError(
            f"{rd.root}: {len(not_done)} of {len(plan.shards)} shards are not done (no done "
            f"manifest): {ranges(not_done)}. Finish them with `{rd.finish_command()}` (`toolkit "
            f"status {rd.root}` shows why they stopped), or merge what is there with `toolkit "
            f"merge {rd.root} --allow-incomplete`."
        )
    return done


def merge_run(
    run_dir: str | os.PathLike,
    *,
    allow_incomplete: bool = False,
    on_record: Callable[[Record], None] | None = None,
    cache_bytes: int = CACHE_BYTES,
) -> MergeManifest:
    """Merge every shard file of a run into `merged/records.zst` and write `merged/manifest.json`.

    Without `allow_incomplete`, refuses (MergeError) when a shard has no done manifest, or when a
    finished shard's file is no longer what its done manifest says; and never replaces a complete
    merged dataset of the same plan with an incomplete one (MergeError: the earlier is kept).
    `on_record`
    sees every merged record, in planned order (the audit runs in the same pass this way). A file
    system that fails it (full, read-only) is a FailedError (exit 1) in one line, nothing left
    behind.
    """
    run = Run.open(run_dir, JobSpec, finish=True)
    rd, plan = run.rd, run.plan
    try:
        return _merge_run(rd, plan, allow_incomplete, on_record, cache_bytes)
    except OSError as e:
        raise io_error(e, rd, "merge") from None


def io_error(e: OSError, rd: RunDir, command: str) -> FailedError:
    """The error of a file system that fails a merge or an audit (exit 1: not the input's fault)."""
    return FailedError(io_problem(e, rd.merged_dir, f"run `toolkit {command} {rd.shown}` again"))


def _named(e: OSError, path: Path) -> OSError:
    """`e`, naming `path` when it names no file (a failed write does not)."""
    if e.filename is None:
        e.filename = str(path)
    return e


def _merge_run(
    rd: RunDir,
    plan: RunPlan,
    allow_incomplete: bool,
    on_record: Callable[[Record], None] | None,
    cache_bytes: int,
) -> MergeManifest:
    done = finished_shards(rd, plan, allow_incomplete=allow_incomplete)
    refs = planned_refs(rd, plan)
    out_dir = rd.merged_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{rd.merged_file.name}.tmp"
    _clear_stale(tmp)
    writer = ShardWriter(
        tmp, plan.fingerprint, MERGED, flush_records=MERGED_FLUSH_RECORDS, flush_seconds=1e9
    )
    try:
        writer.open(range(len(refs)))  # a fresh file (_clear_stale): nothing to recover
    except ShardLocked:
        raise MergeError(
            f"{rd.root}: another merge of this run is writing {tmp}; wait for it to end"
        ) from None
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _named(e, rd.merged_file)
    t = _MergeCounts(plan)
    corrupt: list[FrameProblem] = []
    torn: list[FrameProblem] = []
    shards: list[ShardMerge] = []

    def emit(rec: Record) -> None:
        writer.add(rec)
        c = t.datasets.setdefault(rec.dataset, DatasetCounts(planned=0))
        if rec.status == OK:
            c.ok += 1
            t.ok += 1
        else:
            c.failed += 1
            t.failed += 1
        t.records += 1
        t.prompt_tokens += len(rec.prompt_ids) >> 2
        t.output_tokens += len(rec.output_ids) >> 2
        if on_record is not None:
            on_record(rec)

    missing_tmp = out_dir / f".{rd.missing_file.name}.tmp"
    try:
        with open(missing_tmp, "w") as missing_out:
            for s in plan.shards:
                path = rd.shard_file(s.index)
                sm = ShardMerge(index=s.index, file=str(path), done=s.index in done)
                readable = _check_file(path, s.index, plan, sm, done, corrupt)
                if sm.done and sm.matches_done is not True and not allow_incomplete:
                    raise _changed_since_done(rd, s.index, sm)
                log.info("merging shard %d (%d planned records)", s.index, s.count)
                _merge_shard(
                    s,
                    sm,
                    path if readable is not None else None,
                    refs.shard(s.index),
                    plan,
                    t,
                    corrupt,
                    torn,
                    emit,
                    missing_out,
                    cache_bytes,
                    header=bool(readable),
                )
                t.duplicates += sm.duplicates
                t.continued += sm.continued
                t.foreign += sm.foreign
                t.missing += sm.missing
                shards.append(sm)
        writer.close()
        complete = not (t.missing or corrupt or t.foreign) and t.records == plan.total
        if not complete:
            _keep_complete(rd, plan, t)
        sha = sha256_file(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, rd.merged_file)
        os.replace(missing_tmp, rd.missing_file)
        fsync_dir(out_dir)
    except BaseException as e:
        if isinstance(e, OSError):
            _named(e, rd.merged_file)
        try:
            writer.close()
        except OSError:  # the file system that failed the merge fails its last flush too
            pass
        for p in (tmp, missing_tmp):
            p.unlink(missing_ok=True)
        raise
    manifest = MergeManifest(
        format=MANIFEST_FORMAT,
        run=plan.name,
        fingerprint=plan.fingerprint,
        created=utc_now(),
        engine=plan.engine_class,
        allow_incomplete=allow_incomplete,
        complete=complete,
        planned=plan.total,
        records=t.records,
        ok=t.ok,
        failed=t.failed,
        missing=t.missing,
        duplicates=t.duplicates,
        foreign=t.foreign,
        prompt_tokens=t.prompt_tokens,
        output_tokens=t.output_tokens,
        datasets=t.datasets,
        shards=shards,
        corrupt=corrupt,
        torn=torn,
        file=rd.merged_file.name,
        bytes=size,
        sha256=sha,
        missing_ids=t.missing_ids,
        duplicate_ids=t.duplicate_ids,
        foreign_ids=t.foreign_ids,
        continued=t.continued,
    )
    atomic_write(rd.manifest_file, msgspec.json.format(msgspec.json.encode(manifest), indent=2))
    _log_problems(rd, manifest)
    return manifest


def _check_file(
    path: Path,
    k: int,
    plan: RunPlan,
    sm: ShardMerge,
    done: dict[int, DoneManifest],
    corrupt: list[FrameProblem],
) -> bool | None:
    """Size and checksum of a shard file, and its header: True when it is this shard's; False when
    its header is damaged (reported: its frames are read past it, as the worker's salvage keeps
    them); None when it is absent or another run's (reported: none of its records is this run's)."""
    if not path.exists():
        return None
    sm.bytes = path.stat().st_size
    if sm.done:
        sm.sha256 = sha256_file(path)
        sm.matches_done = sm.sha256 == done[k].sha256
    try:
        head = read_header(path)
    except CorruptShard as e:
        corrupt.append(FrameProblem(k, str(path), 0, f"damaged header: {e.why}"))
        return False
    if head is not None and head != (plan.fingerprint, k):
        if damaged_fingerprint(head[0], plan.fingerprint):
            corrupt.append(
                FrameProblem(k, str(path), 0, f"damaged header (run {head[0]!r} shard {head[1]})")
            )
            return False
        corrupt.append(
            FrameProblem(
                k,
                str(path),
                0,
                f"a file of run {head[0]} shard {head[1]}, not of this run's "
                f"shard {k}: move it aside (mv {path} {path}.other-run) and "
                "run the shard again",
            )
        )
        return None
    return True


def _changed_since_done(rd: RunDir, k: int, sm: ShardMerge) -> MergeError:
    """The refusal to merge a finished shard whose file is no longer what its done manifest says
    (its records would go missing from the merged dataset, which is kept as it was)."""
    what = "is gone" if not sm.bytes and sm.sha256 is None else "changed"
    return MergeError(
        f"{rd.root}: shard {k}'s file {sm.file} {what} since its done manifest was written: "
        f"nothing merged, the merged dataset is kept as it was. `{rd.finish_command()}` checks the "
        "file, keeps what is intact and generates the rest, then merges (`--allow-incomplete` "
        "merges what is there)"
    )


def _keep_complete(rd: RunDir, plan: RunPlan, t: _MergeCounts) -> None:
    """Refuse (MergeError) to replace a complete merged dataset of this plan, intact, with this
    incomplete one: the earlier one is kept, and the message says so."""
    try:
        old = msgspec.json.decode(rd.manifest_file.read_bytes(), type=MergeManifest)
    except (OSError, msgspec.MsgspecError):
        return
    if not (old.complete and old.fingerprint == plan.fingerprint and old.planned == plan.total):
        return
    if merged_file_problem(rd, checksum=True) is not None:
        return
    raise MergeError(
        f"{rd.root}: this merge holds {t.records} of {plan.total} planned records ({t.missing} "
        f"missing), the merged dataset in place all {old.records}: it is kept, nothing replaced. "
        f"`toolkit status {rd.shown}` names the shards that changed since and the command that "
        "repairs them"
    )


def _clear_stale(tmp: Path) -> None:
    """Remove the temporary file of a merge that was killed; refuse if a merge still holds it (its
    writer's lock: flock, or where there is none, its lock file, a stale one taken over)."""
    try:
        fd = os.open(tmp, os.O_RDWR)
    except FileNotFoundError:
        return
    busy = MergeError(f"another merge of this run is writing {tmp}; wait for it to end")
    lock = None
    try:
        taken = try_flock(fd)  # (an I/O error is the merge's, as any other)
        if taken is False:
            raise busy
        if taken is None:  # no flock here: the lock file of the merge's writer
            lock = LockFile(tmp.with_name(tmp.name + ".lock"))
            try:
                lock.acquire()  # (a stale one taken over)
            except ShardLocked:
                raise busy from None
        tmp.unlink(missing_ok=True)
    finally:
        os.close(fd)
        if lock is not None:
            lock.release()


def _log_problems(rd: RunDir, m: MergeManifest) -> None:
    if m.engine == "stub":  # the audit's banner and every export say so too
        log.info(
            "run %s was generated by the STUB engine: its records are synthetic text, not a "
            "model's; do not train on them",
            rd.shown,
        )
    for p in m.corrupt:
        log.error(
            "shard %d: damaged frame in %s at byte %d (%s); its records are counted missing",
            p.shard,
            p.file,
            p.offset,
            p.why,
        )
    for p in m.torn:
        log.warning(
            "shard %d: torn last frame in %s at byte %d (%s)", p.shard, p.file, p.offset, p.why
        )
    if m.continued:
        log.info(
            "%d partial outputs (kept at a stop) superseded by the records that continued them",
            m.continued,
        )
    if m.duplicates:
        log.warning(
            "%d records superseded by a later record of the same id (e.g. %s)",
            m.duplicates,
            ", ".join(m.duplicate_ids[:3]),
        )
    if m.foreign:
        log.error(
            "%d records do not belong to their shard's plan (e.g. %s); left out",
            m.foreign,
            ", ".join(m.foreign_ids[:3]),
        )
    if m.missing:
        log.warning(
            "%d of %d planned records missing; ids in %s", m.missing, m.planned, rd.missing_file
        )
    log.info(
        "merged %d records (%d ok, %d failed) into %s", m.records, m.ok, m.failed, rd.merged_file
    )


def load_manifest(rd: RunDir) -> MergeManifest:
    path = rd.manifest_file
    try:
        return msgspec.json.decode(path.read_bytes(), type=MergeManifest)
    except FileNotFoundError:
        raise MergeError(
            f"{rd.root} has no merged dataset ({path} is missing): run `toolkit merge {rd.root}` "
            "first"
        ) from None
    except msgspec.MsgspecError as e:
        raise MergeError(
            f"{path}: unreadable merge manifest ({e}); run `toolkit merge {rd.root}` again"
        ) from None


def merged_file_problem(rd: RunDir, *, checksum: bool = False) -> str | None:
    """What is wrong with a run's merged dataset against its merge manifest (None: it is what the
    merge wrote): an unreadable manifest, the file gone, another size, or (with `checksum`) another
    sha256."""
    try:
        m = msgspec.json.decode(rd.manifest_file.read_bytes(), type=MergeManifest)
    except FileNotFoundError:
        return None
    except (OSError, msgspec.MsgspecError) as e:
        return (
            f"{rd.manifest_file.name} is unreadable "
            f"({str(e).splitlines()[0] if str(e) else type(e).__name__})"
        )
    try:
        size = rd.merged_file.stat().st_size
    except FileNotFoundError:
        return f"{rd.merged_file.name} is missing"
    if size != m.bytes:
        return f"{rd.merged_file.name} has {size:,} bytes, its manifest says {m.bytes:,}"
    if checksum and sha256_file(rd.merged_file) != m.sha256:
        return f"{rd.merged_file.name} differs from the sha256 in its manifest"
    return None
