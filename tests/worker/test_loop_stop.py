"""Repetition loops stopped while they are generated ([client] loop_stop): outputs asked for in segments of
segment_tokens, each segment's end checked for a loop; a loop is recorded once as it stands (finish "loop", ok,
never training data, never generated again), every other output is token for token the one-request output."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jobfiles import make_job, prepared_run, write_prompts
from toolkit.dataset.finish import merge_and_audit
from toolkit.dataset.quality import Judge, record_loop
from toolkit.formats.frames import read_shard
from toolkit.formats.loops import repetition_loop
from toolkit.formats.progress import read_progress
from toolkit.formats.records import LOOP, OK, PARTIAL, Record, defects
from toolkit.job.schema import ClientSpec
from toolkit.job.spec import load_spec
from toolkit.job.specerrors import SpecError
from toolkit.worker.generate import segment_tokens
from toolkit.worker.run import DONE, run_shard

SAME = (
    "output_ids",
    "finish",
    "matched_stop",
    "reasoning_end",
    "tool_call_at",
    "completion_tokens",
    "prompt_ids",
    "status",
)
MAX_NEW = 4096
SEGMENT = 512


@pytest.fixture(scope="module")
def kimi(toy_tokenizer):
    return toy_tokenizer("kimi")


def records(run: Path) -> list[Record]:
    return list(read_shard(Path(run) / "shards" / "00000.zst"))


def newest(run: Path) -> dict[str, Record]:
    return {r.id: r for r in records(run)}


def fields(r: Record) -> dict:
    return {f: getattr(r, f) for f in SAME}


def loop_job(tmp: Path, prompts: Path, loop_stop: bool, **stub) -> Path:
    # output_scale: the stub's lengths follow max_new_tokens, a model's do not; both runs get the same outputs
    return make_job(
        tmp,
        _KIMI[0],
        prompts=prompts,
        sampling={"max_new_tokens": MAX_NEW},
        stub={"degenerate_fraction": 0.2, "output_scale": MAX_NEW, **stub},
        client={"concurrency": 8, "loop_stop": loop_stop, "segment_tokens": SEGMENT},
        audit={"max_degenerate_share": 1.0, "max_length_share": 1.0, "min_think_end_share": 0.0},
    )


_KIMI: list[Path] = []


@pytest.fixture
def runs(tmp_path, kimi):
    _KIMI[:] = [kimi]
    prompts = write_prompts(tmp_path / "prompts.jsonl", 40)
    ref, _ = prepared_run(loop_job(tmp_path / "ref", prompts, loop_stop=False))
    assert run_shard(ref.root, 0).end == DONE
    return tmp_path, prompts, newest(ref.root)


def test_loops_are_stopped_at_a_segment_end_and_every_other_output_is_the_one_request_output(runs):
    tmp_path, prompts, expected = runs
    looping = {
        i for i, r in expected.items() if r.finish == "length" and record_loop(r) is not None
    }
    assert (
        3 <= len(looping) <= 20
    )  # the stub's draw: a fifth of the outputs loop until max_new_tokens
    rd, _ = prepared_run(loop_job(tmp_path / "stopped", prompts, loop_stop=True))
    assert run_shard(rd.root, 0).end == DONE
    got = newest(rd.root)
    assert got.keys() == expected.keys()
    stopped = {i for i, r in got.items() if r.finish == LOOP}
    assert stopped == looping
    for i, r in got.items():
        if i in looping:  # what the loop had written by the first segment's end, no more
            assert (
                r.status == OK
                and r.failure is None
                and r.n_output == SEGMENT == r.completion_tokens
            )
            assert r.output_ids == expected[i].output_ids[: 4 * SEGMENT] and r.matched_stop is None
            assert defects(r, 4000, r.reasoning_end, MAX_NEW) == []
        else:
            assert fields(r) == fields(expected[i]), i
    assert (
        max(r.segments for i, r in got.items() if i not in looping) > 1
    )  # long outputs came in several segments
    assert all(r.segments == 1 for r in expected.values())
    spent = sum(got[i].n_output for i in looping) / sum(expected[i].n_output for i in looping)
    assert spent <= SEGMENT / MAX_NEW
    assert read_progress(rd, 0).loops_stopped == len(looping)

    # the audit counts them as loops (degenerate), never as failures; the exports leave them out
    judge = Judge(think_start_id=0, think_end_id=1, blank_ids=(), expect_reasoning=True)
    assert all(judge.skip_reason(got[i], opened=True) == "degenerate" for i in looping)
    for run in (tmp_path / "ref" / "run", rd.root):
        report = merge_and_audit(run, out=io.StringIO())
        d = report.datasets[0]
        assert d.degenerate == len(looping) and d.failed == 0 and d.ok == len(got), run


@pytest.mark.slow
def test_kill_9_mid_run_records_each_stopped_loop_once(runs):
    tmp_path, prompts, expected = runs
    looping = {
        i for i, r in expected.items() if r.finish == "length" and record_loop(r) is not None
    }
    rd, _ = prepared_run(
        loop_job(tmp_path / "killed", prompts, loop_stop=True, token_delay_s=0.0005)
    )
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        before = len(records(rd.root)) if rd.shard_file(0).exists() else 0
        deadline = time.monotonic() + 120
        while not (rd.shard_file(0).exists() and len(records(rd.root)) >= before + 3):
            assert proc.poll() is None and time.monotonic() < deadline, "no records written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert run_shard(rd.root, 0).end == DONE
    written = [r for r in records(rd.root) if r.status != PARTIAL]
    assert sorted(r.id for r in written) == sorted(expected)  # each id once: no loop recorded twice
    got = {r.id: r for r in written}
    assert {i for i, r in got.items() if r.finish == LOOP} == looping
    assert all(fields(r) == fields(expected[i]) for i, r in got.items() if i not in looping)


def test_params_a_segment_would_change_are_asked_for_in_one_request():
    c = ClientSpec()
    assert segment_tokens(c, {"max_new_tokens": 32768, "temperature": 0.6}) == 4096
    assert (
        segment_tokens(
            c, {"max_new_tokens": 32768, "repetition_penalty": 1.0, "frequency_penalty": 0}
        )
        == 4096
    )
    for extra in (
        {"stop": ["END"]},
        {"frequency_penalty": 0.5},
        {"presence_penalty": 0.1},
        {"repetition_penalty": 1.1},
        {"json_schema": "{}"},
        {"regex": "a+"},
    ):
        assert segment_tokens(c, {"max_new_tokens": 32768, **extra}) is None, extra
    assert segment_tokens(ClientSpec(loop_stop=False), {"max_new_tokens": 32768}) is None


def test_loop_settings_are_checked_with_a_message_naming_them(tmp_path, kimi):
    job = make_job(tmp_path, kimi, client={"segment_tokens": 300, "loop_window": 512})
    with pytest.raises(
        SpecError, match=r"\[client\] loop stop needs .*segment_tokens = 300, loop_window = 512"
    ):
        load_spec(job)


def test_the_detector_s_thresholds_are_those_given():
    rng = np.random.default_rng(3)
    text = rng.integers(100, 4000, 2000).astype("<u4")
    looped = np.concatenate([text, np.tile(text[:200], 4)])  # a 200-id span, repeated over 800 ids
    assert repetition_loop(looped) is None  # longer than the default largest period (128)
    assert repetition_loop(looped, window=800, max_period=200) == 200
    assert repetition_loop(text, window=1024, max_period=256, match=0.5) is None


REPO = Path(__file__).resolve().parents[2]


def _demo_job(tmp: Path, loop_stop: bool) -> Path:
    """The demo job with its outputs asked for in segments of 256 tokens (its max_new_tokens are 768 and 1,024)."""
    text = (REPO / "jobs" / "demo.toml").read_text()
    text = text.replace('output_dir = "../runs/demo"', f'output_dir = "{tmp / "run"}"')
    text = text.replace('"demo/', f'"{REPO / "jobs" / "demo"}/')
    text = text.replace(
        "[client]\n",
        f"[client]\nloop_stop = {'true' if loop_stop else 'false'}\nsegment_tokens = 256\n"
        "loop_window = 256\nloop_max_period = 64\n",
    )
    text = text.replace("[sampling]\n", "[engine.stub]\noutput_scale = 1024\n[sampling]\n")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "job.toml").write_text(text)
    return tmp / "job.toml"


@pytest.mark.slow
def test_no_loop_is_seen_in_the_demo_outputs_at_any_segment_end(tmp_path):
    """The demo's outputs (real English text, reasoning, answers, tool calls) asked for in segments of 256 tokens,
    the smallest allowed, with the detector's smallest window: no false loop, and every output as one request's."""
    got = {}
    for loop_stop in (False, True):
        rd, plan = prepared_run(_demo_job(tmp_path / str(loop_stop), loop_stop))
        for k in range(len(plan.shards)):
            assert run_shard(rd.root, k).end == DONE
        got[loop_stop] = {
            r.id: r
            for k in range(len(plan.shards))
            for r in read_shard(rd.root / "shards" / f"{k:05d}.zst")
        }
    ref, seg = got[False], got[True]
    assert len(ref) == 44 and ref.keys() == seg.keys()
    assert not any(r.finish == LOOP for r in seg.values())
    assert all(fields(seg[i]) == fields(ref[i]) for i in ref)
    assert sum(r.segments > 1 for r in seg.values()) >= 20


def test_a_continuation_sends_prompt_and_output_so_far_as_the_json_of_those_ids():
    import json

    from toolkit.worker.generate import _SentIds

    rng = np.random.default_rng(5)
    for prompt_len in (0, 1, 7):
        prompt = rng.integers(0, 160_000, prompt_len).tolist()
        prior = rng.integers(0, 160_000, int(rng.integers(0, 3))).astype("<u4")
        sent, ids = _SentIds(prompt, prior), prompt + prior.tolist()
        for _ in range(4):
            new = rng.integers(0, 160_000, int(rng.integers(0, 4))).tolist()
            raw = ("[" + ", ".join(map(str, new)) + " ]").encode()  # as a server may space them
            sent.add(raw, np.array(new, "<u4"))
            ids += new
            assert json.loads(sent.json()) == ids


@pytest.mark.slow
def test_a_stop_mid_segment_keeps_partial_outputs_and_the_resume_ends_as_an_uninterrupted_run(runs):
    """SIGUSR2 (a requeue's signal) while outputs are in their segments: the requests in flight come back as
    partial records, the resume continues them in segments, and the shard ends with each loop stopped once and
    every other output the one-request output."""
    tmp_path, prompts, expected = runs
    looping = {
        i for i, r in expected.items() if r.finish == "length" and record_loop(r) is not None
    }
    rd, _ = prepared_run(
        loop_job(tmp_path / "stopped", prompts, loop_stop=True, token_delay_s=0.0005)
    )
    partial = 0
    for _ in range(2):
        proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit", "worker", str(rd.root), "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        before = len(records(rd.root)) if rd.shard_file(0).exists() else 0
        deadline = time.monotonic() + 120
        while not (rd.shard_file(0).exists() and len(records(rd.root)) >= before + 2):
            assert proc.poll() is None and time.monotonic() < deadline, "no records written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(60) == 3
        partial += read_progress(rd, 0).partial_saved
    assert partial >= 2
    assert run_shard(rd.root, 0).end == DONE
    got = newest(rd.root)
    assert got.keys() == expected.keys() and not any(r.status == PARTIAL for r in got.values())
    assert sorted(r.id for r in records(rd.root) if r.status != PARTIAL) == sorted(expected)
    assert {i for i, r in got.items() if r.finish == LOOP} == looping
    assert all(fields(r) == fields(expected[i]) for i, r in got.items() if i not in looping)
    assert all(
        got[i].output_ids == expected[i].output_ids[: len(got[i].output_ids)] for i in looping
    )
