"""Merge: planned order, exactly once by id, partial runs, damaged and torn frames, flat memory."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import runs
from toolkit import read_run
from toolkit.cli import main as cli_main
from toolkit.dataset.finish import AuditFailed, merge_and_audit
from toolkit.dataset.merge import merge_run
from toolkit.dataset.merge_manifest import MERGED, MergeError, load_manifest
from toolkit.formats.frames import iter_frames, read_header, read_shard
from toolkit.formats.records import OK

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def merged(s: runs.Synth):
    return list(read_shard(s.rd.merged_dir / "records.zst"))


def test_merged_dataset_is_the_planned_order_exactly_once(tmp_path, kimi):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 14, "chat": 9}, shards=4)
    written = runs.write_run(s, failed=[5])  # records land in a shuffled (completion) order
    first_frames = [r.index for r in read_shard(s.rd.shard_file(0))]
    assert first_frames != sorted(first_frames)  # the shard really is out of order

    m = merge_run(s.root)
    out = merged(s)
    assert [r.index for r in out] == list(range(s.plan.total))
    assert [r.id for r in out] == [ref.id for ref in s.refs]
    assert all(
        runs.comparable(r) == runs.comparable(written[r.id]) for r in out
    )  # byte-identical records
    assert read_header(s.rd.merged_dir / "records.zst") == (s.plan.fingerprint, MERGED)
    assert [r.id for r in read_run(s.root)] == [
        r.id for r in out
    ]  # the public reader prefers the merged file

    assert m.complete and (m.planned, m.records, m.ok, m.failed, m.missing, m.duplicates) == (
        23,
        23,
        22,
        1,
        0,
        0,
    )
    ds5 = s.plan.datasets[s.refs[5].dataset].name
    expect = {"math": 14, "chat": 9}
    assert {k: (c.planned, c.ok, c.failed) for k, c in m.datasets.items()} == {
        k: (n, n - (k == ds5), int(k == ds5)) for k, n in expect.items()
    }
    assert m.output_tokens == sum(r.n_output for r in written.values())
    assert [sm.matches_done for sm in m.shards] == [True] * 4
    assert m.sha256 == hashlib.sha256((s.rd.merged_dir / "records.zst").read_bytes()).hexdigest()
    assert load_manifest(s.rd) == m
    assert not list(s.rd.merged_dir.glob(".*"))  # no temporary file left behind


def test_frames_evicted_from_the_cache_are_read_again(tmp_path, kimi):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 40}, shards=2)
    runs.write_run(
        s, window=None, flush_records=3
    )  # fully shuffled: every position wants another frame
    merge_run(s.root, cache_bytes=1)  # a cache of one frame
    tiny = (s.rd.merged_dir / "records.zst").read_bytes()
    merge_run(s.root)
    assert tiny == (s.rd.merged_dir / "records.zst").read_bytes()
    assert [r.index for r in merged(s)] == list(range(40))


def test_merge_refuses_unfinished_shards_and_says_what_to_do(tmp_path, kimi, capsys):
    s = runs.plan_run(tmp_path, kimi, shards=3)
    runs.write_run(s, done=[0, 2])
    with pytest.raises(MergeError) as e:
        merge_run(s.root)
    msg = str(e.value)
    assert "1 of 3 shards" in msg and ": 1." in msg
    assert (
        f"`toolkit retry {s.rd.shown}`" in msg and "--allow-incomplete" in msg
    )  # run here: retry runs them here
    s.rd.jobs_file.parent.mkdir(parents=True, exist_ok=True)
    s.rd.jobs_file.write_text('{"submissions": []}')  # submitted to Slurm: resubmit
    with pytest.raises(MergeError, match=f"`toolkit resubmit {s.rd.shown}`"):
        merge_run(s.root)
    assert cli_main(["merge", str(s.root)]) == 2
    assert "toolkit resubmit" in capsys.readouterr().err
    assert not (s.rd.merged_dir / "records.zst").exists()


def test_allow_incomplete_merges_a_partial_run_and_lists_what_is_missing(tmp_path, kimi, capsys):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 12}, shards=3)  # shards own 0-3, 4-7, 8-11
    runs.write_run(s, done=[0], skip=[1, 2, 5])
    s.rd.shard_file(2).unlink()  # shard 2 never started
    m = merge_run(s.root, allow_incomplete=True)
    lost = {s.refs[p].id for p in (1, 2, 5, 8, 9, 10, 11)}
    assert not m.complete and m.missing == 7 and m.records == 5
    assert set((s.rd.merged_dir / "missing_ids.txt").read_text().split()) == lost
    assert [(sm.index, sm.done, sm.missing) for sm in m.shards] == [
        (0, True, 2),
        (1, False, 1),
        (2, False, 4),
    ]
    assert [r.index for r in merged(s)] == [0, 3, 4, 6, 7]

    assert (
        cli_main(["merge", str(s.root), "--allow-incomplete"]) == 1
    )  # merged, but the audit's coverage fails
    out = capsys.readouterr().out
    assert (
        "FAIL  coverage" in out
        and "5 of 12 planned prompts present" in out
        and "missing_ids.txt" in out
    )
    assert (
        set((s.rd.merged_dir / "missing_ids.txt").read_text().split()) == lost
    )  # the audit's own count agrees


def test_missing_ids_are_the_merges_alone_the_audit_takes_its_counts(tmp_path, kimi):
    from toolkit.dataset.audit import audit_run

    s = runs.plan_run(tmp_path, kimi, datasets={"math": 12}, shards=3)
    runs.write_run(s, done=[0, 1, 2], skip=[1, 2, 5])
    m = merge_run(s.root, allow_incomplete=True)
    s.rd.missing_file.unlink()
    r = audit_run(s.root)
    assert not s.rd.missing_file.exists()  # written by the merge only
    assert (
        r.missing == m.missing == 3
        and r.datasets[0].missing == 3
        and r.files["missing_ids"] == str(s.rd.missing_file)
    )
    assert s.rd.failed_file.exists()  # the audit's own


def test_a_later_record_of_an_id_supersedes_the_earlier_one(tmp_path, kimi):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 8}, shards=1)
    rng = random.Random(3)
    ok = {p: runs.record(s, p, runs.healthy()(s, p, rng)) for p in range(8)}
    failed2 = runs.record(s, 2, None, error="no answer within 10 s", failure="timeout")
    failed5 = runs.record(s, 5, None, error="HTTP 503: overloaded", failure="server_error")
    # First attempt: 0, 1, a timed-out 2, 3, 4 and 0 again in a later frame (a record written twice).
    runs.write_shard(
        s, 0, [ok[0], ok[1], failed2, ok[3], ok[4], ok[0]], done=False, flush_records=3
    )
    # Generated again (a rerun, `toolkit retry`): 2 is ok this time, 3 comes again, 5 is asked again and fails.
    runs.write_shard(s, 0, [ok[2], ok[3], ok[5], failed5, ok[6], ok[7]], flush_records=2)

    m = merge_run(s.root)
    out = merged(s)
    assert [r.index for r in out] == list(range(8))
    assert [r.status for r in out] == [OK] * 5 + ["failed"] + [
        OK
    ] * 2  # the newest attempt counts, ok or not
    assert all(runs.comparable(r) == runs.comparable(ok[r.index]) for r in out if r.index != 5)
    assert out[5].failure == "server_error"
    assert m.duplicates == 4 and m.shards[0].duplicates == 4
    assert sorted(m.duplicate_ids) == sorted(s.refs[p].id for p in (0, 2, 3, 5))
    assert m.complete and m.records == 8 and m.failed == 1


def test_a_bit_flip_in_a_record_count_is_reported_by_merge_and_the_frames_after_it_kept(
    tmp_path, kimi
):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 12}, shards=1)
    runs.write_run(s, window=0, flush_records=3)
    path = s.rd.shard_file(0)
    offsets = _frame_offsets(path)
    data = bytearray(path.read_bytes())
    data[offsets[1] + 16] ^= 0x01  # the record count of the second frame's descriptor
    path.write_bytes(bytes(data))
    with pytest.raises(
        MergeError,
        match=r"shard 0's file .* changed since its done manifest was written: nothing merged",
    ):
        merge_run(s.root)  # a finished shard's file changed: its records would go missing
    assert not s.rd.merged_file.exists()
    m = merge_run(s.root, allow_incomplete=True)  # merges what is there, and reports it
    assert [(p.shard, p.offset) for p in m.corrupt] == [
        (0, offsets[1])
    ] and "descriptor" in m.corrupt[0].why
    assert m.missing_ids == [s.refs[p].id for p in range(3, 6)]
    assert [r.index for r in merged(s)] == [0, 1, 2, *range(6, 12)]


def _frame_offsets(path: Path) -> list[int]:
    return [f.offset for f in iter_frames(path)]


def test_a_damaged_frame_is_reported_with_shard_and_offset(tmp_path, kimi, capsys):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 24}, shards=2)
    runs.write_run(s, window=0, flush_records=3)  # shard 1: four frames of 3 records
    path = s.rd.shard_file(1)
    offsets = _frame_offsets(path)
    data = bytearray(path.read_bytes())
    data[offsets[1] + 40] ^= 0xFF  # inside the second frame's compressed data
    path.write_bytes(bytes(data))

    m = merge_run(s.root, allow_incomplete=True)  # (without it, refused: test above)
    assert [(p.shard, p.file, p.offset) for p in m.corrupt] == [(1, str(path), offsets[1])]
    assert "checksum" in m.corrupt[0].why
    assert m.shards[1].matches_done is False  # the file no longer matches its done manifest
    lost = [
        s.refs[p].id for p in range(15, 18)
    ]  # the damaged frame's records; the frames after it are kept
    assert m.missing == 3 and m.missing_ids == lost and not m.complete
    assert [r.index for r in merged(s)] == [*range(15), *range(18, 24)]

    with pytest.raises(AuditFailed):
        merge_and_audit(s.root, allow_incomplete=True)
    out = capsys.readouterr().out
    assert "FAIL  damaged_frames" in out and f"at byte {offsets[1]}" in out and "shard 1" in out
    assert "FAIL  shard_checksums" in out and "FAIL  coverage" in out


def test_a_torn_last_frame_of_an_unfinished_shard_is_reported(tmp_path, kimi):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 12}, shards=1)
    runs.write_run(s, window=0, done=False, flush_records=4)
    path = s.rd.shard_file(0)
    last = _frame_offsets(path)[-1]
    os.truncate(path, path.stat().st_size - 10)  # killed while writing its last batch
    m = merge_run(s.root, allow_incomplete=True)
    assert [(p.shard, p.offset) for p in m.torn] == [
        (0, last)
    ] and "incomplete data frame" in m.torn[0].why
    assert m.corrupt == [] and m.missing == 4 and m.records == 8


def test_records_that_are_not_the_shards_are_left_out_and_reported(tmp_path, kimi):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 6}, shards=2)  # shard 0: 0-2, shard 1: 3-5
    rng = random.Random(0)
    recs = {p: runs.record(s, p, runs.healthy()(s, p, rng)) for p in range(6)}
    stray = msgspec.structs.replace(recs[1], id="not-planned")
    runs.write_shard(s, 0, [recs[0], recs[1], recs[2], recs[4], stray])  # 4 belongs to shard 1
    runs.write_shard(s, 1, [recs[3], recs[4], recs[5]])
    m = merge_run(s.root)
    assert m.foreign == 2 and sorted(m.foreign_ids) == sorted([s.refs[4].id, "not-planned"])
    assert [r.index for r in merged(s)] == list(range(6)) and not m.complete


@pytest.mark.parametrize("flock", ["flock", "no flock"])
def test_a_killed_merges_file_is_cleared_and_a_live_one_refused(tmp_path, kimi, request, flock):
    """A merge killed part-way leaves its temporary file: the next merge removes it and merges. One
    another merge still writes is refused: its flock held, or where the file system has none, its
    lock file (a stale lock file, of a merge gone, is taken over)."""
    import socket

    from toolkit.formats.shardfile import ShardWriter

    if flock == "no flock":
        request.getfixturevalue("no_flock")
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 6}, shards=2)
    runs.write_run(s)
    tmp = s.rd.merged_dir / ".records.zst.tmp"
    s.rd.merged_dir.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"what a killed merge left")
    if flock == "no flock":  # and its lock file: this host, a pid that is gone
        gone = subprocess.Popen(["true"])
        gone.wait()
        lock = tmp.with_name(tmp.name + ".lock")
        lock.write_bytes(
            msgspec.json.encode({"host": socket.gethostname(), "pid": gone.pid, "started": 1.0})
        )
    merge_run(s.root)
    assert [r.id for r in merged(s)] == [ref.id for ref in s.refs] and not tmp.exists()
    assert not list(s.rd.merged_dir.glob(".*"))  # the lock file of the killed merge too

    other = ShardWriter(tmp, s.plan.fingerprint, MERGED)  # a merge under way
    other.open(range(6))
    try:
        with pytest.raises(MergeError, match="another merge of this run is writing"):
            merge_run(s.root)
    finally:
        other.close()
    assert [r.id for r in merged(s)] == [ref.id for ref in s.refs]


def test_merge_help_names_the_options(capsys):
    with pytest.raises(SystemExit):
        cli_main(["merge", "--help"])
    text = capsys.readouterr().out
    assert "--allow-incomplete" in text and "--no-audit" in text and "planned prompt order" in text


# ---------------------------------------------------------------------------------------------------
# memory
# ---------------------------------------------------------------------------------------------------
_MEASURED = """
import sys
from toolkit.cli import main
rc = main(sys.argv[1:])
print("VmHWM", [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")][0], file=sys.stderr)
sys.exit(rc)
"""


def _peak_rss_mb(args: list[str]) -> float:
    """Peak resident memory of a `toolkit` process, as its kernel high-water mark (VmHWM) at exit.

    Not getrusage: a child's ru_maxrss starts from its parent's size at fork, which this test process dwarfs.
    """
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURED, *args], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return int(proc.stderr.rsplit("VmHWM", 1)[1].split()[0]) / 1024


@pytest.mark.slow
def test_merge_memory_stays_flat_for_a_run_ten_times_larger(tmp_path, kimi):
    runs_ = {}
    for name, n in (("small", 120), ("large", 1200)):
        s = runs.plan_run(
            tmp_path / name, kimi, datasets={"math": n}, shards=4, sampling={"max_new_tokens": 8192}
        )
        runs.write_run(
            s, runs.healthy(reasoning=(3700, 4100), content=(150, 250)), flush_records=16, window=64
        )
        runs_[name] = (s.root, sum(r.n_output for r in s.written.values()))
    (small_run, small_tokens), (large_run, large_tokens) = runs_["small"], runs_["large"]
    assert large_tokens > 9 * small_tokens > 4_000_000  # ~0.5M vs ~5M output tokens (20 MB of ids)
    small, large = _peak_rss_mb(["merge", str(small_run)]), _peak_rss_mb(["merge", str(large_run)])
    # Holding the large run's records would add 20 MB or more; the merge and its audit must not.
    assert large < small * 1.05 + 10, (
        f"peak RSS {small:.0f} MB for the small run, {large:.0f} MB for the 10x run"
    )


def test_a_merge_never_replaces_a_complete_merged_dataset_with_a_smaller_one(tmp_path, kimi):
    s = runs.plan_run(tmp_path, kimi, datasets={"math": 12}, shards=2)
    runs.write_run(s, window=0, flush_records=3)
    assert merge_run(s.root).complete
    before = s.rd.merged_file.read_bytes(), s.rd.manifest_file.read_bytes()
    path = s.rd.shard_file(1)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # shard 1 cut after it was done
    with pytest.raises(
        MergeError, match=r"shard 1's file .* changed since its done manifest was written"
    ):
        merge_run(s.root)
    # even asked to merge what is there, the complete one in place is kept, and the message says so
    with pytest.raises(
        MergeError,
        match=r"this merge holds \d+ of 12 planned records \(\d+ missing\), the merged "
        r"dataset in place all 12: it is kept, nothing replaced",
    ):
        merge_run(s.root, allow_incomplete=True)
    assert (s.rd.merged_file.read_bytes(), s.rd.manifest_file.read_bytes()) == before
    assert not list(s.rd.merged_dir.glob(".*.tmp"))
    # with no complete merged dataset in place, what is there is merged (and counted missing)
    s.rd.manifest_file.unlink()
    m = merge_run(s.root, allow_incomplete=True)
    assert not m.complete and m.missing > 0 and m.records + m.missing == 12
