"""Shard files: torn tails are cut off, damage elsewhere is loud, writers are exclusive."""

import random
import subprocess

import pytest

from toolkit.records import OK, Record, pack_ids, unpack_ids
from toolkit.shardfile import CorruptShard, ShardWriter, iter_frames, read_shard


def rec(i: int) -> Record:
    out = [(i * 7 + k) % 5000 for k in range(50 + i)]
    return Record(id=f"p{i}", dataset="d", index=i, status=OK, prompt_ids=pack_ids([1, 2, i]), output_ids=pack_ids(out),
                  reasoning_end=3, tool_call_at=None, finish="stop", matched_stop=out[-1], prompt_tokens=3,
                  completion_tokens=len(out), cached_tokens=0, latency_s=0.5, attempts=1)


def write(path, records, batch=4, fp="f" * 16):
    w = ShardWriter(path, fp, 0, flush_records=batch)
    done = w.open()
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
    stream = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(path.read_bytes()), read_across_frames=True)
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
        done = w.open()
        assert len(done) == 4 * complete, cut
        w.close()
        assert path.stat().st_size == max([e for e in ends if e <= cut], default=path.stat().st_size)


def test_corrupt_middle_frame_is_loud(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(i) for i in range(12)])
    frames = list(iter_frames(path))
    data = bytearray(path.read_bytes())
    data[frames[1].offset + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShard) as e:
        list(read_shard(path))
    assert e.value.offset == frames[1].offset and "s.zst" in str(e.value)
    with pytest.raises(CorruptShard):
        ShardWriter(path, "f" * 16, 0).open()


def test_fingerprint_mismatch_refused(tmp_path):
    path = tmp_path / "s.zst"
    write(path, [rec(0)])
    with pytest.raises(RuntimeError, match="belongs to run ffffffffffffffff"):
        ShardWriter(path, "a" * 16, 0).open()


def test_second_writer_is_refused(tmp_path):
    path = tmp_path / "s.zst"
    w = ShardWriter(path, "f" * 16, 0)
    w.open()
    code = f"""
import sys
from toolkit.shardfile import ShardWriter
try:
    ShardWriter({str(path)!r}, "f" * 16, 0).open()
except RuntimeError as e:
    print(e); sys.exit(7)
"""
    r = subprocess.run(["python", "-c", code], capture_output=True, text=True)
    w.close()
    assert r.returncode == 7 and "locked by another worker" in r.stdout
