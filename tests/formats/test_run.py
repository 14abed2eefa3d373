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
from toolkit.formats.files import atomic_write
from toolkit.formats.pending import PendingChange
from toolkit.formats.run import PlanError, PromptIndex, RefSlice, Run, ShardRefs, plan_bytes
from toolkit.job.spec import JobSpec


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


def test_every_reader_of_the_prompt_index_gives_the_planned_refs(merged):
    s = merged
    run = Run.open(s.root, JobSpec)
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
        assert index.shard(k) == part and list(ShardRefs(s.rd, sp)) == part
        window = RefSlice(s.rd, sp.first, sp.count)
        assert [window[i] for i in range(len(window))] == part


def test_a_prompt_index_that_does_not_hold_the_plan_is_refused(merged):
    s = merged
    run = Run.open(s.root, JobSpec)
    s.rd.prompts_file.write_bytes(msgspec.msgpack.encode(s.refs[:-1]))
    with pytest.raises(
        PlanError, match=f"holds {len(s.refs) - 1} prompts but run.json plans {len(s.refs)}"
    ):
        run.prompts()
    s.rd.prompts_file.unlink()
    with pytest.raises(PlanError, match="prompts.msgpack is missing: plan the job again"):
        run.prompts()
