"""Run directories: settings that do not change the output follow the job; the wrong kind of path is named."""

from __future__ import annotations

import json
import logging

import pytest

from jobfiles import make_job, prepared_run
from toolkit.cli import main as cli_main
from toolkit.dataset.audit import audit_run
from toolkit.dataset.export import ExportError, export_run
from toolkit.formats.run import Run
from toolkit.formats.runplan import PlanError
from toolkit.job.schema import JobSpec
from toolkit.job.spec import load_spec
from toolkit.job.specerrors import SpecError


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def test_run_settings_changed_in_the_job_take_effect_and_are_logged(tmp_path, kimi, caplog):
    job = make_job(tmp_path, kimi, n=4, engine={"ready_timeout_s": 60}, client={"concurrency": 4})
    rd, plan = prepared_run(job)
    job = make_job(tmp_path, kimi, n=4, engine={"ready_timeout_s": 900}, client={"concurrency": 8})
    with caplog.at_level(logging.INFO, logger="toolkit.job.runsettings"):
        rd2, plan2 = prepared_run(job)
    assert rd2.root == rd.root and plan2.fingerprint == plan.fingerprint
    pinned = Run.open(rd.root, JobSpec, finish=True).plan
    assert pinned.spec.engine.ready_timeout_s == 900 and pinned.spec.client.concurrency == 8
    assert "setting engine.ready_timeout_s changed from 60.0 to 900.0" in caplog.text
    assert "setting client.concurrency changed from 4 to 8" in caplog.text


def test_what_changes_the_output_stays_pinned(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=4, sampling={"max_new_tokens": 64})
    prepared_run(job)
    job = make_job(tmp_path, kimi, n=4, sampling={"max_new_tokens": 65})
    with pytest.raises(PlanError, match="differs in: sampling"):
        prepared_run(job)


def test_a_job_file_where_a_run_directory_is_expected_and_the_reverse(tmp_path, kimi, capsys):
    job = make_job(tmp_path, kimi, n=4)
    rd, _ = prepared_run(job)
    with pytest.raises(PlanError, match="is a file, not a run directory; it looks like a job spec"):
        Run.open(job, JobSpec, finish=True)
    with pytest.raises(SpecError, match="is a run directory, not a job spec"):
        load_spec(rd.root)
    # status takes the job file too: it reads the job's newest run and says which (planned, but nothing runs it:
    # not in progress, exit 1 with the command that runs it)
    assert cli_main(["status", str(job)]) == 1
    out, err = capsys.readouterr()
    assert f"run directory: {rd.root} (the newest run of job {job})" in err
    assert "shard 0 not_started and nothing runs them: `toolkit retry " in out
    assert cli_main(["check", str(rd.root)]) == 2
    assert "not a job spec" in capsys.readouterr().err


@pytest.mark.slow
def test_an_edited_prompt_file_is_never_paired_with_old_records(tmp_path, kimi):
    job = make_job(
        tmp_path, kimi, n=4, sampling={"max_new_tokens": 64}, audit={"max_length_share": 1.0}
    )
    assert cli_main(["run", str(job)]) == 0
    rd = Run.open(tmp_path / "run", JobSpec, finish=True).rd
    src = tmp_path / "prompts.jsonl"
    lines = src.read_text().splitlines()
    row = json.loads(lines[1])
    row["messages"][0]["content"] = "Something else entirely."
    src.write_text("\n".join([lines[0], json.dumps(row), *lines[2:]]) + "\n")
    with pytest.raises(ExportError, match="changed since the run was planned"):
        export_run(rd.root, "conversations", tmp_path / "c.jsonl")
    report = audit_run(rd.root)
    bad = {c.name: c for c in report.checks if not c.passed}
    assert (
        "source_files" in bad and "changed since the run was planned" in bad["source_files"].message
    )
    assert (
        export_run(rd.root, "jsonl", tmp_path / "j.jsonl").rows == 4
    )  # ids only: the sources are not read


@pytest.mark.slow
def test_a_shards_refs_are_read_in_order_with_nothing_kept_per_prompt(tmp_path, kimi):
    """A worker reads its shard's refs from prompts.msgpack a chunk at a time (where the shard
    starts is in run.json; a run planned before that is read from the start): what it holds does
    not grow with the shard."""
    import tracemalloc

    import msgspec

    from jobfiles import write_prompts
    from toolkit.formats.prompts import CHUNK, PromptRef, ShardRefs
    from toolkit.job.plan import create_run, plan_job
    from toolkit.worker.feed import Todo

    job = make_job(tmp_path, kimi, prompts=write_prompts(tmp_path / "p.jsonl", 100_000), shards=3)
    plan, refs = plan_job(load_spec(job))
    rd = create_run(plan, refs)
    chunks = msgspec.msgpack.decode(rd.prompts_file.read_bytes(), type=list[list[bytes]])
    assert [
        r
        for shard in chunks
        for c in shard
        for r in msgspec.msgpack.decode(c, type=list[PromptRef])
    ] == refs  # the file every reader knows: each shard's chunks, each an array of refs
    assert max(len(c) for c in chunks) == -(-max(sp.count for sp in plan.shards) // CHUNK)
    plan = Run.open(rd.root, JobSpec, finish=True).plan
    for k, sp in enumerate(plan.shards):
        assert (
            sp.refs_at > 0 and list(ShardRefs(rd, plan, k)) == refs[sp.first : sp.first + sp.count]
        )
        older = msgspec.structs.replace(
            plan, shards=[msgspec.structs.replace(sp, refs_at=0) for sp in plan.shards]
        )
        assert list(ShardRefs(rd, older, k)) == refs[sp.first : sp.first + sp.count]
    sp = plan.shards[1]

    def peak_of(make) -> float:
        tracemalloc.start()
        try:
            make()
            return tracemalloc.get_traced_memory()[1] / 1e6
        finally:
            tracemalloc.stop()

    def generate() -> None:
        assert sum(len(b) for b in Todo(ShardRefs(rd, plan, 1)).batches(64)) == sp.count

    streamed = peak_of(generate)
    assert streamed < 1.0, f"{streamed:.2f} MB held to read {sp.count:,} refs"
    held = peak_of(lambda: Run.open(rd.root, JobSpec).prompts().shard(1))  # the shard decoded
    assert held > 4 * streamed
