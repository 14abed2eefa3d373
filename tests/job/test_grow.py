"""A run that grows: the job planned again with more prompts generates only those, into the same run; prompts that
moved are followed; changed or removed prompts are named and refused; a run planned with line-number ids resumes."""

from __future__ import annotations

import json

import msgspec
import pytest

from jobfiles import make_job, prepared_run, write_prompts
from runs import planned_refs
from toolkit.cli import main as cli_main
from toolkit.dataset.audit_report import read_report
from toolkit.dataset.merge_manifest import load_manifest
from toolkit.formats.files import sha256_file
from toolkit.formats.frames import read_shard
from toolkit.formats.manifests import RetryRequest, read_done, write_retry
from toolkit.formats.prompts import refs_bytes
from toolkit.formats.run import Run
from toolkit.formats.runplan import PlanError
from toolkit.job.plan import _digest
from toolkit.job.schema import JobSpec


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def append(path, lines: list[str]) -> None:
    with open(path, "a") as f:
        f.writelines(line + "\n" for line in lines)


def new_lines(n: int, start: int = 0) -> list[str]:
    return [
        json.dumps({"prompt": f"An appended question number {start + i}: what is {i} + {i}?"})
        for i in range(n)
    ]


def edit_second_prompt(src):
    """Its second prompt's message changed in place (same id, other content): the prompt file."""
    lines = src.read_text().splitlines()
    row = json.loads(lines[1])
    row["messages"][0]["content"] = (
        "Something else entirely, and longer than it was before the edit."
    )
    src.write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")
    return src


@pytest.mark.slow
def test_appended_prompts_are_the_only_ones_generated_and_the_run_stays_whole(
    tmp_path, kimi, capsys
):
    job = make_job(
        tmp_path, kimi, n=12, sampling={"max_new_tokens": 64}, audit={"max_length_share": 1.0}
    )
    assert cli_main(["run", str(job)]) == 0
    opened = Run.open(tmp_path / "run", JobSpec, finish=True)
    rd, plan = opened.rd, opened.plan
    before = sha256_file(rd.shard_file(0))
    append(tmp_path / "prompts.jsonl", new_lines(3))
    capsys.readouterr()
    assert cli_main(["check", str(job)]) == 0
    assert (
        "add its 3 new prompts (3 records) in 1 new shard and generate only those"
        in capsys.readouterr().out
    )
    assert cli_main(["run", str(job)]) == 0
    opened = Run.open(tmp_path / "run", JobSpec, finish=True)
    rd2, grown = opened.rd, opened.plan
    assert rd2.root == rd.root and grown.fingerprint == plan.fingerprint and len(grown.aliases) == 1
    assert [(s.index, s.first, s.count) for s in grown.shards] == [(0, 0, 12), (1, 12, 3)]
    assert grown.total == 15 and grown.datasets[0].prompts == 15 and grown.grown[0].shards == [1]
    assert sha256_file(rd.shard_file(0)) == before  # nothing of shard 0 generated again
    assert read_done(rd.done_file(1)).records == 3 and len(list(read_shard(rd.shard_file(1)))) == 3
    m = load_manifest(rd)
    assert (m.planned, m.records, m.missing, m.duplicates) == (15, 15, 0, 0)
    planned = [r.id for r in planned_refs(rd)]
    assert len(set(planned)) == 15 and planned[:12] == [r.id for r in planned_refs(rd)][:12]
    report = read_report(rd)
    assert report.passed and report.planned == 15 and report.ok == 15
    # the same job again: resumed as it is (its fingerprint is now the run's alias), nothing generated
    assert cli_main(["run", str(job)]) == 0
    assert Run.open(rd.root, JobSpec, finish=True).plan.shards == grown.shards


def test_changed_and_removed_prompts_are_named_and_refused(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=8)
    rd, _ = prepared_run(job)
    pinned = rd.plan_file.read_bytes(), rd.prompts_file.read_bytes()
    src = tmp_path / "prompts.jsonl"
    lines = src.read_text().splitlines()
    row = json.loads(lines[1])
    row["messages"][0]["content"] = "Something else entirely."
    src.write_text("\n".join([lines[0], json.dumps(row), *lines[2:5], *lines[6:]]) + "\n")
    with pytest.raises(PlanError) as e:
        prepared_run(job)
    msg = str(e.value)
    assert f"{rd.root} holds this job's run" in msg and "(differs in: inputs)" in msg
    assert (
        f"1 prompt changed:\n    {src}:2: id 'p0001' (its messages or tools changed; was line 2)"
        in msg
    )
    assert f"1 prompt removed:\n    {src}:6 (was): id 'p0005'" in msg
    assert "give it a new id" in msg and "--new-run" in msg
    assert (rd.plan_file.read_bytes(), rd.prompts_file.read_bytes()) == pinned  # nothing written
    rd2, plan2 = prepared_run(
        job, new_run=True
    )  # what the refusal offers: a new run beside it, of the job as it is
    assert rd2.root != rd.root and rd2.root.name.startswith("run.") and plan2.total == 7


def test_reordered_and_edited_around_prompts_keep_their_records(tmp_path, kimi):
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "".join(line + "\n" for line in new_lines(6))
    )  # no ids: derived from the content
    job = make_job(tmp_path, kimi, prompts=src, shards=2)
    rd, plan = prepared_run(job)
    old = planned_refs(rd)
    lines = src.read_text().splitlines()
    src.write_text("\n".join(["", *reversed(lines)]) + "\n")  # reordered, a blank line first
    rd2, again = prepared_run(job)
    assert rd2.root == rd.root and again.fingerprint == plan.fingerprint and not again.grown
    assert [(s.first, s.count) for s in again.shards] == [(s.first, s.count) for s in plan.shards]
    now = planned_refs(rd)
    assert [r.id for r in now] == [r.id for r in old]  # every record keeps its id and position
    assert [r.line for r in now] == [7 - r.line + 1 for r in old]  # ... and follows its line
    text = src.read_bytes()
    for r in now:
        assert json.loads(text[r.offset : r.offset + r.length]) == json.loads(
            lines[6 - (r.line - 1)]
        )


def test_a_dataset_added_to_the_job_is_planned_in_new_shards(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=8, shards=2)
    rd, plan = prepared_run(job)
    b = write_prompts(tmp_path / "b.jsonl", 4, prefix="b")
    job.write_text(job.read_text() + f'[[datasets]]\nname = "b"\npath = "{b}"\n')
    rd2, grown = prepared_run(job)
    assert rd2.root == rd.root and [d.name for d in grown.datasets] == ["d", "b"]
    assert [(s.index, s.count) for s in grown.shards] == [(0, 4), (1, 4), (2, 4)]
    assert grown.grown[0].datasets == ["b"] and grown.grown[0].prompts == 4
    assert {r.id for r in planned_refs(rd)[8:]} == {f"b{i:04d}" for i in range(4)}
    assert all(r.dataset == 1 for r in planned_refs(rd)[8:])


def test_what_differs_is_said_down_to_keys_and_files(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=4, sampling={"max_new_tokens": 64})
    prepared_run(job)
    append(tmp_path / "prompts.jsonl", new_lines(1))
    job = make_job(
        tmp_path, kimi, prompts=tmp_path / "prompts.jsonl", sampling={"max_new_tokens": 65}
    )
    with pytest.raises(PlanError) as e:
        prepared_run(job)
    src = tmp_path / "prompts.jsonl"
    assert "(differs in: inputs (" in str(e.value) and f"{src}: sha256 " in str(e.value)
    assert "sampling (max_new_tokens: 64 -> 65), shards" in str(e.value)


def legacy(rd) -> None:
    """Make a run as an older toolkit planned it: ids `<dataset>:<line>` for lines without one, no digests."""
    plan = Run.open(rd.root, JobSpec, finish=True).plan
    refs = [msgspec.structs.replace(r, id=f"d:{r.line}", digest="") for r in planned_refs(rd)]
    plan.format = 1
    plan.parts["shards"] = _digest([plan.spec.sharding.shards, [r.id for r in refs]])
    plan.fingerprint = _digest(plan.parts)[:16]
    rd.prompts_file.write_bytes(refs_bytes(plan, refs))
    rd.plan_file.write_bytes(msgspec.json.encode(plan))


@pytest.mark.slow
def test_a_run_planned_with_line_number_ids_keeps_them_and_resumes(tmp_path, kimi, capsys):
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(line + "\n" for line in new_lines(5)))
    job = make_job(
        tmp_path,
        kimi,
        prompts=src,
        sampling={"max_new_tokens": 64},
        audit={"max_length_share": 1.0},
    )
    rd, _ = prepared_run(job)
    legacy(rd)
    fingerprint = Run.open(rd.root, JobSpec, finish=True).plan.fingerprint
    capsys.readouterr()
    assert cli_main(["check", str(job)]) == 0
    assert (
        "holds this run, planned with ids from line numbers (kept); `toolkit run`/`submit` resume it"
        in capsys.readouterr().out
    )
    assert cli_main(["run", str(job)]) == 0  # resumed, not refused as another job's run
    plan = Run.open(rd.root, JobSpec, finish=True).plan
    assert plan.fingerprint == fingerprint and plan.format == 1 and len(plan.aliases) == 1
    assert {r.id for r in read_shard(rd.shard_file(0))} == {f"d:{i}" for i in range(1, 6)}
    assert read_report(rd).passed
    # it does not grow: its ids come from line numbers
    append(src, new_lines(1, start=9))
    with pytest.raises(
        PlanError, match="planned by an older toolkit, whose ids came from line numbers"
    ):
        prepared_run(job)


def test_submit_sends_the_new_shards_of_a_submitted_run_once_its_jobs_are_over(
    tmp_path, kimi, monkeypatch
):
    from toolkit.cluster import submit as submit_mod
    from toolkit.cluster.jobs import ArrayJob, Submission, append_submission
    from toolkit.cluster.resources import SubmitRefused

    monkeypatch.delenv("SLURM_CONF", raising=False)
    monkeypatch.setenv(
        "PATH", "/nonexistent"
    )  # no cluster answers the dry runs: the same on every machine
    job = make_job(tmp_path, kimi, n=6)
    rd, plan = prepared_run(job)
    append_submission(
        rd, Submission(submitted="now", arrays=[ArrayJob("7", [0], ["7"])], merge_job_id="8")
    )
    monkeypatch.setattr(submit_mod, "live_jobs", lambda rd: {})
    with pytest.raises(
        SubmitRefused, match="already submitted"
    ):  # nothing new: resubmit is for what is left
        submit_mod.submit(str(job), dry_run=True)
    append(tmp_path / "prompts.jsonl", new_lines(2))
    r = submit_mod.submit(str(job), dry_run=True)
    assert r.dry_run.arrays == [[0, 1]] and r.dry_run.shards == 2  # the new shard, and what is left
    assert len(Run.open(rd.root, JobSpec, finish=True).plan.shards) == 1  # a dry run writes nothing
    monkeypatch.setattr(submit_mod, "live_jobs", lambda rd: {"8": "PENDING"})
    with pytest.raises(
        SubmitRefused,
        match=r"gained prompts, but 1 jobs of its run .* are still pending or running",
    ):
        submit_mod.submit(str(job), dry_run=True)


def test_the_plan_does_not_grow_under_a_shard_being_generated(tmp_path, kimi):
    import fcntl
    import os

    job = make_job(tmp_path, kimi, n=4)
    rd, _ = prepared_run(job)
    rd.shard_file(0).write_bytes(b"")
    fd = os.open(rd.shard_file(0), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a worker generating shard 0
        append(tmp_path / "prompts.jsonl", new_lines(1))
        with pytest.raises(
            PlanError, match="shard 0 of its run is being generated .* wait for it to end"
        ):
            prepared_run(job)
    finally:
        os.close(fd)
    assert len(prepared_run(job)[1].shards) == 2  # once it has ended


@pytest.mark.slow
def test_allow_changed_generates_the_changed_prompts_again(tmp_path, kimi, capsys):
    job = make_job(
        tmp_path, kimi, n=6, sampling={"max_new_tokens": 64}, audit={"max_length_share": 1.0}
    )
    assert cli_main(["run", str(job)]) == 0
    rd = Run.open(tmp_path / "run", JobSpec, finish=True).rd
    old = {r.id: r for r in read_shard(rd.merged_file)}
    src = edit_second_prompt(tmp_path / "prompts.jsonl")
    capsys.readouterr()
    assert cli_main(["run", str(job)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{src}:2: id 'p0001' (its messages or tools changed; was line 2)" in err
        and "--allow-changed" in err
    )
    assert cli_main(["run", str(job), "--allow-changed"]) == 0
    new = {r.id: r for r in read_shard(rd.merged_file)}
    assert set(new) == set(old) and new["p0001"].prompt_ids != old["p0001"].prompt_ids
    assert all(
        new[i].output_ids == old[i].output_ids for i in old if i != "p0001"
    )  # only it was generated again
    assert len(list(read_shard(rd.shard_file(0)))) == 7 and not rd.retry_file(0).exists()
    assert read_report(rd).passed  # the re-rendered prompts match their records


@pytest.mark.slow
def test_a_grown_or_changed_run_is_exported_only_after_it_is_merged_again(tmp_path, kimi, capsys):
    job = make_job(
        tmp_path, kimi, n=6, sampling={"max_new_tokens": 16}, audit={"max_length_share": 1.0}
    )
    assert cli_main(["run", str(job)]) == 0
    rd = Run.open(tmp_path / "run", JobSpec, finish=True).rd
    out = tmp_path / "out.jsonl"
    assert cli_main(["export", str(rd.root), "--format", "jsonl", "-o", str(out)]) == 0
    append(tmp_path / "prompts.jsonl", new_lines(2))
    prepared_run(job)  # the plan grows; nothing is generated or merged yet
    out.unlink()
    capsys.readouterr()
    assert cli_main(["export", str(rd.root), "--format", "jsonl", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "the run plans 8 records in 2 shards, the merge had 6 in 1 (the job grew)" in err
    assert f"toolkit merge {rd.root}" in err and not out.exists()
    assert cli_main(["run", str(job)]) == 0
    assert cli_main(["export", str(rd.root), "--format", "jsonl", "-o", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 8
    # a shard asked for some of its records again (as `toolkit retry --ids` or --allow-changed do) is not exported
    # from the older merge
    write_retry(
        rd.retry_file(0), RetryRequest(before=rd.shard_file(0).stat().st_size, ids=["p0001"])
    )
    capsys.readouterr()
    assert cli_main(["export", str(rd.root), "--format", "jsonl", "-o", str(out)]) == 2
    assert "shard 0 changed since (records written, or asked for again)" in capsys.readouterr().err


class Crash(BaseException):
    """A kill between two writes (what kill -9 would leave)."""


@pytest.mark.slow
@pytest.mark.parametrize("at", ["prompts", "plan", "retry"])
def test_a_crash_while_a_run_grows_leaves_the_change_to_finish_never_half_made(
    tmp_path, kimi, monkeypatch, at
):
    """The prompt index, the plan and the retry requests of changed prompts change together: a crash between two of
    their writes is finished by the next command, so a changed prompt is never left with its old answer."""
    job = make_job(
        tmp_path, kimi, n=6, sampling={"max_new_tokens": 64}, audit={"max_length_share": 1.0}
    )
    assert cli_main(["run", str(job)]) == 0
    rd = Run.open(tmp_path / "run", JobSpec, finish=True).rd
    old = {r.id: r for r in read_shard(rd.merged_file)}
    src = edit_second_prompt(tmp_path / "prompts.jsonl")
    append(src, new_lines(2))
    import toolkit.formats.pending as pending

    real_write, real_retry = pending.atomic_write, pending.write_retry

    def crashing_write(path, data, **kw):
        if at == "prompts" and path == rd.prompts_file or at == "plan" and path == rd.plan_file:
            raise Crash
        return real_write(path, data, **kw)

    def crashing_retry(path, request):
        if at == "retry":
            raise Crash
        return real_retry(path, request)

    monkeypatch.setattr(pending, "atomic_write", crashing_write)
    monkeypatch.setattr(pending, "write_retry", crashing_retry)
    with pytest.raises(Crash):
        prepared_run(job, allow_changed=True)
    monkeypatch.undo()
    assert rd.pending_file.exists()
    # the next command finishes the change first: here a plain run, which no longer needs --allow-changed
    assert cli_main(["run", str(job)]) == 0
    assert not rd.pending_file.exists() and not rd.retry_file(0).exists()
    new = {r.id: r for r in read_shard(rd.merged_file)}
    assert len(new) == 8 and set(old) < set(new)
    assert (
        new["p0001"].prompt_ids != old["p0001"].prompt_ids
    )  # generated again from its new messages
    assert all(new[i].output_ids == old[i].output_ids for i in old if i != "p0001")
    assert read_report(rd).passed


def test_a_damaged_pending_change_is_refused_in_one_line_not_guessed_at(tmp_path, kimi, capsys):
    rd, _ = prepared_run(make_job(tmp_path, kimi, n=4))
    pinned = rd.plan_file.read_bytes(), rd.prompts_file.read_bytes()
    rd.pending_file.write_bytes(b"\x93not a change")
    with pytest.raises(PlanError) as e:
        Run.open(rd.root, JobSpec, finish=True)
    assert f"{rd.pending_file} is damaged" in str(e.value) and "--new-run" in str(e.value)
    assert cli_main(["status", str(rd.root)]) == 2
    err = capsys.readouterr().err
    assert "is damaged" in err and "Traceback" not in err
    assert (
        rd.plan_file.read_bytes(),
        rd.prompts_file.read_bytes(),
    ) == pinned and rd.pending_file.exists()
