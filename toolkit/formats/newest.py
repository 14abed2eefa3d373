"""The newest record of each id wins, in one place: a shard file's records located per planned
position, the record written last of each position kept.

A record written again (a retry of a failed record, a task that ran twice) supersedes the earlier
ones; a partial output kept at a stop and superseded by its continuation is counted apart, as
continued, not as a duplicate. Memory stays flat whatever the file's size: the first pass
(`scan_shard`) reads every intact frame and keeps, per planned position, where its newest record
lives (frame number and index in the frame, in compact arrays), noting damaged frames and reading on
past them; the second (`newest_records`) yields those records in planned order, decoding frames
through a cache bounded in bytes and reading a frame again when it was evicted. The merge,
`toolkit.read_run`, the worker's turn history, `toolkit retry`, `toolkit logs` and the shard
writer's recovery (formats.shardfile) read a shard this way.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from toolkit.formats.frames import Damage, decode_batch, intact_frames, read_frame_at
from toolkit.formats.records import PARTIAL, Record

CACHE_BYTES = 64 << 20  # decoded frames kept by the second pass
SAMPLE_IDS = 100  # ids listed per kind of problem (all are counted)


class Planned(Protocol):
    """A planned prompt of a shard, as the scan needs it: its id (formats.prompts.PromptRef is
    one)."""

    @property
    def id(self) -> str: ...


class ShardScan:
    """Where the newest record of each planned position of one shard file lives, and what else was
    found there.

    The one reading of "the newest record of an id wins": a record written again (a retry of a
    failed record, a task that ran twice) supersedes the earlier ones; a partial output kept at a
    stop and superseded by its continuation is counted apart, as continued, not as a duplicate. Only
    positions are kept, not records.
    """

    def __init__(self, n: int):
        self.frame_of = array("q", [-1]) * n  # frame number holding the kept record of each
        # position
        self.item_of = array("i", [0]) * n  # index of that record in its frame
        self.partial_at = bytearray(n)  # 1 where that record is a partial output (to be
        # continued)
        self.offsets: list[int] = []  # frame number -> byte offset
        self.sizes: list[int] = []  # frame number -> decompressed size
        self.ends: list[int] = []  # frame number -> byte offset just past it
        self.records = self.duplicates = self.continued = self.foreign = 0
        self.duplicate_ids: list[str] = []  # the first SAMPLE_IDS
        self.foreign_ids: list[str] = []
        self.damage: list[Damage] = []


def scan_shard(
    path: Path | None,
    first: int,
    refs: Sequence[Planned] | int,
    *,
    header: bool = True,
    each: Callable[[Record], None] | None = None,
) -> ShardScan:
    """Pass 1 over a shard file whose planned positions are first .. first + len(refs) - 1 (`refs`
    in order): every intact frame read, the newest record of each position located, damaged frames
    noted and read past. `refs` a count: the positions' ids are not checked (a record at a planned
    position is taken as its own), and nothing is kept per prompt but the arrays. `header` False:
    the file's header is known damaged; its frames are read past it. `each` sees every record of the
    planned positions as pass 1 reads it (while the scan finds no duplicate and no continued record,
    those are the newest)."""
    n = refs if isinstance(refs, int) else len(refs)
    ids = None if isinstance(refs, int) else refs
    sc = ShardScan(n)
    if path is None:
        return sc
    frame_of, item_of, partial_at = sc.frame_of, sc.item_of, sc.partial_at
    for frame in intact_frames(path, sc.damage, header=header):
        recs = decode_batch(frame)  # decoded and counted here, so the second pass cannot fail on it
        fno = len(sc.offsets)
        sc.offsets.append(frame.offset)
        sc.sizes.append(len(frame.data))
        sc.ends.append(frame.end)
        for i, h in enumerate(recs):
            sc.records += 1
            pos = h.index - first
            if not 0 <= pos < n or ids is not None and ids[pos].id != h.id:
                sc.foreign += 1
                if len(sc.foreign_ids) < SAMPLE_IDS:
                    sc.foreign_ids.append(h.id)
                continue
            # a partial output, continued by this record (or kept again at a stop)
            if partial_at[pos]:
                sc.continued += 1
            # written again (a retry, a task that ran twice): the newest counts
            elif frame_of[pos] != -1:
                sc.duplicates += 1
                if len(sc.duplicate_ids) < SAMPLE_IDS:
                    sc.duplicate_ids.append(h.id)
            frame_of[pos], item_of[pos] = fno, i
            if each is not None:
                each(h)
            partial_at[pos] = h.status == PARTIAL
    return sc


def newest_records(
    path: Path | None, sc: ShardScan, cache_bytes: int = CACHE_BYTES
) -> Iterator[Record | None]:
    """Pass 2: the newest record of each planned position in planned order (None where there is
    none), frames decoded through a cache bounded in bytes."""
    uses = [0] * len(sc.offsets)
    for fno in sc.frame_of:
        if fno >= 0:
            uses[fno] += 1
    cache: OrderedDict[int, list[Record]] = OrderedDict()
    cached = 0
    for pos, fno in enumerate(sc.frame_of):
        if fno < 0:
            yield None
            continue
        batch = cache.get(fno)
        if batch is None:
            batch = decode_batch(read_frame_at(path, sc.offsets[fno]))
            cache[fno] = batch
            cached += sc.sizes[fno]
            while cached > cache_bytes and len(cache) > 1:
                old, _ = cache.popitem(last=False)
                cached -= sc.sizes[old]
        else:
            cache.move_to_end(fno)
        rec = batch[sc.item_of[pos]]
        uses[fno] -= 1
        if not uses[fno]:
            del cache[fno]
            cached -= sc.sizes[fno]
        yield rec
