"""Shard files: append-only, crash-safe files of records, and the `done` manifest of a finished shard.

A shard file is a plain sequence of zstd frames, so `zstd -dc` reads it: a skippable header frame carrying
the run fingerprint, then for every batch of records a small skippable frame (length, record count, CRC32)
followed by one zstd frame holding the msgpack-encoded batch. A batch is written with one `write` and
fsynced, so a crash at any instruction leaves at most a torn last batch, which `open_shard` detects and
cuts off. A writer holds an exclusive lock on the file: two tasks never interleave frames.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import logging
import os
import socket
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import zstandard

from .files import atomic_write, fsync_dir
from .records import Record

__all__ = [
    "CorruptShard",
    "DoneManifest",
    "Frame",
    "ShardWriter",
    "iter_frames",
    "read_done",
    "read_frame_at",
    "read_shard",
    "write_done",
]

log = logging.getLogger(__name__)

_HEAD_MAGIC = 0x184D2A5E   # zstd skippable frame: file header
_BATCH_MAGIC = 0x184D2A5F  # zstd skippable frame: describes the data frame that follows
_FILE_TAG = b"TKSH"
_BATCH_TAG = b"TKFR"
FORMAT = 1
_SKIP = struct.Struct("<II")             # magic, payload size
_HEAD = struct.Struct("<4sH16sI")        # tag, format, fingerprint, shard
_BATCH = struct.Struct("<4sIII")         # tag, compressed size, records, crc32 of the compressed frame

_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[Record])


class CorruptShard(Exception):
    """A shard file with a damaged frame that is not its last one; names the file and byte offset."""

    def __init__(self, path: Path, offset: int, why: str):
        self.path, self.offset, self.why = path, offset, why
        super().__init__(f"{path}: damaged frame at byte {offset}: {why}")


class Frame(msgspec.Struct):
    offset: int      # byte offset of the batch's descriptor
    end: int         # byte offset just past its data frame
    records: int
    data: bytes      # decompressed msgpack batch


def _header_bytes(fingerprint: str, shard: int) -> bytes:
    payload = _HEAD.pack(_FILE_TAG, FORMAT, fingerprint.encode().ljust(16, b"\0")[:16], shard)
    return _SKIP.pack(_HEAD_MAGIC, len(payload)) + payload


def read_header(path: Path) -> tuple[str, int] | None:
    with open(path, "rb") as f:
        raw = f.read(_SKIP.size + _HEAD.size)
    if len(raw) < _SKIP.size + _HEAD.size:
        return None
    magic, size = _SKIP.unpack_from(raw)
    tag, fmt, fp, shard = _HEAD.unpack_from(raw, _SKIP.size)
    if magic != _HEAD_MAGIC or tag != _FILE_TAG or size != _HEAD.size:
        raise CorruptShard(path, 0, "not a shard file (bad header)")
    if fmt != FORMAT:
        raise CorruptShard(path, 0, f"shard format {fmt}, this toolkit reads {FORMAT}")
    return fp.rstrip(b"\0").decode(), shard


def iter_frames(path: str | Path, *, tail: list | None = None) -> Iterator[Frame]:
    """Yield every complete batch frame, decompressed, in file order, reading one frame at a time.

    A damaged or incomplete LAST frame ends the iteration and is described in `tail` (a list that receives
    `(offset, why)`), since that is what a crash mid-write leaves. Damage anywhere else raises CorruptShard.
    """
    path = Path(path)
    dctx = zstandard.ZstdDecompressor()
    with open(path, "rb") as f:
        n = os.fstat(f.fileno()).st_size
        pos = _SKIP.size + _HEAD.size
        if n < pos:
            if n and tail is not None:
                tail.append((0, "incomplete header"))
            return
        read_header(path)
        f.seek(pos)
        desc_size = _SKIP.size + _BATCH.size
        while pos < n:
            start, why = pos, None
            desc = f.read(desc_size)
            if len(desc) < desc_size:
                why = "incomplete batch descriptor"
            else:
                magic, size = _SKIP.unpack_from(desc)
                tag, clen, count, crc = _BATCH.unpack_from(desc, _SKIP.size)
                if magic != _BATCH_MAGIC or size != _BATCH.size or tag != _BATCH_TAG:
                    why = "bad batch descriptor"
                elif start + desc_size + clen > n:
                    why = f"incomplete data frame ({n - start - desc_size} of {clen} bytes)"
                else:
                    comp = f.read(clen)
                    if zlib.crc32(comp) != crc:
                        why = "checksum mismatch"
                    else:
                        try:
                            raw = dctx.decompress(comp)
                        except zstandard.ZstdError as e:
                            why = f"zstd error: {e}"
                        else:
                            pos = start + desc_size + clen
                            yield Frame(start, pos, count, raw)
                            continue
            # A damaged frame is a torn tail only if nothing valid follows it.
            f.seek(start + 1)
            if _valid_frame_after(f.read()):
                raise CorruptShard(path, start, why)
            if tail is not None:
                tail.append((start, why))
            return


def read_frame_at(path: str | Path, offset: int) -> Frame:
    """The batch frame whose descriptor starts at byte `offset` (a `Frame.offset`), decompressed.

    Random access for readers that come back to a frame `iter_frames` showed them; damage raises CorruptShard.
    """
    path = Path(path)
    desc_size = _SKIP.size + _BATCH.size
    with open(path, "rb") as f:
        f.seek(offset)
        desc = f.read(desc_size)
        if len(desc) < desc_size:
            raise CorruptShard(path, offset, "incomplete batch descriptor")
        magic, size = _SKIP.unpack_from(desc)
        tag, clen, count, crc = _BATCH.unpack_from(desc, _SKIP.size)
        if magic != _BATCH_MAGIC or size != _BATCH.size or tag != _BATCH_TAG:
            raise CorruptShard(path, offset, "bad batch descriptor")
        comp = f.read(clen)
    if len(comp) < clen:
        raise CorruptShard(path, offset, f"incomplete data frame ({len(comp)} of {clen} bytes)")
    if zlib.crc32(comp) != crc:
        raise CorruptShard(path, offset, "checksum mismatch")
    try:
        raw = zstandard.ZstdDecompressor().decompress(comp)
    except zstandard.ZstdError as e:
        raise CorruptShard(path, offset, f"zstd error: {e}") from None
    return Frame(offset, offset + desc_size + clen, count, raw)


def _valid_frame_after(data: bytes) -> bool:
    """Whether `data` (the rest of a file) holds a complete, intact batch frame."""
    marker = _SKIP.pack(_BATCH_MAGIC, _BATCH.size) + _BATCH_TAG
    i = data.find(marker)
    while i != -1:
        _, clen, _, crc = _BATCH.unpack_from(data, i + _SKIP.size)
        body = i + _SKIP.size + _BATCH.size
        if body + clen <= len(data) and zlib.crc32(data[body : body + clen]) == crc:
            return True
        i = data.find(marker, i + 1)
    return False


def decode_batch(frame: Frame) -> list[Record]:
    return _batch_decoder.decode(frame.data)


def read_shard(path: str | Path) -> Iterator[Record]:
    """Every record of a shard file, in the order written (a torn last frame is ignored)."""
    for frame in iter_frames(path):
        yield from decode_batch(frame)


class ShardWriter:
    """Appends batches of records to one shard file; resumes a file left by an earlier (killed) attempt.

    Open it with `open()`: it locks the file, checks the fingerprint, cuts off a torn last frame and
    returns the ids already written, so the caller generates only the rest.
    """

    def __init__(self, path: str | Path, fingerprint: str, shard: int, *, flush_records: int = 64,
                 flush_seconds: float = 10.0, level: int = 3):
        self.path = Path(path)
        self.fingerprint, self.shard = fingerprint, shard
        self.flush_records, self.flush_seconds = flush_records, flush_seconds
        self._cctx = zstandard.ZstdCompressor(level=level)
        self._pending: list[Record] = []
        self._last_flush = time.monotonic()
        self._fd: int | None = None
        self.written = 0  # records in the file (before + this session)

    def open(self) -> dict[str, Record | None]:
        """Lock and recover the file; return {id: None} for every id already recorded (records not kept)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"{self.path} is locked by another worker of this shard (a task still running, or a requeue "
                "racing the old one); wait for it to end or cancel it"
            ) from None
        self._fd = fd
        size = os.fstat(fd).st_size
        done: dict[str, Record | None] = {}
        if size == 0:
            self._write(_header_bytes(self.fingerprint, self.shard))
            fsync_dir(self.path.parent)
            return done
        head = read_header(self.path)
        if head is None:  # killed while writing the header itself
            os.ftruncate(fd, 0)
            self._write(_header_bytes(self.fingerprint, self.shard))
            return done
        fp, shard = head
        if fp != self.fingerprint or shard != self.shard:
            raise RuntimeError(
                f"{self.path} belongs to run {fp} shard {shard}, not run {self.fingerprint} shard {self.shard}; "
                "this run directory was planned for another job: use a new output_dir or --new-run"
            )
        tail: list = []
        for frame in iter_frames(self.path, tail=tail):
            for r in decode_batch(frame):
                done[r.id] = None
        if tail:
            off, why = tail[0]
            log.warning("%s: dropping a torn last frame at byte %d (%s); its records will be generated again",
                        self.path, off, why)
            os.ftruncate(fd, off)
            os.fsync(fd)
        self.written = len(done)
        return done

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        os.fsync(self._fd)

    def add(self, record: Record) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.flush_records:
            self.flush()

    def due(self) -> bool:
        return bool(self._pending) and time.monotonic() - self._last_flush >= self.flush_seconds

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        comp = self._cctx.compress(_encoder.encode(batch))
        desc = _BATCH.pack(_BATCH_TAG, len(comp), len(batch), zlib.crc32(comp))
        self._write(_SKIP.pack(_BATCH_MAGIC, _BATCH.size) + desc + comp)
        self.written += len(batch)

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)  # releases the lock
            self._fd = None


class DoneManifest(msgspec.Struct):
    shard: int
    fingerprint: str
    records: int
    ok: int
    failed: int
    prompt_tokens: int
    output_tokens: int
    bytes: int
    sha256: str
    host: str
    finished: str


def write_done(path: Path, shard_path: Path, shard: int, fingerprint: str) -> DoneManifest:
    """Count and checksum a complete shard file and atomically write its `done` manifest."""
    ok = failed = ptok = otok = 0
    for r in read_shard(shard_path):
        if r.status == "ok":
            ok += 1
        else:
            failed += 1
        ptok += r.n_prompt
        otok += r.n_output
    h = hashlib.sha256(shard_path.read_bytes()).hexdigest()
    m = DoneManifest(
        shard=shard, fingerprint=fingerprint, records=ok + failed, ok=ok, failed=failed, prompt_tokens=ptok,
        output_tokens=otok, bytes=shard_path.stat().st_size, sha256=h, host=socket.gethostname(),
        finished=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )
    atomic_write(path, msgspec.json.encode(m))
    return m


def read_done(path: Path) -> DoneManifest | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=DoneManifest)
    except FileNotFoundError:
        return None
