"""The audit's checks, one pure function each: a pass and a fail on hand-built counts."""

from pathlib import Path

import pytest

from toolkit.dataset import audit_checks as checks
from toolkit.dataset.audit_report import (
    DatasetStats,
    Integrity,
    ReasoningCounts,
    Reprompt,
    ShardStats,
)
from toolkit.dataset.merge_manifest import FrameProblem
from toolkit.job.chat import TokenInfo
from toolkit.job.schema import AuditSpec, ModelSpec

RUN = Path("runs/r")
INFO = TokenInfo(
    think_start_id=10,
    think_end_id=11,
    eos_ids=[2],
    tool_call_start_id=None,
    tool_call_end_id=None,
    vocab_size=1000,
    opens_reasoning=True,
    thinking_kwargs=["thinking"],
)
MODEL = ModelSpec(path="m")


def reasoning(**counts) -> checks.ReasoningChecks:
    """The reasoning checks over these counts, with INFO's tokens and MODEL."""
    return checks.ReasoningChecks(ReasoningCounts(**counts), INFO, MODEL)


def stats(name="all", planned=10, records=10, ok=10, failed=0, **kw) -> DatasetStats:
    return DatasetStats(name=name, planned=planned, records=records, ok=ok, failed=failed, **kw)


def shard(index=0, **kw) -> ShardStats:
    return ShardStats(index=index, done=True, planned=10, **kw)


def test_coverage():
    ok = checks.coverage(stats(ok=8, failed=2), Integrity(), [shard()], 3, [], RUN / "m.txt", RUN)
    assert ok.passed and ok.value == 1.0 and ok.unit == "share"
    assert (
        "all 10 planned prompts present exactly once (8 ok, 2 failed; 3 duplicates kept once)"
        in ok.message
    )
    bad = checks.coverage(
        stats(records=7, ok=7),
        Integrity(),
        [shard(0, missing=3), shard(1)],
        0,
        ["a", "b"],
        RUN / "m.txt",
        RUN,
    )
    assert not bad.passed and bad.value == 0.7
    assert (
        "7 of 10 planned prompts present" in bad.message
        and "3 missing (e.g. a, b; all in runs/r/m.txt)" in bad.message
    )
    assert "in shards 0;" in bad.message and "toolkit resubmit runs/r" in bad.message
    twice = checks.coverage(stats(), Integrity(seen_twice=1), [shard()], 0, [], RUN / "m.txt", RUN)
    assert not twice.passed and "1 present twice" in twice.message


def test_damaged_frames():
    assert checks.damaged_frames([], RUN).passed
    bad = checks.damaged_frames([FrameProblem(3, "s/00003.zst", 4096, "checksum mismatch")], RUN)
    assert not bad.passed and bad.value == 1 and bad.unit == "count"
    assert "shard 3 s/00003.zst at byte 4096 (checksum mismatch)" in bad.message


def test_shard_checksums():
    assert checks.shard_checksums([shard(0, matches_done=True), shard(1, matches_done=None)]).passed
    bad = checks.shard_checksums([shard(0, matches_done=True), shard(4, matches_done=False)])
    assert not bad.passed and bad.value == 1 and "shard files 4 differ" in bad.message


def test_failed_share():
    assert checks.failed_share(stats(ok=10), 0.01, RUN / "f.txt", RUN).passed
    bad = checks.failed_share(stats(ok=8, failed=2, errors={"timeout": 2}), 0.1, RUN / "f.txt", RUN)
    assert not bad.passed and bad.value == 0.2
    assert (
        "2 of 10 prompts failed (20.0%, limit 10.0%): timeout (2). Ids in runs/r/f.txt"
        in bad.message
    )
    # what `toolkit retry` generates again is every kind that may pass, the unreachable and wrong answers too
    assert (
        "may pass (aborted, bad_response, nan, server_error, timeout, unreachable) again"
        in bad.message
    )


def test_failed_share_names_failure_kinds_with_a_real_message():
    msg = "SGLang's NaN stop (finish_reason matched 'NaN happened'): a token sampled from NaN logits after 41 tokens"
    bad = checks.failed_share(
        stats(ok=0, failed=10, errors={"nan": 10}, error_examples={"nan": msg}),
        0.1,
        RUN / "f.txt",
        RUN,
    )
    assert f"nan (10); e.g. {msg!r}" in bad.message and "'…'" not in bad.message


def test_nan_stop():
    assert checks.nan_stop(ReasoningCounts(), [], RUN).passed
    bad = checks.nan_stop(ReasoningCounts(nan_stops=1, nan_failed=2), ["x"], RUN)
    assert (
        not bad.passed
        and bad.value == 3
        and "e.g. x" in bad.message
        and "1 of them are stored as ok" in bad.message
    )


def test_reasoning_mode():
    good = reasoning(in_reasoning=5, mode_opened=5).mode(5, [])
    assert (
        good.passed
        and "5 of 5 ok outputs are in reasoning mode (5 opened by the template)" in good.message
    )
    closed = reasoning(in_reasoning=4, closed_by_template=1).mode(5, ["c"])
    assert not closed.passed and "CLOSED reasoning" in closed.message and "e.g. c" in closed.message
    assert "chat_template_kwargs = { thinking = true }" in closed.message
    none = reasoning(mode_unknown=5).mode(5, [])
    assert not none.passed and "No ok output is in reasoning mode" in none.message


def test_think_end_share():
    assert reasoning(expected=10, think_end=10).think_end_share(0.9).passed
    bad = reasoning(
        expected=10, think_end=5, length_without_think_end=3, stopped_without_think_end=2
    ).think_end_share(0.9)
    assert not bad.passed and bad.value == 0.5 and "3 hit max_new_tokens" in bad.message
    assert "think-end id 11 ('</think>')" in bad.message


def test_stop_without_think_end():
    assert reasoning(stopped=10).stop_without_think_end(0.01, []).passed
    bad = reasoning(stopped=10, stopped_without_think_end=10).stop_without_think_end(0.01, ["s"])
    assert (
        not bad.passed and bad.value == 1.0 and "the reasoning sits in the content" in bad.message
    )


def test_empty_reasoning():
    assert reasoning(think_end=10).empty_reasoning(0.05, []).passed
    bad = reasoning(think_end=10, empty_reasoning=5).empty_reasoning(0.05, ["e"])
    assert not bad.passed and "closes reasoning at once" in bad.message and "e.g. e" in bad.message


def test_empty_content():
    assert reasoning(stopped_with_think_end=10).empty_content(0.2, []).passed
    bad = reasoning(stopped_with_think_end=10, empty_content=5).empty_content(0.2, ["e"])
    assert (
        not bad.passed
        and bad.value == 0.5
        and "the answer after the think-end id 11" in bad.message
    )


def test_double_think_start():
    assert reasoning(opened_by_template=10).double_think_start(0.01, []).passed
    bad = reasoning(opened_by_template=10, double_think_start=2).double_think_start(0.01, ["d"])
    assert (
        not bad.passed
        and "another think-start id 10" in bad.message
        and "model opens it again" in bad.message
    )


def test_no_reasoning():
    assert reasoning().no_reasoning(10, 0.01, []).passed
    bad = reasoning(think_tokens=3).no_reasoning(10, 0.01, ["t"])
    assert not bad.passed and bad.value == 0.3 and "the model reasoned" in bad.message
    assert "thinking = false" in bad.message


def test_length_share():
    assert checks.length_share(
        [stats("a", length_share=0.1), stats("b", ok=0, length_share=0.9)], 0.2
    ).passed
    bad = checks.length_share([stats("a", length_share=0.5, finish={"length": 5}), stats("b")], 0.2)
    assert not bad.passed and bad.value == 0.5
    assert (
        "dataset 'a': 5 of 10 outputs (50.0%) hit max_new_tokens" in bad.message
        and "'b'" not in bad.message
    )


@pytest.mark.parametrize(
    "check, kinds",
    [
        (checks.stop_tokens, ("stop_mismatch", "bad_finish")),
        (checks.token_counts, ("completion_mismatch", "prompt_mismatch")),
    ],
)
def test_consistency_counts(check, kinds):
    assert check(Integrity()).passed
    for kind in kinds:
        bad = check(Integrity(**{kind: 2}, examples={kind: ["r1"]}))
        assert not bad.passed and bad.value == 2 and "r1" in bad.message


def test_reasoning_split():
    assert checks.reasoning_split(Integrity(), INFO, MODEL).passed
    bad = checks.reasoning_split(
        Integrity(split_mismatch=1, examples={"split_mismatch": ["r"]}), INFO, MODEL
    )
    assert not bad.passed and "not the first think-end id 11" in bad.message


def test_vocabulary():
    assert checks.vocabulary(Integrity(), 1000).passed
    bad = checks.vocabulary(Integrity(out_of_vocab=1, examples={"out_of_vocab": ["r"]}), 1000)
    assert not bad.passed and "ids >= 1000" in bad.message


def test_prompt_rerender():
    good = checks.prompt_rerender(Reprompt(sampled=4))
    assert good.passed and "4 sampled prompts render to exactly the stored ids" in good.message
    bad = checks.prompt_rerender(
        Reprompt(sampled=4, mismatched=1, examples=["p: 3 ids rendered now, 4 stored"])
    )
    assert not bad.passed and "1 of 4 sampled prompts" in bad.message and "p: 3 ids" in bad.message


def _all(model: ModelSpec, **kw) -> list:
    args = dict(
        a=AuditSpec(),
        model=model,
        info=INFO,
        overall=stats(),
        datasets=[stats("d")],
        shards=[shard()],
        integ=Integrity(),
        reprompt=Reprompt(),
        corrupt=[],
        duplicates=0,
        missing_ids=[],
        examples={},
        missing_file=RUN / "m.txt",
        failed_file=RUN / "f.txt",
        run=RUN,
    )
    return checks.run_checks(**{**args, **kw})


def test_run_checks_order_and_the_reasoning_switch():
    common = ["coverage", "damaged_frames", "shard_checksums", "failed_share", "nan_stop"]
    tail = [
        "length_share",
        "degenerate",
        "identical_samples",
        "stop_tokens",
        "token_counts",
        "reasoning_split",
        "vocabulary",
        "prompt_rerender",
    ]
    assert [c.name for c in _all(MODEL)] == common + [
        "reasoning_mode",
        "think_end_share",
        "stop_without_think_end",
        "empty_reasoning",
        "empty_content",
        "double_think_start",
    ] + tail
    assert [c.name for c in _all(ModelSpec(path="m", expect_reasoning=False))] == common + [
        "no_reasoning"
    ] + tail
