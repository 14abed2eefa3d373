"""The audit's checks: one pure function per check, from the counts the auditor gathered to a
`Check`.

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

from toolkit.dataset.audit_report import (
    Check,
    DatasetStats,
    Integrity,
    ReasoningCounts,
    Reprompt,
    ShardStats,
    modes_text,
)
from toolkit.formats.records import MAY_PASS, NAN_MATCHED
from toolkit.formats.text import ranges
from toolkit.job import chat
from toolkit.job.spec import AuditSpec, ModelSpec

__all__ = [
    "coverage",
    "damaged_frames",
    "degenerate",
    "double_think_start",
    "empty_content",
    "empty_reasoning",
    "failed_share",
    "identical_samples",
    "length_share",
    "nan_stop",
    "no_reasoning",
    "prompt_rerender",
    "reasoning_mode",
    "reasoning_split",
    "run_checks",
    "shard_checksums",
    "stop_tokens",
    "stop_without_think_end",
    "think_end_share",
    "token_counts",
    "vocabulary",
]


def _check(name: str, passed: bool, value, limit, message: str) -> Check:
    return Check(
        name, bool(passed), value, limit, message, "share" if isinstance(limit, float) else "count"
    )


def _short(nums: Sequence[int]) -> str:
    return ranges(nums, limit=12) or "-"


def _te(info: chat.TokenInfo, model: ModelSpec) -> str:
    return f"think-end id {info.think_end_id} ({model.think_end!r})"


def _where(info: chat.TokenInfo, model: ModelSpec) -> str:
    return (
        f"The chat template {'opens' if info.opens_reasoning else 'does not open'} reasoning "
        f"(prompts {'end' if info.opens_reasoning else 'do not end'} with {model.think_start!r})."
    )


def _what_to_check(info: chat.TokenInfo, model: ModelSpec) -> str:
    return (
        "Check: [model] chat_template and chat_template_kwargs (e.g. thinking = true for Kimi, "
        "enable_thinking = true for Qwen3) so the prompt puts the model in reasoning mode; "
        f"[model] think_end is the token this model writes (here {_te(info, model)}); the server "
        "flags (a chat template or reasoning parser overriding the model's, stop / stop_token_ids "
        "that cut at the think-end). For a model that does not reason, set [audit] "
        "min_think_end_share = 0 and max_stop_without_think_end_share = 1."
    )


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
# reasoning capture
# --------------------------------------------------------------------------------------------------
def reasoning_mode(
    r: ReasoningCounts,
    ok: int,
    closed_examples: Sequence[str],
    info: chat.TokenInfo,
    model: ModelSpec,
) -> Check:
    """No prompt rendered with reasoning closed, and at least one ok output really in reasoning
    mode."""
    closed, modes = r.closed_by_template, modes_text(r)
    if closed or not r.in_reasoning:
        return _check(
            "reasoning_mode",
            False,
            r.in_reasoning,
            ok,
            (
                f"{closed} of {ok} ok outputs were generated from prompts whose template CLOSED "
                f"reasoning (they end with {model.think_end!r}: thinking switched off, e.g. "
                f"{', '.join(closed_examples)}), so they hold no reasoning; "
                f"{chat.thinking_hint(info, True)}, or set [model] expect_reasoning = false for "
                "non-thinking data. "
                if closed
                else ""
            )
            + (
                f"No ok output is in reasoning mode ({modes}): the data holds no reasoning at all. "
                f"{_where(info, model)} {_what_to_check(info, model)}"
                if not r.in_reasoning
                else f"({modes})"
            ),
        )
    return _check(
        "reasoning_mode",
        True,
        r.in_reasoning,
        ok,
        f"{r.in_reasoning} of {ok} ok outputs are in reasoning mode ({modes})",
    )


def _share_check(
    name: str,
    part: int,
    whole: int,
    limit: float,
    counted: str,
    when_failed: str,
    *,
    minimum: bool = False,
) -> Check:
    """`part` of `whole` against a limit (a maximum, or with `minimum` a minimum): the message says
    "<part> of <whole> <counted> (share, limit)", and adds `when_failed` only when the check
    fails."""
    share = part / whole if whole else 0.0
    passed = share >= limit if minimum else share <= limit
    bound = f"minimum {limit:.0%}" if minimum else f"limit {limit:.1%}"
    return _check(
        name,
        passed,
        share,
        limit,
        f"{part} of {whole} {counted} ({share:.1%}, {bound})" + ("" if passed else when_failed),
    )


def think_end_share(
    r: ReasoningCounts, limit: float, info: chat.TokenInfo, model: ModelSpec
) -> Check:
    """Outputs holding the think-end id / ok outputs expected to reason, at least [audit]
    min_think_end_share."""
    return _share_check(
        "think_end_share",
        r.think_end,
        r.expected,
        limit,
        f"ok outputs in reasoning mode hold the {_te(info, model)}",
        f"; of those without it, {r.length_without_think_end} hit max_new_tokens while reasoning "
        f"(raise max_new_tokens for those) and {r.stopped_without_think_end} stopped normally (see "
        "stop_without_think_end)",
        minimum=True,
    )


def stop_without_think_end(
    r: ReasoningCounts,
    limit: float,
    examples: Sequence[str],
    info: chat.TokenInfo,
    model: ModelSpec,
) -> Check:
    """Outputs finished by a stop token without a think-end (the seed's failure), at most the
    limit."""
    return _share_check(
        "stop_without_think_end",
        r.stopped_without_think_end,
        r.stopped,
        limit,
        f"outputs that ended with a stop token have no {_te(info, model)}",
        ": the model finished without ever writing the think-end, so reasoning and answer cannot "
        "be told apart: the reasoning sits in the content, mixed with the answer, and a reasoning "
        f"field split from it is empty (e.g. {', '.join(examples)}). {_where(info, model)} "
        f"{_what_to_check(info, model)}",
    )


def empty_reasoning(
    r: ReasoningCounts, limit: float, examples: Sequence[str], model: ModelSpec
) -> Check:
    """Outputs with nothing but blanks before the think-end, at most the limit of those with a
    think-end."""
    return _share_check(
        "empty_reasoning",
        r.empty_reasoning,
        r.think_end,
        limit,
        "outputs with a think-end have empty reasoning",
        f" (e.g. {', '.join(examples)}): the model closes reasoning at once. Check that thinking "
        "is enabled in chat_template_kwargs and the template does not pre-fill "
        f"{model.think_start!r}{model.think_end!r}.",
    )


def empty_content(
    r: ReasoningCounts,
    limit: float,
    examples: Sequence[str],
    info: chat.TokenInfo,
    model: ModelSpec,
) -> Check:
    """Finished outputs with reasoning but nothing after the think-end, at most the limit."""
    return _share_check(
        "empty_content",
        r.empty_content,
        r.stopped_with_think_end,
        limit,
        "finished outputs with reasoning have empty content",
        f" (e.g. {', '.join(examples)}): the answer after the {_te(info, model)} is missing. Check "
        "stop / stop_token_ids (a stop at the think-end or right after it) and [model] think_end.",
    )


def double_think_start(
    r: ReasoningCounts,
    limit: float,
    examples: Sequence[str],
    info: chat.TokenInfo,
    model: ModelSpec,
) -> Check:
    """Outputs that open reasoning again although their prompt opened it, at most the limit of such
    prompts."""
    return _share_check(
        "double_think_start",
        r.double_think_start,
        r.opened_by_template,
        limit,
        "outputs whose prompt already opened reasoning contain another think-start id "
        f"{info.think_start_id}",
        f" (e.g. {', '.join(examples)}): the template opens {model.think_start!r} and the model "
        "opens it again: the template does not match the model's training format. Check [model] "
        "chat_template / chat_template_kwargs.",
    )


def no_reasoning(
    r: ReasoningCounts,
    ok: int,
    limit: float,
    examples: Sequence[str],
    info: chat.TokenInfo,
    model: ModelSpec,
) -> Check:
    """expect_reasoning = false: outputs holding a think token, at most [audit] max_reasoning_share
    of ok ones."""
    share = r.think_tokens / ok if ok else 0.0
    return _check(
        "no_reasoning",
        share <= limit,
        share,
        limit,
        f"{r.think_tokens} of {ok} ok outputs hold a think token ({model.think_start!r} or the "
        f"{_te(info, model)}) although [model] expect_reasoning = false ({share:.1%}, limit "
        f"{limit:.1%}; modes: {modes_text(r)})"
        + (
            ""
            if share <= limit
            else f" (e.g. {', '.join(examples)}): the model reasoned. "
            f"{chat.thinking_hint(info, False)}, or set expect_reasoning = true to keep the "
            "reasoning"
        ),
    )


# --------------------------------------------------------------------------------------------------
# truncation and consistency
# --------------------------------------------------------------------------------------------------
def length_share(datasets: Sequence[DatasetStats], limit: float) -> Check:
    """Outputs cut by max_new_tokens / ok outputs, per dataset, at most [audit] max_length_share."""
    over = [d for d in datasets if d.ok and d.length_share > limit]
    worst = max((d.length_share for d in datasets if d.ok), default=0.0)
    return _check(
        "length_share",
        not over,
        worst,
        limit,
        "; ".join(
            f"dataset {d.name!r}: {d.finish.get('length', 0)} of {d.ok} outputs "
            f"({d.length_share:.1%}) hit max_new_tokens"
            for d in over
        )
        + (
            f" (limit {limit:.0%}): raise max_new_tokens for those datasets ([[datasets]] "
            "sampling) or accept truncated outputs by raising [audit] max_length_share"
            if over
            else f"at most {worst:.1%} of a dataset's outputs hit max_new_tokens (limit "
            f"{limit:.0%})"
        ),
    )


def degenerate(datasets: Sequence[DatasetStats], limit: float, examples: Sequence[str]) -> Check:
    """Outputs in a repetition loop / ok outputs, per dataset, at most [audit]
    max_degenerate_share."""
    share = {d.name: d.degenerate / d.ok for d in datasets if d.ok}
    over = [d for d in datasets if d.ok and share[d.name] > limit]
    worst = max(share.values(), default=0.0)
    counts = (
        "; ".join(
            f"dataset {d.name!r}: {d.degenerate} of {d.ok} outputs ({share[d.name]:.1%})"
            for d in datasets
            if d.degenerate
        )
        or "no output"
    )
    return _check(
        "degenerate",
        not over,
        worst,
        limit,
        f"{counts} in a repetition loop (one span of ids repeated over most of the tail; limit "
        f"{limit:.0%})"
        + (
            f" (e.g. {', '.join(examples)}): the model loops until max_new_tokens. Check the "
            "sampling ([sampling] temperature, repetition_penalty as the model's card "
            "recommends); the training exports leave them out"
            if over
            else (
                f" (e.g. {', '.join(examples)}), left out of the training exports"
                if examples
                else ""
            )
        ),
    )


def identical_samples(
    datasets: Sequence[DatasetStats], limit: float, examples: Sequence[str]
) -> Check:
    """n > 1 at temperature > 0: samples token-identical to an earlier sample of their prompt, at
    most the limit of the samples compared, per dataset."""
    share = {
        d.name: d.identical_samples / d.samples_compared for d in datasets if d.samples_compared
    }
    over = [d for d in datasets if d.samples_compared and share[d.name] > limit]
    worst = max(share.values(), default=0.0)
    if not share:
        return _check(
            "identical_samples",
            True,
            0.0,
            limit,
            "no dataset samples a prompt more than once at a temperature above 0",
        )
    return _check(
        "identical_samples",
        not over,
        worst,
        limit,
        "; ".join(
            f"dataset {d.name!r}: {d.identical_samples} of {d.samples_compared} samples "
            f"({share[d.name]:.1%}) repeat an earlier sample of their prompt token for token"
            for d in datasets
            if d.samples_compared
        )
        + f" (limit {limit:.0%})"
        + (
            f" (e.g. {', '.join(examples)}): the samples do not differ although the temperature is "
            "above 0. Check that the server samples (a sampling_seed without "
            "--enable-deterministic-inference, a server that ignores the temperature)"
            if over
            else ""
        ),
    )


def stop_tokens(integ: Integrity) -> Check:
    """Every `stop` finish ends with its matched id, and every ok record finished by a stop or by
    length."""
    ex = integ.examples
    bad = integ.stop_mismatch + integ.bad_finish
    return _check(
        "stop_tokens",
        not bad,
        bad,
        0,
        f"{integ.stop_mismatch} `stop` finishes whose matched id is not the last output id, "
        f"{integ.bad_finish} ok records without a stop/length finish (e.g. "
        f"{', '.join(ex.get('stop_mismatch', []) + ex.get('bad_finish', []))}): the engine's "
        "output_ids were cut or re-assembled; check the engine version and flags (no_stop_trim, "
        "stream options)"
        if bad
        else f"every `stop` finish ends with its matched id ({integ.unexpected_stop} matched ids "
        "outside eos and stop_token_ids)",
    )


def token_counts(integ: Integrity) -> Check:
    """completion_tokens and prompt_tokens equal the stored ids everywhere, and no output is longer
    than its dataset's max_new_tokens."""
    ex = integ.examples
    bad = integ.completion_mismatch + integ.prompt_mismatch + integ.over_max_new_tokens
    kinds = ("completion_mismatch", "prompt_mismatch", "over_max_new_tokens")
    return _check(
        "token_counts",
        not bad,
        bad,
        0,
        f"{integ.completion_mismatch} records with completion_tokens != len(output_ids), "
        f"{integ.prompt_mismatch} with prompt_tokens != len(prompt_ids) and "
        f"{integ.over_max_new_tokens} with more output ids than max_new_tokens (e.g. "
        f"{', '.join(i for k in kinds for i in ex.get(k, []))}): the server's counts disagree with "
        "the ids it returned; check the engine version"
        if bad
        else "completion_tokens and prompt_tokens equal the stored ids everywhere, no output over "
        "max_new_tokens",
    )


def reasoning_split(integ: Integrity, info: chat.TokenInfo, model: ModelSpec) -> Check:
    """The stored reasoning_end is the first think-end id everywhere."""
    n = integ.split_mismatch
    return _check(
        "reasoning_split",
        not n,
        n,
        0,
        f"{n} records whose reasoning_end is not the first {_te(info, model)} (e.g. "
        f"{', '.join(integ.examples.get('split_mismatch', []))}): the run was generated with other "
        "think tokens than [model] has now"
        if n
        else "reasoning_end is the first think-end id everywhere",
    )


def vocabulary(integ: Integrity, vocab_size: int) -> Check:
    """Every stored id below the tokenizer's size."""
    n = integ.out_of_vocab
    return _check(
        "vocabulary",
        not n,
        n,
        0,
        f"{n} records hold ids >= {vocab_size}, outside the tokenizer (e.g. "
        f"{', '.join(integ.examples.get('out_of_vocab', []))}): the engine served another model or "
        "tokenizer than [model] names"
        if n
        else f"every id below the tokenizer size {vocab_size}",
    )


def prompt_rerender(reprompt: Reprompt) -> Check:
    """Sampled prompts, rendered again from their source lines, give exactly the stored ids."""
    rp = reprompt
    return _check(
        "prompt_rerender",
        not rp.mismatched,
        rp.mismatched,
        0,
        f"{rp.mismatched} of {rp.sampled} sampled prompts render to other ids than those stored "
        f"({'; '.join(rp.examples)}): the tokenizer, chat template or prompt files changed since "
        f"generation; restore them, or the dataset does not match its sources"
        if rp.mismatched
        else f"{rp.sampled} sampled prompts render to exactly the stored ids",
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
    if model.expect_reasoning:
        checks += [
            reasoning_mode(r, overall.ok, ex("closed_by_template"), info, model),
            think_end_share(r, a.min_think_end_share, info, model),
            stop_without_think_end(
                r, a.max_stop_without_think_end_share, ex("stopped_without_think_end"), info, model
            ),
            empty_reasoning(r, a.max_empty_reasoning_share, ex("empty_reasoning"), model),
            empty_content(r, a.max_empty_content_share, ex("empty_content"), info, model),
            double_think_start(
                r, a.max_double_think_start_share, ex("double_think_start"), info, model
            ),
        ]
    else:
        checks.append(
            no_reasoning(r, overall.ok, a.max_reasoning_share, ex("think_tokens"), info, model)
        )
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
