"""The audit's checks: one pure function per check, from the counts the auditor gathered to a
`Check`. This module holds the checks of coverage and integrity of the merge and `run_checks`; the
checks of reasoning capture are in `audit_checks_reasoning` (methods of `ReasoningChecks`, over one
audit's reasoning counts), those of the outputs (truncation, loops, identical samples, consistency
of the ids) in `audit_checks_outputs`.

Every check says what was seen and, when it fails, what to check; thresholds come from the job's
[audit] table. `run_checks` puts them together in the order the report shows them.

The checks exist because of a run whose reasoning fields were silently empty for days: outputs that
stop normally without a think-end id mean the reasoning sits in the content, and that must never
pass unnoticed.

Checks (name: what must hold; [audit] key):
  coverage                every planned id present exactly once, ok or failed (ids of the rest:
                          missing_ids.txt)
  damaged_frames          no damaged frame in any shard file
  shard_checksums         finished files match their done manifests
  failed_share            failed / planned <= max_failed_share (ids: failed_ids.txt)
  nan_stop                no output stopped by SGLang on NaN logits (failed records of kind nan,
                          or ok ones of older runs): they end in an EOS the model never wrote
  reasoning_mode          [model] expect_reasoning = true: no prompt the template rendered with
                          reasoning closed, and at least one output really in reasoning mode (no
                          vacuous pass); outputs are counted per mode (opened by the template,
                          opened by the model itself, closed, unknown)
  no_reasoning            expect_reasoning = false instead of the reasoning checks: outputs
                          holding a think token / ok <= max_reasoning_share
  think_end_share         outputs holding the think-end id / ok outputs expected to reason
                          >= min_think_end_share
  stop_without_think_end  outputs finished by a stop token without a think-end / those finished
                          by a stop token <= max_stop_without_think_end_share (the seed's failure)
  empty_reasoning         nothing but blanks before the think-end / outputs with a think-end
                          <= max_empty_reasoning_share
  empty_content           nothing but blanks between think-end and stop / finished outputs with a
                          think-end <= max_empty_content_share
  double_think_start      a think-start in the output although the prompt ends with one / such
                          prompts <= max_double_think_start_share
  length_share            finished by length / ok, per dataset, <= max_length_share
  degenerate              outputs cut by max_new_tokens in a repetition loop (quality.record_loop:
                          one span of ids repeated over most of the tail) / ok, per dataset,
                          <= max_degenerate_share
  identical_samples       n > 1 at temperature > 0: samples whose output ids equal an earlier
                          sample's of the same prompt / samples compared, per dataset,
                          <= max_identical_sample_share
  stop_tokens, token_counts, reasoning_split, vocabulary, prompt_rerender: no exception at all (a
                          `stop` finish ends with its matched id; completion/prompt_tokens equal
                          the ids; reasoning_end is the first think-end; every id inside the
                          tokenizer; `reprompt_sample` prompts re-render identically)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from toolkit.dataset.audit_checks_outputs import (
    degenerate,
    identical_samples,
    length_share,
    prompt_rerender,
    stop_tokens,
    token_counts,
    vocabulary,
)
from toolkit.dataset.audit_checks_reasoning import ReasoningChecks, reasoning_split
from toolkit.dataset.audit_report import (
    Check,
    DatasetStats,
    Integrity,
    ReasoningCounts,
    Reprompt,
    ShardStats,
)
from toolkit.dataset.audit_report import check as _check
from toolkit.formats.records import MAY_PASS, NAN_MATCHED
from toolkit.formats.text import ranges
from toolkit.job import chat
from toolkit.job.schema import AuditSpec, ModelSpec

__all__ = [
    "coverage",
    "damaged_frames",
    "failed_share",
    "nan_stop",
    "run_checks",
    "shard_checksums",
]


def _short(nums: Sequence[int]) -> str:
    return ranges(nums, limit=12) or "-"


# --------------------------------------------------------------------------------------------------
# coverage and integrity of the merge
# --------------------------------------------------------------------------------------------------
def coverage(
    overall: DatasetStats,
    integ: Integrity,
    shards: Sequence[ShardStats],
    duplicates: int,
    missing_ids: Sequence[str],
    missing_file: Path,
    run: Path,
    continued: int = 0,
    finish: str | None = None,
    noun: str = "prompt",
) -> Check:
    """Every planned prompt present exactly once, at its planned position (`missing_ids`: a few
    examples). `finish`: the command that finishes the run's shards (RunDir.finish_command)."""
    planned, present = overall.planned, overall.records
    lost = planned - present
    if lost or integ.seen_twice or integ.id_mismatch:
        incomplete = [s.index for s in shards if s.missing]
        return _check(
            "coverage",
            False,
            present / planned if planned else 1.0,
            1.0,
            f"{present} of {planned} planned {noun}s present (ok + failed); {lost} missing (e.g. "
            f"{', '.join(missing_ids)}; all in {missing_file}) in shards {_short(incomplete)}; "
            f"{integ.seen_twice} present twice, {integ.id_mismatch} not at their planned position. "
            f"Finish the shards with `{finish or f'toolkit resubmit {run}'}`, then `toolkit merge "
            f"{run}` again.",
        )
    return _check(
        "coverage",
        True,
        1.0,
        1.0,
        f"all {planned} planned {noun}s present exactly once "
        f"({overall.ok} ok, {overall.failed} failed; {duplicates} duplicates kept once"
        + (f", {continued} partial outputs continued" if continued else "")
        + ")",
    )


def damaged_frames(corrupt: Sequence, run: Path, finish: str | None = None) -> Check:
    """No damaged frame in any shard file (`corrupt`: the merge manifest's FrameProblems)."""
    if corrupt:
        p = corrupt[0]
        return _check(
            "damaged_frames",
            False,
            len(corrupt),
            0,
            f"{len(corrupt)} damaged frame(s) in shard files, e.g. shard {p.shard} {p.file} at "
            f"byte {p.offset} ({p.why}); their records are missing. "
            f"`{finish or f'toolkit resubmit {run}'}` checks each shard file against its done "
            "manifest, keeps its intact frames and generates the rest, then merges (check the "
            "disk / file system).",
        )
    return _check("damaged_frames", True, 0, 0, "every frame of every shard file intact")


def shard_checksums(shards: Sequence[ShardStats]) -> Check:
    """Every done shard's file still matches the sha256 of its done manifest."""
    changed = [s.index for s in shards if s.matches_done is False]
    return _check(
        "shard_checksums",
        not changed,
        len(changed),
        0,
        f"shard files {_short(changed)} differ from the sha256 in their done manifests: they "
        "changed after they were done (a second writer, or a copy gone wrong); check them before "
        "trusting this run"
        if changed
        else "every done shard's file matches its done manifest",
    )


def failed_share(
    overall: DatasetStats, limit: float, failed_file: Path, run: Path, noun: str = "prompt"
) -> Check:
    """Failed records / planned within [audit] max_failed_share."""
    planned = overall.planned
    share = overall.failed / planned if planned else 0.0
    top = ", ".join(f"{k} ({v})" for k, v in list(overall.errors.items())[:3])
    first = next(iter(overall.errors), None)
    if first is not None and overall.error_examples.get(first):
        top += f"; e.g. {overall.error_examples[first]!r}"
    return _check(
        "failed_share",
        share <= limit,
        share,
        limit,
        f"{overall.failed} of {planned} {noun}s failed ({share:.1%}, limit {limit:.1%})"
        + (
            f": {top}. Ids in {failed_file}; `toolkit retry {run}` generates the failures "
            f"that may pass ({MAY_PASS}) again, `toolkit retry {run} --ids "
            f"{failed_file}` all of them; see `toolkit logs {run} --failed`"
            if overall.failed
            else ""
        ),
    )


def nan_stop(r: ReasoningCounts, examples: Sequence[str], run: Path) -> Check:
    """No output stopped by SGLang on NaN logits, failed (kind nan) or stored as ok by an older
    toolkit."""
    nan = r.nan_failed + r.nan_stops
    return _check(
        "nan_stop",
        not nan,
        nan,
        0,
        f"{nan} outputs were stopped by SGLang on NaN logits (finish_reason matched "
        f"{NAN_MATCHED!r}: the engine replaced a token sampled from NaN with a stop id, so the "
        f"output ends in an EOS the model never wrote; e.g. {', '.join(examples)}). {r.nan_stops} "
        "of them are stored as ok records (from an older toolkit): generate them again. NaN "
        "logits point at the model's numerics: check the quantization, kv-cache dtype and "
        f"attention backend in [engine] extra_args. `toolkit retry {run}` generates the failed "
        "ones again"
        if nan
        else "no output was stopped on NaN logits",
    )


# --------------------------------------------------------------------------------------------------
def run_checks(
    *,
    a: AuditSpec,
    model: ModelSpec,
    info: chat.TokenInfo,
    overall: DatasetStats,
    datasets: Sequence[DatasetStats],
    shards: Sequence[ShardStats],
    integ: Integrity,
    reprompt: Reprompt,
    corrupt: Sequence,
    duplicates: int,
    missing_ids: Sequence[str],
    examples: dict[str, list[str]],
    missing_file: Path,
    failed_file: Path,
    run: Path,
    continued: int = 0,
    finish: str | None = None,
    noun: str = "prompt",
) -> list[Check]:
    """Every check of an audit, in the report's order (reasoning checks or, without
    expect_reasoning, no_reasoning).

    `examples`: a few ids per kind of problem the auditor saw (nan_stop, closed_by_template, ...).
    """
    r = overall.reasoning

    def ex(kind: str) -> list[str]:
        return examples.get(kind, [])

    checks = [
        coverage(
            overall,
            integ,
            shards,
            duplicates,
            missing_ids,
            missing_file,
            run,
            continued,
            finish,
            noun,
        ),
        damaged_frames(corrupt, run, finish),
        shard_checksums(shards),
        failed_share(overall, a.max_failed_share, failed_file, run, noun),
        nan_stop(r, ex("nan_stop"), run),
    ]
    rc = ReasoningChecks(r, info, model)
    if model.expect_reasoning:
        checks += [
            rc.mode(overall.ok, ex("closed_by_template")),
            rc.think_end_share(a.min_think_end_share),
            rc.stop_without_think_end(
                a.max_stop_without_think_end_share, ex("stopped_without_think_end")
            ),
            rc.empty_reasoning(a.max_empty_reasoning_share, ex("empty_reasoning")),
            rc.empty_content(a.max_empty_content_share, ex("empty_content")),
            rc.double_think_start(a.max_double_think_start_share, ex("double_think_start")),
        ]
    else:
        checks.append(rc.no_reasoning(overall.ok, a.max_reasoning_share, ex("think_tokens")))
    return checks + [
        length_share(datasets, a.max_length_share),
        degenerate(datasets, a.max_degenerate_share, ex("degenerate")),
        identical_samples(datasets, a.max_identical_sample_share, ex("identical_samples")),
        stop_tokens(integ),
        token_counts(integ),
        reasoning_split(integ, info, model),
        vocabulary(integ, info.vocab_size),
        prompt_rerender(reprompt),
    ]
