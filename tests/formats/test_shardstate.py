"""A shard's state, derived in one place (formats.shardstate) from a real run directory: each state from the files
a run leaves beside a shard, and the checks that decide between them."""

from __future__ import annotations

import fcntl
import random

import pytest

import runs
from toolkit.cluster.retry import request_retry
from toolkit.formats.manifests import read_done
from toolkit.formats.progress import Progress, write_progress
from toolkit.formats.records import SERVER_ERROR
from toolkit.formats.run import Run
from toolkit.formats.shardstate import (
    BUSY,
    CHEAP,
    REPAIRED,
    VERIFIED,
    WATCHED,
    Checks,
    ShardState,
    shard_state,
)


@pytest.fixture
def synth(tmp_path, toy_tokenizer):
    """A planned run of 7 shards of 2 prompts each, none written yet."""
    return runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 14}, shards=7)


def _write(s, k: int, *, failed: bool = False, done: bool = True) -> None:
    sp = s.plan.shards[k]
    rng = random.Random(k)
    recs = [
        runs.record(s, pos, None if failed else runs.healthy()(s, pos, rng), failure=SERVER_ERROR)
        for pos in range(sp.first, sp.first + sp.count)
    ]
    runs.write_shard(s, k, recs, done=done)


def test_each_state_from_the_files_beside_a_shard(synth):
    s = synth
    rd, run = s.rd, Run(s.rd, s.plan)
    _write(s, 0)  # 0: complete
    _write(s, 1, failed=True)  # 1: complete with failures that may pass (server errors)
    _write(s, 2)  # 2: complete, then `toolkit retry --ids` asks for one of its ids
    request_retry(rd.root, [s.refs[s.plan.shards[2].first].id])
    _write(s, 3)  # 3: complete, then its file changed
    with open(rd.shard_file(3), "ab") as f:
        f.write(b"\0" * 7)
    _write(s, 4, done=False)  # 4: part way, its file held by a writer elsewhere
    write_progress(
        rd.progress_file(5), Progress(shard=5, total=2, state="failed", group="g")
    )  # 5: failed in g
    # 6: never started

    with open(rd.shard_file(4), "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        every = Checks(verify=True, held=True)
        got = [run.shard_state(k, every, group="g").state for k in range(7)]
    assert got == [
        ShardState.DONE,
        ShardState.MAY_PASS,
        ShardState.RETRY,
        ShardState.UNTRUSTED,
        ShardState.HELD,
        ShardState.FAILED,
        ShardState.MISSING,
    ]

    # the cheap reading (no checks asked) takes the changed file's manifest at its word, sees no lock, no group
    cheap = [run.shard_state(k) for k in range(7)]
    assert [st.state for st in cheap] == [
        ShardState.DONE,
        ShardState.MAY_PASS,
        ShardState.RETRY,
        ShardState.DONE,
        ShardState.MISSING,
        ShardState.MISSING,
        ShardState.MISSING,
    ]
    assert [st.ended for st in cheap] == [
        True,
        True,
        False,
        True,
        False,
        False,
        False,
    ]  # retry removes the manifest
    assert cheap[1].done.transient == 2 and cheap[0].finished and not cheap[1].finished
    # a failed shard of another group is offered again; a lock no longer held is not HELD
    assert run.shard_state(5, group="h").state is ShardState.MISSING
    assert run.shard_state(4, BUSY).state is ShardState.MISSING


def test_an_untrusted_manifest_says_why_and_is_removed_only_when_asked(synth):
    s = synth
    rd, run = s.rd, Run(s.rd, s.plan)
    _write(s, 0)
    _write(s, 1)
    with open(rd.shard_file(1), "ab") as f:
        f.write(b"\0")
    foreign = shard_state(rd, 0, "another-run")  # what a run of that fingerprint sees
    assert (
        foreign.state is ShardState.UNTRUSTED and foreign.foreign and "another-run" in foreign.why
    )
    assert foreign.done is None and read_done(rd.done_file(0)) is not None  # not removed: not asked
    assert run.shard_state(0, VERIFIED).state is ShardState.DONE
    changed = run.shard_state(1, REPAIRED)
    assert changed.state is ShardState.UNTRUSTED and not changed.foreign and "bytes" in changed.why
    assert (
        read_done(rd.done_file(1)) is None
    )  # removed: its next run checks the file and generates the rest
    assert run.shard_state(1).state is ShardState.MISSING
    # `recheck`: the caller found it untrusted already (a worker's claim loop checks once per pool)
    assert run.shard_state(0, recheck=True).state is ShardState.UNTRUSTED


def test_a_claiming_look_reads_the_progress_of_unfinished_shards_only(synth, monkeypatch):
    """What a claiming task looks at every second at the run's tail (worker.claims.look): a done shard costs its
    done manifest and nothing more; the others come with their progress, whatever the group."""
    from toolkit.formats import shardstate
    from toolkit.worker.poolview import claimable, look

    s = synth
    rd = s.rd
    for k in (0, 1):
        _write(s, k)
        write_progress(rd.progress_file(k), Progress(shard=k, total=2, state="done"))
    _write(s, 2, failed=True)
    for k in (2, 3):
        write_progress(rd.progress_file(k), Progress(shard=k, total=2, state="generating", done=1))
    read = []
    real = shardstate.read_progress
    monkeypatch.setattr(
        shardstate,
        "read_progress",
        lambda rd, k: read.append(rd.progress_file(k).name) or real(rd, k),
    )
    for group in (None, "g"):
        read.clear()
        states = look(Run(rd, s.plan), list(range(7)), group=group)
        assert [st.progress is not None for st in states] == [
            False,
            False,
            True,
            True,
            False,
            False,
            False,
        ]
        assert sorted(read) == [f"{k:05d}.json" for k in range(2, 7)], group
        assert [c.shard for c in claimable(s.plan, states, skip={6})] == [2, 3, 4, 5]
    read.clear()
    assert Run(rd, s.plan).shard_state(0, WATCHED).progress.state == "done"
    assert read == ["00000.json"]


def test_the_cheap_check_reads_the_size_always_and_the_sha256_only_of_a_file_written_after_its_manifest(
    synth,
):
    import os

    s = synth
    rd = s.rd
    for k in (0, 1, 2):
        _write(s, k)
    done_at = rd.done_file(0).stat().st_mtime_ns
    cut = rd.shard_file(0)
    cut.write_bytes(cut.read_bytes()[:-1])  # 0: cut by a byte: its size tells
    os.utime(cut, ns=(done_at, done_at))
    for k in (1, 2):  # 1, 2: a byte changed in place, the size kept
        path = rd.shard_file(k)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        at = rd.done_file(k).stat().st_mtime_ns
        os.utime(
            path, ns=(at, at + (1_000_000_000 if k == 1 else 0))
        )  # 1 written after its manifest; 2 not
    run = Run(rd, s.plan)
    st = [run.shard_state(k, CHEAP) for k in (0, 1, 2)]
    assert [x.state for x in st] == [ShardState.UNTRUSTED, ShardState.UNTRUSTED, ShardState.DONE]
    assert "bytes, its done manifest says" in st[0].why and "sha256" in st[1].why
    # the full check reads every file: the change in place that kept the mtime too
    assert run.shard_state(2, VERIFIED).state is ShardState.UNTRUSTED
