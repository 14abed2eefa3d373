"""The audit report's schema: what `audit.json` holds, as typed Structs, and how to read it back.

The auditor (`audit`) fills an `AuditReport`; `report` writes it as audit.json, the terminal table
and audit.html; anything else that reads audit.json (status, export, a person's script) decodes it
with `read_report` without importing the auditor. Field names are the JSON names: changing one
changes the format.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from toolkit.dataset.examples import DatasetSamples
from toolkit.formats.rundir import RunDir

if TYPE_CHECKING:
    from toolkit.formats.runplan import RunPlan
    from toolkit.job.chat import TokenInfo
    from toolkit.job.schema import ModelSpec

__all__ = [
    "AUDIT_FORMAT",
    "AuditReport",
    "Check",
    "check",
    "DatasetStats",
    "Histogram",
    "Integrity",
    "Lengths",
    "ReasoningCounts",
    "Reprompt",
    "ShardStats",
    "SkippedInputs",
    "TokenSummary",
    "TrainingShare",
    "TurnStats",
    "modes_text",
    "read_report",
    "skipped_inputs",
    "token_summary",
]

AUDIT_FORMAT = 1


class Check(msgspec.Struct):
    name: str
    passed: bool
    value: float | None  # the measured share or count
    limit: float | None  # the threshold it is held to
    message: str
    unit: str = "count"  # "share" (a fraction) or "count"


def check(name: str, passed: bool, value, limit, message: str) -> Check:
    """A check's result, its unit said by its limit: a float limit is a share, any other a count."""
    return Check(
        name, bool(passed), value, limit, message, "share" if isinstance(limit, float) else "count"
    )


class Lengths(msgspec.Struct):
    count: int = 0
    total: int = 0
    mean: float = 0.0
    p50: int = 0
    p90: int = 0
    p99: int = 0
    max: int = 0


class Histogram(msgspec.Struct):
    edges: list[int]  # bin i holds lengths in [edges[i], edges[i+1])
    counts: list[int]


class ReasoningCounts(msgspec.Struct):
    """Counts over ok records; `expected` are those whose prompt does not close reasoning (thinking
    on)."""

    expected: int = 0
    think_end: int = 0  # output holds the think-end id
    stopped: int = 0  # expected and finished with a stop token
    stopped_without_think_end: int = 0  # the seed's failure: reasoning left in the content
    length_without_think_end: int = 0  # truncated while reasoning
    empty_reasoning: int = 0  # think-end present, nothing but blanks before it
    stopped_with_think_end: int = 0
    empty_content: int = 0  # reasoning, then nothing but blanks after the think-end
    opened_by_template: int = 0  # prompt ends with the think-start id
    double_think_start: int = 0  # ... and the model wrote a think-start again
    closed_by_template: int = 0  # prompt ends with the think-end id (thinking off)
    # Every ok output by the reasoning mode its prompt left the model in (chat.reasoning_mode).
    # the template opened reasoning (= opened_by_template + closed ones: none)
    mode_opened: int = 0
    # the prompt ends at the assistant header: the model opens it itself
    mode_model_opens: int = 0
    mode_unknown: int = 0  # a template that never mentions the think tokens
    # outputs really in reasoning mode: opened by the prompt or the model,
    in_reasoning: int = 0
    # or holding the think-end id
    think_tokens: int = 0  # outputs holding a think-start or think-end id anywhere
    # ok records SGLang stopped on NaN logits (older runs stored them as ok)
    nan_stops: int = 0
    # failed records of the NaN stop (failure "nan"): to generate again
    nan_failed: int = 0


class DatasetStats(msgspec.Struct):
    name: str
    planned: int = 0
    records: int = 0
    ok: int = 0
    failed: int = 0
    missing: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, found in the server's prefix cache
    output_tokens: int = 0
    prompt_len: Lengths = msgspec.field(default_factory=Lengths)
    output_len: Lengths = msgspec.field(default_factory=Lengths)
    reasoning_len: Lengths = msgspec.field(default_factory=Lengths)
    content_len: Lengths = msgspec.field(default_factory=Lengths)
    finish: dict[str, int] = {}
    # failed records per failure kind (`nan`, `server_error`, ...)
    errors: dict[str, int] = {}
    error_examples: dict[str, str] = {}  # failure kind -> one real message of that kind
    length_share: float = 0.0
    # ok outputs in a repetition loop (dataset.quality.repetition_loop)
    degenerate: int = 0
    # n > 1 at temperature > 0: ok samples token-identical to an earlier sample
    identical_samples: int = 0
    # ... of the ok samples that had an earlier sample of their prompt to match
    samples_compared: int = 0
    reasoning: ReasoningCounts = msgspec.field(default_factory=ReasoningCounts)
    histograms: dict[str, Histogram] = {}
    # requests that continued an output (its next loop-stop segment, its continuation after a stop
    # or an abort; input_ids = prompt + output so far): their input tokens, those of them the server
    # found in its prefix cache, and the hit rate (None: no continuation). Under data-parallel
    # attention each rank has its own cache: a continuation sent to another rank misses.
    continued_tokens: int = 0
    continued_cached: int = 0
    continued_cache_hit: float | None = None


class ShardStats(msgspec.Struct):
    index: int
    done: bool
    planned: int
    records: int = 0
    ok: int = 0
    failed: int = 0
    missing: int = 0
    duplicates: int = 0
    damaged_frames: int = 0
    torn_frames: int = 0
    output_tokens: int = 0
    matches_done: bool | None = None
    tok_per_s: float | None = None  # generation throughput of its last attempt (progress file)
    mean_latency_s: float | None = None
    host: str | None = None
    engine_restarts: int | None = None


class TurnStats(msgspec.Struct):
    """Per user turn of a regenerated dataset ([[datasets]] regenerate = true)."""

    dataset: str
    turn: int  # 1-based, as people count turns
    records: int = 0
    ok: int = 0
    failed: int = 0
    output_tokens: int = 0
    think_end: int = 0  # ok outputs holding the think-end id
    length: int = 0  # ok outputs cut by max_new_tokens
    prompt_tokens: int = 0  # the history grows turn by turn


class Integrity(msgspec.Struct):
    id_mismatch: int = 0  # record id differs from the planned id at its position
    seen_twice: int = 0  # a position present more than once in the merged file
    completion_mismatch: int = 0  # completion_tokens != len(output_ids)
    prompt_mismatch: int = 0  # prompt_tokens != len(prompt_ids)
    split_mismatch: int = 0  # stored reasoning_end is not the first think-end id
    stop_mismatch: int = 0  # a `stop` finish whose matched id is not the last output id
    unexpected_stop: int = 0  # matched stop id neither an eos id nor a configured stop_token_id
    bad_finish: int = 0  # an ok record without a stop or length finish
    out_of_vocab: int = 0  # an id >= the tokenizer's size
    over_max_new_tokens: int = 0  # more output ids than the dataset's max_new_tokens
    examples: dict[str, list[str]] = {}


class Reprompt(msgspec.Struct):
    sampled: int = 0
    mismatched: int = 0
    examples: list[str] = []


class TokenSummary(msgspec.Struct):
    tokenizer: str
    think_start: str
    think_start_id: int
    think_end: str
    think_end_id: int
    eos_ids: list[int]
    vocab_size: int
    template_opens_reasoning: bool


class SkippedInputs(msgspec.Struct):
    """Prompt lines of one dataset the plan left out ([inputs] on_bad_line / on_too_long =
    "skip")."""

    dataset: str
    path: str
    bad_lines: int
    too_long: int
    examples: list[str] = []  # `file:line: reason` of the first of them


class TrainingShare(msgspec.Struct):
    """The output tokens decoded for the merged records, and the share of them the default training
    export (`tokens`) holds: ok outputs that are training data and outputs cut by max_new_tokens
    (`quality.KEPT_FOR_DRAFTERS`); the rest by the reason it is left out (a key of
    `quality.SKIP_REASONS`; "nan" also for records failed on NaN logits, "failed" for the other
    failed records: the output ids a failed record holds, those of an abort say, count; most hold
    none). A figure, not a check."""

    decoded_tokens: int = 0  # output ids of the merged records
    exported_tokens: int = 0  # ... of the records the tokens export holds
    share: float = 0.0  # exported_tokens / decoded_tokens
    exported_records: int = 0
    cut_tokens: int = 0  # of exported_tokens: outputs cut by max_new_tokens, kept
    cut_records: int = 0
    left_out_tokens: dict[str, int] = {}  # reason -> output ids left out for it
    left_out_records: dict[str, int] = {}  # reason -> records left out for it

    def add(self, n: int, reason: str | None, kept: bool) -> None:
        """Count a record of `n` output ids, named by `reason` (None: training data), `kept` by
        the export or not."""
        self.decoded_tokens += n
        if kept:
            self.exported_tokens += n
            self.exported_records += 1
            if reason is not None:
                self.cut_tokens += n
                self.cut_records += 1
            return
        key = reason or "failed"
        self.left_out_tokens[key] = self.left_out_tokens.get(key, 0) + n
        self.left_out_records[key] = self.left_out_records.get(key, 0) + 1


class AuditReport(msgspec.Struct):
    format: int
    run: str
    fingerprint: str
    created: str
    passed: bool
    checks: list[Check]
    planned: int
    present: int
    ok: int
    failed: int
    missing: int
    # resolved by the merge (kept once); partial outputs continued are not counted
    duplicates: int
    damaged_frames: int
    tokens: TokenSummary
    overall: DatasetStats
    datasets: list[DatasetStats]
    shards: list[ShardStats]
    integrity: Integrity
    reprompt: Reprompt
    files: dict[str, str] = {}
    turns: list[TurnStats] = []  # regenerated datasets only
    # a few decoded outputs and one message per failure kind, per dataset
    samples: list[DatasetSamples] = []
    # partial outputs kept at a stop, superseded by their continuation (the merge's)
    continued: int = 0
    # prompt lines left out of the plan, per dataset that has any
    skipped_inputs: list[SkippedInputs] = []
    # what made the records (the run's pinned engine, RunPlan.synthetic): "stub" says the outputs
    # are synthetic, not a model's; else the [engine] kind
    engine: str = ""
    # the share of decoded output tokens the training export holds, and why the rest is left out
    training: TrainingShare = msgspec.field(default_factory=TrainingShare)


def token_summary(model: ModelSpec, info: TokenInfo) -> TokenSummary:
    """The model's think and eos tokens as the audit used them."""
    return TokenSummary(
        tokenizer=model.tokenizer_path or model.path,
        think_start=model.think_start,
        think_start_id=info.think_start_id,
        think_end=model.think_end,
        think_end_id=info.think_end_id,
        eos_ids=list(info.eos_ids),
        vocab_size=info.vocab_size,
        template_opens_reasoning=info.opens_reasoning,
    )


def skipped_inputs(plan: RunPlan) -> list[SkippedInputs]:
    """The prompt lines the plan left out, per dataset, with their first reasons."""
    return [
        SkippedInputs(
            d.name,
            d.path,
            d.bad_lines,
            d.too_long,
            [f"{d.path}:{x.line}: {x.reason}" for x in d.skipped],
        )
        for d in plan.datasets
        if d.skipped_lines
    ]


def read_report(rd: RunDir) -> AuditReport | None:
    """The run's audit.json, typed; None when the run has not been audited."""
    try:
        return msgspec.json.decode(rd.audit_json.read_bytes(), type=AuditReport)
    except FileNotFoundError:
        return None


def modes_text(r: ReasoningCounts) -> str:
    parts = [
        (r.mode_opened, "opened by the template"),
        (r.mode_model_opens, "opened by the model itself"),
        (r.closed_by_template, "closed by the template"),
        (r.mode_unknown, "template unaware of think tokens"),
    ]
    return ", ".join(f"{n} {what}" for n, what in parts if n) or "no ok output"
