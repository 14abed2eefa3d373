"""What is not training data: repetition loops on token ids, identical samples, and what the audit and the exports
do with them (counted per dataset, shown in audit.html, left out of the training exports by default)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

import runs
from jobfiles import make_job, prepared_run
from toolkit.cli import main as cli_main
from toolkit.dataset.audit import audit_run
from toolkit.dataset.export import Selection, export_run
from toolkit.dataset.finish import audit_and_report
from toolkit.dataset.merge import merge_run
from toolkit.formats.loops import LOOP_MIN_TOKENS, LOOP_WINDOW, repetition_loop


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def pool(toy_tokenizer):
    from toolkit.job import chat
    from toolkit.job.schema import ModelSpec

    tok = chat.load_tokenizer(ModelSpec(path=str(toy_tokenizer("kimi"))))
    return runs.text_pool(tok, "quality-kimi", 400_000)


def test_text_is_not_a_loop_and_a_repeated_span_is(pool):
    rng = random.Random(1)
    for _ in range(200):  # real English of every length: never a loop
        n = rng.randrange(LOOP_MIN_TOKENS, 3000)
        start = rng.randrange(len(pool) - n)
        assert repetition_loop(pool[start : start + n]) is None
    text = pool[1000:1400]
    for period in (1, 7, 40, 128):
        span = pool[5000 : 5000 + period]
        looped = np.concatenate([text, np.tile(span, LOOP_WINDOW // period + 2)])
        assert repetition_loop(looped) == period
    assert (
        repetition_loop(np.tile(pool[:129], 8)) is None
    )  # a span longer than LOOP_MAX_PERIOD is not looked for


def test_the_definition_at_its_edges(pool):
    span = pool[7000:7012]
    # a counter that changes each time round (one id of twelve differs): still a loop
    reps = [np.concatenate([span[:-1], [pool[9000 + i]]]) for i in range(60)]
    assert repetition_loop(np.concatenate([pool[:300], *reps])) == 12
    # the loop must cover most of the tail: 30% of the last 512 ids is not enough
    tail_loop = np.tile(span, 13)  # 156 ids
    assert repetition_loop(np.concatenate([pool[:2000], tail_loop])) is None
    # and at least four repeats: a period above a quarter of the tail is not looked for
    assert repetition_loop(np.tile(pool[:30], 3)) is None
    assert repetition_loop(np.tile(pool[:4], 15)) is None  # 60 ids: shorter than LOOP_MIN_TOKENS


def looping(s: runs.Synth, pos: int, rng: random.Random) -> runs.Out:
    """Reasoning that falls into a loop of a 9-id span until max_new_tokens (400)."""
    span = s.text(rng, 9)
    ids = s.text(rng, 20) + span * 45
    return runs.Out(ids[:400], "length", None)


LOOPING = ("math-0001", "math-0004", "chat-0002")


@pytest.fixture(scope="module")
def loop_run(tmp_path_factory, toy_tokenizer):
    s = runs.plan_run(
        tmp_path_factory.mktemp("loops"),
        toy_tokenizer("kimi"),
        datasets={"math": 10, "chat": 10},
        shards=2,
        sampling={"max_new_tokens": 400},
        audit={"max_length_share": 1.0},
    )
    ok = runs.healthy()
    runs.write_run(
        s, lambda s, pos, rng: (looping if s.refs[pos].id in LOOPING else ok)(s, pos, rng)
    )
    merge_run(s.root)
    return s


def test_the_audit_counts_loops_per_dataset_and_shows_one(loop_run):
    s = loop_run
    report = audit_run(s.root)
    by = {d.name: d for d in report.datasets}
    assert (by["math"].degenerate, by["chat"].degenerate, report.overall.degenerate) == (2, 1, 3)
    check = next(c for c in report.checks if c.name == "degenerate")
    assert not check.passed and check.value == pytest.approx(0.2) and check.limit == 0.02
    assert (
        "dataset 'math': 2 of 10 outputs (20.0%)" in check.message and "math-0001" in check.message
    )
    shown = {
        d.dataset: [o for o in d.outputs if o.why.startswith("repetition loop")]
        for d in report.samples
    }
    first = min(
        ("math-0001", "math-0004"),
        key=lambda i: next(r.index for r in s.written.values() if r.id == i),
    )
    assert [o.id for o in shown["math"]] == [first] and [o.id for o in shown["chat"]] == [
        "chat-0002"
    ]
    assert "a span of 9 ids repeated" in shown["math"][0].why
    with pytest.raises(Exception):  # the audit fails (and writes its reports)
        audit_and_report(s.root)
    data = json.loads(s.rd.audit_json.read_text())
    assert [d["degenerate"] for d in data["datasets"]] == [2, 1]
    html = s.rd.audit_html.read_text()
    assert "repetition loop: a span of 9 ids repeated over the tail" in html and "'loops'" in html


def test_loops_are_left_out_of_the_training_exports_unless_included(loop_run, tmp_path):
    s = loop_run
    out = tmp_path / "t.jsonl"
    summary = export_run(s.root, "tokens", out)
    assert (summary.planned, summary.exported, summary.skipped, summary.failed) == (20, 17, 3, 0)
    assert summary.skipped_by_reason == {"degenerate": 3}
    assert sorted((r["id"], r["reason"]) for r in lines(tmp_path / "t_skipped.jsonl")) == [
        ("chat-0002", "degenerate"),
        ("math-0001", "degenerate"),
        ("math-0004", "degenerate"),
    ]
    assert json.loads((tmp_path / "t_summary.json").read_text())["skipped_by_reason"] == {
        "degenerate": 3
    }
    # a loop cut by max_new_tokens is a loop first: --include-truncated does not bring it back
    assert (
        export_run(
            s.root, "tokens", out, select=Selection(include=frozenset({"truncated"}))
        ).exported
        == 17
    )
    assert (
        export_run(
            s.root, "tokens", out, select=Selection(include=frozenset({"degenerate"}))
        ).exported
        == 20
    )
    assert (
        export_run(s.root, "jsonl", tmp_path / "j.jsonl").exported == 20
    )  # the record format keeps every ok record


def identical(s: runs.Synth, pos: int, rng: random.Random) -> runs.Out:
    """Both samples of prompts 0 and 2 write the same ids (a sampler that does not sample)."""
    prompt = pos // 2
    r = random.Random(prompt if prompt in (0, 2) else 1000 + pos)
    return runs.healthy()(s, pos, r)


def test_identical_samples_of_one_prompt_are_flagged(tmp_path, toy_tokenizer):
    s = runs.plan_run(
        tmp_path,
        toy_tokenizer("kimi"),
        datasets={"math": 5},
        shards=1,
        sampling={"n": 2, "temperature": 0.7},
    )
    runs.write_run(s, identical)
    merge_run(s.root)
    report = audit_run(s.root)
    d = report.datasets[0]
    assert (d.identical_samples, d.samples_compared) == (2, 5)
    check = next(c for c in report.checks if c.name == "identical_samples")
    assert not check.passed and "2 of 5 samples (40.0%) repeat an earlier sample" in check.message
    assert (
        "math-0000#1 = math-0000#0" in check.message
        and "math-0002#1 = math-0002#0" in check.message
    )


def test_greedy_or_single_samples_are_not_compared(tmp_path, toy_tokenizer):
    s = runs.plan_run(tmp_path, toy_tokenizer("kimi"), datasets={"math": 4}, shards=1)
    runs.write_run(
        s, lambda s, pos, rng: runs.healthy()(s, pos, random.Random(0))
    )  # all the same, n = 1
    merge_run(s.root)
    report = audit_run(s.root)
    check = next(c for c in report.checks if c.name == "identical_samples")
    assert check.passed and report.datasets[0].identical_samples == 0


# ---------------------------------------------------------------------------------------------------
# the stub makes them on request
# ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_stub_loops_on_request_and_the_run_shows_it(tmp_path, toy_tokenizer, capsys):
    job = make_job(
        tmp_path,
        toy_tokenizer("kimi"),
        n=16,
        sampling={"max_new_tokens": 300},
        stub={"degenerate_fraction": 0.25},
        audit={"max_length_share": 1.0, "max_degenerate_share": 1.0, "min_think_end_share": 0.0},
    )
    assert cli_main(["run", str(job)]) == 0
    rd, _ = prepared_run(job)
    audit = json.loads(rd.audit_json.read_text())
    loops = audit["datasets"][0]["degenerate"]
    assert 1 <= loops <= 10
    assert any(o["why"].startswith("repetition loop") for o in audit["samples"][0]["outputs"])
    capsys.readouterr()
    assert (
        cli_main(
            ["export", str(rd.root), "--format", "conversations", "-o", str(tmp_path / "c.jsonl")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"degenerate {loops}" in out
    skipped = lines(tmp_path / "c_skipped.jsonl")
    assert sum(r["reason"] == "degenerate" for r in skipped) == loops
    assert all(r["finish_reason"] == "length" for r in skipped if r["reason"] == "degenerate")


@pytest.mark.slow
def test_the_stub_makes_identical_samples_on_request(tmp_path, toy_tokenizer):
    sampling = {"max_new_tokens": 64, "n": 2, "temperature": 0.6, "sampling_seed": 5}
    job = make_job(
        tmp_path / "a",
        toy_tokenizer("kimi"),
        n=4,
        sampling=sampling,
        audit={"max_length_share": 1.0},
    )
    assert cli_main(["run", str(job)]) == 0  # seeded samples differ: the check passes
    rd, _ = prepared_run(job)
    check = next(
        c
        for c in json.loads(rd.audit_json.read_text())["checks"]
        if c["name"] == "identical_samples"
    )
    assert check["passed"] and check["value"] == 0
    job = make_job(
        tmp_path / "b",
        toy_tokenizer("kimi"),
        n=4,
        sampling=sampling,
        audit={"max_length_share": 1.0},
        stub={"identical_samples": True},
    )
    assert cli_main(["run", str(job)]) == 1
    rd, _ = prepared_run(job)
    check = next(
        c
        for c in json.loads(rd.audit_json.read_text())["checks"]
        if c["name"] == "identical_samples"
    )
    assert not check["passed"] and check["value"] == 1.0 and "p0000#1 = p0000#0" in check["message"]
