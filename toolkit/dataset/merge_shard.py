"""One shard's file into the merge: the file checked (size, checksum against its done manifest,
header), its newest record at each planned position handed on in planned order, the positions it
lacks written to the missing ids, and everything counted in the merge's `MergeCounts`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from toolkit.dataset.merge_manifest import DatasetCounts, FrameProblem, MergeError, ShardMerge
from toolkit.formats.files import sha256_file
from toolkit.formats.frames import CorruptShard, damaged_fingerprint, read_header
from toolkit.formats.manifests import DoneManifest
from toolkit.formats.newest import SAMPLE_IDS, newest_records, scan_shard
from toolkit.formats.prompts import PromptIndex, PromptRef
from toolkit.formats.records import OK, Record
from toolkit.formats.rundir import RunDir
from toolkit.formats.runplan import RunPlan, ShardPlan

__all__ = ["MergeCounts", "merge_shard"]

log = logging.getLogger("toolkit.dataset.merge")  # the merge stage logs under one name


class MergeCounts:
    """What the merge counted so far: per dataset, over the run, per shard, and the frames it found
    damaged or torn."""

    def __init__(self, plan: RunPlan):
        self.datasets = {d.name: DatasetCounts(planned=d.planned) for d in plan.datasets}
        self.records = self.ok = self.failed = self.prompt_tokens = self.output_tokens = 0
        self.duplicates = self.foreign = self.missing = self.continued = 0
        self.duplicate_ids: list[str] = []
        self.foreign_ids: list[str] = []
        self.missing_ids: list[str] = []
        self.shards: list[ShardMerge] = []
        self.corrupt: list[FrameProblem] = []  # damaged frames (their records are missing)
        self.torn: list[FrameProblem] = []  # incomplete last frames

    def add(self, rec: Record) -> None:
        """A record written to the merged dataset."""
        c = self.datasets.setdefault(rec.dataset, DatasetCounts(planned=0))
        if rec.status == OK:
            c.ok += 1
            self.ok += 1
        else:
            c.failed += 1
            self.failed += 1
        self.records += 1
        self.prompt_tokens += len(rec.prompt_ids) >> 2
        self.output_tokens += len(rec.output_ids) >> 2

    def add_shard(self, sm: ShardMerge) -> None:
        """A shard merged: its problems added to the run's."""
        self.duplicates += sm.duplicates
        self.continued += sm.continued
        self.foreign += sm.foreign
        self.missing += sm.missing
        self.shards.append(sm)


def _read_shard(
    sp: ShardPlan,
    sm: ShardMerge,
    path: Path | None,
    refs: list[PromptRef],
    plan: RunPlan,
    t: MergeCounts,
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
        (t.torn if d.torn else t.corrupt).append(FrameProblem(sp.index, str(path), d.offset, d.why))
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


def merge_shard(
    rd: RunDir,
    plan: RunPlan,
    s: ShardPlan,
    refs: PromptIndex,
    done: dict[int, DoneManifest],
    t: MergeCounts,
    emit: Callable[[Record], None],
    missing_out,
    cache_bytes: int,
    allow_incomplete: bool,
) -> ShardMerge:
    """One shard's records into the merged dataset, its file checked first (MergeError: a finished
    shard's file changed since its done manifest, unless `allow_incomplete`)."""
    path = rd.shard_file(s.index)
    sm = ShardMerge(index=s.index, file=str(path), done=s.index in done)
    readable = _check_file(path, s.index, plan, sm, done, t.corrupt)
    if sm.done and sm.matches_done is not True and not allow_incomplete:
        raise _changed_since_done(rd, s.index, sm)
    log.info("merging shard %d (%d planned records)", s.index, s.count)
    _read_shard(
        s,
        sm,
        path if readable is not None else None,
        refs.shard(s.index),
        plan,
        t,
        emit,
        missing_out,
        cache_bytes,
        header=bool(readable),
    )
    return sm


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
