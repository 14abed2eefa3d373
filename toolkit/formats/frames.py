"""The frame format of shard files, and every reader of it.

A shard file is a plain sequence of zstd frames, so `zstd -dc` reads it: a skippable header frame
carrying the run fingerprint, then for every batch of records a small skippable frame, the
descriptor (length, record count, CRC32 of the data frame, and — since format 2 — a CRC32 of those
fields themselves) followed by one zstd frame holding the msgpack-encoded batch (the writer is
formats.shardfile).

Every reader (the worker's resume, `read_shard`, merge, audit, export) judges a frame through one
function, `read_frame`: descriptor marker and checksum, data checksum, zstd, msgpack, and the record
count. `scan` walks a file past damaged frames, finding the next intact one by its marker, so a
damaged frame costs only its records; `intact_frames` is that walk as a merge uses it (the intact
frames, the damage noted aside).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec
import zstandard

from toolkit.formats.records import Record

log = logging.getLogger(__name__)


_HEAD_MAGIC = 0x184D2A5E  # zstd skippable frame: file header
_BATCH_MAGIC = 0x184D2A5F  # zstd skippable frame: describes the data frame that follows
_FILE_TAG = b"TKSH"
_BATCH_TAG = b"TKFR"
# written; format 1 files (descriptors without their own CRC) are read
FORMAT = 2
READS = (1, 2)
_SKIP = struct.Struct("<II")  # magic, payload size
_HEAD = struct.Struct("<4sH16sI")  # tag, format, fingerprint, shard
_BATCH1 = struct.Struct("<4sIII")  # format 1: tag, compressed size, records, crc32 of the
# compressed frame
_BATCH = struct.Struct("<4sIIII")  # format 2: the same, then crc32 of those 16 bytes
_DESC_SIZES = (_BATCH.size, _BATCH1.size)
_MARKER = _BATCH_MAGIC.to_bytes(4, "little")

batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[Record])


class CorruptShard(Exception):
    """A shard file with a damaged frame that is not its last one; names the file and byte
    offset."""

    def __init__(self, path: Path, offset: int, why: str):
        self.path, self.offset, self.why = path, offset, why
        super().__init__(f"{path}: damaged frame at byte {offset}: {why}")


class FrameError(Exception):
    """The frame at an offset is not intact; the message says why."""


class Frame(msgspec.Struct):
    offset: int  # byte offset of the batch's descriptor
    end: int  # byte offset just past its data frame
    records: int
    data: bytes  # decompressed msgpack batch
    batch: list[Record] = []  # the decoded records (checked: as many as the descriptor says)


class Damage(msgspec.Struct):
    """Bytes of a shard file that hold no intact frame: from `offset` to `end` (the next intact
    frame, or EOF)."""

    offset: int
    end: int
    why: str
    torn: bool  # nothing intact follows: what a crash mid-write leaves


def header_bytes(fingerprint: str, shard: int) -> bytes:
    payload = _HEAD.pack(_FILE_TAG, FORMAT, fingerprint.encode().ljust(16, b"\0")[:16], shard)
    return _SKIP.pack(_HEAD_MAGIC, len(payload)) + payload


def batch_bytes(comp: bytes, count: int) -> bytes:
    fields = _BATCH1.pack(_BATCH_TAG, len(comp), count, zlib.crc32(comp))
    return (
        _SKIP.pack(_BATCH_MAGIC, _BATCH.size)
        + fields
        + struct.pack("<I", zlib.crc32(fields))
        + comp
    )


HEADER_SIZE = _SKIP.size + _HEAD.size
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")  # what plan.fingerprint looks like


def damaged_fingerprint(fp: str, ours: str) -> bool:
    """Whether a header's fingerprint other than `ours` is ours with a damaged byte (or two), rather
    than another run's: not a fingerprint at all, or ours but for a character or two (another run's
    differs almost everywhere). Ours with another shard number is a damaged byte too."""
    return (
        not _FINGERPRINT.fullmatch(fp)
        or len(fp) == len(ours)
        and sum(a != b for a, b in zip(fp, ours)) <= 2
    )


def read_header(path: Path) -> tuple[str, int] | None:
    with open(path, "rb") as f:
        raw = f.read(HEADER_SIZE)
    if len(raw) < HEADER_SIZE:
        return None
    magic, size = _SKIP.unpack_from(raw)
    tag, fmt, fp, shard = _HEAD.unpack_from(raw, _SKIP.size)
    if magic != _HEAD_MAGIC or tag != _FILE_TAG or size != _HEAD.size:
        raise CorruptShard(path, 0, "not a shard file (bad header)")
    if fmt not in READS:
        raise CorruptShard(
            path, 0, f"shard format {fmt}, this toolkit reads formats {', '.join(map(str, READS))}"
        )
    try:
        return fp.rstrip(b"\0").decode("ascii"), shard
    except UnicodeDecodeError:
        raise CorruptShard(path, 0, f"damaged header (fingerprint {fp!r})") from None


def read_frame(
    f: BinaryIO, offset: int, size: int, dctx: zstandard.ZstdDecompressor | None = None
) -> Frame:
    """Judge and read the batch frame whose descriptor starts at `offset` of the open file `f`
    (`size` bytes).

    The one place a frame is judged: descriptor (marker, tag, its own CRC in format 2), data frame
    (length, CRC32, zstd), batch (msgpack, record count). Raises FrameError saying what is wrong.
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
    if (
        tag != _BATCH_TAG
        or dsize == _BATCH.size
        and zlib.crc32(desc[: _BATCH1.size]) != _BATCH.unpack(desc)[4]
    ):
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
    """The first intact frame starting after byte `after`, found by its marker (reading in
    chunks)."""
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
    """Every intact frame of a shard file, in file order, and a Damage for each stretch between them
    that holds none (the last one `torn` when nothing intact follows it). A bad header raises
    CorruptShard at byte 0 (with `header` False it is not read: the frames after it are, for a
    salvage)."""
    path = Path(path)
    dctx = zstandard.ZstdDecompressor()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_SIZE:
            if size:
                yield Damage(0, size, "incomplete header", True)
            return
        if header:
            read_header(path)
        pos = HEADER_SIZE
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

    A damaged or incomplete LAST frame ends the iteration and is described in `tail` (a list that
    receives `(offset, why)`), since that is what a crash mid-write leaves. Damage anywhere else
    raises CorruptShard (`scan` reads past it).
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


def intact_frames(
    path: str | Path, damage: list[Damage], *, header: bool = True
) -> Iterator[Frame]:
    """Every intact frame of a shard file, reading on past damaged ones (`scan`): what a merge
    salvages.

    Each damaged stretch is appended to `damage` (the last one `torn` when nothing intact follows
    it); a bad header is appended as one damaged stretch from byte 0 to the end, and no frame is
    read — unless `header` is False (the caller judged the header damaged, not another run's): then
    the frames after it are read, as the worker's salvage keeps them (shardfile.ShardWriter.open).
    """
    path = Path(path)
    try:
        for item in scan(path, header=header):
            if isinstance(item, Damage):
                damage.append(item)
            else:
                yield item
    except CorruptShard as e:
        damage.append(Damage(e.offset, path.stat().st_size, e.why, False))


def read_frame_at(path: str | Path, offset: int) -> Frame:
    """The batch frame whose descriptor starts at byte `offset` (a `Frame.offset`), decoded.

    Random access for readers that come back to a frame `scan` showed them; damage raises
    CorruptShard.
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
