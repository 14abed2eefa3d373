"""The audit's checks: one pure function each, from the facts the auditor gathered to a passed or failed `Check`.

Each message says what was seen and what to do; thresholds come from the job's [audit] table. `all_checks` runs
them in the report's order: merge integrity, failures, NaN stops, reasoning capture (or its absence when
`[model] expect_reasoning = false`), then truncation and consistency.

Checks (name: what must hold; [audit] key):
  coverage                every planned id present exactly once, ok or failed (ids of the rest: missing_ids.txt)
  damaged_frames          no damaged frame in any shard file; shard_checksums: finished files match their manifests
  failed_share            failed / planned <= max_failed_share (ids: failed_ids.txt)
  nan_stop                no output stopped by SGLang on NaN logits (failed records of kind nan, or ok ones of
                          older runs): they end in an EOS the model never wrote
  reasoning_mode          [model] expect_reasoning = true: no prompt the template rendered with reasoning closed,
                          and at least one output really in reasoning mode (no vacuous pass); outputs are counted
                          per mode (opened by the template, opened by the model itself, closed, unknown)
  no_reasoning            expect_reasoning = false instead of the reasoning checks: outputs holding a think token /
                          ok <= max_reasoning_share
  think_end_share         outputs holding the think-end id / ok outputs expected to reason >= min_think_end_share
  stop_without_think_end  outputs finished by a stop token without a think-end / those finished by a stop token
                          <= max_stop_without_think_end_share (the seed's failure)
  empty_reasoning         nothing but blanks before the think-end / outputs with a think-end <= max_empty_reasoning_share
  empty_content           nothing but blanks between think-end and stop / finished outputs with a think-end
                          <= max_empty_content_share
  double_think_start      a think-start in the output although the prompt ends with one / such prompts
                          <= max_double_think_start_share
  length_share            finished by length / ok, per dataset, <= max_length_share
  stop_tokens, token_counts, reasoning_split, vocabulary, prompt_rerender: no exception at all (a `stop` finish
                          ends with its matched id; completion/prompt_tokens equal the ids; reasoning_end is the first
                          think-end; every id inside the tokenizer; `reprompt_sample` prompts re-render identically)
An output is "expected to reason" unless its prompt ends with the think-end id (thinking switched off by the
template). Whitespace-only ids are ignored at the end of prompts and when deciding that a part is empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import chat
from .auditreport import Check, DatasetStats, Integrity, Reprompt, ShardStats, modes_text
from .records import NAN_MATCHED

__all__ = ["Facts", "all_checks"]


@dataclass(frozen=True)
class Facts:
    """What the checks judge, gathered by the auditor once it has seen the last record."""

    audit: object               # the job's [audit] table (spec.AuditSpec)
    plan: object                # the run's plan.RunPlan
    rd: object                  # its rundir.RunDir (file names quoted in messages)
    info: object                # chat.TokenInfo of the run's tokenizer
    manifest: object            # the merge's MergeManifest
    overall: DatasetStats
    datasets: list[DatasetStats]
    shards: list[ShardStats]
    integ: Integrity
    reprompt: Reprompt
    missing_ids: list[str] = field(default_factory=list)      # the first few, quoted
    examples: dict[str, list[str]] = field(default_factory=dict)  # ids quoted per kind of problem


def _check(name: str, passed: bool, value, limit, message: str) -> Check:
    unit = "share" if isinstance(limit, float) else "count"
    return Check(name, bool(passed), value, limit, message, unit)


def _short(nums: list[int], limit: int = 12) -> str:
    if not nums:
        return "-"
    head = ", ".join(map(str, nums[:limit]))
    return head + (f" and {len(nums) - limit} more" if len(nums) > limit else "")


def _think_end(f: Facts) -> str:
    return f"think-end id {f.info.think_end_id} ({f.plan.spec.model.think_end!r})"


def coverage(f: Facts) -> Check:
    """Every planned id present exactly once, ok or failed."""
    plan = f.plan
    integ = f.integ
    run = f.rd.root
    manifest = f.manifest
    overall = f.overall
    shards = f.shards
    missing_ids = f.missing_ids
    present = overall.records
    lost = overall.planned - present
    if lost or integ.seen_twice or integ.id_mismatch:
        incomplete = [s.index for s in shards if s.missing]
        return _check("coverage", False, present / plan.total if plan.total else 1.0, 1.0,
            f"{present} of {plan.total} planned prompts present (ok + failed); {lost} missing "
            f"(e.g. {', '.join(missing_ids)}; all in {f.rd.missing_file}) in shards "
            f"{_short(incomplete)}; {integ.seen_twice} present twice, {integ.id_mismatch} not at their planned "
            f"position. Finish the shards with `toolkit resubmit {run}`, then `toolkit merge {run}` again.")
    else:
        return _check("coverage", True, 1.0, 1.0, f"all {plan.total} planned prompts present exactly once "
            f"({overall.ok} ok, {overall.failed} failed; {manifest.duplicates} duplicates kept once)")


def damaged_frames(f: Facts) -> Check:
    """No damaged frame in any shard file."""
    run = f.rd.root
    manifest = f.manifest
    if manifest.corrupt:
        p = manifest.corrupt[0]
        return _check("damaged_frames", False, len(manifest.corrupt), 0,
            f"{len(manifest.corrupt)} damaged frame(s) in shard files, e.g. shard {p.shard} {p.file} at byte "
            f"{p.offset} ({p.why}); their records are missing. Move the damaged shard file and its .done aside "
            f"and `toolkit resubmit {run}` to generate that shard again (check the disk / file system).")
    else:
        return _check("damaged_frames", True, 0, 0, "every frame of every shard file intact")


def shard_checksums(f: Facts) -> Check:
    """Every finished shard file matches the sha256 of its done manifest."""
    shards = f.shards
    changed = [s.index for s in shards if s.matches_done is False]
    return _check("shard_checksums", not changed, len(changed), 0,
        f"shard files {_short(changed)} differ from the sha256 in their done manifests: they changed after "
        f"they were finished (a second writer, or a copy gone wrong); check them before trusting this run"
        if changed else "every finished shard file matches its done manifest")


def failed_share(f: Facts) -> Check:
    """Failed records / planned <= [audit] max_failed_share."""
    a = f.audit
    plan = f.plan
    run = f.rd.root
    overall = f.overall
    failed_share = overall.failed / plan.total if plan.total else 0.0
    top = ", ".join(f"{k} ({v})" for k, v in list(overall.errors.items())[:3])
    return _check("failed_share", failed_share <= a.max_failed_share, failed_share, a.max_failed_share,
        f"{overall.failed} of {plan.total} prompts failed ({failed_share:.1%}, limit {a.max_failed_share:.1%})"
        + (f": {top}. Ids in {f.rd.failed_file}; `toolkit retry {run}` generates the failures "
           f"that may pass (timeouts, 5xx, aborts, NaN) again, `toolkit retry {run} --ids "
           f"{f.rd.failed_file}` all of them; see `toolkit logs {run} --failed`" if overall.failed else ""))


def nan_stop(f: Facts) -> Check:
    """No output stopped by SGLang on NaN logits."""
    r = f.overall.reasoning
    run = f.rd.root
    nan = r.nan_failed + r.nan_stops
    ex = ", ".join(f.examples.get("nan_stop", []))
    return _check("nan_stop", not nan, nan, 0,
        f"{nan} outputs were stopped by SGLang on NaN logits (finish_reason matched {NAN_MATCHED!r}: the engine "
        f"replaced a token sampled from NaN with a stop id, so the output ends in an EOS the model never wrote; "
        f"e.g. {ex}). {r.nan_stops} of them are stored as ok records (from an older toolkit): generate them "
        f"again. NaN logits point at the model's numerics: check the quantization, kv-cache dtype and attention "
        f"backend in [engine] extra_args. `toolkit retry {run}` generates the failed ones again"
        if nan else "no output was stopped on NaN logits")


def reasoning_mode(f: Facts) -> Check:
    """No prompt rendered with reasoning closed, and at least one output really in reasoning mode."""
    info = f.info
    model = f.plan.spec.model
    r = f.overall.reasoning
    overall = f.overall
    where = _where(f)
    what_to_check = _what_to_check(f)
    closed, modes = r.closed_by_template, modes_text(r)
    if closed or not r.in_reasoning:
        ex = ", ".join(f.examples.get("closed_by_template", []))
        return _check("reasoning_mode", False, r.in_reasoning, overall.ok,
            (f"{closed} of {overall.ok} ok outputs were generated from prompts whose template CLOSED reasoning "
             f"(they end with {model.think_end!r}: thinking switched off, e.g. {ex}), so they hold no reasoning; "
             f"{chat.thinking_hint(info, True)}, or set [model] expect_reasoning = false for non-thinking data. "
             if closed else "")
            + (f"No ok output is in reasoning mode ({modes}): the data holds no reasoning at all. {where} "
               f"{what_to_check}" if not r.in_reasoning else f"({modes})"))
    else:
        return _check("reasoning_mode", True, r.in_reasoning, overall.ok,
            f"{r.in_reasoning} of {overall.ok} ok outputs are in reasoning mode ({modes})")


def think_end_share(f: Facts) -> Check:
    """Outputs holding the think-end / those expected to reason >= min_think_end_share."""
    a = f.audit
    r = f.overall.reasoning
    te = _think_end(f)
    share = r.think_end / r.expected if r.expected else 0.0
    return _check("think_end_share", share >= a.min_think_end_share, share, a.min_think_end_share,
        f"{r.think_end} of {r.expected} ok outputs in reasoning mode hold the {te} ({share:.1%}, minimum "
        f"{a.min_think_end_share:.0%})" + ("" if share >= a.min_think_end_share else
        f"; of those without it, {r.length_without_think_end} hit max_new_tokens while reasoning (raise "
        f"max_new_tokens for those) and {r.stopped_without_think_end} stopped normally (see "
        f"stop_without_think_end)"))


def stop_without_think_end(f: Facts) -> Check:
    """Outputs that stopped without a think-end / stopped outputs <= the limit."""
    a = f.audit
    r = f.overall.reasoning
    te = _think_end(f)
    where = _where(f)
    what_to_check = _what_to_check(f)
    share = r.stopped_without_think_end / r.stopped if r.stopped else 0.0
    ex = ", ".join(f.examples.get("stopped_without_think_end", []))
    return _check("stop_without_think_end", share <= a.max_stop_without_think_end_share, share,
        a.max_stop_without_think_end_share,
        f"{r.stopped_without_think_end} of {r.stopped} outputs that ended with a stop token have no {te} "
        f"({share:.1%}, limit {a.max_stop_without_think_end_share:.1%})"
        + ("" if share <= a.max_stop_without_think_end_share else
           f": the model finished without ever writing the think-end, so reasoning and answer cannot be told "
           f"apart: the reasoning sits in the content, mixed with the answer, and a reasoning field split from "
           f"it is empty (e.g. {ex}). {where} {what_to_check}"))


def empty_reasoning(f: Facts) -> Check:
    """Outputs with nothing but blanks before the think-end <= the limit."""
    a = f.audit
    model = f.plan.spec.model
    r = f.overall.reasoning
    share = r.empty_reasoning / r.think_end if r.think_end else 0.0
    return _check("empty_reasoning", share <= a.max_empty_reasoning_share, share, a.max_empty_reasoning_share,
        f"{r.empty_reasoning} of {r.think_end} outputs with a think-end have empty reasoning ({share:.1%}, limit "
        f"{a.max_empty_reasoning_share:.1%})" + ("" if share <= a.max_empty_reasoning_share else
        f" (e.g. {', '.join(f.examples.get('empty_reasoning', []))}): the model closes reasoning at once. "
        f"Check that thinking is enabled in chat_template_kwargs and the template does not pre-fill "
        f"{model.think_start!r}{model.think_end!r}."))


def empty_content(f: Facts) -> Check:
    """Finished outputs with nothing but blanks after the think-end <= the limit."""
    a = f.audit
    r = f.overall.reasoning
    te = _think_end(f)
    share = r.empty_content / r.stopped_with_think_end if r.stopped_with_think_end else 0.0
    return _check("empty_content", share <= a.max_empty_content_share, share, a.max_empty_content_share,
        f"{r.empty_content} of {r.stopped_with_think_end} finished outputs with reasoning have empty content "
        f"({share:.1%}, limit {a.max_empty_content_share:.1%})" + ("" if share <= a.max_empty_content_share else
        f" (e.g. {', '.join(f.examples.get('empty_content', []))}): the answer after the {te} is missing. "
        f"Check stop / stop_token_ids (a stop at the think-end or right after it) and [model] think_end."))


def double_think_start(f: Facts) -> Check:
    """A think-start in the output although the prompt opened one <= the limit."""
    a = f.audit
    info = f.info
    model = f.plan.spec.model
    r = f.overall.reasoning
    share = r.double_think_start / r.opened_by_template if r.opened_by_template else 0.0
    return _check("double_think_start", share <= a.max_double_think_start_share, share, a.max_double_think_start_share,
        f"{r.double_think_start} of {r.opened_by_template} outputs whose prompt already opened reasoning "
        f"contain another think-start id {info.think_start_id} ({share:.1%}, limit "
        f"{a.max_double_think_start_share:.1%})" + ("" if share <= a.max_double_think_start_share else
        f" (e.g. {', '.join(f.examples.get('double_think_start', []))}): the template opens "
        f"{model.think_start!r} and the model opens it again: the template does not match the model's training "
        f"format. Check [model] chat_template / chat_template_kwargs."))


def no_reasoning(f: Facts) -> Check:
    """expect_reasoning = false: outputs holding a think token <= max_reasoning_share."""
    a = f.audit
    model = f.plan.spec.model
    r = f.overall.reasoning
    overall = f.overall
    te = _think_end(f)
    share = r.think_tokens / overall.ok if overall.ok else 0.0
    ex = ", ".join(f.examples.get("think_tokens", []))
    return _check("no_reasoning", share <= a.max_reasoning_share, share, a.max_reasoning_share,
        f"{r.think_tokens} of {overall.ok} ok outputs hold a think token ({model.think_start!r} or the {te}) "
        f"although [model] expect_reasoning = false ({share:.1%}, limit {a.max_reasoning_share:.1%}; modes: "
        f"{modes_text(r)})" + ("" if share <= a.max_reasoning_share else
        f" (e.g. {ex}): the model reasoned. {chat.thinking_hint(f.info, False)}, or set expect_reasoning = "
        f"true to keep the reasoning"))


def length_share(f: Facts) -> Check:
    """Per dataset, outputs finished by length / ok <= max_length_share."""
    a = f.audit
    datasets = f.datasets
    over = [d for d in datasets if d.ok and d.length_share > a.max_length_share]
    worst = max((d.length_share for d in datasets if d.ok), default=0.0)
    return _check("length_share", not over, worst, a.max_length_share,
        "; ".join(f"dataset {d.name!r}: {d.finish.get('length', 0)} of {d.ok} outputs ({d.length_share:.1%}) hit "
                  f"max_new_tokens" for d in over)
        + (f" (limit {a.max_length_share:.0%}): raise max_new_tokens for those datasets ([[datasets]] sampling) "
           f"or accept truncated outputs by raising [audit] max_length_share" if over else
           f"at most {worst:.1%} of a dataset's outputs hit max_new_tokens (limit {a.max_length_share:.0%})"))


def stop_tokens(f: Facts) -> Check:
    """Every `stop` finish ends with its matched id; every ok record has a stop or length finish."""
    integ = f.integ
    ex = integ.examples
    bad = integ.stop_mismatch + integ.bad_finish
    return _check("stop_tokens", not bad, bad, 0,
        f"{integ.stop_mismatch} `stop` finishes whose matched id is not the last output id, {integ.bad_finish} ok "
        f"records without a stop/length finish (e.g. {', '.join(ex.get('stop_mismatch', []) + ex.get('bad_finish', []))}): "
        f"the engine's output_ids were cut or re-assembled; check the engine version and flags (no_stop_trim, "
        f"stream options)" if bad else
        f"every `stop` finish ends with its matched id ({integ.unexpected_stop} matched ids outside eos and "
        f"stop_token_ids)")


def token_counts(f: Facts) -> Check:
    """completion_tokens and prompt_tokens equal the stored ids."""
    ex = f.integ.examples
    integ = f.integ
    bad = integ.completion_mismatch + integ.prompt_mismatch
    return _check("token_counts", not bad, bad, 0,
        f"{integ.completion_mismatch} records with completion_tokens != len(output_ids) and "
        f"{integ.prompt_mismatch} with prompt_tokens != len(prompt_ids) (e.g. "
        f"{', '.join(ex.get('completion_mismatch', []) + ex.get('prompt_mismatch', []))}): the server's counts "
        f"disagree with the ids it returned; check the engine version" if bad else
        "completion_tokens and prompt_tokens equal the stored ids everywhere")


def reasoning_split(f: Facts) -> Check:
    """reasoning_end is the first think-end id everywhere."""
    ex = f.integ.examples
    integ = f.integ
    te = _think_end(f)
    return _check("reasoning_split", not integ.split_mismatch, integ.split_mismatch, 0,
        f"{integ.split_mismatch} records whose reasoning_end is not the first {te} (e.g. "
        f"{', '.join(ex.get('split_mismatch', []))}): the run was generated with other think tokens than "
        f"[model] has now" if integ.split_mismatch else "reasoning_end is the first think-end id everywhere")


def vocabulary(f: Facts) -> Check:
    """Every id below the tokenizer's size."""
    ex = f.integ.examples
    integ = f.integ
    info = f.info
    return _check("vocabulary", not integ.out_of_vocab, integ.out_of_vocab, 0,
        f"{integ.out_of_vocab} records hold ids >= {info.vocab_size}, outside the tokenizer (e.g. "
        f"{', '.join(ex.get('out_of_vocab', []))}): the engine served another model or tokenizer than [model] "
        f"names" if integ.out_of_vocab else f"every id below the tokenizer size {info.vocab_size}")


def prompt_rerender(f: Facts) -> Check:
    """A sample of prompts re-renders to exactly the stored ids."""
    reprompt = f.reprompt
    return _check("prompt_rerender", not reprompt.mismatched, reprompt.mismatched, 0,
        f"{reprompt.mismatched} of {reprompt.sampled} sampled prompts render to other ids than those stored "
        f"({'; '.join(reprompt.examples)}): the tokenizer, chat template or prompt files changed since "
        f"generation; restore them, or the dataset does not match its sources" if reprompt.mismatched else
        f"{reprompt.sampled} sampled prompts render to exactly the stored ids")


def _where(f: Facts) -> str:
    info, model = f.info, f.plan.spec.model
    return (f"The chat template {'opens' if info.opens_reasoning else 'does not open'} reasoning "
                 f"(prompts {'end' if info.opens_reasoning else 'do not end'} with {model.think_start!r}).")


def _what_to_check(f: Facts) -> str:
    te = _think_end(f)
    return (
        f"Check: [model] chat_template and chat_template_kwargs (e.g. thinking = true for Kimi, enable_thinking = "
        f"true for Qwen3) so the prompt puts the model in reasoning mode; [model] think_end is the token this "
        f"model writes (here {te}); the server flags (a chat template or reasoning parser overriding the "
        f"model's, stop / stop_token_ids that cut at the think-end). For a model that does not reason, set "
        f"[audit] min_think_end_share = 0 and max_stop_without_think_end_share = 1.")



REASONING = (reasoning_mode, think_end_share, stop_without_think_end, empty_reasoning, empty_content, double_think_start)
CONSISTENCY = (length_share, stop_tokens, token_counts, reasoning_split, vocabulary, prompt_rerender)


def all_checks(f: Facts) -> list[Check]:
    """Every check, in the report's order."""
    first = [coverage(f), damaged_frames(f), shard_checksums(f), failed_share(f), nan_stop(f)]
    middle = [fn(f) for fn in REASONING] if f.plan.spec.model.expect_reasoning else [no_reasoning(f)]
    return first + middle + [fn(f) for fn in CONSISTENCY]
