"""The newest record of each id wins, in one place (formats.newest): a record written again supersedes the earlier
ones, a partial output continued is counted apart from a duplicate, a record not of the shard is counted foreign,
a damaged frame is read past; the merge, `read_run`, `toolkit retry`, `toolkit logs`, the worker and the shard writer's
recovery read this way."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import msgspec

import runs
from toolkit.cluster.logs import failed_records
from toolkit.cluster.retry import given_up_ids
from toolkit.formats.newest import newest_records, scan_shard
from toolkit.formats.records import PARTIAL, SERVER_ERROR


def test_the_newest_record_of_each_position_wins_and_the_rest_is_counted(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 8}, shards=2)
    sp = s.plan.shards[0]
    rng = random.Random(0)
    pos = list(range(sp.first, sp.first + sp.count))
    ok = {p: runs.record(s, p, runs.healthy()(s, p, rng)) for p in pos}
    failed = runs.record(s, pos[0], None, failure=SERVER_ERROR)
    given_up = msgspec.structs.replace(
        runs.record(s, pos[3], None, failure=SERVER_ERROR), final=True, tries=3
    )
    cut = msgspec.structs.replace(ok[pos[1]], status=PARTIAL, failure=PARTIAL, finish="abort")
    other = runs.record(
        s, s.plan.shards[1].first, runs.healthy()(s, s.plan.shards[1].first, rng)
    )  # shard 1's
    # written in this order: a failure then its retry; a partial output then its continuation; a record of another
    # shard; position 2 once; position 3 ok, then given up on a later try (the newest wins, whatever it says)
    path = runs.write_shard(
        s,
        0,
        [failed, cut, ok[pos[2]], other, ok[pos[0]], ok[pos[1]], ok[pos[3]], given_up],
        done=False,
        flush_records=2,
    )
    refs = s.refs[sp.first : sp.first + sp.count]
    for planned in (refs, sp.count):  # checked against the planned ids, or by position only
        sc = scan_shard(path, sp.first, planned)
        assert (sc.records, sc.duplicates, sc.continued, sc.foreign) == (8, 2, 1, 1)
        assert sc.duplicate_ids == [s.refs[pos[0]].id, s.refs[pos[3]].id] and sc.foreign_ids == [
            other.id
        ]
        newest = list(
            newest_records(path, sc, cache_bytes=1)
        )  # a cache of one frame: frames read again
        assert newest == [ok[pos[0]], ok[pos[1]], ok[pos[2]], given_up]
    # the same answer for `toolkit retry` (given up ids) and `toolkit logs` (failures, partial outputs)
    assert given_up_ids(s.rd, s.plan, 0) == [given_up.id]
    assert failed_records(s.rd, 5) == (1, [(given_up.id, "server error 500: boom")], 0)
    assert list(newest_records(None, scan_shard(None, sp.first, refs))) == [None] * sp.count


def test_a_damaged_frame_is_read_past_and_its_records_are_missing(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 6}, shards=1)
    rng = random.Random(1)
    recs = [runs.record(s, p, runs.healthy()(s, p, rng)) for p in range(6)]
    path = runs.write_shard(s, 0, recs, done=False, flush_records=2)
    sc = scan_shard(path, 0, 6)
    data = bytearray(path.read_bytes())
    data[sc.offsets[1] + 20] ^= 0xFF  # a byte inside the second frame
    path.write_bytes(bytes(data))
    sc = scan_shard(path, 0, s.refs)
    assert len(sc.damage) == 1 and len(sc.offsets) == 2
    assert list(newest_records(path, sc)) == [recs[0], recs[1], None, None, recs[4], recs[5]]


def test_only_formats_newest_reads_a_shard_file_frame_by_frame():
    """One implementation of newest-wins: the frame scanners of formats.frames (`scan`, `intact_frames`) are imported by
    formats.newest alone; every other reader of a shard file (the writer's recovery, merge, read_run, retry, logs, the
    done manifests) goes through it. `iter_frames` and `read_shard` are for the merged file, one record per id."""
    package = Path(__file__).resolve().parents[2] / "toolkit"
    scanners = {"scan", "intact_frames"}
    users = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module == "toolkit.formats.frames":
                if scanners & {a.name for a in node.names}:
                    users.add(path.relative_to(package).as_posix())
    assert users == {"formats/newest.py"}
    shardfile = (package / "formats" / "shardfile.py").read_text()
    assert "from toolkit.formats.newest import" in shardfile and "scan_shard(" in shardfile
