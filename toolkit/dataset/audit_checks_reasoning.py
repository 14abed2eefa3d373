"""The audit's checks of reasoning capture: the mode the prompts left the model in, the think-end
written, and what stands on either side of it (or, for a model that does not reason, no think token
at all). `audit_checks` lists every check and runs them in the report's order."""

from __future__ import annotations

from collections.abc import Sequence

from toolkit.dataset.audit_report import Check, Integrity, ReasoningCounts, modes_text
from toolkit.dataset.audit_report import check as _check
from toolkit.job import chat
from toolkit.job.spec import ModelSpec

__all__ = [
    "double_think_start",
    "empty_content",
    "empty_reasoning",
    "no_reasoning",
    "reasoning_mode",
    "reasoning_split",
    "stop_without_think_end",
    "think_end_share",
]


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
