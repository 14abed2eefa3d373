"""Several samples per prompt ([sampling] n): one record per (prompt, sample), exactly once, resumable, exported."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from jobfiles import make_job, prepared_run
from toolkit.cli import main as cli_main
from toolkit.dataset.export import export_run
from toolkit.formats.frames import read_shard
from toolkit.job.plan import load_refs, plan_job
from toolkit.job.spec import load_spec
from toolkit.worker.run import DONE, run_shard


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def test_each_prompt_is_planned_once_per_sample_and_samples_stay_in_one_shard(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=7, shards=3, sampling={"max_new_tokens": 64, "n": 3, "temperature": 0.6})
    plan, refs = plan_job(load_spec(job))
    assert plan.total == 21 and plan.datasets[0].prompts == 7 and plan.datasets[0].planned == 21
    assert len({r.id for r in refs}) == 21
    assert [(r.id, r.sample) for r in refs[:3]] == [("p0000#0", 0), ("p0000#1", 1), ("p0000#2", 2)]
    for sp in plan.shards:  # a prompt's samples are adjacent, in one shard
        ids = [r.id.rsplit("#", 1)[0] for r in refs[sp.first : sp.first + sp.count]]
        assert all(Counter(ids)[i] == 3 for i in ids)


def test_one_sample_keeps_the_ids_and_plan_of_before(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=4)
    plan, refs = plan_job(load_spec(job))
    assert [r.id for r in refs] == [f"p{i:04d}" for i in range(4)] and all(r.sample == 0 for r in refs)


def test_requests_never_carry_n_and_seeded_samples_differ(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=2, sampling={"max_new_tokens": 64, "n": 4, "temperature": 0.6, "sampling_seed": 100})
    spec = load_spec(job)
    params = [spec.request_sampling("d", k) for k in range(4)]
    assert all("n" not in p for p in params)
    assert [p["sampling_seed"] for p in params] == [100, 101, 102, 103]
    assert spec.sampling_for("d")["sampling_seed"] == 100  # the spec itself is unchanged


@pytest.mark.slow
def test_a_run_with_samples_has_every_prompt_sample_exactly_once_and_exports_the_index(tmp_path, kimi):
    job = make_job(tmp_path, kimi, n=5, shards=2, sampling={"max_new_tokens": 64, "n": 2, "temperature": 0.6,
                                                           "sampling_seed": 3},
                   audit={"max_length_share": 1.0})
    rd, plan = prepared_run(job)
    assert run_shard(rd.root, 0) == DONE
    assert run_shard(rd.root, 0) == DONE  # resumed: nothing generated twice
    assert cli_main(["run", str(job)]) == 0  # the other shard, then merge and audit
    recs = [r for k in range(2) for r in read_shard(rd.shard_file(k))]
    assert sorted(r.id for r in recs) == sorted(r.id for r in load_refs(rd)) and len(recs) == 10
    audit = json.loads((rd.merged_dir / "audit.json").read_text())
    assert audit["passed"] and audit["planned"] == 10 and audit["datasets"][0]["planned"] == 10
    out = tmp_path / "out.jsonl"
    assert export_run(rd.root, "jsonl", out).rows == 10
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted((r["id"], r["sample"]) for r in rows) == sorted((f"p{i:04d}#{k}", k) for i in range(5) for k in range(2))
    export_run(rd.root, "tokens", tmp_path / "t.jsonl")
    assert {json.loads(x)["sample"] for x in (tmp_path / "t.jsonl").read_text().splitlines()} == {0, 1}
