"""The audit's checks of the outputs themselves: truncation by max_new_tokens, repetition loops,
identical samples, and the consistency of the stored ids with what the engine said (stop ids, token
counts, vocabulary, prompts rendered again). `audit_checks` lists every check and runs them."""

from __future__ import annotations

from collections.abc import Sequence

from toolkit.dataset.audit_report import Check, DatasetStats, Integrity, Reprompt
from toolkit.dataset.audit_report import check as _check

__all__ = [
    "degenerate",
    "identical_samples",
    "length_share",
    "prompt_rerender",
    "stop_tokens",
    "token_counts",
    "vocabulary",
]


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
