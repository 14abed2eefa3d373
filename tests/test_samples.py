"""Several samples per prompt ([sampling] n): one record per (prompt, sample), exactly once, resumable, exported."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from jobfiles import make_job, prepared_run
from runs import planned_refs
from toolkit.cli import main as cli_main
from toolkit.dataset.export import export_run
from toolkit.formats.frames import read_shard
from toolkit.formats.progress import read_progress
from toolkit.job.plan import plan_job
from toolkit.job.spec import load_spec
from toolkit.worker.run import DONE, run_shard


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def test_each_prompt_is_planned_once_per_sample_and_samples_stay_in_one_shard(tmp_path, kimi):
    job = make_job(
        tmp_path, kimi, n=7, shards=3, sampling={"max_new_tokens": 64, "n": 3, "temperature": 0.6}
    )
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
    assert [r.id for r in refs] == [f"p{i:04d}" for i in range(4)] and all(
        r.sample == 0 for r in refs
    )


def test_requests_never_carry_n_and_seeded_samples_differ(tmp_path, kimi):
    job = make_job(
        tmp_path,
        kimi,
        n=2,
        sampling={"max_new_tokens": 64, "n": 4, "temperature": 0.6, "sampling_seed": 100},
    )
    spec = load_spec(job)
    params = [spec.request_sampling("d", k) for k in range(4)]
    assert all("n" not in p for p in params)
    assert [p["sampling_seed"] for p in params] == [100, 101, 102, 103]
    assert spec.sampling_for("d")["sampling_seed"] == 100  # the spec itself is unchanged


@pytest.mark.slow
def test_a_run_with_samples_has_every_prompt_sample_exactly_once_and_exports_the_index(
    tmp_path, kimi
):
    job = make_job(
        tmp_path,
        kimi,
        n=5,
        shards=2,
        sampling={"max_new_tokens": 64, "n": 2, "temperature": 0.6, "sampling_seed": 3},
        audit={"max_length_share": 1.0},
    )
    rd, plan = prepared_run(job)
    assert run_shard(rd.root, 0).end == DONE
    assert run_shard(rd.root, 0).end == DONE  # resumed: nothing generated twice
    assert cli_main(["run", str(job)]) == 0  # the other shard, then merge and audit
    recs = [r for k in range(2) for r in read_shard(rd.shard_file(k))]
    assert sorted(r.id for r in recs) == sorted(r.id for r in planned_refs(rd)) and len(recs) == 10
    audit = json.loads((rd.merged_dir / "audit.json").read_text())
    assert audit["passed"] and audit["planned"] == 10 and audit["datasets"][0]["planned"] == 10
    out = tmp_path / "out.jsonl"
    assert export_run(rd.root, "jsonl", out).rows == 10
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted((r["id"], r["sample"]) for r in rows) == sorted(
        (f"p{i:04d}#{k}", k) for i in range(5) for k in range(2)
    )
    export_run(rd.root, "tokens", tmp_path / "t.jsonl")
    assert {json.loads(x)["sample"] for x in (tmp_path / "t.jsonl").read_text().splitlines()} == {
        0,
        1,
    }


@pytest.mark.slow
def test_ctrl_c_then_run_again_with_samples_and_no_seed_passes_the_audit(tmp_path, kimi):
    """Each Ctrl-C stops the run with requests in flight (their partial outputs kept); the stub started again
    must draw sample 1 as sample 1 (not as a twin of sample 0) and continue each partial from the draw it was cut
    from (no second think-start): the run then passes its audit, identical_samples and double_think_start
    included."""
    job = make_job(
        tmp_path,
        kimi,
        n=10,
        shards=1,
        stub={"token_delay_s": 0.01},
        sampling={"max_new_tokens": 400, "min_new_tokens": 100, "n": 2, "temperature": 0.8},
        client={"concurrency": 4},
        audit={"max_length_share": 1.0},
    )
    rd, _ = prepared_run(job)
    saved = 0
    for at_least in (4, 10):  # two interruptions, at two moments
        proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit", "run", str(job)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            p = read_progress(rd, 0)
            if p is not None and p.state == "generating" and p.done >= at_least:
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        p = read_progress(rd, 0)
        assert p.state == "stopped" and p.done < 20, p
        saved += p.partial_saved
    assert saved > 0, "the interruptions should leave partial outputs to continue"
    assert cli_main(["run", str(job)]) == 0
    audit = json.loads((rd.merged_dir / "audit.json").read_text())
    checks = {c["name"]: c for c in audit["checks"]}
    assert audit["passed"] and audit["planned"] == 20, checks
    for name in ("identical_samples", "double_think_start"):
        assert checks[name]["passed"] and checks[name]["value"] == 0, checks[name]
