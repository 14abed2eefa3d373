"""What an ok record must be to be training data: repetition loops on token ids, and the reasons an
output is kept out of the training exports (`skip_reason`).

A record the server answered is not always something a drafter should learn from: reasoning that
never ended (no think-end: the answer is missing and the reasoning field holds everything), an empty
answer, a think marker left inside a part, reasoning in a run that must have none, an output SGLang
stopped on NaN logits, or a repetition loop. An output cut by max_new_tokens is named too
(`truncated`), but it is the model's own distribution at every position it has: the drafters'
export keeps it (`KEPT_FOR_DRAFTERS`), its mask over every id it wrote; a chat row cannot hold it
(the template would close the turn). Each is named by one reason, decided on token ids only, the
same way by the audit and by every export.

Repetition loops (`repetition_loop`, `record_loop`; defined in formats/loops): reasoning models fall
into loops that repeat a span of tokens until max_new_tokens, so only outputs cut by max_new_tokens
(finish_reason length) are looked at (which also keeps the audit fast: most outputs stop), and those
the worker stopped in flight (finish "loop", see worker/inflight), which are loops by its word.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from toolkit.formats.loops import (
    best_period,
    repetition_loop,
)
from toolkit.formats.records import (
    LOOP,
    OK,
    Record,
    all_blank,
    ends_with_stop,
    id_positions,
    is_nan_stop,
    split_parts,
)

__all__ = [
    "KEPT_FOR_DRAFTERS",
    "SKIP_REASONS",
    "Judge",
    "record_loop",
]

# Why an ok record is not training data, in the order they are decided (the first that holds is the
# reason).
SKIP_REASONS = {
    "nan": "stopped by SGLang on NaN logits (it ends in an EOS the model never wrote)",
    "degenerate": "a repetition loop: cut by max_new_tokens or stopped while generated, one span "
    "of ids repeated",
    "truncated": "cut by max_new_tokens (finish_reason length)",
    "no_think_end": "no think-end id: the reasoning never ended (or never started) and there is "
    "no answer",
    "empty_reasoning": "nothing but blanks before the think-end",
    "empty_content": "nothing but blanks after the think-end, and no tool call",
    "think_marker": "a think-start or think-end id inside the reasoning or the answer",
    "reasoning": "a think token although [model] expect_reasoning = false",
}
# Reasons whose records the drafters' export (`tokens`) keeps unless told otherwise: an output cut
# by max_new_tokens is what the model wrote, position by position (a loop is `degenerate` first).
KEPT_FOR_DRAFTERS = frozenset({"truncated"})


def record_loop(rec: Record) -> int | None:
    """The period of the repetition loop an output cut by max_new_tokens ends in (None: none, or it
    stopped). An output the worker stopped as a loop (finish "loop") is one whatever thresholds it
    used: its period is the definition's, else the one at which the most of its tail repeats."""
    if rec.finish == LOOP:
        ids = np.frombuffer(rec.output_ids, "<u4")
        return repetition_loop(ids) or best_period(ids)
    if rec.finish != "length":
        return None
    return repetition_loop(np.frombuffer(rec.output_ids, "<u4"))


class Judge:
    """Decides, on token ids, why an ok record is not training data (`skip_reason`), for one run's
    tokenizer and its [model] expect_reasoning."""

    def __init__(
        self,
        think_start_id: int,
        think_end_id: int,
        blank_ids: Collection[int],
        expect_reasoning: bool,
    ):
        self.ts, self.te = think_start_id, think_end_id
        self.blank = frozenset(blank_ids)
        self.expect_reasoning = expect_reasoning

    def skip_reason(self, rec: Record, opened: bool, looped: bool | None = None) -> str | None:
        """The first of SKIP_REASONS that holds for ok record `rec` (None: training data). `opened`:
        its prompt ends with the think-start id; `looped`: whether it is a repetition loop, when
        the caller knows (`record_loop`)."""
        if rec.status != OK:
            raise ValueError(f"{rec.id}: only ok records are judged, this one is {rec.status}")
        out = rec.output_ids
        n = len(out) >> 2
        if is_nan_stop(rec.finish, rec.matched_stop):
            return "nan"
        if looped if looped is not None else record_loop(rec) is not None:
            return "degenerate"
        if rec.finish == "length":
            return "truncated"
        te = rec.reasoning_end
        if not self.expect_reasoning:
            if te is not None or id_positions(out, self.ts) is not None:
                return "reasoning"
            return (
                "empty_content" if all_blank(out, 0, n - ends_with_stop(rec), self.blank) else None
            )
        if te is None:
            return "no_think_end"
        r0, r1, c0, c1 = split_parts(rec, self.ts, opened)
        if all_blank(out, r0, r1, self.blank):
            return "empty_reasoning"
        if all_blank(out, c0, c1, self.blank) and rec.tool_call_at is None:
            return "empty_content"
        if (
            id_positions(out, self.ts, r0) is not None
            or id_positions(out, self.te, te + 1) is not None
            or (opened and r0 == 1)
        ):
            return "think_marker"
        return None
