"""Shard files: torn tails are cut off, damage elsewhere is salvaged, every reader judges frames alike, writers
are exclusive."""

import errno
import fcntl
import os
import random
import socket
import struct
import subprocess
import sys
import time
import zlib

import msgspec
import pytest
import zstandard

import toolkit.formats.shardfile as sf
from toolkit.formats import frames, locks
from toolkit.formats.frames import (
    CorruptShard,
    Damage,
    intact_frames,
    iter_frames,
    read_shard,
    scan,
)
from toolkit.formats.locks import ShardLocked
from toolkit.formats.manifests import read_done, verify_done, write_done
from toolkit.formats.records import (
    OK,
    PARTIAL,
    Record,
    failed_record,
    is_transient,
    pack_ids,
    unpack_ids,
)
from toolkit.formats.shardfile import ForeignShard, ShardWriter


def rec(i: int) -> Record:
    out = [(i * 7 + k) % 5000 for k in range(50 + i)]
    return Record(
        id=f"p{i}",
        dataset="d",
        index=i,
        status=OK,
        prompt_ids=pack_ids([1, 2, i]),
        output_ids=pack_ids(out),
        reasoning_end=3,
        tool_call_at=None,
        finish="stop",
        matched_stop=out[-1],
        prompt_tokens=3,
        completion_tokens=len(out),
        cached_tokens=0,
        latency_s=0.5,
        attempts=1,
    )


PLANNED = range(64)  # the planned positions of the shard these tests write


def write(path, records, batch=4, fp="f" * 16):
    w = ShardWriter(path, fp, 0, flush_records=batch)
    done = w.open(PLANNED).done
    for r in records:
        w.add(r)
    w.close()
    return done


def test_roundtrip_and_zstd_compatible(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(10)])
    back = list(read_shard(path))
    assert back == [rec(i) for i in range(10)]
    assert unpack_ids(back[3].output_ids) == [(3 * 7 + k) % 5000 for k in range(53)]
    assert [f.records for f in iter_frames(path)] == [4, 4, 2]
    # Plain zstd frames: a standard decoder reads the file, skipping the toolkit's skippable frames.
    import io

    import zstandard

    stream = zstandard.ZstdDecompressor().stream_reader(
        io.BytesIO(path.read_bytes()), read_across_frames=True
    )
    assert stream.read() == b"".join(f.data for f in iter_frames(path))


def test_reopen_returns_done_ids_and_appends(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(6)])
    done = write(path, [rec(i) for i in range(6, 9)])
    assert set(done) == {f"p{i}" for i in range(6)}
    assert [r.id for r in read_shard(path)] == [f"p{i}" for i in range(9)]


def test_torn_tail_at_every_cut_is_dropped_and_nothing_else(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(12)])
    full = path.read_bytes()
    ends = [f.end for f in iter_frames(path)]
    rng = random.Random(1)
    cuts = sorted(rng.sample(range(30, len(full)), 40)) + [e - 1 for e in ends]
    for cut in cuts:
        path.write_bytes(full[:cut])
        complete = sum(1 for e in ends if e <= cut)
        w = ShardWriter(path, "f" * 16, 0)
        done = w.open(PLANNED).done
        assert len(done) == 4 * complete, cut
        w.close()
        assert path.stat().st_size == max(
            [e for e in ends if e <= cut], default=path.stat().st_size
        )


def test_corrupt_middle_frame_is_loud_for_readers_and_salvaged_on_resume(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(12)])
    frames = list(iter_frames(path))
    data = bytearray(path.read_bytes())
    data[frames[1].offset + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShard) as e:
        list(read_shard(path))
    assert e.value.offset == frames[1].offset and "s.zst" in str(e.value)
    items = list(scan(path))
    assert [type(i).__name__ for i in items] == ["Frame", "Damage", "Frame"]
    assert (
        items[1].offset == frames[1].offset
        and items[1].end == frames[2].offset
        and not items[1].torn
    )

    w = ShardWriter(path, "f" * 16, 0)
    found = w.open(PLANNED)  # keeps frames 0 and 2, drops only frame 1's four records
    assert set(found.done) == {f"p{i}" for i in (0, 1, 2, 3, 8, 9, 10, 11)}
    for i in range(4, 8):
        w.add(rec(i))
    w.close()
    assert sorted(r.index for r in read_shard(path)) == list(range(12))  # the file is whole again
    kept = list(tmp_path.glob("s.zst.damaged-*"))
    assert kept == [found.damaged] and kept[0].read_bytes() == bytes(
        data
    )  # the original, untouched, for inspection
    assert not list(tmp_path.glob(".*"))  # no temporary file left


def test_intact_frames_reads_on_past_a_damaged_middle_frame_and_notes_a_torn_end(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(16)])
    frames = list(iter_frames(path))
    data = bytearray(path.read_bytes())
    data[frames[1].offset + 40] ^= 0xFF
    path.write_bytes(bytes(data[: frames[3].end - 5]))  # and the last frame cut short
    damage: list[Damage] = []
    kept = list(intact_frames(path, damage))
    assert [f.offset for f in kept] == [frames[0].offset, frames[2].offset]
    assert [r.index for f in kept for r in f.batch] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert [(d.offset, d.torn) for d in damage] == [
        (frames[1].offset, False),
        (frames[3].offset, True),
    ]
    assert damage[0].end == frames[2].offset and "checksum" in damage[0].why


def test_intact_frames_of_an_intact_file_note_no_damage(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(10)])
    damage: list[Damage] = []
    assert [f.records for f in intact_frames(path, damage)] == [4, 4, 2] and damage == []


def test_intact_frames_of_a_file_with_a_bad_header_yield_nothing_and_note_it(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(8)])
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    path.write_bytes(bytes(data))
    damage: list[Damage] = []
    assert list(intact_frames(path, damage)) == []
    assert (
        len(damage) == 1
        and damage[0].offset == 0
        and damage[0].end == len(data)
        and not damage[0].torn
    )
    assert "bad header" in damage[0].why


def _flip_count(path, frame_no: int) -> None:
    frame = list(iter_frames(path))[frame_no]
    data = bytearray(path.read_bytes())
    data[frame.offset + 8 + 8] ^= (
        0x01  # the record count in the descriptor (after magic, size, tag, length)
    )
    path.write_bytes(bytes(data))


def test_a_bit_flip_in_the_record_count_is_caught_by_every_reader(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(12)])
    _flip_count(path, 1)
    with pytest.raises(CorruptShard, match="descriptor"):
        list(read_shard(path))
    damage = [i for i in scan(path) if isinstance(i, Damage)]
    assert len(damage) == 1 and "descriptor" in damage[0].why
    w = ShardWriter(path, "f" * 16, 0)
    assert set(w.open(PLANNED).done) == {
        f"p{i}" for i in (0, 1, 2, 3, 8, 9, 10, 11)
    }  # the frame's records are redone
    w.close()


def _write_format1(path, records, batch=4, fp="f" * 16):
    """A shard file as format 1 wrote it: descriptors without their own CRC."""
    out = struct.pack("<II", 0x184D2A5E, 26) + struct.pack("<4sH16sI", b"TKSH", 1, fp.encode(), 0)
    cctx = zstandard.ZstdCompressor(level=3)
    for k in range(0, len(records), batch):
        comp = cctx.compress(msgspec.msgpack.encode(records[k : k + batch]))
        out += (
            struct.pack("<II", 0x184D2A5F, 16)
            + struct.pack(
                "<4sIII", b"TKFR", len(comp), len(records[k : k + batch]), zlib.crc32(comp)
            )
            + comp
        )
    path.write_bytes(out)


def test_format_1_files_are_read_and_resumed(tmp_path):
    path = tmp_path / "s.zst"
    _write_format1(path, [rec(i) for i in range(6)])
    assert list(read_shard(path)) == [rec(i) for i in range(6)]
    done = write(path, [rec(i) for i in range(6, 9)])
    assert set(done) == {f"p{i}" for i in range(6)}
    assert list(read_shard(path)) == [rec(i) for i in range(9)]


def test_the_newest_record_of_an_id_counts(tmp_path):
    path = tmp_path / "s.zst"
    timeout = failed_record("p1", "d", 1, [1, 2], "no answer within 1 s", 2, failure="timeout")
    rejected = failed_record("p2", "d", 2, [1, 2], "HTTP 400: too long", 1, failure="rejected")
    write(path, [rec(0), timeout, rejected, rec(3)])
    w = ShardWriter(path, "f" * 16, 0)
    found = w.open(PLANNED)
    assert set(found.done) == {"p0", "p1", "p2", "p3"} and found.transient == {
        "p1"
    }  # only the transient one is redone
    w.add(rec(1))
    w.close()
    w = ShardWriter(path, "f" * 16, 0)
    found = w.open(PLANNED)
    w.close()
    assert found.transient == set() and w.written == 5
    m = write_done(tmp_path / "s.done", path, 0, "f" * 16, positions=range(0, 4))
    assert (m.records, m.ok, m.failed, m.transient, m.superseded) == (4, 3, 1, 0, 1)
    assert verify_done(read_done(tmp_path / "s.done"), path) is None
    with open(path, "ab") as f:
        f.write(b"x")
    assert "bytes" in verify_done(m, path)


def test_done_counts_the_newest_record_of_each_planned_position(tmp_path):
    """write_done counts the newest record of each of the shard's positions (formats.newest): records written again
    (once, or 300 times), a failure superseded by an ok record and the reverse, records outside the positions
    ignored (counted superseded); one pass while no position has two records."""
    path = tmp_path / "s.zst"
    timeout = failed_record("p1", "d", 1, [1, 2], "no answer", 2, failure="timeout")
    late_fail = failed_record("p4", "d", 4, [1, 2], "no answer", 2, failure="timeout")
    stray = msgspec.structs.replace(rec(9), id="x", index=99)
    written = (
        [rec(0), timeout, rec(2), rec(3), rec(4), rec(1), late_fail, stray]
        + [rec(5)] * 300
        + [rec(6)]
    )
    write(path, written)
    m = write_done(tmp_path / "b.done", path, 0, "f" * 16, positions=range(0, 7))
    newest = {r.index: r for r in written if r.index < 7}
    assert (m.records, m.ok, m.failed, m.transient) == (7, 6, 1, 1)
    assert m.prompt_tokens == sum(r.n_prompt for r in newest.values())
    assert m.output_tokens == sum(r.n_output for r in newest.values())
    assert m.superseded == 1 + 1 + 299 + 1  # p1, p4, p5 x 299, and the stray record
    path2 = tmp_path / "once.zst"
    write(path2, [rec(0), timeout, rec(2)])
    m = write_done(tmp_path / "c.done", path2, 0, "f" * 16, positions=range(0, 3))
    assert (m.records, m.ok, m.failed, m.transient, m.superseded) == (3, 2, 1, 1, 0)


def test_a_writer_whose_write_failed_writes_nothing_more(tmp_path, monkeypatch):
    path = tmp_path / "00000.zst"
    w = ShardWriter(path, "f" * 16, 0, flush_records=2)
    w.open(range(0, 6))
    w.add(rec(0))
    w.add(rec(1))  # one intact batch
    real, writes = os.write, []

    def torn(fd, data):
        writes.append(len(data))
        if len(writes) == 1:
            real(fd, bytes(data)[:5])  # a torn frame, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(sf.os, "write", torn)
    w.add(rec(2))
    with pytest.raises(OSError):
        w.add(rec(3))
    w.add(rec(4))
    assert not w.due() and not w.flush_within(1.0)
    with pytest.raises(OSError) as e:
        w.flush()  # even with nothing pending: what it lost is not in the file
    assert e.value.errno == errno.ENOSPC
    w.close()
    assert len(writes) == 1
    monkeypatch.setattr(sf.os, "write", real)
    again = ShardWriter(path, "f" * 16, 0)
    assert sorted(again.open(range(0, 6)).done) == [rec(0).id, rec(1).id]  # the torn frame cut off
    again.close()


def test_fingerprint_mismatch_refused(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(0)])
    with pytest.raises(ForeignShard, match="belongs to run ffffffffffffffff"):
        ShardWriter(path, "a" * 16, 0).open(PLANNED)


def test_second_writer_is_refused(tmp_path):
    path = tmp_path / "s.zst"
    w = ShardWriter(path, "f" * 16, 0)
    w.open(PLANNED)
    code = f"""
import sys
from toolkit.formats.locks import ShardLocked
from toolkit.formats.shardfile import ShardWriter
try:
    ShardWriter({str(path)!r}, "f" * 16, 0).open(range(64))
except ShardLocked as e:
    print(e); sys.exit(7)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    w.close()
    assert r.returncode == 7 and "locked by another worker" in r.stdout


# ---------------------------------------------------------------------------------------------------
# file systems without flock (older NFS, Lustre without -o flock): a lock file stands in (`no_flock`: conftest)
# ---------------------------------------------------------------------------------------------------


def lock_info(path) -> dict:
    return msgspec.json.decode((path.parent / (path.name + ".lock")).read_bytes())


def test_without_flock_a_lock_file_keeps_one_writer_per_shard(tmp_path, no_flock):
    path = tmp_path / "00000.zst"
    w = ShardWriter(path, "f" * 16, 0, flush_records=1)
    w.open(PLANNED)
    info = lock_info(path)
    assert (
        info["host"] == socket.gethostname() and info["pid"] == os.getpid() and info["started"] > 0
    )
    with pytest.raises(
        ShardLocked, match=rf"pid {os.getpid()} on this host holds it .* rm {path}.lock"
    ):
        ShardWriter(path, "f" * 16, 0).open(PLANNED)
    w.add(rec(0))
    w.close()
    assert not (tmp_path / "00000.zst.lock").exists(), "released with the writer"
    assert write(path, [rec(1)]) == {"p0": frames.HEADER_SIZE}
    assert [r.id for r in read_shard(path)] == ["p0", "p1"]


def test_a_stale_lock_file_is_taken_over_and_a_live_one_on_another_host_refused(tmp_path, no_flock):
    path = tmp_path / "00000.zst"
    lock = tmp_path / "00000.zst.lock"
    gone = subprocess.Popen(["true"])
    gone.wait()
    lock.write_bytes(
        msgspec.json.encode({"host": socket.gethostname(), "pid": gone.pid, "started": 1.0})
    )
    write(path, [rec(0)])  # same host, pid gone: taken over
    assert not lock.exists()
    lock.write_bytes(
        msgspec.json.encode({"host": "gpu-17", "pid": 4242, "started": time.time(), "since": "now"})
    )
    with pytest.raises(ShardLocked) as e:
        ShardWriter(path, "f" * 16, 0).open(PLANNED)
    msg = str(e.value)
    assert (
        "pid 4242 on host gpu-17 holds it since now" in msg
        and f"rm {lock}" in msg
        and "\n" not in msg
    )
    old = time.time() - locks.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    write(path, [rec(1)])  # another host's lock untouched for longer than the bound: taken over
    assert [r.id for r in read_shard(path)] == ["p0", "p1"] and not lock.exists()


def test_a_second_worker_of_a_shard_fails_in_one_line(tmp_path, toy_tokenizer, capsys, caplog):
    from jobfiles import make_job, prepared_run
    from toolkit.cli import main

    rd, plan = prepared_run(make_job(tmp_path, toy_tokenizer("kimi"), n=4))
    for flockless in (False, True):
        mp = pytest.MonkeyPatch()
        if flockless:
            mp.setattr(
                fcntl,
                "flock",
                lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOTSUP, "Not supported")),
            )
        try:
            holder = ShardWriter(rd.shard_file(0), plan.fingerprint, 0)
            holder.open(PLANNED)
            try:
                assert main(["worker", str(rd.root), "0"]) == 1
            finally:
                holder.close()
        finally:
            mp.undo()
        errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
        assert (
            errors
            and "locked by another worker of this shard" in errors[-1]
            and "Traceback" not in capsys.readouterr().err
        )
        assert "rm " in errors[-1] if flockless else "wait for it to end or cancel it" in errors[-1]


# ---------------------------------------------------------------------------------------------------
# the writer's recovery reads a shard as every reader does (formats.newest)
# ---------------------------------------------------------------------------------------------------
from toolkit.formats.newest import newest_records, scan_shard  # noqa: E402


def _random_record(rng: random.Random, pos: int) -> Record:
    kind = rng.choice(["ok", "ok", "timeout", "rejected", "partial", "given up"])
    if kind == "ok":
        return msgspec.structs.replace(
            rec(pos),
            output_ids=pack_ids([rng.randrange(5000) for _ in range(rng.randrange(1, 40))]),
        )
    if kind == "partial":
        return msgspec.structs.replace(
            rec(pos), status=PARTIAL, finish=None, output_ids=pack_ids([7] * rng.randrange(1, 30))
        )
    r = failed_record(
        f"p{pos}",
        "d",
        pos,
        [1, 2],
        "no answer",
        2,
        failure="rejected" if kind == "rejected" else "timeout",
        final=kind == "given up",
    )
    r.tries = rng.randrange(1, 4)
    return r


@pytest.mark.parametrize("seed", range(8))
def test_recovery_keeps_the_newest_record_of_each_position_like_every_reader(tmp_path, seed):
    """Retries, partials continued or kept again, failures superseded and the reverse, records outside the planned
    positions, then a torn or a damaged frame: the writer's recovered state is the newest record of each position,
    as a plain fold of the surviving records says and as scan_shard says."""
    rng = random.Random(seed)
    planned = range(10, 40)
    path = tmp_path / "s.zst"
    records = [_random_record(rng, rng.choice(planned)) for _ in range(rng.randrange(20, 120))]
    records += [msgspec.structs.replace(rec(3), id="stray")] * rng.randrange(0, 2)
    w = ShardWriter(path, "f" * 16, 0, flush_records=rng.randrange(1, 9))
    w.open(planned)
    for r in records:
        w.add(r)
    w.close()
    frames = list(iter_frames(path))
    data = bytearray(path.read_bytes())
    harm = rng.choice(["none", "torn", "middle"])
    lost = set()
    if harm == "torn":
        del data[frames[-1].end - 3 :]
        lost = {-1}
    elif harm == "middle" and len(frames) > 2:
        data[frames[1].offset + 30] ^= 0xFF
        lost = {1}
    path.write_bytes(bytes(data))
    kept = [
        r
        for k, f in enumerate(frames)
        if k not in lost and k - len(frames) not in lost
        for r in f.batch
    ]

    newest = {}
    for r in kept:  # the oracle: the last record written at each planned position
        if r.index in planned:
            newest[r.index] = r
    w = ShardWriter(path, "f" * 16, 0)
    found = w.open(planned)
    w.close()
    done = found.done
    assert set(done) == {r.id for r in newest.values()}
    assert found.transient == {r.id for r in newest.values() if is_transient(r)}
    assert found.tries == {r.id: r.tries for r in newest.values() if is_transient(r)}
    assert found.partial == {r.id: r for r in newest.values() if r.status == PARTIAL}
    if newest:
        assert list(found.output_tokens_at) == [
            newest[p].n_output if p in newest else 0 for p in planned
        ]
    else:
        assert found.output_tokens_at is None
    assert w.written == len(kept)
    assert found.foreign == sum(r.index not in planned for r in kept)
    offsets = {
        f.offset for f in iter_frames(path)
    }  # the file as recovered: the offsets point at its frames
    assert set(done.values()) <= offsets
    sc = scan_shard(path, planned.start, len(planned))
    assert [r and r.id for r in newest_records(path, sc)] == [
        newest[p].id if p in newest else None for p in planned
    ]
