"""Which records an export holds, why the others are left out, and the account of every one.

What is exported (`Selection`): the planned records the filters select (dataset, sample, turn;
finish reason and reasoning mode of ok ones). Only ok records are exported unless
`include_failed`. `tokens` and `conversations` are training formats: records that are not
training data (`quality.SKIP_REASONS`: a NaN stop, a repetition loop, truncated, no think-end, an
empty part, a think marker inside a part, reasoning where none is expected; in conversations also
an answer with neither text nor a tool call, an unreadable tool call, or think markers written as
text) are left out unless included by reason, and included ones left out by reason
(`kept_reasons`). `tokens`, the drafters' format, keeps outputs cut by max_new_tokens
(`quality.KEPT_FOR_DRAFTERS`): the model's ids at every position, masked whole, with nothing
added; `conversations` leaves them out (the chat template would close a turn the model never
ended). `Selection.max_length` leaves out rows of more ids (prompt + output) with their own reason
(`LONGER`): nothing is cut.

Every selected record is accounted for once (`_Account`), in `ExportSummary` (exported + skipped +
failed + missing + filtered == planned), written beside the output as `<name>_summary.json`, with
each record left out and why in `<name>_skipped.jsonl` (`SkippedRow`). The rows of a training
format are measured (`trainer_config.RowLengths`: tokens per row, what the trainer's default
length would cut). Every ok record read is checked as the audit checks one record on its own
(`_Defects`, `records.defects`: counts, max_new_tokens, vocabulary, finish, split): an export that
meets one is refused, nothing written, unless `force` (then each kind is warned about).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec

from toolkit.dataset.export.text import _Tokens
from toolkit.dataset.quality import KEPT_FOR_DRAFTERS, SKIP_REASONS, Judge
from toolkit.dataset.trainer_config import LengthFigures, RowLengths
from toolkit.errors import BadInputError
from toolkit.formats.frames import CorruptShard, decode_batch, iter_frames
from toolkit.formats.prompts import PromptIndex, PromptRef
from toolkit.formats.records import OK, RECORD_CHECKS, Record, defects, id_positions
from toolkit.formats.runplan import RunPlan
from toolkit.job import chat

FORMATS = ("jsonl", "parquet", "tokens", "conversations")
# the recommended one: the model's exact ids, which each trainer's loader takes as they are
DEFAULT_FORMAT = "tokens"


class ExportError(BadInputError):
    """An export refused as asked (unknown format, trainer or reason, a missing optional package, a
    merged dataset that is missing, stale or of another run). A file system that fails it is a
    FailedError (exit 1)."""


class _Defects:
    """The ok records that fail the audit's checks of one record (`records.defects`), as they are
    read."""

    def __init__(self, plan: RunPlan, tokens: _Tokens):
        self.info = tokens.info
        self.max_new = {
            d.name: plan.spec.sampling_for(d.name).get("max_new_tokens") for d in plan.datasets
        }
        self.found: dict[str, list[str]] = {}  # kind -> ids
        self.count = 0

    def check(self, rec: Record) -> None:
        kinds = defects(
            rec,
            self.info.vocab_size,
            id_positions(rec.output_ids, self.info.think_end_id),
            self.max_new.get(rec.dataset),
        )
        self.count += bool(kinds)
        for kind in kinds:
            self.found.setdefault(kind, []).append(rec.id)

    def summary(self) -> str:
        """e.g. `2 ok records fail the audit's record checks: an id outside the tokenizer (p0003,
        p0007)`."""
        parts = [
            f"{RECORD_CHECKS[k]} ({', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''})"
            for k, ids in self.found.items()
        ]
        return (
            f"{self.count} ok record{'s' if self.count != 1 else ''} fail the audit's record "
            "checks: " + "; ".join(parts)
        )


MODES = ("reasoning", "non-reasoning")
OTHER_TURN = "other_turn"  # a regenerated conversation is written whole or not at all
EXPORT_REASONS = {
    **SKIP_REASONS,
    OTHER_TURN: "another turn of its conversation is failed or not training data",
    "text_think_marker": "<think> or </think> written as text in the reasoning or the answer",
    "unreadable_tool_call": "a tool-call section whose calls cannot be read (a trainer would "
    "train an empty call)",
    "empty_answer": "an answer with no text and no tool call",
    "tool_call_only": "an answer that is a tool call alone: SpecForge's validator refuses its "
    "empty content (its loader trains it)",
}
# prompt + output longer than --max-length: left out whatever `include` says (the trainer would cut
# it)
LONGER = "longer_than_max_length"


class Selection(msgspec.Struct, frozen=True):
    """Which records an export holds: each filter None (all) or the values kept. `include`: reasons
    of `EXPORT_REASONS` whose records are exported anyway (None: the format's default); `exclude`:
    reasons whose records are left out although the format keeps them (`kept_reasons`)."""

    datasets: frozenset[str] | None = None
    finish: frozenset[str] | None = None
    mode: str | None = None  # "reasoning" | "non-reasoning"
    samples: frozenset[int] | None = None
    turns: frozenset[int] | None = None
    include: frozenset[str] | None = None
    max_length: int | None = None  # rows of more ids are left out (LONGER)
    exclude: frozenset[str] | None = None

    def planned(self, ref: PromptRef, dataset: str) -> bool:
        """Whether a planned record is selected by what the plan knows of it (dataset, sample,
        turn)."""
        return (
            (self.datasets is None or dataset in self.datasets)
            and (self.samples is None or ref.sample in self.samples)
            and (self.turns is None or ref.turn in self.turns)
        )


class ExportSummary(msgspec.Struct):
    """What an export did with every planned record it selects: `exported + skipped + failed +
    missing + filtered == planned`. Written beside the export as `<name>_summary.json`."""

    format: str
    output: str
    skipped_file: str
    planned: int = 0  # planned records the --dataset / --sample / --turn filters select
    # records written (rows of a regenerated conversation count each turn they hold)
    exported: int = 0
    rows: int = 0  # rows (lines) written
    # ok records that are not training data (skipped file, with the reason)
    skipped: int = 0
    failed: int = 0  # failed records not exported (skipped file, with their failure kind)
    # planned records the merged dataset does not hold (merged with --allow-incomplete)
    missing: int = 0
    filtered: int = 0  # ok records --finish / --mode leave out
    skipped_by_reason: dict[str, int] = {}
    failed_by_kind: dict[str, int] = {}
    # jsonl, parquet, tokens: records exported that a reason names, by reason (in tokens, outputs
    # cut by max_new_tokens: kept for the drafter)
    kept_by_reason: dict[str, int] = {}
    trainer: str | None = None  # tokens: the trainer whose loss-mask rule the export follows
    # tokens: a think-start the template wrote is in the loss mask
    supervise_think_start: bool | None = None
    audit: str = "none"  # the run's audit: "passed", "failed" or "none" (not run)
    # what made the records, as the run pinned it (RunPlan.synthetic): "model", or "stub":
    # synthetic text from the stand-in for SGLang's protocol, not training data
    engine: str = "model"
    # conversations: rows rendered again as SpecForge renders them
    roundtrip_rows: int = 0
    roundtrip_identical: int = 0  # ... of which give the model's exact ids
    # conversations: --check-sample N, the rows checked about N (None: every row checked)
    roundtrip_sample: int | None = None
    # conversations: per row, whether the render gives the exact ids
    roundtrip_file: str | None = None
    # conversations: the SpecForge chat-template registration of the model
    registration_file: str | None = None
    # conversations: tool calls whose arguments SpecForge would re-serialise
    arguments_reformatted: int = 0
    # tokens and conversations: tokens per row, and what the trainer's default length would cut
    lengths: LengthFigures | None = None
    # tokens: the trainer's config that keeps every row whole (`trainer_config`)
    trainer_config: str | None = None
    warnings: list[str] = []

    def line(self) -> str:
        """e.g. `44 planned: 39 exported, 4 skipped (truncated 3, degenerate 1), 1 failed
        (server_error 1)`."""

        def by(counts: dict[str, int]) -> str:
            ranked = sorted(counts.items(), key=lambda kv: -kv[1])
            return f" ({', '.join(f'{k} {v}' for k, v in ranked)})" if counts else ""

        kept = f" ({by(self.kept_by_reason)[2:-1]} kept)" if self.kept_by_reason else ""
        parts = [
            f"{self.exported} exported{kept}",
            f"{self.skipped} skipped{by(self.skipped_by_reason)}",
            f"{self.failed} failed{by(self.failed_by_kind)}",
        ]
        if self.missing:
            parts.append(f"{self.missing} missing")
        if self.filtered:
            parts.append(f"{self.filtered} left out by --finish/--mode")
        return f"{self.planned} planned: " + ", ".join(parts)


class SkippedRow(msgspec.Struct):
    """One line of the skipped file: a selected record that is not in the export, and why."""

    id: str
    dataset: str
    sample: int
    turn: int
    status: str  # "skipped" (ok, not training data) or "failed"
    reason: str  # a key of EXPORT_REASONS, or the failure kind of a failed record
    finish_reason: str | None
    completion_tokens: int
    error: str | None = None


STUB_EXPORT = (
    "the records are the STUB engine's: synthetic text from a stand-in for SGLang's protocol, NOT "
    "a model's outputs; do not train a drafter on them"
)


# records that are not training data are skipped by default
TRAINING_FORMATS = ("tokens", "conversations")
# the reasons whose records each format keeps unless told otherwise: the record formats every one;
# the drafters' ids the outputs cut by max_new_tokens (the model's own tokens at every position);
# chat rows none (a cut output rendered by the template would end a turn the model never ended)
KEPT_BY_DEFAULT = {
    "jsonl": frozenset(EXPORT_REASONS),
    "parquet": frozenset(EXPORT_REASONS),
    "tokens": KEPT_FOR_DRAFTERS,
    "conversations": frozenset(),
}
CUT_CHAT_ROWS = (
    "outputs cut by max_new_tokens are kept as chat rows (--include truncated): the chat template "
    "closes their turn with an end of turn the model never wrote, and a trainer learns it; the "
    "tokens export keeps them as they are"
)


def kept_reasons(fmt: str, select: Selection) -> frozenset[str]:
    """The reasons of `EXPORT_REASONS` whose records an export in `fmt` holds: the format's
    (`KEPT_BY_DEFAULT`) with those `select.include` names (for jsonl and parquet, only those, when
    given), less those `select.exclude` names."""
    if fmt in TRAINING_FORMATS:
        kept = KEPT_BY_DEFAULT[fmt] | (select.include or frozenset())
    else:
        kept = KEPT_BY_DEFAULT[fmt] if select.include is None else select.include
    return kept - (select.exclude or frozenset())


class _Account:
    """Decides for each record whether the export holds it, counts every selected record once, and
    writes the skipped file."""

    def __init__(
        self,
        plan: RunPlan,
        refs: PromptIndex,
        sel: Selection,
        include: frozenset[str],
        include_failed: bool,
        tokens: _Tokens,
        summary: ExportSummary,
        skipped_out,
    ):
        self.plan, self.refs, self.sel, self.include = plan, refs, sel, include
        self.include_failed = include_failed
        info = tokens.info
        self.judge = Judge(
            info.think_start_id, info.think_end_id, info.blank_ids, plan.spec.model.expect_reasoning
        )
        self.info = info
        self.summary, self.out = summary, skipped_out
        self.enc = msgspec.json.Encoder()
        self.seen = 0
        self.named: str | None = None  # the reason of the last record judged, kept by `include`
        self.lengths = RowLengths(summary.trainer or "specforge")
        for k in range(len(plan.shards)):
            for ref in refs.shard(k):
                summary.planned += sel.planned(ref, plan.datasets[ref.dataset].name)

    def ref(self, rec: Record) -> PromptRef:
        ref = self.refs.at(rec.index)
        if ref is None or ref.id != rec.id:
            raise ExportError(
                f"record {rec.id} is not the planned record at position {rec.index}: the merged "
                f"dataset does not match the plan; merge again"
            )
        return ref

    def selected(self, rec: Record, ref: PromptRef) -> bool:
        return self.sel.planned(ref, rec.dataset)

    def outcome(self, rec: Record) -> str | None:
        """None: export it; "failed", "filtered", or the reason it is not training data."""
        self.named = None
        if rec.status != OK:
            return None if self.include_failed else "failed"
        opened = chat.opens_reasoning(rec.prompt_ids, self.info)
        sel = self.sel
        if sel.finish is not None and rec.finish not in sel.finish:
            return "filtered"
        if sel.mode is not None:
            in_reasoning = chat.output_in_reasoning(rec, self.info, opened)
            if sel.mode != ("reasoning" if in_reasoning else "non-reasoning"):
                return "filtered"
        reason = self.judge.skip_reason(rec, opened)
        if reason is not None and reason not in self.include:
            return reason
        self.named = reason
        n = (len(rec.prompt_ids) + len(rec.output_ids)) >> 2
        return LONGER if sel.max_length is not None and n > sel.max_length else None

    def measured(self, rec: Record, mask: list[int]) -> list[int]:
        """The loss mask of a row written from `rec` (its prompt and output); its length
        counted."""
        self.lengths.add(len(mask), len(mask) - sum(mask))
        return mask

    def exported(self, n: int = 1) -> None:
        self.summary.exported += n

    def left_out(self, rec: Record, ref: PromptRef, outcome: str) -> None:
        """Count a selected record that is not exported; write it to the skipped file unless a
        filter left it out."""
        s = self.summary
        if outcome == "filtered":
            s.filtered += 1
            return
        failed = rec.status != OK
        if failed:
            kind = rec.failure or "failed"
            s.failed += 1
            s.failed_by_kind[kind] = s.failed_by_kind.get(kind, 0) + 1
        else:
            s.skipped += 1
            s.skipped_by_reason[outcome] = s.skipped_by_reason.get(outcome, 0) + 1
        row = SkippedRow(
            id=rec.id,
            dataset=rec.dataset,
            sample=ref.sample,
            turn=ref.turn,
            status="failed" if failed else "skipped",
            reason=rec.failure or "failed" if failed else outcome,
            finish_reason=rec.finish,
            completion_tokens=rec.completion_tokens,
            error=rec.error,
        )
        self.out.write(self.enc.encode(row) + b"\n")

    def finish(self) -> None:
        s = self.summary
        s.missing = s.planned - s.exported - s.skipped - s.failed - s.filtered


def _batches(path: Path, defects: _Defects) -> Iterator[list[Record]]:
    """The merged records, frame by frame, each ok one checked (`defects`); CorruptShard on a
    damaged frame, a torn last one included (a merged file is written whole: a frame cut short is
    damage, not a crash mid-write)."""
    tail: list = []
    for frame in iter_frames(path, tail=tail):
        recs = decode_batch(frame)
        for r in recs:
            if r.status == OK:
                defects.check(r)
        if recs:
            yield recs
    if tail:
        raise CorruptShard(path, tail[0][0], tail[0][1])


def _kept(
    path: Path, acc: _Account, defects: _Defects
) -> Iterator[tuple[list[Record], list[PromptRef]]]:
    """The selected records an export of one row per record holds, batch by batch, with their
    planned refs; every other selected record is accounted for (`acc`)."""
    for recs in _batches(path, defects):
        keep, refs = [], []
        for r in recs:
            ref = acc.ref(r)
            if not acc.selected(r, ref):
                continue
            why = acc.outcome(r)
            if why is None:
                keep.append(r)
                refs.append(ref)
                if acc.named is not None:
                    kept = acc.summary.kept_by_reason
                    kept[acc.named] = kept.get(acc.named, 0) + 1
            else:
                acc.left_out(r, ref, why)
        if keep:
            acc.exported(len(keep))
            yield keep, refs
