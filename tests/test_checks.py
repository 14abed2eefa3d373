"""The audit's checks as pure functions, on hand-built facts: each passes on good facts and fails on bad ones."""

from __future__ import annotations

from types import SimpleNamespace

from toolkit import checks
from toolkit.auditreport import DatasetStats, Integrity, ReasoningCounts, Reprompt, ShardStats
from toolkit.chat import TokenInfo
from toolkit.rundir import RunDir
from toolkit.spec import AuditSpec, ModelSpec

INFO = TokenInfo(think_start_id=5, think_end_id=6, eos_ids=[2], tool_call_start_id=None, tool_call_end_id=None,
                 vocab_size=100, opens_reasoning=True)


def facts(tmp_path, *, expect_reasoning=True, planned=100, overall=None, reprompt=None, integ=None,
          datasets=None, corrupt=(), **audit) -> checks.Facts:
    model = ModelSpec(path="m", expect_reasoning=expect_reasoning)
    plan = SimpleNamespace(total=planned, spec=SimpleNamespace(model=model))
    good = ReasoningCounts(expected=100, think_end=100, stopped=100, stopped_with_think_end=100,
                           opened_by_template=100, mode_opened=100, in_reasoning=100)
    overall = overall or DatasetStats(name="all", planned=planned, records=planned, ok=planned, reasoning=good)
    shard = ShardStats(index=0, done=True, planned=planned, records=overall.records, matches_done=True)
    return checks.Facts(
        audit=AuditSpec(**audit), plan=plan, rd=RunDir(tmp_path), info=INFO,
        manifest=SimpleNamespace(duplicates=0, corrupt=list(corrupt)), overall=overall,
        datasets=datasets or [overall], shards=[shard], integ=integ or Integrity(),
        reprompt=reprompt or Reprompt(sampled=8), missing_ids=[], examples={})


def by_name(f):
    return {c.name: c for c in checks.all_checks(f)}


def test_good_facts_pass_every_check(tmp_path):
    result = by_name(facts(tmp_path))
    assert all(c.passed for c in result.values()), [c.message for c in result.values() if not c.passed]
    assert list(result)[:5] == ["coverage", "damaged_frames", "shard_checksums", "failed_share", "nan_stop"]
    assert "reasoning_mode" in result and "no_reasoning" not in result


def test_expect_reasoning_false_swaps_the_reasoning_checks(tmp_path):
    result = by_name(facts(tmp_path, expect_reasoning=False,
                           overall=DatasetStats(name="all", planned=100, records=100, ok=100)))
    assert "no_reasoning" in result and "think_end_share" not in result and "reasoning_mode" not in result
    assert result["no_reasoning"].passed


def test_coverage_fails_on_missing_records_and_names_the_file(tmp_path):
    f = facts(tmp_path, overall=DatasetStats(name="all", planned=100, records=97, ok=97))
    c = checks.coverage(f)
    assert not c.passed and c.value == 0.97 and "3 missing" in c.message
    assert str(RunDir(tmp_path).missing_file) in c.message and "toolkit resubmit" in c.message


def test_the_seeds_failure_fails_stop_without_think_end(tmp_path):
    r = ReasoningCounts(expected=100, think_end=0, stopped=100, stopped_without_think_end=100, in_reasoning=100,
                        opened_by_template=100, mode_opened=100)
    f = facts(tmp_path, overall=DatasetStats(name="all", planned=100, records=100, ok=100, reasoning=r))
    assert not checks.stop_without_think_end(f).passed
    assert not checks.think_end_share(f).passed
    assert checks.stop_without_think_end(f).value == 1.0


def test_reasoning_mode_fails_when_the_template_closed_reasoning(tmp_path):
    r = ReasoningCounts(expected=0, closed_by_template=100, in_reasoning=0)
    f = facts(tmp_path, overall=DatasetStats(name="all", planned=100, records=100, ok=100, reasoning=r))
    c = checks.reasoning_mode(f)
    assert not c.passed and "CLOSED" in c.message


def test_nan_stops_fail(tmp_path):
    r = ReasoningCounts(expected=100, think_end=100, stopped=100, in_reasoning=100, nan_failed=2)
    f = facts(tmp_path, overall=DatasetStats(name="all", planned=100, records=100, ok=98, failed=2, reasoning=r))
    c = checks.nan_stop(f)
    assert not c.passed and c.value == 2 and "NaN" in c.message


def test_thresholds_come_from_the_audit_table(tmp_path):
    ds = DatasetStats(name="math", planned=100, records=100, ok=100, finish={"length": 30}, length_share=0.3)
    assert not checks.length_share(facts(tmp_path, datasets=[ds])).passed
    assert checks.length_share(facts(tmp_path, datasets=[ds], max_length_share=0.5)).passed


def test_consistency_checks_fail_on_one_exception(tmp_path):
    assert not checks.vocabulary(facts(tmp_path, integ=Integrity(out_of_vocab=1))).passed
    assert not checks.prompt_rerender(facts(tmp_path, reprompt=Reprompt(sampled=8, mismatched=1,
                                                                      examples=["p1: 3 ids"]))).passed
    assert not checks.damaged_frames(facts(tmp_path, corrupt=[SimpleNamespace(shard=0, file="f", offset=9,
                                                                              why="crc")])).passed
