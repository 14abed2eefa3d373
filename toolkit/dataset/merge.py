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

from toolkit.dataset.merge_manifest import (
    MANIFEST_FORMAT,
    MERGED,
    MergeError,
    MergeManifest,
    log_problems,
    merged_file_problem,
)
from toolkit.dataset.merge_shard import MergeCounts, merge_shard
from toolkit.errors import FailedError
from toolkit.formats.files import atomic_write, fsync_dir, io_problem, sha256_file
from toolkit.formats.locks import LockFile, ShardLocked, try_flock
from toolkit.formats.manifests import DoneManifest
from toolkit.formats.newest import CACHE_BYTES
from toolkit.formats.prompts import PromptIndex
from toolkit.formats.records import Record
from toolkit.formats.run import Run
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import PlanError, RunPlan
from toolkit.formats.shardfile import ShardWriter
from toolkit.formats.text import ranges, utc_now
from toolkit.job.schema import JobSpec

__all__ = [
    "finished_shards",
    "merge_run",
    "planned_refs",
]

log = logging.getLogger(__name__)

MERGED_FLUSH_RECORDS = 128  # records per frame of the merged file


# --------------------------------------------------------------------------------------------------
# merging
# --------------------------------------------------------------------------------------------------
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
    not_done, done, run = [], {}, Run(rd, plan)
    for s in plan.shards:
        m = run.shard_state(s.index).done
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
    writer = _open_merged(rd, plan, tmp, len(refs))
    t = MergeCounts(plan)

    def emit(rec: Record) -> None:
        writer.add(rec)
        t.add(rec)
        if on_record is not None:
            on_record(rec)

    missing_tmp = out_dir / f".{rd.missing_file.name}.tmp"
    try:
        with open(missing_tmp, "w") as missing_out:
            for s in plan.shards:
                t.add_shard(
                    merge_shard(
                        rd, plan, s, refs, done, t, emit, missing_out, cache_bytes, allow_incomplete
                    )
                )
        writer.close()
        complete = not (t.missing or t.corrupt or t.foreign) and t.records == plan.total
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
    manifest = _manifest(rd, plan, t, allow_incomplete, complete, size, sha)
    atomic_write(rd.manifest_file, msgspec.json.format(msgspec.json.encode(manifest), indent=2))
    log_problems(rd, manifest)
    return manifest


def _open_merged(rd: RunDir, plan: RunPlan, tmp: Path, n: int) -> ShardWriter:
    """The writer of the merged dataset's temporary file `tmp`, fresh (a killed merge's removed)."""
    _clear_stale(tmp)
    writer = ShardWriter(
        tmp, plan.fingerprint, MERGED, flush_records=MERGED_FLUSH_RECORDS, flush_seconds=1e9
    )
    try:
        writer.open(range(n))  # a fresh file (_clear_stale): nothing to recover
    except ShardLocked:
        raise MergeError(
            f"{rd.root}: another merge of this run is writing {tmp}; wait for it to end"
        ) from None
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _named(e, rd.merged_file)
    return writer


# what the manifest takes from the merge's counts (MergeCounts), under the same names
_COUNTED = (
    "records ok failed missing duplicates foreign prompt_tokens output_tokens datasets shards "
    "corrupt torn missing_ids duplicate_ids foreign_ids continued"
).split()


def _manifest(
    rd: RunDir,
    plan: RunPlan,
    t: MergeCounts,
    allow_incomplete: bool,
    complete: bool,
    size: int,
    sha: str,
) -> MergeManifest:
    """The manifest of a merge that wrote `size` bytes of sha256 `sha`."""
    return MergeManifest(
        format=MANIFEST_FORMAT,
        run=plan.name,
        fingerprint=plan.fingerprint,
        created=utc_now(),
        engine=plan.engine_class,
        allow_incomplete=allow_incomplete,
        complete=complete,
        planned=plan.total,
        file=rd.merged_file.name,
        bytes=size,
        sha256=sha,
        **{name: getattr(t, name) for name in _COUNTED},
    )


def _keep_complete(rd: RunDir, plan: RunPlan, t: MergeCounts) -> None:
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
