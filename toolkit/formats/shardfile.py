"""Shard files: append-only, crash-safe files of records (`ShardWriter`).

A batch is written with one `write` and fsynced, so a crash at any instruction leaves at most a torn
last batch, which `ShardWriter.open` detects and cuts off; a damaged file is salvaged (its intact
frames kept, the original set aside). A writer holds the shard's lock (formats.locks). The format
and its readers are formats.frames; the done manifest and retry requests beside a shard file are
formats.manifests.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import zstandard

from toolkit.errors import BadInputError
from toolkit.formats.files import fsync_dir
from toolkit.formats.frames import (
    HEADER_SIZE,
    CorruptShard,
    Damage,
    batch_bytes,
    batch_encoder,
    damaged_fingerprint,
    header_bytes,
    read_header,
)
from toolkit.formats.locks import LockFile, flock_or_lockfile
from toolkit.formats.newest import ShardScan, newest_records, scan_shard
from toolkit.formats.records import LOOP, PARTIAL, Record, is_transient
from toolkit.formats.text import file_stamp

log = logging.getLogger(__name__)


class ForeignShard(BadInputError):
    """A shard file that belongs to another run (another fingerprint or shard): the run directory
    was planned for another job. Nothing is written to it."""


@dataclass
class Recovered:
    """What `ShardWriter.open` found in a shard file, for the caller to resume from: {id: byte
    offset of the frame of its newest record} for every planned position already recorded (`done`);
    the ids whose newest record is a transient failure (records.TRANSIENT), with the failed tries it
    counts (`tries`); those whose newest record is PARTIAL, with it (continued, not redone); the
    n_output of the newest record per planned position (`output_tokens_at`, None while the file
    holds no record); the positions whose newest record was stopped in a repetition loop; the
    records found outside the planned positions (another shard's) and their first ids; and where a
    damaged original was kept aside (`damaged`)."""

    done: dict[str, int] = field(default_factory=dict)
    transient: set[str] = field(default_factory=set)
    tries: dict[str, int] = field(default_factory=dict)
    partial: dict[str, Record] = field(default_factory=dict)
    output_tokens_at: array | None = None
    loops_at: list[int] = field(default_factory=list)
    foreign: int = 0
    foreign_ids: list[str] = field(default_factory=list)
    damaged: Path | None = None


class ShardWriter:
    """Appends batches of records to one shard file; resumes a file left by an earlier (killed)
    attempt.

    Open it with `open(positions)`: it locks the file, checks the fingerprint, cuts off a torn
    last frame, salvages a file damaged in the middle (see `open`) and returns what it found
    (`Recovered`: the ids already written, those to redo, ...), so the caller generates only the
    rest. A record written again later supersedes the earlier one (the newest attempt counts:
    formats.newest, as every reader reads a shard).
    """

    def __init__(
        self,
        path: str | Path,
        fingerprint: str,
        shard: int,
        *,
        flush_records: int = 64,
        flush_seconds: float = 10.0,
        level: int = 3,
    ):
        self.path = Path(path)
        self.fingerprint, self.shard = fingerprint, shard
        self.flush_records, self.flush_seconds = flush_records, flush_seconds
        self._cctx = zstandard.ZstdCompressor(level=level)
        self._pending: list[Record] = []
        self._last_flush = time.monotonic()
        # one flush at a time: the exit guard may flush from its own thread
        self._flushing = threading.Lock()
        self._fd: int | None = None
        self._lockfile: LockFile | None = None  # where flock is not available
        self.written = 0  # records in the file (before + this session), superseded ones included
        # the error of a write that failed (a full disk): the file may end in a torn frame, so
        # nothing more is written to it; its records are generated again when it is reopened
        self.write_error: OSError | None = None

    def open(self, positions: range) -> Recovered:
        """Lock and recover the file whose planned positions are `positions`; return what it found
        (`Recovered`): {id: byte offset of the frame of its newest record} for every planned
        position already recorded (`done`; records not kept); `transient` names those whose newest
        record should be redone.

        The file is read as every reader reads it (formats.newest: the newest record of each
        position wins); records outside `positions` are counted in `foreign` (their first ids in
        `foreign_ids`), not returned: the caller refuses such a file.

        Damage in the middle of the file (a frame that fails its checks, intact frames after it) is
        salvaged: every intact frame is copied to a new file (temporary name, fsync, rename), the
        damaged original is kept aside as `NNNNN.zst.damaged-<time>`, and only the records of the
        bad frames are missing (generated again).

        `output_tokens_at[i]` is then the n_output of the newest record at position positions[i]
        (0 where none): what is already recorded, 4 bytes a prompt (None while the file holds no
        record: a fresh shard keeps nothing per prompt).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._lockfile = flock_or_lockfile(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        try:
            return self._recover(positions)
        except BaseException:
            self.close()  # the lock (and lock file) go with it
            raise

    def _recover(self, positions: range) -> Recovered:
        fd = self._fd
        assert fd is not None
        size = os.fstat(fd).st_size
        if size == 0:
            self._write(header_bytes(self.fingerprint, self.shard))
            fsync_dir(self.path.parent)
            return Recovered()
        damage: list[Damage] = []
        try:
            head = read_header(self.path)
        except CorruptShard as e:
            head = None
            damage.append(Damage(0, HEADER_SIZE, f"damaged header: {e.why}", False))
        if head is None and not damage:  # killed while writing the header itself
            os.ftruncate(fd, 0)
            self._write(header_bytes(self.fingerprint, self.shard))
            return Recovered()
        if head is not None and head != (self.fingerprint, self.shard):
            fp, shard = head
            if not damaged_fingerprint(fp, self.fingerprint):
                raise ForeignShard(
                    f"{self.path} belongs to run {fp} shard {shard}, not run {self.fingerprint} "
                    f"shard {self.shard} (a file put here from another run): none of its records "
                    f"is this run's; move it aside (mv {self.path} {self.path}.other-run) and run "
                    "the shard again: it is generated anew"
                )
            damage.append(
                Damage(0, HEADER_SIZE, f"damaged header (run {fp!r} shard {shard})", False)
            )
        sc = scan_shard(self.path, positions.start, len(positions), header=not damage)
        damage += sc.damage
        self.written = sc.records
        found = self._adopt(sc)
        if damage and not damage[-1].torn or len(damage) > 1:
            self._salvage(list(zip(sc.offsets, sc.ends)), damage, found)
        elif damage:
            off, why = damage[0].offset, damage[0].why
            log.warning(
                "%s: dropping a torn last frame at byte %d (%s); its records will be generated "
                "again",
                self.path,
                off,
                why,
            )
            os.ftruncate(fd, off)
            os.fsync(fd)
        return found

    def _adopt(self, sc: ShardScan) -> Recovered:
        """What the newest record of each position says (`scan_shard`'s pass 2, read before any
        salvage moves frames): {id: offset of its frame}, the transient ones with their tries, the
        partial ones, the output tokens per position."""
        found = Recovered(foreign=sc.foreign, foreign_ids=sc.foreign_ids)
        if sc.records == sc.foreign:  # nothing at the planned positions
            return found
        done = found.done
        otok = found.output_tokens_at = array("I", bytes(4 * len(sc.frame_of)))
        for pos, r in enumerate(newest_records(self.path, sc)):
            if r is None:
                continue
            done[r.id] = sc.offsets[sc.frame_of[pos]]
            otok[pos] = r.n_output
            if r.finish == LOOP:
                found.loops_at.append(pos)
            if is_transient(r):
                found.transient.add(r.id)
                found.tries[r.id] = r.tries
            if r.status == PARTIAL:
                found.partial[r.id] = r
        return found

    def _salvage(self, good: list[tuple[int, int]], damage: list[Damage], found: Recovered) -> None:
        """Rewrite the file with its intact frames only (the original kept aside, `found.damaged`);
        the offsets in `found.done` follow."""
        bad = ", ".join(f"byte {d.offset} ({d.why})" for d in damage)
        damaged = found.damaged = self.path.with_name(f"{self.path.name}.damaged-{file_stamp()}")
        log.error(
            "%s: damaged frames at %s; keeping its %d intact frames, generating the records of "
            "the damaged ones again; the damaged file is kept as %s",
            self.path,
            bad,
            len(good),
            damaged.name,
        )
        tmp = self.path.with_name(f".{self.path.name}.salvage")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        if self._lockfile is None:  # (with a lock file, the shard's lock covers this file too)
            fcntl.flock(fd, fcntl.LOCK_EX)
        old, self._fd = self._fd, fd
        moved: dict[int, int] = {}
        pos = HEADER_SIZE
        self._write(header_bytes(self.fingerprint, self.shard), sync=False)
        with open(self.path, "rb") as f:
            for start, end in good:
                f.seek(start)
                self._write(f.read(end - start), sync=False)
                moved[start] = pos
                pos += end - start
        os.fsync(fd)
        os.link(self.path, damaged)
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        assert old is not None
        os.close(old)
        found.done = {k: moved[v] for k, v in found.done.items()}

    def _write(self, data: bytes, *, sync: bool = True) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
            if sync:
                os.fsync(self._fd)
        except OSError as e:
            self.write_error = e
            raise

    def add(self, record: Record) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.flush_records:
            self.flush()

    def due(self) -> bool:
        """Whether a timed flush is due (never after a failed write: the shard's own next write
        says it)."""
        return (
            bool(self._pending)
            and self.write_error is None
            and time.monotonic() - self._last_flush >= self.flush_seconds
        )

    def flush(self) -> None:
        with self._flushing:
            self._flush()

    def flush_within(self, timeout_s: float) -> bool:
        """Flush from another thread (the exit guard's), unless a flush under way does not end
        within `timeout_s` or the file is closed: whether it flushed."""
        if not self._flushing.acquire(timeout=timeout_s):
            return False
        try:
            if self._fd is None or self.write_error is not None:
                return False
            self._flush()
            return True
        finally:
            self._flushing.release()

    def _flush(self) -> None:
        if self.write_error is not None:  # the records it lost are not in the file
            raise self.write_error
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        comp = self._cctx.compress(batch_encoder.encode(batch))
        self._write(batch_bytes(comp, len(batch)))
        self.written += len(batch)
        if self._lockfile is not None:
            self._lockfile.touch()

    def close(self) -> None:
        """Flush and release the file; after a failed write, release it only (what was pending
        is generated again when the shard is reopened)."""
        if self._fd is None:
            return
        try:
            if self.write_error is None:
                self.flush()
        finally:
            os.close(self._fd)  # releases the lock
            self._fd = None
            if self._lockfile is not None:
                self._lockfile.release()
                self._lockfile = None
