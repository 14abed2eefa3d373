"""Shard files: append-only, crash-safe files of records, and the `done` manifest of a finished shard.

A shard file is a plain sequence of zstd frames, so `zstd -dc` reads it: a skippable header frame carrying
the run fingerprint, then for every batch of records a small skippable frame, the descriptor (length, record
count, CRC32 of the data frame, and — since format 2 — a CRC32 of those fields themselves) followed by one zstd
frame holding the msgpack-encoded batch. A batch is written with one `write` and fsynced, so a crash at any
instruction leaves at most a torn last batch, which `ShardWriter.open` detects and cuts off. A writer holds an
exclusive lock on the file: two tasks never interleave frames. Where the file system has no flock (older NFS,
Lustre mounted without flock: ENOLCK, EOPNOTSUPP, ENOSYS), an exclusive lock file `NNNNN.zst.lock` created
with O_CREAT|O_EXCL stands in (`_LockFile`): it names host, pid and start time, a stale one is taken over
(same host and pid gone, or another host's untouched for STALE_LOCK_S), any other is refused with how to remove
it. Where flock works but is node-local, the Slurm array runs one task per shard.

Every reader (the worker's resume, `read_shard`, merge, audit, export) judges a frame through one function,
`read_frame`: descriptor marker and checksum, data checksum, zstd, msgpack, and the record count. `scan` walks a
file past damaged frames, finding the next intact one by its marker, so a damaged frame costs only its records;
`intact_frames` is that walk as a merge uses it (the intact frames, the damage noted aside).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
import struct
import threading
import time
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec
import zstandard

from .files import atomic_write, fsync_dir, sha256_file
from .fmt import file_stamp, local_time, utc_now
from .records import OK, PARTIAL, Record, is_transient

__all__ = [
    "CorruptShard",
    "Damage",
    "DoneManifest",
    "Frame",
    "LockHolder",
    "RetryRequest",
    "ShardLocked",
    "ShardWriter",
    "held_elsewhere",
    "intact_frames",
    "iter_frames",
    "needs_work",
    "read_done",
    "read_frame",
    "read_frame_at",
    "read_retry",
    "read_shard",
    "scan",
    "write_retry",
    "verify_done",
    "write_done",
]

log = logging.getLogger(__name__)

_HEAD_MAGIC = 0x184D2A5E   # zstd skippable frame: file header
_BATCH_MAGIC = 0x184D2A5F  # zstd skippable frame: describes the data frame that follows
_FILE_TAG = b"TKSH"
_BATCH_TAG = b"TKFR"
FORMAT = 2                               # written; format 1 files (descriptors without their own CRC) are read
READS = (1, 2)
_SKIP = struct.Struct("<II")             # magic, payload size
_HEAD = struct.Struct("<4sH16sI")        # tag, format, fingerprint, shard
_BATCH1 = struct.Struct("<4sIII")        # format 1: tag, compressed size, records, crc32 of the compressed frame
_BATCH = struct.Struct("<4sIIII")        # format 2: the same, then crc32 of those 16 bytes
_DESC_SIZES = (_BATCH.size, _BATCH1.size)
_MARKER = _BATCH_MAGIC.to_bytes(4, "little")

_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[Record])


class CorruptShard(Exception):
    """A shard file with a damaged frame that is not its last one; names the file and byte offset."""

    def __init__(self, path: Path, offset: int, why: str):
        self.path, self.offset, self.why = path, offset, why
        super().__init__(f"{path}: damaged frame at byte {offset}: {why}")


class FrameError(Exception):
    """The frame at an offset is not intact; the message says why."""


class Frame(msgspec.Struct):
    offset: int      # byte offset of the batch's descriptor
    end: int         # byte offset just past its data frame
    records: int
    data: bytes      # decompressed msgpack batch
    batch: list[Record] = []  # the decoded records (checked: as many as the descriptor says)


class Damage(msgspec.Struct):
    """Bytes of a shard file that hold no intact frame: from `offset` to `end` (the next intact frame, or EOF)."""

    offset: int
    end: int
    why: str
    torn: bool       # nothing intact follows: what a crash mid-write leaves


def _header_bytes(fingerprint: str, shard: int) -> bytes:
    payload = _HEAD.pack(_FILE_TAG, FORMAT, fingerprint.encode().ljust(16, b"\0")[:16], shard)
    return _SKIP.pack(_HEAD_MAGIC, len(payload)) + payload


def _batch_bytes(comp: bytes, count: int) -> bytes:
    fields = _BATCH1.pack(_BATCH_TAG, len(comp), count, zlib.crc32(comp))
    return _SKIP.pack(_BATCH_MAGIC, _BATCH.size) + fields + struct.pack("<I", zlib.crc32(fields)) + comp


_HEADER_SIZE = _SKIP.size + _HEAD.size
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")  # what plan.fingerprint looks like


def _damaged_fingerprint(fp: str, ours: str) -> bool:
    """Whether a header's fingerprint other than `ours` is ours with a damaged byte (or two), rather than another
    run's: not a fingerprint at all, or ours but for a character or two (another run's differs almost everywhere).
    Ours with another shard number is a damaged byte too."""
    return not _FINGERPRINT.fullmatch(fp) or len(fp) == len(ours) and sum(a != b for a, b in zip(fp, ours)) <= 2


def read_header(path: Path) -> tuple[str, int] | None:
    with open(path, "rb") as f:
        raw = f.read(_HEADER_SIZE)
    if len(raw) < _HEADER_SIZE:
        return None
    magic, size = _SKIP.unpack_from(raw)
    tag, fmt, fp, shard = _HEAD.unpack_from(raw, _SKIP.size)
    if magic != _HEAD_MAGIC or tag != _FILE_TAG or size != _HEAD.size:
        raise CorruptShard(path, 0, "not a shard file (bad header)")
    if fmt not in READS:
        raise CorruptShard(path, 0, f"shard format {fmt}, this toolkit reads formats {', '.join(map(str, READS))}")
    try:
        return fp.rstrip(b"\0").decode("ascii"), shard
    except UnicodeDecodeError:
        raise CorruptShard(path, 0, f"damaged header (fingerprint {fp!r})") from None


def read_frame(f: BinaryIO, offset: int, size: int, dctx: zstandard.ZstdDecompressor | None = None) -> Frame:
    """Judge and read the batch frame whose descriptor starts at `offset` of the open file `f` (`size` bytes).

    The one place a frame is judged: descriptor (marker, tag, its own CRC in format 2), data frame (length,
    CRC32, zstd), batch (msgpack, record count). Raises FrameError saying what is wrong.
    """
    f.seek(offset)
    skip = f.read(_SKIP.size)
    if len(skip) < _SKIP.size:
        raise FrameError("incomplete batch descriptor")
    magic, dsize = _SKIP.unpack(skip)
    if magic != _BATCH_MAGIC or dsize not in _DESC_SIZES:
        raise FrameError("bad batch descriptor")
    desc = f.read(dsize)
    if len(desc) < dsize:
        raise FrameError("incomplete batch descriptor")
    tag, clen, count, crc = _BATCH1.unpack_from(desc)
    if tag != _BATCH_TAG or dsize == _BATCH.size and zlib.crc32(desc[: _BATCH1.size]) != _BATCH.unpack(desc)[4]:
        raise FrameError("bad batch descriptor (checksum mismatch)")
    body = offset + _SKIP.size + dsize
    if body + clen > size:
        raise FrameError(f"incomplete data frame ({max(0, size - body)} of {clen} bytes)")
    comp = f.read(clen)
    if len(comp) < clen:
        raise FrameError(f"incomplete data frame ({len(comp)} of {clen} bytes)")
    if zlib.crc32(comp) != crc:
        raise FrameError("checksum mismatch")
    try:
        raw = (dctx or zstandard.ZstdDecompressor()).decompress(comp)
    except zstandard.ZstdError as e:
        raise FrameError(f"zstd error: {e}") from None
    try:
        batch = _batch_decoder.decode(raw)
    except msgspec.MsgspecError as e:
        raise FrameError(f"undecodable batch: {e}") from None
    if len(batch) != count:
        raise FrameError(f"batch holds {len(batch)} records, its descriptor says {count}")
    return Frame(offset, body + clen, count, raw, batch)


def _next_frame(f: BinaryIO, after: int, size: int, dctx) -> Frame | None:
    """The first intact frame starting after byte `after`, found by its marker (reading in chunks)."""
    chunk = 8 << 20
    pos = after + 1
    while pos < size:
        f.seek(pos)
        data = f.read(chunk + len(_MARKER) - 1)
        i = data.find(_MARKER)
        while i != -1 and i < chunk:
            try:
                return read_frame(f, pos + i, size, dctx)
            except FrameError:
                i = data.find(_MARKER, i + 1)
        pos += chunk
    return None


def scan(path: str | Path, *, header: bool = True) -> Iterator[Frame | Damage]:
    """Every intact frame of a shard file, in file order, and a Damage for each stretch between them that holds
    none (the last one `torn` when nothing intact follows it). A bad header raises CorruptShard at byte 0 (with
    `header` False it is not read: the frames after it are, for a salvage)."""
    path = Path(path)
    dctx = zstandard.ZstdDecompressor()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < _HEADER_SIZE:
            if size:
                yield Damage(0, size, "incomplete header", True)
            return
        if header:
            read_header(path)
        pos = _HEADER_SIZE
        while pos < size:
            try:
                frame = read_frame(f, pos, size, dctx)
            except FrameError as e:
                nxt = _next_frame(f, pos, size, dctx)
                yield Damage(pos, nxt.offset if nxt else size, str(e), nxt is None)
                if nxt is None:
                    return
                frame = nxt
            yield frame
            pos = frame.end


def iter_frames(path: str | Path, *, tail: list | None = None) -> Iterator[Frame]:
    """Yield every complete batch frame, decoded, in file order, reading one frame at a time.

    A damaged or incomplete LAST frame ends the iteration and is described in `tail` (a list that receives
    `(offset, why)`), since that is what a crash mid-write leaves. Damage anywhere else raises CorruptShard
    (`scan` reads past it).
    """
    for item in scan(path):
        if isinstance(item, Frame):
            yield item
        elif not item.torn:
            raise CorruptShard(Path(path), item.offset, item.why)
        else:
            if tail is not None:
                tail.append((item.offset, item.why))
            return


def intact_frames(path: str | Path, damage: list[Damage]) -> Iterator[Frame]:
    """Every intact frame of a shard file, reading on past damaged ones (`scan`): what a merge salvages.

    Each damaged stretch is appended to `damage` (the last one `torn` when nothing intact follows it); a bad
    header, which makes nothing in the file trustworthy, is appended as one damaged stretch from byte 0 to the
    end, and no frame is read.
    """
    path = Path(path)
    try:
        for item in scan(path):
            if isinstance(item, Damage):
                damage.append(item)
            else:
                yield item
    except CorruptShard as e:
        damage.append(Damage(e.offset, path.stat().st_size, e.why, False))


def read_frame_at(path: str | Path, offset: int) -> Frame:
    """The batch frame whose descriptor starts at byte `offset` (a `Frame.offset`), decoded.

    Random access for readers that come back to a frame `scan` showed them; damage raises CorruptShard.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            return read_frame(f, offset, os.fstat(f.fileno()).st_size)
        except FrameError as e:
            raise CorruptShard(path, offset, str(e)) from None


def decode_batch(frame: Frame) -> list[Record]:
    return frame.batch


def read_shard(path: str | Path) -> Iterator[Record]:
    """Every record of a shard file, in the order written (a torn last frame is ignored)."""
    for frame in iter_frames(path):
        yield from frame.batch


class ShardLocked(RuntimeError):
    """Another writer holds this shard file (or may): the message says who and what to do."""


NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})  # file systems without flock
STALE_LOCK_S = 2 * 3600  # another host's lock file untouched this long is stale (its writer touches it per batch)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LockHolder(msgspec.Struct):
    """What a shard's lock file holds: who took it and when (`started` in epoch seconds, `since` for people)."""

    host: str
    pid: int
    started: float
    since: str = "?"


class _LockFile:
    """The writer's lock where flock is not available: `NNNNN.zst.lock`, created with O_CREAT|O_EXCL, holding a
    `LockHolder`; touched at every batch written, removed when the writer closes."""

    def __init__(self, path: Path):
        self.path = path
        self.held = False
        self.mine = b""

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._judge()  # raises ShardLocked, or has moved a stale lock aside
                continue
            now = time.time()
            self.mine = msgspec.json.encode(LockHolder(socket.gethostname(), os.getpid(), now, local_time(now)))
            try:
                os.write(fd, self.mine)
                os.fsync(fd)
            finally:
                os.close(fd)
            self.held = True
            return
        raise ShardLocked(f"{self.path}: other writers keep taking this shard's lock file; is the shard submitted twice?")

    def _refuse(self, why: str) -> ShardLocked:
        return ShardLocked(f"{self.path.parent / self.path.name[:-5]} is locked by another worker of this shard: {why} "
                           f"(this file system has no flock, so the lock file {self.path.name} stands in). If no task "
                           f"of this shard runs any more (squeue, ps), remove it: rm {self.path}")

    def _judge(self) -> None:
        try:
            seen = self.path.read_bytes()
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return  # released meanwhile: try again
        try:
            holder = msgspec.json.decode(seen, type=LockHolder)
            host, pid, since = holder.host, holder.pid, holder.since
        except msgspec.DecodeError:  # msgspec.ValidationError included
            if age < 60:  # being written right now
                raise self._refuse("its lock file is being written") from None
            host, pid, since = "", 0, "?"
        if host == socket.gethostname():
            if _pid_alive(pid):
                raise self._refuse(f"pid {pid} on this host holds it since {since}")
            log.warning("%s: taking over the lock of pid %d on this host, which is gone", self.path, pid)
        elif host:
            if age < STALE_LOCK_S:
                raise self._refuse(f"pid {pid} on host {host} holds it since {since}, last written {age:.0f} s ago")
            log.warning("%s: taking over the lock of pid %d on host %s, untouched for %.0f s (over %d s)",
                        self.path, pid, host, age, STALE_LOCK_S)
        else:
            log.warning("%s: taking over an unreadable lock file untouched for %.0f s", self.path, age)
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)  # atomic: of two takers, one moves the stale lock
        except FileNotFoundError:
            return
        if aside.read_bytes() != seen:  # moved the fresh lock of a faster taker: put it back, and refuse
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            aside.unlink()
            raise self._refuse("another worker took it over at the same moment")
        aside.unlink()

    def touch(self) -> None:
        if self.held:
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                if self.path.read_bytes() == self.mine:
                    self.path.unlink()
            except FileNotFoundError:
                pass


def _flock_or_lockfile(fd: int, path: Path) -> _LockFile | None:
    """Lock `fd` (the shard file) for this writer: flock, or where the file system has none, a lock file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        raise ShardLocked(
            f"{path} is locked by another worker of this shard (a task still running, or a requeue "
            "racing the old one); wait for it to end or cancel it"
        ) from None
    except OSError as e:
        if e.errno not in NO_FLOCK:
            raise ShardLocked(f"{path}: cannot lock it ({e.strerror}); check the file system it is on") from None
        log.warning("%s: this file system has no flock (%s): an exclusive lock file stands in", path, e.strerror)
    lock = _LockFile(path.with_name(path.name + ".lock"))
    lock.acquire()
    return lock


def held_elsewhere(path: Path) -> bool:
    """Whether another writer holds the lock of shard file `path` at this moment (its flock; where the file system
    has none, its lock file). Only looked at: a writer may take the lock the next moment (ShardLocked says so)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as e:
        return e.errno in NO_FLOCK and path.with_name(path.name + ".lock").exists()
    finally:
        os.close(fd)  # (releases the probe's lock)
    return False


class ShardWriter:
    """Appends batches of records to one shard file; resumes a file left by an earlier (killed) attempt.

    Open it with `open()`: it locks the file, checks the fingerprint, cuts off a torn last frame, salvages a
    file damaged in the middle (see `open`) and returns the ids already written, so the caller generates only
    the rest. A record of an id written again later supersedes the earlier one (the newest attempt counts).
    """

    def __init__(self, path: str | Path, fingerprint: str, shard: int, *, flush_records: int = 64,
                 flush_seconds: float = 10.0, level: int = 3):
        self.path = Path(path)
        self.fingerprint, self.shard = fingerprint, shard
        self.flush_records, self.flush_seconds = flush_records, flush_seconds
        self._cctx = zstandard.ZstdCompressor(level=level)
        self._pending: list[Record] = []
        self._last_flush = time.monotonic()
        self._flushing = threading.Lock()  # one flush at a time: the exit guard may flush from its own thread
        self._fd: int | None = None
        self._lockfile: _LockFile | None = None  # where flock is not available
        self.written = 0  # records in the file (before + this session), superseded ones included
        self.transient: set[str] = set()  # ids whose newest record is a transient failure (see records.TRANSIENT)
        self.partial: dict[str, Record] = {}  # ids whose newest record is PARTIAL, with it: continued, not redone
        self.damaged: Path | None = None  # where a damaged original was kept aside by `open`
        self.output_tokens_at: array | None = None  # open(positions=...): n_output of the newest record per position

    def open(self, positions: range | None = None) -> dict[str, int]:
        """Lock and recover the file; return {id: byte offset of the frame of its newest record} for every id
        already recorded (records not kept); `transient` names those whose newest record should be redone.

        Damage in the middle of the file (a frame that fails its checks, intact frames after it) is salvaged:
        every intact frame is copied to a new file (temporary name, fsync, rename), the damaged original is kept
        aside as `NNNNN.zst.damaged-<time>`, and only the records of the bad frames are missing (generated again).

        With `positions` (the shard's planned positions), `output_tokens_at[i]` is then the n_output of the newest
        record at position positions[i] (0 where none): what is already recorded, 4 bytes a prompt (None while the
        file holds no record: a fresh shard keeps nothing per prompt).
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._lockfile = _flock_or_lockfile(fd, self.path)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        try:
            return self._recover(positions)
        except BaseException:
            self.close()  # the lock (and lock file) go with it
            raise

    def _recover(self, positions: range | None) -> dict[str, int]:
        fd = self._fd
        assert fd is not None
        size = os.fstat(fd).st_size
        done: dict[str, int] = {}
        otok = self.output_tokens_at = None
        first = positions.start if positions is not None else 0
        if size == 0:
            self._write(_header_bytes(self.fingerprint, self.shard))
            fsync_dir(self.path.parent)
            return done
        damage: list[Damage] = []
        try:
            head = read_header(self.path)
        except CorruptShard as e:
            head = None
            damage.append(Damage(0, _HEADER_SIZE, f"damaged header: {e.why}", False))
        if head is None and not damage:  # killed while writing the header itself
            os.ftruncate(fd, 0)
            self._write(_header_bytes(self.fingerprint, self.shard))
            return done
        if head is not None and head != (self.fingerprint, self.shard):
            fp, shard = head
            if not _damaged_fingerprint(fp, self.fingerprint):
                raise RuntimeError(
                    f"{self.path} belongs to run {fp} shard {shard}, not run {self.fingerprint} shard {self.shard}; "
                    "this run directory was planned for another job: use a new output_dir or --new-run"
                )
            damage.append(Damage(0, _HEADER_SIZE, f"damaged header (run {fp!r} shard {shard})", False))
        good: list[tuple[int, int]] = []  # (offset, end) of intact frames
        for item in scan(self.path, header=not damage):
            if isinstance(item, Damage):
                damage.append(item)
                continue
            good.append((item.offset, item.end))
            for r in item.batch:
                done[r.id] = item.offset
                self.written += 1
                if positions is not None and 0 <= r.index - first < len(positions):
                    if otok is None:
                        otok = self.output_tokens_at = array("I", bytes(4 * len(positions)))
                    otok[r.index - first] = r.n_output
                if is_transient(r):
                    self.transient.add(r.id)
                else:
                    self.transient.discard(r.id)
                if r.status == PARTIAL:
                    self.partial[r.id] = r
                else:
                    self.partial.pop(r.id, None)
        if damage and not damage[-1].torn or len(damage) > 1:
            done = self._salvage(good, damage, done)
        elif damage:
            off, why = damage[0].offset, damage[0].why
            log.warning("%s: dropping a torn last frame at byte %d (%s); its records will be generated again",
                        self.path, off, why)
            os.ftruncate(fd, off)
            os.fsync(fd)
        return done

    def _salvage(self, good: list[tuple[int, int]], damage: list[Damage], done: dict[str, int]) -> dict[str, int]:
        """Rewrite the file with its intact frames only (the original kept aside); offsets in `done` follow."""
        bad = ", ".join(f"byte {d.offset} ({d.why})" for d in damage)
        self.damaged = self.path.with_name(f"{self.path.name}.damaged-{file_stamp()}")
        log.error("%s: damaged frames at %s; keeping its %d intact frames, generating the records of the damaged "
                  "ones again; the damaged file is kept as %s", self.path, bad, len(good), self.damaged.name)
        tmp = self.path.with_name(f".{self.path.name}.salvage")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        if self._lockfile is None:  # (with a lock file, the shard's lock covers this file too)
            fcntl.flock(fd, fcntl.LOCK_EX)
        old, self._fd = self._fd, fd
        moved: dict[int, int] = {}
        pos = _HEADER_SIZE
        self._write(_header_bytes(self.fingerprint, self.shard), sync=False)
        with open(self.path, "rb") as f:
            for start, end in good:
                f.seek(start)
                self._write(f.read(end - start), sync=False)
                moved[start] = pos
                pos += end - start
        os.fsync(fd)
        os.link(self.path, self.damaged)
        os.replace(tmp, self.path)
        fsync_dir(self.path.parent)
        assert old is not None
        os.close(old)
        return {k: moved[v] for k, v in done.items()}

    def _write(self, data: bytes, *, sync: bool = True) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if sync:
            os.fsync(self._fd)

    def add(self, record: Record) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.flush_records:
            self.flush()

    def due(self) -> bool:
        return bool(self._pending) and time.monotonic() - self._last_flush >= self.flush_seconds

    def flush(self) -> None:
        with self._flushing:
            self._flush()

    def flush_within(self, timeout_s: float) -> bool:
        """Flush from another thread (the exit guard's), unless a flush under way does not end within `timeout_s`
        or the file is closed: whether it flushed."""
        if not self._flushing.acquire(timeout=timeout_s):
            return False
        try:
            if self._fd is None:
                return False
            self._flush()
            return True
        finally:
            self._flushing.release()

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        comp = self._cctx.compress(_encoder.encode(batch))
        self._write(_batch_bytes(comp, len(batch)))
        self.written += len(batch)
        if self._lockfile is not None:
            self._lockfile.touch()

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)  # releases the lock
            self._fd = None
            if self._lockfile is not None:
                self._lockfile.release()
                self._lockfile = None


class DoneManifest(msgspec.Struct):
    shard: int
    fingerprint: str
    records: int                 # distinct ids (the newest record of each)
    ok: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    bytes: int
    sha256: str
    host: str
    finished: str
    transient: int = 0           # failed records worth generating again: while > 0 the shard is not complete
    superseded: int = 0          # older records of ids written again (kept in the file, not counted above)


def needs_work(m: DoneManifest | None) -> bool:
    """Whether a shard with this done manifest still has prompts to generate (none, or transient failures)."""
    return m is None or m.transient > 0


def write_done(path: Path, shard_path: Path, shard: int, fingerprint: str, *, positions: range | None = None) -> DoneManifest:
    """Count (newest record per id) and checksum a complete shard file and atomically write its `done` manifest.

    `positions`, the shard's planned positions, lets the newest record of each be told with one byte per prompt
    (records outside them are ignored) rather than a dict of ids.
    """
    if positions is not None:
        totals, total = _count_positions(shard_path, positions)
    else:
        counts, total = _IdCounts(), 0
        for r in read_shard(shard_path):
            total += 1
            counts.add(r)
        totals = counts.totals()
    ok, failed, transient, ptok, otok = totals.ok, totals.failed, totals.transient, totals.ptok, totals.otok
    m = DoneManifest(
        shard=shard, fingerprint=fingerprint, records=ok + failed, ok=ok, failed=failed, prompt_tokens=ptok,
        output_tokens=otok, bytes=shard_path.stat().st_size, sha256=sha256_file(shard_path), host=socket.gethostname(),
        finished=utc_now(),
        transient=transient, superseded=total - ok - failed,
    )
    atomic_write(path, msgspec.json.encode(m))
    return m


class _Totals:
    """What a done manifest counts of the records that count (the newest of each id)."""

    def __init__(self) -> None:
        self.ok = self.failed = self.transient = self.ptok = self.otok = 0

    def add(self, r: Record) -> None:
        if r.status == OK:
            self.ok += 1
        else:
            self.failed += 1
            self.transient += is_transient(r)
        self.ptok += r.n_prompt
        self.otok += r.n_output


class _IdCounts:
    """The newest record's state per id, in a dict."""

    def __init__(self) -> None:
        self.newest: dict[str, tuple[bool, bool, int, int]] = {}

    def add(self, r: Record) -> None:
        self.newest[r.id] = (r.status == OK, is_transient(r), r.n_prompt, r.n_output)

    def totals(self) -> _Totals:
        t = _Totals()
        for ok, transient, ptok, otok in self.newest.values():
            t.ok += ok
            t.failed += not ok
            t.transient += transient
            t.ptok += ptok
            t.otok += otok
        return t


def _count_positions(shard_path: Path, positions: range) -> tuple[_Totals, int]:
    """(totals of the newest record of each planned position, records read), with one byte per position: how many
    records it has. While no position has two, one pass counts; else a second pass counts, for each position,
    the record after which it has none left."""
    first, n = positions.start, len(positions)
    seen = bytearray(n)
    more: dict[int, int] = {}  # positions with 255 records or more: their count (seen says 255)
    once, total, again = _Totals(), 0, False
    for r in read_shard(shard_path):
        total += 1
        i = r.index - first
        if not 0 <= i < n:
            continue
        if seen[i] == 255:
            more[i] = more.get(i, 255) + 1
        else:
            seen[i] += 1
        if seen[i] > 1:
            again = True
        elif not again:
            once.add(r)
    if not again:
        return once, total
    newest = _Totals()
    for r in read_shard(shard_path):
        i = r.index - first
        if not 0 <= i < n:
            continue
        if seen[i] == 255 and i in more:
            more[i] -= 1
            left = more[i]
        else:
            seen[i] -= 1
            left = seen[i]
        if not left:
            newest.add(r)
    return newest, total


def verify_done(m: DoneManifest, shard_path: Path) -> str | None:
    """None when the shard file is exactly what its done manifest describes, else what differs."""
    try:
        size = shard_path.stat().st_size
    except FileNotFoundError:
        return f"{shard_path} is gone"
    if size != m.bytes:
        return f"{shard_path} has {size} bytes, its done manifest says {m.bytes}"
    sha = sha256_file(shard_path)
    if sha != m.sha256:
        return f"{shard_path}'s sha256 is {sha[:12]}, its done manifest says {m.sha256[:12]}"
    return None


class RetryRequest(msgspec.Struct):
    """Ids to generate again although they are recorded (`toolkit retry`): those whose newest record lies
    before byte `before` of the shard file (records written since are the retry's own)."""

    before: int
    ids: list[str]


def write_retry(path: Path, request: RetryRequest) -> None:
    atomic_write(path, msgspec.json.encode(request))


def read_retry(path: Path) -> RetryRequest | None:
    """The retry request of a shard; None when there is none, or when it is damaged (said once, in one line)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=RetryRequest)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as e:  # (ValidationError included)
        _damaged_once(path, f"damaged retry request ({_why(e)}): ignored, so the ids it named are not generated "
                            "again; ask again with `toolkit retry RUN --ids FILE`")
        return None


def read_done(path: Path) -> DoneManifest | None:
    """The done manifest of a shard; None when there is none, or when it is damaged (said once, in one line): the
    shard is then not taken as finished, and its next run checks its file and writes the manifest again."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=DoneManifest)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as e:  # (ValidationError included)
        _damaged_once(path, f"damaged done manifest ({_why(e)}): the shard is taken as not finished; its next run "
                            "checks its file and writes the manifest again")
        return None


_said_damaged: set[str] = set()


def _damaged_once(path: Path, message: str) -> None:
    """A damaged small file, said once per process (status --watch reads it every refresh)."""
    key = f"{path}:{message}"
    if key not in _said_damaged:
        _said_damaged.add(key)
        log.warning("%s: %s", path, message)


def _why(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
