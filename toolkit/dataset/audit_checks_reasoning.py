"""The audit's checks of reasoning capture: the mode the prompts left the model in, the think-end
written, and what stands on either side of it (or, for a model that does not reason, no think token
at all). `ReasoningChecks` holds them over one audit's counts, with the think tokens and the [model]
table their messages name; `audit_checks` lists every check and runs them in the report's order."""

from __future__ import annotations

from collections.abc import Sequence

from toolkit.dataset.audit_report import Check, Integrity, ReasoningCounts, modes_text
from toolkit.dataset.audit_report import check as _check
from toolkit.job import chat
from toolkit.job.schema import ModelSpec

__all__ = ["ReasoningChecks", "reasoning_split"]


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


class ReasoningChecks:
    """The checks of reasoning capture over one audit's counts (`r`); `info` and `model`: the
    think tokens their messages name and the [model] table they point to."""

    def __init__(self, r: ReasoningCounts, info: chat.TokenInfo, model: ModelSpec):
        self.r, self.info, self.model = r, info, model

    def mode(self, ok: int, closed_examples: Sequence[str]) -> Check:
        """No prompt rendered with reasoning closed, and at least one ok output really in reasoning
        mode."""
        r, info, model = self.r, self.info, self.model
        closed, modes = r.closed_by_template, modes_text(r)
        if closed or not r.in_reasoning:
            return _check(
                "reasoning_mode",
                False,
                r.in_reasoning,
                ok,
                (
                    f"{closed} of {ok} ok outputs were generated from prompts whose template "
                    f"CLOSED reasoning (they end with {model.think_end!r}: thinking switched off, "
                    f"e.g. {', '.join(closed_examples)}), so they hold no reasoning; "
                    f"{chat.thinking_hint(info, True)}, or set [model] expect_reasoning = false "
                    "for non-thinking data. "
                    if closed
                    else ""
                )
                + (
                    f"No ok output is in reasoning mode ({modes}): the data holds no reasoning at "
                    f"all. {_where(info, model)} {_what_to_check(info, model)}"
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

    def think_end_share(self, limit: float) -> Check:
        """Outputs holding the think-end id / ok outputs expected to reason, at least [audit]
        min_think_end_share."""
        r = self.r
        return _share_check(
            "think_end_share",
            r.think_end,
            r.expected,
            limit,
            f"ok outputs in reasoning mode hold the {_te(self.info, self.model)}",
            f"; of those without it, {r.length_without_think_end} hit max_new_tokens while "
            f"reasoning (raise max_new_tokens for those) and {r.stopped_without_think_end} stopped "
            "normally (see stop_without_think_end)",
            minimum=True,
        )

    def stop_without_think_end(self, limit: float, examples: Sequence[str]) -> Check:
        """Outputs finished by a stop token without a think-end (the seed's failure), at most the
        limit."""
        info, model = self.info, self.model
        return _share_check(
            "stop_without_think_end",
            self.r.stopped_without_think_end,
            self.r.stopped,
            limit,
            f"outputs that ended with a stop token have no {_te(info, model)}",
            ": the model finished without ever writing the think-end, so reasoning and answer "
            "cannot be told apart: the reasoning sits in the content, mixed with the answer, and a "
            f"reasoning field split from it is empty (e.g. {', '.join(examples)}). "
            f"{_where(info, model)} {_what_to_check(info, model)}",
        )

    def empty_reasoning(self, limit: float, examples: Sequence[str]) -> Check:
        """Outputs with nothing but blanks before the think-end, at most the limit of those with a
        think-end."""
        return _share_check(
            "empty_reasoning",
            self.r.empty_reasoning,
            self.r.think_end,
            limit,
            "outputs with a think-end have empty reasoning",
            f" (e.g. {', '.join(examples)}): the model closes reasoning at once. Check that "
            "thinking is enabled in chat_template_kwargs and the template does not pre-fill "
            f"{self.model.think_start!r}{self.model.think_end!r}.",
        )

    def empty_content(self, limit: float, examples: Sequence[str]) -> Check:
        """Finished outputs with reasoning but nothing after the think-end, at most the limit."""
        return _share_check(
            "empty_content",
            self.r.empty_content,
            self.r.stopped_with_think_end,
            limit,
            "finished outputs with reasoning have empty content",
            f" (e.g. {', '.join(examples)}): the answer after the {_te(self.info, self.model)} is "
            "missing. Check stop / stop_token_ids (a stop at the think-end or right after it) and "
            "[model] think_end.",
        )

    def double_think_start(self, limit: float, examples: Sequence[str]) -> Check:
        """Outputs that open reasoning again although their prompt opened it, at most the limit of
        such prompts."""
        return _share_check(
            "double_think_start",
            self.r.double_think_start,
            self.r.opened_by_template,
            limit,
            "outputs whose prompt already opened reasoning contain another think-start id "
            f"{self.info.think_start_id}",
            f" (e.g. {', '.join(examples)}): the template opens {self.model.think_start!r} and the "
            "model opens it again: the template does not match the model's training format. Check "
            "[model] chat_template / chat_template_kwargs.",
        )

    def no_reasoning(self, ok: int, limit: float, examples: Sequence[str]) -> Check:
        """expect_reasoning = false: outputs holding a think token, at most [audit]
        max_reasoning_share of ok ones."""
        r, info, model = self.r, self.info, self.model
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
