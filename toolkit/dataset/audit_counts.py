"""The audit's per-record counters: running totals of a dataset, of a shard and of a user turn, the
ids quoted per kind of problem, samples repeated token for token, and the counts of reasoning
capture; then the totals as the report's statistics.

`dataset.audit.Auditor` feeds them one record at a time; each counter owns its own state. Memory
stays a few bytes per record (lengths in compact arrays).
"""

from __future__ import annotations

import hashlib
import re
from array import array
from collections import Counter
from typing import NamedTuple

import numpy as np

from toolkit.dataset.audit_report import (
    DatasetStats,
    Histogram,
    Integrity,
    Lengths,
    ReasoningCounts,
    TurnStats,
)
from toolkit.formats.prompts import PromptRef
from toolkit.formats.records import OK, Record, all_blank, id_positions
from toolkit.formats.runplan import RunPlan
from toolkit.job import chat

__all__ = [
    "EXAMPLES",
    "DatasetTotals",
    "Examples",
    "Output",
    "SampleRepeats",
    "ShardTotals",
    "TurnTotals",
    "combine",
    "count_reasoning",
    "dataset_stats",
    "error_kind",
    "hist_tops",
    "note",
]

HIST_BINS = 30
EXAMPLES = 5  # ids quoted per kind of problem


class Output(NamedTuple):
    """What the audit reads once from an ok record's output ids."""

    n: int  # output tokens
    mode: str  # chat.reasoning_mode of its prompt
    te_at: int | None  # position of the first think-end id
    parts: tuple[int, int, int, int]  # reasoning [r0, r1) and content [c0, c1) (split_parts)

    @property
    def opened(self) -> bool:
        return self.mode == chat.OPENED


class DatasetTotals:
    """Running totals of one dataset (or of the run)."""

    def __init__(self, name: str, planned: int):
        self.stats = DatasetStats(name=name, planned=planned)
        self.finish: Counter = Counter()
        self.errors: Counter = Counter()
        # failure kind -> the first real message of that kind
        self.error_examples: dict[str, str] = {}
        self.r = ReasoningCounts()
        self.prompt_len, self.output_len = array("I"), array("I")
        self.reasoning_len, self.content_len = array("I"), array("I")

    def add_record(self, rec: Record, n_prompt: int) -> None:
        """Any record, ok or failed: its prompt and what the prefix cache held of it."""
        st = self.stats
        st.records += 1
        st.prompt_tokens += n_prompt
        st.cached_tokens += rec.cached_tokens
        st.continued_tokens += rec.continued_tokens
        st.continued_cached += rec.continued_cached
        self.prompt_len.append(n_prompt)

    def add_failure(self, rec: Record) -> str:
        """A failed record, counted by kind with its first message; returns the kind."""
        self.stats.failed += 1
        # records of older toolkits carry no failure kind
        kind = rec.failure or error_kind(rec.error)
        self.errors[kind] += 1
        self.error_examples.setdefault(kind, (rec.error or "(no message)").splitlines()[0][:300])
        return kind

    def add_output(self, rec: Record, out: Output) -> None:
        """An ok record: its output tokens, finish reason and the lengths of its parts."""
        self.stats.ok += 1
        self.stats.output_tokens += out.n
        self.finish[rec.finish or "none"] += 1
        r0, r1, c0, c1 = out.parts
        self.output_len.append(out.n)
        self.reasoning_len.append(r1 - r0)
        self.content_len.append(c1 - c0)


class ShardTotals:
    """Running totals of one shard's records."""

    def __init__(self) -> None:
        self.records = self.ok = self.failed = self.output_tokens = 0
        self.latency = 0.0

    def add(self, rec: Record, n: int, ok: bool) -> None:
        self.records += 1
        if not ok:
            self.failed += 1
            return
        self.ok += 1
        self.output_tokens += n
        self.latency += rec.latency_s


class Examples(dict[str, list[str]]):
    """The first EXAMPLES ids of each kind of problem."""

    def add(self, kind: str, rec_id: str) -> None:
        ex = self.setdefault(kind, [])
        if len(ex) < EXAMPLES:
            ex.append(rec_id)


_DIGITS = re.compile(r"\d+")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def error_kind(error: str | None) -> str:
    """A failure without a kind (written by an older toolkit): its message with the particulars
    (numbers, quoted names) folded, to count such failures by what they say."""
    if not error:
        return "(no message)"
    text = _QUOTED.sub("'…'", _DIGITS.sub("N", error.splitlines()[0]))
    return text[:120]


def _note(integ: Integrity, kind: str, rec_id: str) -> None:
    setattr(integ, kind, getattr(integ, kind) + 1)
    ex = integ.examples.setdefault(kind, [])
    if len(ex) < EXAMPLES:
        ex.append(rec_id)


class TurnTotals:
    """Per user turn of a regenerated dataset ([[datasets]] regenerate = true): its records, tokens,
    think-ends and outputs cut by max_new_tokens."""

    def __init__(self) -> None:
        self.turns: dict[tuple[str, int], TurnStats] = {}

    def add(self, rec: Record, turn: int) -> None:
        t = self.turns.get((rec.dataset, turn))
        if t is None:
            t = self.turns[(rec.dataset, turn)] = TurnStats(dataset=rec.dataset, turn=turn + 1)
        t.records += 1
        t.prompt_tokens += rec.n_prompt
        if rec.status != OK:
            t.failed += 1
            return
        t.ok += 1
        t.output_tokens += rec.n_output
        t.think_end += rec.reasoning_end is not None
        t.length += rec.finish == "length"

    def stats(self) -> list[TurnStats]:
        """Every turn's, by dataset and turn."""
        return [self.turns[k] for k in sorted(self.turns, key=lambda k: (k[0], k[1]))]


class SampleRepeats:
    """n > 1 at temperature > 0: ok samples whose output ids equal an earlier sample's of the same
    prompt (and turn). The samples of a prompt are adjacent in planned order, so only the prompt
    being read is kept: its outputs by turn and hash of their ids -> the first sample's id."""

    def __init__(self, plan: RunPlan):
        # the datasets (by index) that sample a prompt more than once at a temperature above 0
        self.datasets = {
            i
            for i, d in enumerate(plan.datasets)
            if (plan.spec.sampling_for(d.name).get("n") or 1) > 1
            and (plan.spec.sampling_for(d.name).get("temperature", 1.0) or 0) > 0
        }
        self.prompt_at: tuple[int, int] | None = None  # (dataset, line)
        self.outputs_seen: dict[tuple[int, bytes], str] = {}

    def add(self, rec: Record, ref: PromptRef, st: DatasetStats, example: Examples) -> None:
        at = (ref.dataset, ref.line)
        if at != self.prompt_at:
            self.prompt_at, self.outputs_seen = at, {}
        key = (ref.turn, hashlib.blake2b(rec.output_ids, digest_size=16).digest())
        if any(k[0] == ref.turn for k in self.outputs_seen):
            st.samples_compared += 1
        first = self.outputs_seen.setdefault(key, rec.id)
        if first != rec.id:
            st.identical_samples += 1
            example.add("identical_samples", f"{rec.id} = {first}")


def note(integ: Integrity, kind: str, rec_id: str) -> None:
    """Count a record of an integrity problem `kind`, and quote its id (the first EXAMPLES)."""
    setattr(integ, kind, getattr(integ, kind) + 1)
    ex = integ.examples.setdefault(kind, [])
    if len(ex) < EXAMPLES:
        ex.append(rec_id)


def count_reasoning(
    r: ReasoningCounts,
    rec: Record,
    out: Output,
    info: chat.TokenInfo,
    blank: frozenset[int],
    example: Examples,
) -> None:
    """Reasoning capture of an ok output: the mode its prompt left the model in, whether it wrote
    the think-end, and what it wrote on either side of it."""
    r0, r1, c0, c1 = out.parts
    te_at, ids = out.te_at, rec.output_ids
    if out.mode == chat.CLOSED:
        r.closed_by_template += 1
        example.add("closed_by_template", rec.id)
        return
    if out.mode == chat.OPENED:
        r.mode_opened += 1
    elif out.mode == chat.MODEL_OPENS:
        r.mode_model_opens += 1
    else:
        r.mode_unknown += 1
    if chat.output_in_reasoning(rec, info, out.opened):
        r.in_reasoning += 1
    r.expected += 1
    if te_at is not None:
        r.think_end += 1
        if all_blank(ids, r0, r1, blank):
            r.empty_reasoning += 1
            example.add("empty_reasoning", rec.id)
    if rec.finish == "stop":
        r.stopped += 1
        if te_at is None:
            r.stopped_without_think_end += 1
            example.add("stopped_without_think_end", rec.id)
        else:
            r.stopped_with_think_end += 1
            if all_blank(ids, c0, c1, blank):
                r.empty_content += 1
                example.add("empty_content", rec.id)
    elif rec.finish == "length" and te_at is None:
        r.length_without_think_end += 1
    if out.opened:
        r.opened_by_template += 1
        end = te_at if te_at is not None else out.n
        if id_positions(ids, info.think_start_id, 0, end) is not None:
            r.double_think_start += 1
            example.add("double_think_start", rec.id)


# --------------------------------------------------------------------------------------------------
# the totals as the report's statistics
# --------------------------------------------------------------------------------------------------
def _lengths(a: array) -> Lengths:
    if not len(a):
        return Lengths()
    v = np.frombuffer(a, np.uint32)
    p50, p90, p99 = (int(x) for x in np.percentile(v, [50, 90, 99], method="inverted_cdf"))
    total = int(v.sum(dtype=np.int64))
    return Lengths(
        count=len(v),
        total=total,
        mean=round(total / len(v), 1),
        p50=p50,
        p90=p90,
        p99=p99,
        max=int(v.max()),
    )


def hist_tops(accs: list[DatasetTotals]) -> dict[str, int]:
    """The largest length of each kind over every dataset: the datasets' histograms share their
    bins."""

    def top(a: array) -> int:
        return int(np.frombuffer(a, np.uint32).max()) if len(a) else 0

    return {
        k: max((top(getattr(a, f"{k}_len")) for a in accs), default=0) + 1
        for k in ("output", "reasoning", "content")
    }


def _histogram(a: array, top: int | None = None) -> Histogram:
    v = np.frombuffer(a, np.uint32) if len(a) else np.zeros(0, np.uint32)
    top = top or (int(v.max()) + 1 if len(v) else 1)
    width = max(1, -(-top // HIST_BINS))
    edges = list(range(0, width * HIST_BINS + 1, width))
    counts, _ = np.histogram(v, bins=edges)
    return Histogram(edges=edges, counts=counts.tolist())


def dataset_stats(acc: DatasetTotals, tops: dict[str, int] | None = None) -> DatasetStats:
    st = acc.stats
    st.prompt_len = _lengths(acc.prompt_len)
    st.output_len = _lengths(acc.output_len)
    st.reasoning_len = _lengths(acc.reasoning_len)
    st.content_len = _lengths(acc.content_len)
    st.finish = dict(acc.finish.most_common())
    st.errors = dict(acc.errors.most_common(20))
    st.error_examples = {k: acc.error_examples[k] for k in st.errors if k in acc.error_examples}
    st.length_share = acc.finish.get("length", 0) / st.ok if st.ok else 0.0
    if st.continued_tokens:
        st.continued_cache_hit = round(st.continued_cached / st.continued_tokens, 4)
    st.reasoning = acc.r
    tops = tops or {}
    st.histograms = {
        "output": _histogram(acc.output_len, tops.get("output")),
        "reasoning": _histogram(acc.reasoning_len, tops.get("reasoning")),
        "content": _histogram(acc.content_len, tops.get("content")),
    }
    return st


def combine(accs: list[DatasetTotals], name: str, planned: int) -> DatasetTotals:
    """The totals of several datasets as one (the run's)."""
    out = DatasetTotals(name, planned)
    s = out.stats
    for a in accs:
        for f in (
            "records",
            "ok",
            "failed",
            "missing",
            "prompt_tokens",
            "cached_tokens",
            "continued_tokens",
            "continued_cached",
            "output_tokens",
            "degenerate",
            "identical_samples",
            "samples_compared",
        ):
            setattr(s, f, getattr(s, f) + getattr(a.stats, f))
        out.finish.update(a.finish)
        out.errors.update(a.errors)
        for k, v in a.error_examples.items():
            out.error_examples.setdefault(k, v)
        for f in ReasoningCounts.__struct_fields__:
            setattr(out.r, f, getattr(out.r, f) + getattr(a.r, f))
        for f in ("prompt_len", "output_len", "reasoning_len", "content_len"):
            getattr(out, f).extend(getattr(a, f))
    return out
