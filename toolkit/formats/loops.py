"""Repetition loops on token ids: reasoning models fall into loops that repeat a span of tokens
until max_new_tokens. One definition, used by the worker to stop a loop while it is generated
(worker/inflight) and by the audit and the exports to keep loops out of the dataset
(dataset/quality).

Defined precisely: the tail of an output is its last min(len, window) ids. The output loops with
period p when 1 <= p <= min(max_period, len(tail) // 4) and at least `match` of the tail positions j
>= p hold the id p positions before them (tail[j] == tail[j - p]): with the defaults, all but a
tenth of the tail is one span of p ids repeated at least four times (the tenth tolerates a counter
that changes each time round). Outputs shorter than LOOP_MIN_TOKENS are never loops. The smallest
such p is the loop's period. Normal text repeats a token now and then, never most of its tail at one
fixed distance.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "LOOP_MATCH",
    "LOOP_MAX_PERIOD",
    "LOOP_MIN_TOKENS",
    "LOOP_WINDOW",
    "best_period",
    "repetition_loop",
]

LOOP_WINDOW = 512  # tail ids looked at
LOOP_MIN_TOKENS = 64  # shorter outputs are never called loops
LOOP_MAX_PERIOD = 128  # longest repeated span looked for
LOOP_MATCH = 0.9  # share of tail positions that must repeat the id one period before


def repetition_loop(
    ids: np.ndarray,
    window: int = LOOP_WINDOW,
    max_period: int = LOOP_MAX_PERIOD,
    match: float = LOOP_MATCH,
) -> int | None:
    """The period of the repetition loop that ends `ids` (an output's ids, stop token excluded), or
    None; see the module's docstring for the definition."""
    n = len(ids)
    if n < LOOP_MIN_TOKENS:
        return None
    tail = ids[-window:]
    t = len(tail)
    top = min(max_period, t // 4)
    # At period p, the ids not copied from p before are the first p and the misses: a tail with more
    # distinct ids than top + (1 - match) * t cannot loop at any period up to top (most text is
    # ruled out here).
    if len(set(tail.tolist())) > top + (1 - match) * t:
        return None
    for p in range(1, top + 1):
        if np.count_nonzero(tail[p:] == tail[:-p]) >= match * (t - p):
            return p
    return None


def best_period(
    ids: np.ndarray, window: int = LOOP_WINDOW, max_period: int = LOOP_MAX_PERIOD
) -> int:
    """The period up to `max_period` at which the most of the tail repeats (1 for an output too
    short to say)."""
    tail = ids[-window:]
    top = min(max_period, len(tail) - 1)
    if top < 1:
        return 1
    shares = [np.count_nonzero(tail[p:] == tail[:-p]) / (len(tail) - p) for p in range(1, top + 1)]
    return int(np.argmax(shares)) + 1
