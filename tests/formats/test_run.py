"""A run directory opened (formats.run): the commands that only read a run write nothing into it, even with a
change a crash interrupted, which they read as it will be; the commands that plan or run it finish that change.
Every reader of prompts.msgpack gives the same refs."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec
import pytest

import runs
import toolkit
from toolkit.cli import main as cli_main
from toolkit.dataset.merge import merge_run
from toolkit.formats import prompts
from toolkit.formats.files import atomic_write
from toolkit.formats.pending import PendingChange
from toolkit.formats.prompts import (
    BY_SHARD,
    FLAT,
    PromptIndex,
    ShardRefs,
    prompts_problem,
    refs_bytes,
)
from toolkit.formats.run import Run
from toolkit.formats.runplan import PlanError, plan_bytes
from toolkit.job.schema import JobSpec


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and folder under `root`: kind, size, modification time and content digest."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(folder) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else ""
            out[str(p.relative_to(root))] = (p.is_dir(), st.st_size, st.st_mtime_ns, digest)
    return out


@pytest.fixture
def merged(tmp_path, toy_tokenizer):
    """A merged run with one failed record, and a change to its plan pinned by a crash but not applied."""
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 6, "chat": 4}, shards=2)
    runs.write_run(s, failed=[3])
    merge_run(s.root)
    plan = Run.open(s.root, JobSpec).plan
    plan.aliases = ["0123456789abcdef"]  # what the change makes of run.json: something to see
    atomic_write(
        s.rd.pending_file, msgspec.msgpack.encode(PendingChange("a test change", plan_bytes(plan)))
    )
    return s


def test_status_logs_export_and_read_run_write_nothing_into_the_run(merged, tmp_path, capsys):
    s = merged
    before = snapshot(s.root)
    (tmp_path / "out").mkdir()
    assert cli_main(["status", str(s.root)]) in (0, 1, 5)
    assert cli_main(["logs", str(s.root), "0"]) in (0, 1)
    assert cli_main(["logs", str(s.root), "--failed"]) in (0, 1)
    assert (
        cli_main(["export", str(s.root), "-o", str(tmp_path / "out" / "tokens.jsonl"), "--force"])
        == 0
    )
    assert (tmp_path / "out" / "tokens.jsonl").stat().st_size > 0
    assert (
        cli_main(
            ["export", str(s.root), "--format", "jsonl", "-o", str(tmp_path / "out" / "r.jsonl")]
        )
        == 0
    )
    got = list(toolkit.read_run(s.root))
    assert [r.id for r in got] == [r.id for r in s.refs]
    assert len(list(toolkit.read_rows(s.root, ok_only=True))) == len(s.refs) - 1
    opened = Run.open(s.root, JobSpec)
    assert opened.plan.aliases == ["0123456789abcdef"]  # read as the change makes it
    assert [r.id for r in opened.prompts().refs()] == [r.id for r in s.refs]
    assert snapshot(s.root) == before, "a command that only reads wrote into the run directory"
    assert s.rd.pending_file.exists() and "0123456789abcdef" not in s.rd.plan_file.read_text()


def test_a_command_that_runs_the_run_finishes_the_interrupted_change(merged):
    s = merged
    plan = Run.open(s.root, JobSpec, finish=True).plan
    assert plan.aliases == ["0123456789abcdef"]
    assert not s.rd.pending_file.exists() and "0123456789abcdef" in s.rd.plan_file.read_text()


def test_a_damaged_pending_change_is_refused_in_one_line_without_writing(merged):
    s = merged
    s.rd.pending_file.write_bytes(b"\x00garbage")
    before = snapshot(s.root)
    for opener in (
        lambda: Run.open(s.root, JobSpec),
        lambda: Run.open(s.root, JobSpec, finish=True),
    ):
        with pytest.raises(PlanError, match="pending.msgpack is damaged .*--new-run"):
            opener()
    assert snapshot(s.root) == before


def _readers_agree(s, run: Run) -> None:
    """Every reader of prompts.msgpack gives the planned refs: by position, a shard at a time, and a
    worker's shard streamed and looked into by position."""
    index = run.prompts()
    assert isinstance(index, PromptIndex) and len(index) == len(s.refs)
    assert index.refs() == s.refs and index.refs(3, 4) == s.refs[3:7]
    assert [index.at(i) for i in range(len(s.refs))] == s.refs and index.at(len(s.refs)) is None
    shuffled = sorted(
        range(len(s.refs)), key=lambda i: (i * 7) % len(s.refs)
    )  # one at a time, then whole shards
    fresh = run.prompts()
    assert [fresh.at(i) for i in shuffled] == [s.refs[i] for i in shuffled] and fresh.at(-1) is None
    for k, sp in enumerate(run.plan.shards):
        part = s.refs[sp.first : sp.first + sp.count]
        refs = run.shard_refs(k)
        assert isinstance(refs, ShardRefs) and len(refs) == sp.count and refs.first == sp.first
        assert index.shard(k) == part and list(refs) == part
        assert [refs[i] for i in reversed(range(len(refs)))] == part[::-1]
    assert prompts_problem(s.rd, run.plan, cheap=False) is None


def test_every_reader_of_the_prompt_index_gives_the_planned_refs(merged, monkeypatch):
    s = merged
    run = Run.open(s.root, JobSpec)
    assert run.plan.prompts_layout == BY_SHARD
    _readers_agree(s, run)
    s.rd.pending_file.unlink()
    monkeypatch.setattr(prompts, "CHUNK", 2)  # shards of several chunks, the last one short
    run = Run.open(s.root, JobSpec)
    atomic_write(s.rd.prompts_file, refs_bytes(run.plan, s.refs))
    run.write_plan()
    chunks = msgspec.msgpack.decode(s.rd.prompts_file.read_bytes(), type=list[list[bytes]])
    assert [len(c) for c in chunks] == [(sp.count + 1) // 2 for sp in run.plan.shards]
    _readers_agree(s, Run.open(s.root, JobSpec))


def _old_layout(s, *, recorded: bool) -> None:
    """Write the run's prompts.msgpack and run.json as a toolkit before `BY_SHARD` did: one array of
    every ref (what msgspec encodes for the list), where each shard's first ref starts recorded in
    run.json (`recorded`), with the file's size and sha256; or, older still, none of that."""
    s.rd.pending_file.unlink(missing_ok=True)
    plan = Run.open(s.root, JobSpec).plan
    data = msgspec.msgpack.encode(s.refs)
    at = len(data) - sum(len(msgspec.msgpack.encode(r)) for r in s.refs)  # the array's header
    for sp in plan.shards:
        sp.refs_at = at if recorded else 0
        at += sum(len(msgspec.msgpack.encode(r)) for r in s.refs[sp.first : sp.first + sp.count])
    s.rd.prompts_file.write_bytes(data)
    doc = msgspec.json.decode(plan_bytes(plan))
    del doc["prompts_layout"]
    doc["prompts_bytes"], doc["prompts_sha256"] = (
        (len(data), hashlib.sha256(data).hexdigest()) if recorded else (0, "")
    )
    s.rd.plan_file.write_bytes(msgspec.json.encode(doc))


@pytest.mark.parametrize("recorded", [True, False], ids=["offsets", "no-offsets"])
def test_a_run_planned_with_one_array_of_every_ref_reads_the_same(merged, recorded):
    s = merged
    _old_layout(s, recorded=recorded)
    run = Run.open(s.root, JobSpec)
    assert run.plan.prompts_layout == FLAT
    _readers_agree(s, run)
    assert [r.id for r in toolkit.read_run(s.root)] == [r.id for r in s.refs]
    # a byte changed in place: the sha256 run.json records tells, or reading every ref does
    data = bytearray(s.rd.prompts_file.read_bytes())
    data[-3] ^= 0xFF
    s.rd.prompts_file.write_bytes(bytes(data))
    assert prompts_problem(s.rd, run.plan, cheap=False) is not None or not recorded
    # a file that holds fewer refs than planned
    s.rd.prompts_file.write_bytes(msgspec.msgpack.encode(s.refs[:-1]))
    with pytest.raises(
        PlanError, match=f"holds {len(s.refs) - 1} prompts but run.json plans {len(s.refs)}"
    ):
        run.prompts()


def test_a_prompt_index_that_does_not_hold_the_plan_is_refused(merged):
    s = merged
    run = Run.open(s.root, JobSpec)
    last = run.plan.shards[-1]
    short = [s.refs[sp.first : sp.first + sp.count] for sp in run.plan.shards]
    short[-1] = short[-1][:-1]
    items = [prompts._shard_item(refs) for refs in short]
    s.rd.prompts_file.write_bytes(prompts._array_header(len(items)) + b"".join(items))
    with pytest.raises(
        PlanError, match=f"holds {last.count - 1} prompts of shard {last.index} but run.json plans"
    ):
        run.prompts().refs()
    s.rd.prompts_file.write_bytes(prompts._array_header(1) + items[0])
    with pytest.raises(PlanError, match="holds the prompts of 1 shards but run.json plans 2"):
        run.prompts()
    s.rd.prompts_file.unlink()
    with pytest.raises(PlanError, match="prompts.msgpack is missing: plan the job again"):
        run.prompts()
    with pytest.raises(PlanError, match="prompts.msgpack is missing: plan the job again"):
        list(run.shard_refs(0))
