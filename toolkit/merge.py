"""Merge: the shard files of a run into one dataset, in planned order, exactly once by id, with a manifest.

The merged dataset, `RUN/merged/records.zst`, has the format of a shard file (`read_shard` reads it) with
shard number MERGED. Memory stays flat whatever the run's size: shards are merged one at a time, in two
passes. The first pass reads every frame and keeps, per planned position, where its record lives (frame
number and index in the frame, in compact arrays); it resolves duplicates (an id written again, by a retry of a
failed record or a task that ran twice: the record written last supersedes the earlier ones) and notes damaged
frames, reading on past them to the next intact frame. The
second pass writes the records in planned order, decoding frames through a small cache bounded in bytes and
reading a frame again when it was evicted. Every problem (duplicate, damaged or torn frame, record that is not
the shard's, missing record) is counted and named in `merged/manifest.json`, never skipped in silence.

Also the `merge`, `audit` and `export` commands, and `merge_and_audit`, the final job of every run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fcntl
import hashlib
import logging
import os
import sys
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from .files import atomic_write, fsync_dir, shown_path
from .plan import PromptRef, RunDir, RunPlan, ShardPlan, load_run
from .records import OK, Record
from .shardfile import (
    CorruptShard,
    Damage,
    DoneManifest,
    Frame,
    ShardWriter,
    decode_batch,
    read_done,
    read_frame_at,
    read_header,
    scan,
)

__all__ = [
    "MERGED",
    "FrameProblem",
    "MergeError",
    "MergeManifest",
    "PlannedRefs",
    "add_cli",
    "load_manifest",
    "merge_and_audit",
    "merge_run",
]

log = logging.getLogger(__name__)

MERGED = 2**32 - 1             # shard number in the merged file's header
MANIFEST_FORMAT = 1
CACHE_BYTES = 64 << 20         # decoded frames kept by the second pass
MERGED_FLUSH_RECORDS = 128     # records per frame of the merged file
SAMPLE_IDS = 100               # ids listed in the manifest per kind of problem (all are counted)
RECORDS_FILE, MANIFEST_FILE, MISSING_FILE = "records.zst", "manifest.json", "missing_ids.txt"


class MergeError(Exception):
    """A run that cannot be merged as asked; the message says why and what to do."""


class FrameProblem(msgspec.Struct):
    shard: int
    file: str
    offset: int      # byte offset of the frame in the shard file
    why: str


class ShardMerge(msgspec.Struct):
    index: int
    file: str
    done: bool                   # has a done manifest of this run
    frames: int = 0
    records: int = 0             # records read (duplicates and foreign ones included)
    kept: int = 0
    duplicates: int = 0
    foreign: int = 0             # records whose id or position this shard does not own
    missing: int = 0
    bytes: int = 0
    sha256: str | None = None
    matches_done: bool | None = None  # the file's sha256 equals its done manifest's (None: no manifest)


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
    complete: bool               # every planned prompt present exactly once and no damaged frame
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
    torn: list[FrameProblem]     # incomplete last frames (a write cut short)
    file: str
    bytes: int
    sha256: str
    missing_ids: list[str] = []      # the first SAMPLE_IDS; all are in missing_ids.txt
    duplicate_ids: list[str] = []
    foreign_ids: list[str] = []


_ref_decoder = msgspec.msgpack.Decoder(PromptRef)


class PlannedRefs:
    """The plan's prompt refs, decoded one shard at a time: a run may plan millions of prompts."""

    def __init__(self, rd: RunDir, plan: RunPlan):
        try:
            data = rd.prompts_file.read_bytes()
        except FileNotFoundError:
            raise MergeError(f"{rd.prompts_file} is missing: the run directory is damaged; plan the job again") from None
        self._raw = msgspec.msgpack.decode(data, type=list[msgspec.Raw])
        if len(self._raw) != plan.total:
            raise MergeError(f"{rd.prompts_file} holds {len(self._raw)} prompts but run.json plans {plan.total}")
        self.shards = plan.shards
        self._firsts = [s.first for s in plan.shards]
        self._k = -1
        self._refs: list[PromptRef] = []

    def shard_of(self, pos: int) -> int:
        return bisect_right(self._firsts, pos) - 1

    def shard(self, k: int) -> list[PromptRef]:
        if k != self._k:
            s = self.shards[k]
            self._refs = [_ref_decoder.decode(r) for r in self._raw[s.first : s.first + s.count]]
            self._k = k
        return self._refs

    def at(self, pos: int) -> PromptRef | None:
        if not 0 <= pos < len(self._raw):
            return None
        k = self.shard_of(pos)
        return self.shard(k)[pos - self.shards[k].first]


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _ranges(nums: list[int]) -> str:
    """'0-3, 7, 9-10' for [0, 1, 2, 3, 7, 9, 10]."""
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------------
# reading a shard file, past damaged frames
# ---------------------------------------------------------------------------------------------------
def _frames(path: Path, shard: int, corrupt: list[FrameProblem], torn: list[FrameProblem]) -> Iterator[Frame]:
    """Every intact frame of a shard file (judged by shardfile.read_frame, past damage); damaged stretches go to
    `corrupt`, a torn end to `torn`."""
    try:
        for item in scan(path):
            if isinstance(item, Damage):
                (torn if item.torn else corrupt).append(FrameProblem(shard, str(path), item.offset, item.why))
            else:
                yield item
    except CorruptShard as e:  # the header: nothing in this file can be trusted as this run's
        corrupt.append(FrameProblem(shard, str(path), e.offset, e.why))


# ---------------------------------------------------------------------------------------------------
# merging
# ---------------------------------------------------------------------------------------------------
class _Totals:
    def __init__(self, plan: RunPlan):
        self.datasets = {d.name: DatasetCounts(planned=d.planned) for d in plan.datasets}
        self.records = self.ok = self.failed = self.prompt_tokens = self.output_tokens = 0
        self.duplicates = self.foreign = self.missing = 0
        self.duplicate_ids: list[str] = []
        self.foreign_ids: list[str] = []
        self.missing_ids: list[str] = []


def _merge_shard(
    sp: ShardPlan, sm: ShardMerge, path: Path | None, refs: list[PromptRef], plan: RunPlan, t: _Totals,
    corrupt: list[FrameProblem], torn: list[FrameProblem], emit: Callable[[Record], None],
    missing_out, cache_bytes: int,
) -> None:
    n, first = sp.count, sp.first
    frame_of = array("q", [-1]) * n      # frame number holding the kept record of each position
    item_of = array("i", [0]) * n        # index of that record in its frame
    offsets: list[int] = []               # frame number -> byte offset
    sizes: list[int] = []                 # frame number -> decompressed size

    # Pass 1: where every record is; duplicates and foreign records. Only positions are kept, not records.
    if path is not None:
        for frame in _frames(path, sp.index, corrupt, torn):
            recs = decode_batch(frame)  # decoded and counted by read_frame, so the second pass cannot fail on it
            fno = len(offsets)
            offsets.append(frame.offset)
            sizes.append(len(frame.data))
            sm.frames += 1
            for i, h in enumerate(recs):
                sm.records += 1
                pos = h.index - first
                if not 0 <= pos < n or refs[pos].id != h.id:
                    sm.foreign += 1
                    if len(t.foreign_ids) < SAMPLE_IDS:
                        t.foreign_ids.append(h.id)
                    continue
                if frame_of[pos] != -1:  # written again (a retry, a task that ran twice): the newest counts
                    sm.duplicates += 1
                    if len(t.duplicate_ids) < SAMPLE_IDS:
                        t.duplicate_ids.append(h.id)
                frame_of[pos], item_of[pos] = fno, i

    # Pass 2: records in planned order, frames decoded through a cache bounded in bytes.
    uses = [0] * len(offsets)
    for fno in frame_of:
        if fno >= 0:
            uses[fno] += 1
    cache: OrderedDict[int, list[Record]] = OrderedDict()
    cached = 0
    for pos in range(n):
        fno = frame_of[pos]
        if fno < 0:
            sm.missing += 1
            ref = refs[pos]
            t.datasets[plan.datasets[ref.dataset].name].missing += 1
            if len(t.missing_ids) < SAMPLE_IDS:
                t.missing_ids.append(ref.id)
            missing_out.write(ref.id + "\n")
            continue
        batch = cache.get(fno)
        if batch is None:
            batch = decode_batch(read_frame_at(path, offsets[fno]))
            cache[fno] = batch
            cached += sizes[fno]
            while cached > cache_bytes and len(cache) > 1:
                old, _ = cache.popitem(last=False)
                cached -= sizes[old]
        else:
            cache.move_to_end(fno)
        rec = batch[item_of[pos]]
        uses[fno] -= 1
        if not uses[fno]:
            del cache[fno]
            cached -= sizes[fno]
        sm.kept += 1
        emit(rec)


def finished_shards(rd: RunDir, plan: RunPlan, *, allow_incomplete: bool = False) -> dict[int, DoneManifest]:
    """The done manifests of this run's shards; MergeError naming the unfinished ones unless `allow_incomplete`."""
    not_done, done = [], {}
    for s in plan.shards:
        m = read_done(rd.done_file(s.index))
        if m is not None and m.fingerprint == plan.fingerprint:
            done[s.index] = m
        else:
            not_done.append(s.index)
    if not_done and not allow_incomplete:
        raise MergeError(
            f"{rd.root}: {len(not_done)} of {len(plan.shards)} shards are not finished (no done manifest): "
            f"{_ranges(not_done)}. Finish them with `toolkit resubmit {rd.root}` (`toolkit status {rd.root}` shows "
            f"why they stopped), or merge what is there with `toolkit merge {rd.root} --allow-incomplete`."
        )
    return done


def merge_run(
    run_dir: str | os.PathLike, *, allow_incomplete: bool = False,
    on_record: Callable[[Record], None] | None = None, cache_bytes: int = CACHE_BYTES,
) -> MergeManifest:
    """Merge every shard file of a run into `merged/records.zst` and write `merged/manifest.json`.

    Without `allow_incomplete`, refuses (MergeError) when a shard has no done manifest. `on_record` sees every
    merged record, in planned order (the audit runs in the same pass this way).
    """
    rd, plan = load_run(run_dir)
    done = finished_shards(rd, plan, allow_incomplete=allow_incomplete)
    refs = PlannedRefs(rd, plan)
    out_dir = rd.merged_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{RECORDS_FILE}.tmp"
    _clear_stale(tmp)
    writer = ShardWriter(tmp, plan.fingerprint, MERGED, flush_records=MERGED_FLUSH_RECORDS, flush_seconds=1e9)
    try:
        writer.open()
    except RuntimeError:
        raise MergeError(f"{rd.root}: another merge of this run is writing {tmp}; wait for it to end") from None
    t = _Totals(plan)
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

    missing_tmp = out_dir / f".{MISSING_FILE}.tmp"
    try:
        with open(missing_tmp, "w") as missing_out:
            for s in plan.shards:
                path = rd.shard_file(s.index)
                sm = ShardMerge(index=s.index, file=str(path), done=s.index in done)
                readable = _check_file(path, s.index, plan, sm, done, corrupt)
                log.info("merging shard %d (%d planned records)", s.index, s.count)
                _merge_shard(s, sm, path if readable else None, refs.shard(s.index), plan, t, corrupt, torn, emit,
                             missing_out, cache_bytes)
                t.duplicates += sm.duplicates
                t.foreign += sm.foreign
                t.missing += sm.missing
                shards.append(sm)
        writer.close()
        sha = _sha256(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, out_dir / RECORDS_FILE)
        os.replace(missing_tmp, out_dir / MISSING_FILE)
        fsync_dir(out_dir)
    except BaseException:
        writer.close()
        for p in (tmp, missing_tmp):
            p.unlink(missing_ok=True)
        raise
    manifest = MergeManifest(
        format=MANIFEST_FORMAT, run=plan.name, fingerprint=plan.fingerprint, created=_now(),
        allow_incomplete=allow_incomplete,
        complete=not (t.missing or corrupt or t.foreign) and t.records == plan.total,
        planned=plan.total, records=t.records, ok=t.ok, failed=t.failed, missing=t.missing,
        duplicates=t.duplicates, foreign=t.foreign, prompt_tokens=t.prompt_tokens, output_tokens=t.output_tokens,
        datasets=t.datasets, shards=shards, corrupt=corrupt, torn=torn, file=RECORDS_FILE, bytes=size, sha256=sha,
        missing_ids=t.missing_ids, duplicate_ids=t.duplicate_ids, foreign_ids=t.foreign_ids,
    )
    atomic_write(out_dir / MANIFEST_FILE, msgspec.json.format(msgspec.json.encode(manifest), indent=2))
    _log_problems(rd, manifest)
    return manifest


def _check_file(path: Path, k: int, plan: RunPlan, sm: ShardMerge, done: dict[int, DoneManifest], corrupt: list[FrameProblem]) -> bool:
    """Size and checksum of a shard file; False when it is absent or not this shard's (then reported)."""
    if not path.exists():
        return False
    sm.bytes = path.stat().st_size
    if sm.done:
        sm.sha256 = _sha256(path)
        sm.matches_done = sm.sha256 == done[k].sha256
    try:
        head = read_header(path)
    except CorruptShard as e:
        corrupt.append(FrameProblem(k, str(path), e.offset, e.why))
        return False
    if head is not None and head != (plan.fingerprint, k):
        corrupt.append(FrameProblem(k, str(path), 0, f"a file of run {head[0]} shard {head[1]}, not of this run's shard {k}"))
        return False
    return True


def _clear_stale(tmp: Path) -> None:
    """Remove the temporary file of a merge that was killed; refuse if a merge still holds it."""
    try:
        fd = os.open(tmp, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise MergeError(f"another merge of this run is writing {tmp}; wait for it to end") from None
    finally:
        os.close(fd)
    tmp.unlink(missing_ok=True)


def _log_problems(rd: RunDir, m: MergeManifest) -> None:
    for p in m.corrupt:
        log.error("shard %d: damaged frame in %s at byte %d (%s); its records are counted missing", p.shard, p.file,
                  p.offset, p.why)
    for p in m.torn:
        log.warning("shard %d: torn last frame in %s at byte %d (%s)", p.shard, p.file, p.offset, p.why)
    if m.duplicates:
        log.warning("%d records superseded by a later record of the same id (e.g. %s)", m.duplicates, ", ".join(m.duplicate_ids[:3]))
    if m.foreign:
        log.error("%d records do not belong to their shard's plan (e.g. %s); left out", m.foreign,
                  ", ".join(m.foreign_ids[:3]))
    if m.missing:
        log.warning("%d of %d planned records missing; ids in %s", m.missing, m.planned, rd.merged_dir / MISSING_FILE)
    log.info("merged %d records (%d ok, %d failed) into %s", m.records, m.ok, m.failed, rd.merged_dir / RECORDS_FILE)


def load_manifest(rd: RunDir) -> MergeManifest:
    path = rd.merged_dir / MANIFEST_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=MergeManifest)
    except FileNotFoundError:
        raise MergeError(f"{rd.root} has no merged dataset ({path} is missing): run `toolkit merge {rd.root}` first") from None
    except msgspec.MsgspecError as e:
        raise MergeError(f"{path}: unreadable merge manifest ({e}); run `toolkit merge {rd.root}` again") from None


def merge_and_audit(run_dir: str | os.PathLike, *, allow_incomplete: bool = False, out=None) -> int:
    """The final job of a run: merge, audit in the same pass, write the reports, print the summary.

    Returns 0 when the run merged completely and the audit passed, 1 otherwise, 2 when it cannot merge (e.g.
    unfinished shards without `allow_incomplete`; the message says what to do).
    """
    from . import audit, report

    out = out or sys.stdout
    rd, plan = load_run(run_dir)
    try:
        finished_shards(rd, plan, allow_incomplete=allow_incomplete)  # refuse before loading the tokenizer
        auditor = audit.Auditor(rd, plan)
        manifest = merge_run(rd.root, allow_incomplete=allow_incomplete, on_record=auditor.add)
    except MergeError as e:
        print(f"toolkit: error: {e}", file=sys.stderr)
        return 2
    result = auditor.finish(manifest)
    report.write_reports(rd, result)
    print(report.summary_table(result), file=out)
    return 0 if result.passed else 1


# ---------------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------------
def _fail(e: BaseException) -> int:
    print(f"toolkit: error: {e}", file=sys.stderr)
    return 2


def cmd_merge(args) -> int:
    if not args.no_audit:
        return merge_and_audit(args.run, allow_incomplete=args.allow_incomplete)
    try:
        m = merge_run(args.run, allow_incomplete=args.allow_incomplete)
    except MergeError as e:
        return _fail(e)
    print(f"merged {m.records} of {m.planned} planned records ({m.ok} ok, {m.failed} failed) into "
          f"{RunDir(args.run).merged_dir / RECORDS_FILE}; {m.missing} missing, {m.duplicates} duplicates kept once, "
          f"{len(m.corrupt)} damaged frames")
    return 0 if not (m.corrupt or m.foreign) and (m.complete or args.allow_incomplete) else 1


def cmd_audit(args) -> int:
    from . import audit, report

    try:
        rd, _ = load_run(args.run)
        result = audit.audit_run(rd.root)
    except MergeError as e:
        return _fail(e)
    report.write_reports(rd, result)
    print(report.summary_table(result))
    return 0 if result.passed else 1


def cmd_export(args) -> int:
    from . import export

    output = args.output or export.default_output(args.run, args.format)
    try:
        n = export.export_run(args.run, args.format, args.output, include_failed=args.include_failed)
    except (MergeError, export.ExportError) as e:
        return _fail(e)
    print(f"wrote {n} records to {shown_path(output)} ({args.format})")
    return 0


def add_cli(sub) -> None:
    """Register the `merge`, `audit` and `export` subcommands."""
    fmt = argparse.RawDescriptionHelpFormatter
    s = sub.add_parser(
        "merge", help="merge a run's shard files into one dataset (in planned order, exactly once) and audit it",
        formatter_class=fmt,
        description="Stream every shard file of RUN into RUN/merged/records.zst in planned prompt order, keeping each\n"
        "record exactly once, with RUN/merged/manifest.json (counts, checksums, problems). Then audit it\n"
        "(RUN/merged/audit.json, audit.html) unless --no-audit.\n\n"
        "exit codes: 0 merged and audit passed, 1 audit failed or records missing/damaged, 2 cannot merge",
    )
    s.add_argument("run", help="run directory")
    s.add_argument("--allow-incomplete", action="store_true",
                   help="merge even if some shards are unfinished; missing ids go to merged/missing_ids.txt")
    s.add_argument("--no-audit", action="store_true", help="only merge")
    s.set_defaults(func=cmd_merge)

    s = sub.add_parser(
        "audit", help="check a merged run: coverage, reasoning capture, truncation, consistency; write reports",
        formatter_class=fmt,
        description="Audit RUN/merged/records.zst: every planned id present once, reasoning split on the think-end id,\n"
        "truncation, stop tokens, token counts, prompts re-rendered from the source. Thresholds come from the\n"
        "job's [audit] table. Writes RUN/merged/audit.json, audit.html, missing_ids.txt and failed_ids.txt.\n\n"
        "exit codes: 0 passed, 1 a check failed, 2 no merged dataset or unreadable run",
    )
    s.add_argument("run", help="run directory (merged with `toolkit merge`)")
    s.set_defaults(func=cmd_audit)

    s = sub.add_parser(
        "export", help="write a merged run as jsonl, parquet, tokens (input_ids + loss_mask) or conversations",
        formatter_class=fmt,
        description="Export RUN/merged/records.zst (ok records only unless --include-failed):\n"
        "  jsonl          one object per record: id, dataset, status, error, prompt_ids, output_ids,\n"
        "                 reasoning_end, reasoning, content, finish_reason, matched_stop (token id),\n"
        "                 matched_stop_str (stop string), prompt_tokens, completion_tokens\n"
        "  parquet        the same columns and types (needs pyarrow)\n"
        "  tokens         {\"input_ids\": prompt + output, \"loss_mask\": 0 per prompt id, 1 per output id},\n"
        "                 the layout EAGLE-3 / SpecForge draft-model trainers consume\n"
        "  conversations  SpecForge-style chat JSONL: the source messages, then the assistant turn with\n"
        "                 `content` and `reasoning_content` kept apart",
    )
    s.add_argument("run", help="run directory (merged with `toolkit merge`)")
    s.add_argument("--format", required=True, choices=["jsonl", "parquet", "tokens", "conversations"])
    s.add_argument("-o", "--output", help="output file (default: RUN/export/records.jsonl, records.parquet, "
                   "tokens.jsonl or conversations.jsonl)")
    s.add_argument("--include-failed", action="store_true", help="also export failed records")
    s.set_defaults(func=cmd_export)
