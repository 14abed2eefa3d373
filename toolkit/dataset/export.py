"""Exports of a merged run: JSONL, Parquet, token ids with a loss mask, and chat conversations.

Records are read frame by frame from `RUN/merged/records.zst` (planned order) and written as they
come, so memory stays flat. Text is derived from the token ids here, batch-decoded per frame (a
byte-level BPE tokenizer's ids through a table of their bytes, `_byte_table`): the reasoning is
the output up to the think-end id (a think-start the model wrote at position 0 excluded), the
content is what follows it; the stop token and the think-end are in neither (see
`records.split_parts` for outputs without a think-end). Only ok records are exported unless
`include_failed`. Every ok record exported is checked as the audit checks one record on its own
(`records.defects`: counts, max_new_tokens, vocabulary, finish, split): an export that meets one is
refused, nothing written, unless `force` (then each kind is warned about).

What is exported (`Selection`): the planned records the filters select (dataset, sample, turn;
finish reason and reasoning mode of ok ones). `tokens` and `conversations` are training formats:
records that are not training data (`quality.SKIP_REASONS`: a NaN stop, a repetition loop,
truncated, no think-end, an empty part, a think marker inside a part, reasoning where none is
expected; in conversations also an answer with neither text nor a tool call, an unreadable tool
call, or think markers written as text) are left out unless included by reason, and included ones
left out by reason (`kept_reasons`). `tokens`, the drafters' format, keeps outputs cut by
max_new_tokens (`quality.KEPT_FOR_DRAFTERS`): the model's ids at every position, masked whole, with
nothing added; `conversations` leaves them out (the chat template would close a turn the model
never ended). Every selected
record is accounted for once, in `ExportSummary` (exported + skipped + failed + missing + filtered
== planned), written beside the output as `<name>_summary.json`, with each record left out and why
in `<name>_skipped.jsonl`. A run of the stub engine (`RunPlan.synthetic`) says so in the summary
(`engine`, a warning), in the Parquet file's metadata and in the SpecForge registration file.
`Selection.max_length` leaves out rows of more ids (prompt + output) with their own reason
(`LONGER`): nothing is cut. The rows of a training format are measured (`trainer_config.RowLengths`:
tokens per row, what the trainer's default length would cut), and a `tokens` export gets beside it
the trainer's config that keeps every row whole (`trainer_config.write_config`).

Formats (every one carries dataset, sample, turn and segments):
  jsonl          id, dataset, sample, turn, segments, status, error, prompt_ids, output_ids,
                 reasoning_end, reasoning, content, finish_reason, matched_stop, matched_stop_str,
                 prompt_tokens, completion_tokens, meta (the prompt line's other fields, e.g. a
                 dataset's `source` and `category`: `_Meta`)
  parquet        the same columns with the same types (ids as list<uint32>, matched_stop as int64,
                 meta as JSON text: `rows_schema`)
  tokens         {"id", "dataset", "sample", "turn", "segments", "input_ids": prompt + output,
                 "loss_mask"}: the default and recommended format, the model's exact ids that
                 SpecForge's and speculators' loaders take as they are; the mask covers the
                 assistant turn after its header for SpecForge, the output only for speculators
                 (`loss_mask`, `trainers.TRAINERS`)
  conversations  {"id", "status": "success", "dataset", "sample", "turn", "segments",
                 "conversations": [source messages..., {"role": "assistant", "content",
                 "reasoning_content"}], "tools"} (tools [] when the prompt had none): SpecForge's
                 chat JSONL, with its round trip through the chat template as SpecForge renders it
                 measured per row and the SpecForge registration of the template beside it; a
                 tool-call section the model wrote is a structured "tool_calls" list of the answer
                 (toolcalls.py), not markup in its content. A regenerated conversation is one row
                 with every turn (plus "turns"), written only when every turn is training data;
                 assistant messages of a source history (not regenerated) keep their content, not
                 their reasoning, and the generated answer is the last message (the row trains
                 with only its last turn)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from toolkit.dataset.merge import MERGED, MergeManifest, load_manifest
from toolkit.dataset.quality import KEPT_FOR_DRAFTERS, SKIP_REASONS, Judge
from toolkit.dataset.trainer_config import LengthFigures, RowLengths, config_name, write_config
from toolkit.dataset.trainers import (
    TRAINERS,
    Registration,
    RoundTrip,
    builtin_problems,
    registration,
    trainer_json,
    writes_default_system,
)
from toolkit.errors import BadInputError, FailedError
from toolkit.formats.files import io_problem
from toolkit.formats.frames import CorruptShard, decode_batch, iter_frames, read_header
from toolkit.formats.records import (
    OK,
    RECORD_CHECKS,
    Record,
    defects,
    id_at,
    id_positions,
    split_parts,
)
from toolkit.formats.run import PromptIndex, PromptRef, Run, RunPlan
from toolkit.formats.rundir import RunDir
from toolkit.formats.shardstate import ShardState, shard_state
from toolkit.formats.text import ranges
from toolkit.job import chat
from toolkit.job.inputs import ExtraReader, InputError, PromptReader, check_plan_inputs
from toolkit.job.sources import SourceError, source_sha256
from toolkit.job.spec import JobSpec
from toolkit.job.toolcalls import parse_tool_calls
from toolkit.job.turns import answer_message, turn_messages, user_turns

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "KEPT_BY_DEFAULT",
    "ExportError",
    "ExportSummary",
    "JsonlRecord",
    "Selection",
    "SkippedRow",
    "export_run",
    "kept_reasons",
]

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "parquet", "tokens", "conversations")
# the recommended one: the model's exact ids, which each trainer's loader takes as they are
DEFAULT_FORMAT = "tokens"
PARQUET_ROWS = 1024  # records per Parquet row group
# conversations rows whose round trip is checked in one tokenizer call (at most CHECK_TOKENS ids)
CHECK_ROWS = 64
CHECK_TOKENS = 1 << 18
# decode_batch spreads a batch over the cores at about 130 ns of CPU per token; the byte table takes
# 43 on one core (`_byte_table`): with more cores than this, decode_batch is the faster
TABLE_CORES = 4


class ExportError(BadInputError):
    """An export refused as asked (unknown format, trainer or reason, a missing optional package, a
    merged dataset that is missing, stale or of another run). A file system that fails it is a
    FailedError (exit 1)."""


class JsonlRecord(msgspec.Struct):
    """One line of the `jsonl` export (and one row of `parquet`), fields in this order."""

    id: str
    dataset: str
    sample: int
    turn: int
    # requests the output took (> 1: continued after an abort or a stop)
    segments: int
    status: str
    error: str | None
    prompt_ids: list[int]
    output_ids: list[int]
    reasoning_end: int | None
    reasoning: str
    content: str
    finish_reason: str | None
    # the stop token id SGLang matched (None: a stop string, or no stop)
    matched_stop: int | None
    matched_stop_str: str | None  # the stop string SGLang matched, when the stop was a string
    prompt_tokens: int
    completion_tokens: int
    # the prompt line's other fields (`_Meta`); None: its file changed
    meta: dict[str, Any] | None = None


class _Meta:
    """The fields a prompt line holds besides id, messages, prompt and tools (a dataset's `source`,
    `category`, ...), carried into each record's row: re-read from the line at the byte offset the
    plan pinned. A prompt file gone or changed since the run was planned gives None for its records,
    said once."""

    def __init__(self, plan: RunPlan):
        self.datasets = plan.datasets
        self.reader = ExtraReader()
        self.usable: dict[int, bool] = {}

    def of(self, ref: PromptRef) -> dict[str, Any] | None:
        d = ref.dataset
        if d not in self.usable:
            ds = self.datasets[d]
            try:
                self.usable[d] = source_sha256(ds.path) == ds.sha256
            except (FileNotFoundError, SourceError):
                self.usable[d] = False
            if not self.usable[d]:
                log.warning(
                    "%s changed or is gone since the run was planned: the rows of dataset %s "
                    "carry no fields of their prompt lines (meta is null)",
                    ds.path,
                    ds.name,
                )
        return (
            self.reader.read(self.datasets[d].path, ref.offset, ref.length)
            if self.usable[d]
            else None
        )


class _Tokens:
    """The run's tokenizer and its token info, loaded once per export."""

    def __init__(self, plan: RunPlan):
        model = plan.spec.model
        self.tok = chat.load_tokenizer(model)
        self.info = chat.token_info(self.tok, model)


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


class _Text:
    """Decodes the reasoning and content of a batch of records in one tokenizer call."""

    def __init__(self, plan: RunPlan, tokens: _Tokens):
        self.tok, self.info = tokens.tok, tokens.info
        self._decode = _batch_decoder(self.tok)

    def parts(self, recs: list[Record]) -> list[tuple[str, str]]:
        seqs: list[list[int]] = []
        for r in recs:
            ids = np.frombuffer(r.output_ids, "<u4")
            opened = chat.opens_reasoning(r.prompt_ids, self.info)
            r0, r1, c0, c1 = split_parts(r, self.info.think_start_id, opened)
            seqs.append(ids[r0:r1].tolist())
            seqs.append(ids[c0:c1].tolist())
        texts = self._decode(seqs) if seqs else []
        return [(texts[2 * i], texts[2 * i + 1]) for i in range(len(recs))]

    def parts_and_tools(self, recs: list[Record]) -> list[tuple[str, str, str]]:
        """(reasoning, content before any tool-call section, the tool-call section) of each
        record."""
        seqs: list[list[int]] = []
        for r in recs:
            ids = np.frombuffer(r.output_ids, "<u4")
            opened = chat.opens_reasoning(r.prompt_ids, self.info)
            r0, r1, c0, c1 = split_parts(r, self.info.think_start_id, opened)
            tc = r.tool_call_at if r.tool_call_at is not None and c0 <= r.tool_call_at < c1 else c1
            seqs += [ids[r0:r1].tolist(), ids[c0:tc].tolist(), ids[tc:c1].tolist()]
        texts = self._decode(seqs) if seqs else []
        return [(texts[3 * i], texts[3 * i + 1], texts[3 * i + 2]) for i in range(len(recs))]


def _batch_decoder(tok: Any):
    """`tok.batch_decode` without cleanup: a byte-level BPE tokenizer's table of bytes
    (`_byte_table`) on up to TABLE_CORES cores, else straight to the Rust backend of a fast
    tokenizer (same text, several times faster than batch_decode, on every core)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - tokenizers ships with transformers
        Tokenizer = None
    backend = getattr(tok, "_tokenizer", None)
    if Tokenizer is not None and isinstance(backend, Tokenizer):
        return (_byte_table(backend) if _table_first() else None) or (
            lambda seqs: backend.decode_batch(seqs, skip_special_tokens=False)
        )
    return lambda seqs: tok.batch_decode(
        seqs, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )


def _table_first() -> bool:
    """Whether the byte table decodes faster than `decode_batch` here: on up to TABLE_CORES cores,
    or when the tokenizer's own threads are turned off."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "").lower() in ("false", "0", "off", "no"):
        return True
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return cores <= TABLE_CORES


def _byte_values() -> dict[str, int]:
    """The byte each character of a byte-level BPE vocabulary stands for (GPT-2's map)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = [b for b in range(256) if b not in bs]
    return {chr(c): b for b, c in zip(bs + extra, bs + [256 + n for n in range(len(extra))])}


def _byte_table(backend: Any):
    """The decoding of a byte-level BPE tokenizer (its decoder `ByteLevel`) from a table of the
    bytes of each id: the text `decode_batch` gives, about three times faster (43 against 123 ns
    per token, the latter on two cores; docs/benchmarks.md). Checked when built against
    `decode_batch` on every id of the vocabulary in context and on random sequences; None (decode
    with the tokenizer) for another decoder or when the check finds a difference."""
    from tokenizers.decoders import ByteLevel

    if not isinstance(backend.decoder, ByteLevel):
        return None
    byte_of = _byte_values()
    added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
    size = max(backend.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)
    table: list[bytes] = []
    for i in range(size):
        token = added.get(i)
        if token is not None:  # an added token: its text
            table.append(token.encode())
            continue
        token = backend.id_to_token(i) or ""  # a hole in the vocabulary decodes to nothing
        try:
            table.append(bytes(byte_of[c] for c in token))
        except KeyError:  # a character outside the map: the token's own text
            table.append(token.encode())
    get = table.__getitem__

    def decode(seqs: list[list[int]]) -> list[str]:
        try:
            return [b"".join(map(get, s)).decode("utf-8", "replace") for s in seqs]
        except IndexError:  # an id outside the vocabulary (an export forced past the audit)
            return backend.decode_batch(seqs, skip_special_tokens=False)

    rng = np.random.default_rng(0)
    every = rng.permutation(size).tolist()
    probe = [every[k : k + 7] for k in range(0, size, 7)]
    probe += rng.integers(0, size, (500, 40)).tolist()
    same = decode(probe) == backend.decode_batch(probe, skip_special_tokens=False)
    return decode if same else None


def _ids(packed: bytes) -> list[int]:
    return np.frombuffer(packed, "<u4").tolist()


def stop_columns(matched: int | str | None) -> tuple[int | None, str | None]:
    """SGLang's `matched_stop` (a token id or a stop string) as (id, string): one of them set, or
    neither."""
    if isinstance(matched, bool) or matched is None:
        return None, None
    if isinstance(matched, int):
        return matched, None
    return None, str(matched)


# --------------------------------------------------------------------------------------------------
# what is exported: the filters, the reasons a record is not training data, and the account of every
# planned id
# --------------------------------------------------------------------------------------------------
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


def side_file(out_path: Path, what: str, suffix: str) -> Path:
    """A file beside the export, named after it: `.jsonl` dropped (`conversations.jsonl` ->
    `conversations_skipped.jsonl`, `conversations_summary.json`), another extension kept, its dot
    an underscore (`records.parquet` -> `records_parquet_summary.json`): exports of one name in two
    formats keep their own side files."""
    name, ext = out_path.name, out_path.suffix
    stem = name[: len(name) - len(ext)] + ("" if ext == ".jsonl" else ext.replace(".", "_"))
    return out_path.with_name(f"{stem}_{what}{suffix}")


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
        self.checks: _Checks | None = None  # conversations: the round trip of each row
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


def _jsonl_rows(
    recs: list[Record], refs: list[PromptRef], texts: list[tuple[str, str]], meta: _Meta
) -> Iterator[JsonlRecord]:
    for r, ref, (reasoning, content) in zip(recs, refs, texts):
        stop_id, stop_str = stop_columns(r.matched_stop)
        yield JsonlRecord(
            id=r.id,
            dataset=r.dataset,
            sample=ref.sample,
            turn=ref.turn,
            segments=r.segments,
            status=r.status,
            error=r.error,
            prompt_ids=_ids(r.prompt_ids),
            output_ids=_ids(r.output_ids),
            reasoning_end=r.reasoning_end,
            reasoning=reasoning,
            content=content,
            finish_reason=r.finish,
            matched_stop=stop_id,
            matched_stop_str=stop_str,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            meta=meta.of(ref),
        )


def _write_lines(out, objs: Iterator[Any], enc: msgspec.json.Encoder) -> int:
    buf = bytearray()
    n = 0
    for obj in objs:
        enc.encode_into(obj, buf, -1)
        buf += b"\n"
        n += 1
    out.write(buf)
    return n


def _export_jsonl(
    path: Path, plan: RunPlan, out, acc: _Account, tokens: _Tokens, defects: _Defects
) -> int:
    text, enc, n, meta = _Text(plan, tokens), msgspec.json.Encoder(), 0, _Meta(plan)
    for recs, refs in _kept(path, acc, defects):
        n += _write_lines(out, _jsonl_rows(recs, refs, text.parts(recs), meta), enc)
    return n


def loss_mask(
    prompt: bytes, n_output: int, info: chat.TokenInfo, supervise_think_start: bool = True
) -> list[int]:
    """The `tokens` export's loss mask of a prompt (packed ids) followed by `n_output` output ids: 1
    on everything the assistant turn holds after the template's assistant header — a think-start the
    template wrote at the end of the prompt (and the blanks after it), then every output id: the
    reasoning, the think-end, the content, a tool-call section, and the stop token (an output cut by
    max_new_tokens has none: nothing is added) — and 0 on the
    rest of the prompt (system, tools, user turns, earlier turns, the header). This is the span
    SpecForge's parsers supervise (from the end of the assistant header to its end-of-turn token,
    inclusive) with `train_only_last_turn`. `supervise_think_start=False` leaves the template's
    think-start and its blanks out (0): the whole prompt unsupervised, speculators' rule (it masks
    from the end of the rendered generation prompt)."""
    n = len(prompt) >> 2
    head = n
    if supervise_think_start and chat.opens_reasoning(prompt, info):
        head = n - 1
        while id_at(prompt, head) != info.think_start_id:
            head -= 1
    return [0] * head + [1] * (n - head + n_output)


def _export_tokens(
    path: Path, plan: RunPlan, out, acc: _Account, tokens: _Tokens, defects: _Defects
) -> int:
    enc, n = msgspec.json.Encoder(), 0
    think = acc.summary.supervise_think_start is not False
    for recs, refs in _kept(path, acc, defects):
        n += _write_lines(
            out,
            (
                {
                    "id": r.id,
                    "dataset": r.dataset,
                    "sample": ref.sample,
                    "turn": ref.turn,
                    "segments": r.segments,
                    "input_ids": _ids(r.prompt_ids + r.output_ids),
                    "loss_mask": acc.measured(
                        r, loss_mask(r.prompt_ids, r.n_output, tokens.info, think)
                    ),
                }
                for r, ref in zip(recs, refs)
            ),
            enc,
        )
    return n


def has_think_marker(text: str) -> bool:
    """`<think>` or `</think>` written as text, in any case (what SpecForge's strict validation
    refuses)."""
    low = text.lower()
    return "<think>" in low or "</think>" in low


def _text_problem(answer: dict[str, Any]) -> str | None:
    """What makes a decoded answer unfit for a conversation turn, seen on its text."""
    if has_think_marker(answer["content"]) or has_think_marker(answer["reasoning_content"]):
        return "text_think_marker"
    calls = answer.get("tool_calls") or []
    if any("raw" in c for c in calls):
        return "unreadable_tool_call"
    if not answer["content"].strip():
        return "tool_call_only" if calls else "empty_answer"
    return None


def _visible(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message of the history as a trainer's multi-turn rows hold it: its visible
    content, no reasoning."""
    if message.get("role") != "assistant" or "reasoning_content" not in message:
        return message
    return {k: v for k, v in message.items() if k != "reasoning_content"}


class _Chain:
    """The turns of one regenerated conversation read so far: (record, ref, answer or None, why
    not)."""

    def __init__(self) -> None:
        self.turns: list[tuple[Record, PromptRef, dict[str, Any] | None, str | None]] = []
        self.done = -1  # the last turn accounted for (a row ending at it written, or left out)


class _Checks:
    """The conversations export's own round trip: each row rendered with the model's chat template
    as SpecForge renders it (`trainers.RoundTrip`), written per row to the round-trip file; and
    tool-call arguments SpecForge would re-serialise, counted. Rows are checked in batches
    (CHECK_ROWS rows or CHECK_TOKENS ids, whichever comes first: one tokenizer call each, on every
    core), written in row order; `every` > 1 checks one row in `every` (`--check-sample`)."""

    def __init__(self, tokens: _Tokens, reg, out, every: int = 1):
        self.trip = RoundTrip(tokens.tok, reg)
        self.out, self.enc = out, msgspec.json.Encoder()
        self.reformatted = 0
        self.every, self.seen = every, 0
        self.pending: list[tuple[str, int, list, list | None, list[int]]] = []
        self.tokens = 0

    def row(self, row: dict[str, Any], last: Record) -> None:
        reformatted = 0
        for m in row["conversations"]:
            for call in m.get("tool_calls") or ():
                args = call.get("function", {}).get("arguments")
                reformatted += isinstance(args, str) and not trainer_json(args)
        self.reformatted += reformatted
        self.seen += 1
        if (self.seen - 1) % self.every:
            return
        stored = _ids(last.prompt_ids + last.output_ids)
        self.pending.append((row["id"], reformatted, row["conversations"], row["tools"], stored))
        self.tokens += len(stored)
        if len(self.pending) >= CHECK_ROWS or self.tokens >= CHECK_TOKENS:
            self.flush()

    def flush(self) -> None:
        """Check the rows held and write their lines."""
        if not self.pending:
            return
        firsts = self.trip.check_many([(c, t, ids) for _, _, c, t, ids in self.pending])
        buf = bytearray()
        for (row_id, reformatted, *_), at in zip(self.pending, firsts):
            self.enc.encode_into(
                {
                    "id": row_id,
                    "identical": at is None,
                    "first_difference": at,
                    "arguments_reformatted": reformatted,
                },
                buf,
                -1,
            )
            buf += b"\n"
        self.out.write(buf)
        self.pending.clear()
        self.tokens = 0


def _export_conversations(
    path: Path, plan: RunPlan, out, acc: _Account, tokens: _Tokens, defects: _Defects
) -> int:
    text, enc, n = _Text(plan, tokens), msgspec.json.Encoder(), 0
    reader = PromptReader()
    chains: dict[tuple[int, int, int], _Chain] = {}
    checks: _Checks = acc.checks

    def base(r: Record, ref: PromptRef, prompt) -> dict[str, Any]:
        return {
            "id": r.id,
            "status": "success",
            "dataset": r.dataset,
            "sample": ref.sample,
            "turn": ref.turn,
            "segments": r.segments,
        }

    def answer_of(r: Record, parts: tuple[str, str, str]) -> dict[str, Any] | None:
        reasoning, content, section = parts
        if r.status != OK:
            return None
        return answer_message(reasoning, content, parse_tool_calls(section) if section else None)

    def regenerated(r: Record, ref: PromptRef, prompt, why: str | None, answer) -> Iterator[dict]:
        key = (ref.dataset, ref.line, ref.sample)
        chain = chains.setdefault(key, _Chain())
        chain.turns.append((r, ref, answer, why))
        last = ref.turn + 1 >= user_turns(prompt.messages)
        if last:
            del chains[key]
        if not acc.selected(r, ref) or not (
            acc.sel.turns is None
            and last
            or acc.sel.turns is not None
            and ref.turn in acc.sel.turns
        ):
            return
        turns = chain.turns[: ref.turn + 1]
        # a turn is missing from the merged dataset
        if [t[1].turn for t in turns] != list(range(ref.turn + 1)):
            return
        bad = next((t for t in turns if t[3] is not None), None)
        selected = [t for t in turns[chain.done + 1 :] if acc.selected(t[0], t[1])]
        chain.done = ref.turn
        if bad is not None:
            for rec, tref, _, twhy in selected:
                acc.left_out(rec, tref, twhy if twhy is not None else OTHER_TURN)
            return
        acc.exported(len(selected))
        answers = [t[2] for t in turns]
        row = base(r, ref, prompt)
        row["id"] = r.id.rsplit("/t", 1)[0]
        row["turns"] = len(turns)
        row["segments"] = sum(t[0].segments for t in turns)
        row["conversations"] = [*turn_messages(prompt.messages, ref.turn, answers), answers[-1]]
        row["tools"] = prompt.tools or []
        checks.row(row, r)
        acc.measured(r, loss_mask(r.prompt_ids, r.n_output, tokens.info))
        yield row

    def rows(recs: list[Record], parts: list[tuple[str, str, str]]) -> Iterator[dict]:
        for r, p in zip(recs, parts):
            ref = acc.ref(r)
            ds = plan.datasets[ref.dataset]
            if not acc.selected(r, ref) and (
                not ds.regenerate
                or acc.sel.datasets is not None
                and ds.name not in acc.sel.datasets
            ):
                # (a regenerated turn not selected may still be the history of one that is)
                continue
            prompt = reader.read(ds.path, ds.name, ref.line, ref.offset, ref.length)
            why = acc.outcome(r)
            answer = answer_of(r, p) if why is None else None
            if answer is not None:
                why = _text_problem(answer)
                if why is not None and why in acc.include:
                    why = None
                answer = answer if why is None else None
            if ds.regenerate:
                yield from regenerated(
                    r, ref, prompt, why if r.status == OK or why is not None else "failed", answer
                )
                continue
            if why is not None:
                acc.left_out(r, ref, why)
                continue
            acc.exported()
            row = base(r, ref, prompt)
            if r.status != OK:  # --include-failed
                row["status"] = "failed"
                answer = answer_message("", "")
            row["conversations"] = [*(_visible(m) for m in prompt.messages), answer]
            row["tools"] = prompt.tools or []
            if r.status == OK:
                checks.row(row, r)
                acc.measured(r, loss_mask(r.prompt_ids, r.n_output, tokens.info))
            yield row

    with reader:
        for recs in _batches(path, defects):
            n += _write_lines(out, rows(recs, text.parts_and_tools(recs)), enc)
    checks.flush()
    # conversations whose later turns the merged dataset does not hold
    for chain in chains.values():
        for rec, ref, _, why in chain.turns[chain.done + 1 :]:
            if acc.selected(rec, ref):
                acc.left_out(rec, ref, why if why is not None else OTHER_TURN)
    return n


def rows_schema(pa: Any) -> Any:
    """The Arrow schema of the jsonl export's rows, as the parquet export and `to_dataset` store
    them: token ids as uint32 lists, counts as int32/int64, `meta` as JSON text. `pa`: pyarrow."""
    ids_type = pa.list_(pa.uint32())
    return pa.schema(
        [
            ("id", pa.string()),
            ("dataset", pa.string()),
            ("sample", pa.int32()),
            ("turn", pa.int32()),
            ("segments", pa.int32()),
            ("status", pa.string()),
            ("error", pa.string()),
            ("prompt_ids", ids_type),
            ("output_ids", ids_type),
            ("reasoning_end", pa.int32()),
            ("reasoning", pa.string()),
            ("content", pa.string()),
            ("finish_reason", pa.string()),
            ("matched_stop", pa.int64()),
            ("matched_stop_str", pa.string()),
            ("prompt_tokens", pa.int64()),
            ("completion_tokens", pa.int64()),
            ("meta", pa.string()),  # the jsonl export's object, as JSON
        ]
    )


def _export_parquet(
    path: Path, plan: RunPlan, out_path: Path, acc: _Account, tokens: _Tokens, defects: _Defects
) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ExportError(
            "the parquet export needs pyarrow: `pip install pyarrow` (or the toolkit's [parquet] "
            "extra)"
        ) from None
    # what made the records, as the run pinned it: "stub" is synthetic text, not a model's
    engine = b"stub" if plan.synthetic else b"model"
    schema = rows_schema(pa).with_metadata({b"toolkit.engine": engine})

    def id_lists(packed: list[bytes]) -> pa.Array:
        lengths = np.fromiter((len(p) >> 2 for p in packed), np.int32, len(packed))
        offsets = np.zeros(len(packed) + 1, np.int32)
        np.cumsum(lengths, out=offsets[1:])
        values = np.frombuffer(b"".join(packed), "<u4")
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, pa.uint32()))

    text, n, meta = _Text(plan, tokens), 0, _Meta(plan)
    as_json = msgspec.json.Encoder().encode
    pending: list[Record] = []
    pending_refs: list[PromptRef] = []
    pending_text: list[tuple[str, str]] = []

    def flush(writer) -> None:
        if not pending:
            return
        cols = [
            pa.array([r.id for r in pending], pa.string()),
            pa.array([r.dataset for r in pending], pa.string()),
            pa.array([ref.sample for ref in pending_refs], pa.int32()),
            pa.array([ref.turn for ref in pending_refs], pa.int32()),
            pa.array([r.segments for r in pending], pa.int32()),
            pa.array([r.status for r in pending], pa.string()),
            pa.array([r.error for r in pending], pa.string()),
            id_lists([r.prompt_ids for r in pending]),
            id_lists([r.output_ids for r in pending]),
            pa.array([r.reasoning_end for r in pending], pa.int32()),
            pa.array([t[0] for t in pending_text], pa.string()),
            pa.array([t[1] for t in pending_text], pa.string()),
            pa.array([r.finish for r in pending], pa.string()),
            pa.array([stop_columns(r.matched_stop)[0] for r in pending], pa.int64()),
            pa.array([stop_columns(r.matched_stop)[1] for r in pending], pa.string()),
            pa.array([r.prompt_tokens for r in pending], pa.int64()),
            pa.array([r.completion_tokens for r in pending], pa.int64()),
            pa.array(
                [
                    None if (m := meta.of(ref)) is None else as_json(m).decode()
                    for ref in pending_refs
                ],
                pa.string(),
            ),
        ]
        writer.write_table(pa.Table.from_arrays(cols, schema=schema))
        pending.clear()
        pending_refs.clear()
        pending_text.clear()

    with pq.ParquetWriter(str(out_path), schema, compression="zstd") as writer:
        for recs, refs in _kept(path, acc, defects):
            pending.extend(recs)
            pending_refs.extend(refs)
            pending_text.extend(text.parts(recs))
            n += len(recs)
            if len(pending) >= PARQUET_ROWS:
                flush(writer)
        flush(writer)
    return n


_TEXT_WRITERS = {
    "jsonl": _export_jsonl,
    "tokens": _export_tokens,
    "conversations": _export_conversations,
}
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


def default_output(run_dir: str | os.PathLike, fmt: str, trainer: str = "specforge") -> Path:
    """Where an export goes when no output is given: RUN/export/records.jsonl, records.parquet,
    tokens.jsonl (for SpecForge; tokens_speculators.jsonl for speculators), conversations.jsonl."""
    default = RunDir(run_dir).export_file(fmt)
    return default.with_name(TRAINERS[trainer].output) if fmt == "tokens" else default


# the formats an output's extension holds, the one written without --format first
_JSON_LINES = ("tokens", "jsonl", "conversations")
EXTENSIONS = {".jsonl": _JSON_LINES, ".json": _JSON_LINES, ".parquet": ("parquet",)}


def output_format(output: str | os.PathLike | None, fmt: str | None) -> str:
    """The format an export writes: `fmt`; when None, the output's extension says it (`.parquet`:
    parquet; `.jsonl`, `.json`, no extension, a folder or no output: `DEFAULT_FORMAT`). An output
    whose extension is not one of `EXTENSIONS`, or one that `fmt` does not write, is refused
    (ExportError) before anything is written."""
    text = None if output is None else os.fspath(output)
    if text is None or text.endswith(("/", os.sep)) or Path(text).is_dir():
        return fmt or DEFAULT_FORMAT
    ext = Path(text).suffix
    if not ext:
        return fmt or DEFAULT_FORMAT
    holds = EXTENSIONS.get(ext.lower())
    said = f"--format {fmt}" if fmt else "no --format"
    if holds is None:
        raise ExportError(
            f"{text}: {said} and an output named {ext}: an export is written as .jsonl or .json "
            "(tokens, jsonl, conversations) or .parquet (parquet), uncompressed; name it so"
        )
    if fmt is None:
        return holds[0]
    if fmt not in holds:
        named = " or ".join(e for e, formats in EXTENSIONS.items() if fmt in formats)
        raise ExportError(
            f"{text}: --format {fmt} writes {_kind(fmt)}, an output named {ext} holds "
            f"{_kind(holds[0])}: name it {named}, or drop --format to write {holds[0]}; nothing "
            "written"
        )
    return fmt


def _kind(fmt: str) -> str:
    return "parquet" if fmt == "parquet" else "JSON lines"


def output_path(
    run_dir: str | os.PathLike,
    fmt: str,
    output: str | os.PathLike | None,
    trainer: str = "specforge",
) -> Path:
    """The file an export writes: `output`; the default name inside it when it is a folder or ends
    with a slash (the folder made when its parent exists); `default_output` when None."""
    default = default_output(run_dir, fmt, trainer)
    if output is None:
        return default
    text = os.fspath(output)
    path = Path(text)
    if text.endswith(("/", os.sep)) or path.is_dir():
        return path / default.name
    return path


def audit_state(rd: RunDir) -> tuple[str, str]:
    """("passed" | "failed" | "none", what failed): the verdict of the run's last audit
    (merged/audit.json)."""
    try:
        report = msgspec.json.decode(rd.audit_json.read_bytes())
    except (OSError, msgspec.DecodeError):
        return "none", ""
    if not isinstance(report, dict) or "passed" not in report:
        return "none", ""
    if report["passed"]:
        return "passed", ""
    bad = [
        c.get("name", "?")
        for c in report.get("checks", [])
        if isinstance(c, dict) and not c.get("passed", True)
    ]
    return "failed", ", ".join(bad)


def short_merge(rd: RunDir, manifest: MergeManifest) -> str | None:
    """What the merged dataset lacks of the plan (records missing, damaged frames), or None when it
    is complete."""
    if manifest.complete:
        return None
    return (
        f"{rd.merged_file} holds {manifest.records} of {manifest.planned} planned records "
        f"({manifest.missing} missing, {len(manifest.corrupt)} damaged frames): nothing exported. "
        f"`toolkit status {rd.shown}` names what is damaged and the command that repairs it; "
        f"`toolkit merge {rd.shown} --allow-incomplete` to export what is there"
    )


def stale_merge(rd: RunDir, plan: RunPlan, manifest: MergeManifest) -> str | None:
    """What the run gained or changed since its merged dataset was made (grown by new prompts, a
    shard written to or asked to generate records again since), or None when the merge is of the run
    as it is. Reads no record."""
    if manifest.planned != plan.total or len(manifest.shards) != len(plan.shards):
        return (
            f"the run plans {plan.total} records in {len(plan.shards)} shards, the merge had "
            f"{manifest.planned} in {len(manifest.shards)} (the job grew)"
        )
    changed = []
    for m in manifest.shards:
        path = rd.shard_file(m.index)
        size = path.stat().st_size if path.exists() else 0
        if size != m.bytes or shard_state(rd, m.index).state is ShardState.RETRY:
            changed.append(m.index)
    if changed:
        return (
            f"shard{'s' * (len(changed) != 1)} {ranges(changed, sep=',')} changed since "
            "(records written, or asked for again)"
        )
    return None


def export_run(
    run_dir: str | os.PathLike,
    fmt: str | None = None,
    output: str | os.PathLike | None = None,
    *,
    include_failed: bool = False,
    force: bool = False,
    select: Selection | None = None,
    trainer: str = "specforge",
    supervise_think_start: bool | None = None,
    check_sample: int | None = None,
) -> ExportSummary:
    """Write the merged records of a run that `select` selects to `output` in `fmt` (None: as the
    output's extension says, `output_format`; a mismatch is refused); return the
    account of every selected planned record (`ExportSummary`), also written beside the output as
    `<name>_summary.json`, with the records left out and why in `<name>_skipped.jsonl`.

    Records that are not training data (`quality.SKIP_REASONS`) are left out of `tokens` and
    `conversations` unless `select.include` names their reason, except outputs cut by
    max_new_tokens, which `tokens` keeps; `jsonl` and `parquet` hold every ok record unless
    `select.include` is given; `select.exclude` leaves out the records of its reasons
    (`kept_reasons`). Without `output`, the file is `default_output(run_dir,
    fmt, trainer)` (its folder is created); an `output` that is a folder (or ends with a slash) gets
    that name inside it. `tokens` follows `trainer`'s loss-mask rule (`trainers.TRAINERS`) unless
    `supervise_think_start` says otherwise. `conversations` also writes, beside the output, the
    round trip of each row through the chat template as SpecForge renders it
    (`<name>_roundtrip.jsonl`; counted in the summary) and the SpecForge registration of the model's
    template (`<name>_specforge_template.py`); `tokens` writes the trainer's config with the length
    that keeps every row whole (`<name>_specforge.yaml`, `<name>_prepare_data.sh`). A failed or
    missing audit is said in `summary.warnings`. The files appear under their names only when
    complete (written to temporary names, then renamed). Ok records that fail the audit's record
    checks refuse the export (ExportError, nothing written) unless `force`, which warns about them.
    `check_sample` N: the conversations round trip checks about N rows, one every planned/N rows
    (None: every row).
    """
    if fmt is not None and fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    fmt = output_format(output, fmt)
    if trainer not in TRAINERS:
        raise ExportError(f"unknown trainer {trainer!r}; choose one of {', '.join(TRAINERS)}")
    select = select or Selection()
    if check_sample is not None and (check_sample < 1 or fmt != "conversations"):
        raise ExportError(
            f"--check-sample {check_sample}: give a number of rows, 1 or more, to a "
            "conversations export (the only one with a round trip)"
        )
    if select.max_length is not None and select.max_length < 1:
        raise ExportError(f"--max-length {select.max_length}: give a number of tokens, 1 or more")
    if select.mode is not None and select.mode not in MODES:
        raise ExportError(
            f"unknown reasoning mode {select.mode!r}; choose one of {', '.join(MODES)}"
        )
    for verb, given in (("include", select.include), ("exclude", select.exclude)):
        unknown = sorted((given or frozenset()) - set(EXPORT_REASONS))
        if unknown:
            raise ExportError(
                f"unknown reason {', '.join(unknown)} to {verb}; choose among "
                f"{', '.join(EXPORT_REASONS)}"
            )
    both = sorted((select.include or frozenset()) & (select.exclude or frozenset()))
    if both:
        raise ExportError(
            f"reason {', '.join(both)} both included and excluded: give it to one of --include "
            "and --exclude"
        )
    include = kept_reasons(fmt, select)
    run = Run.open(run_dir, JobSpec)  # read-only: only the export's own files are written
    rd, plan = run.rd, run.plan
    manifest = load_manifest(rd)  # a merged dataset must exist
    path = rd.merged_file
    if not path.exists():
        raise ExportError(f"{path} is missing: run `toolkit merge {rd.root}` again")
    size = path.stat().st_size
    if size != manifest.bytes:
        raise ExportError(
            f"{path} has {size} bytes, its manifest says {manifest.bytes}: it changed after the "
            f"merge; run `toolkit merge {rd.root}` again"
        )
    try:
        head = read_header(path)
    except CorruptShard as e:
        raise _damaged(rd, e) from None
    if head != (plan.fingerprint, MERGED):
        raise ExportError(
            f"{path} is not the merged dataset of run {plan.fingerprint}; run `toolkit merge "
            f"{rd.root}` again"
        )
    short = short_merge(rd, manifest)
    if short and not manifest.allow_incomplete:
        raise ExportError(short)
    stale = stale_merge(rd, plan, manifest)
    if stale:
        raise ExportError(
            f"{path} is older than the run: {stale}; nothing exported. Run `toolkit merge "
            f"{rd.root}` once the run is complete (`--allow-incomplete` to merge what is there), "
            "then export"
        )
    out_path = output_path(run_dir, fmt, output, trainer)
    if output is None or (
        os.fspath(output).endswith(("/", os.sep)) and out_path.parent.parent.is_dir()
    ):
        out_path.parent.mkdir(exist_ok=True)
    # pairs records with their source messages: the files must be those planned
    if fmt == "conversations":
        try:
            check_plan_inputs(plan)
        except InputError as e:
            raise ExportError(
                f"{e}; the conversations export would pair records with other messages than they "
                "were generated from"
            ) from None
    if out_path.is_dir():
        raise ExportError(f"cannot write {out_path}: it is a folder; give another file name")
    if out_path.parent and not out_path.parent.is_dir():
        raise ExportError(
            f"cannot write {out_path}: folder {out_path.parent} does not exist; create it first"
        )
    known = {d.name for d in plan.datasets}
    if select.datasets is not None and not select.datasets <= known:
        raise ExportError(
            f"no dataset {', '.join(sorted(select.datasets - known))} in run {rd.root}; its "
            f"datasets: {', '.join(d.name for d in plan.datasets)}"
        )
    tokens = _Tokens(plan)
    found = _Defects(plan, tokens)
    skipped_path, summary_path = (
        side_file(out_path, "skipped", ".jsonl"),
        side_file(out_path, "summary", ".json"),
    )
    summary = ExportSummary(format=fmt, output=str(out_path), skipped_file=str(skipped_path))
    finals = [out_path, skipped_path, summary_path]
    if plan.synthetic:
        summary.engine = "stub"
        summary.warnings.append(STUB_EXPORT)
    if fmt == "conversations" and "truncated" in include:
        summary.warnings.append(CUT_CHAT_ROWS)
    summary.audit, failed_checks = audit_state(rd)
    if short:  # merged with --allow-incomplete: exported, and said
        summary.warnings.append(
            f"the merged dataset holds {manifest.records} of {manifest.planned} planned records "
            "(merged with --allow-incomplete): the export lacks the others"
        )
    if summary.audit == "failed":
        summary.warnings.append(
            f"the audit of run {rd.root} failed ({failed_checks}): see {rd.audit_json} and "
            f"`toolkit audit {rd.root}` before training on this export"
        )
    elif summary.audit == "none":
        summary.warnings.append(
            f"run {rd.root} has no audit: run `toolkit audit {rd.root}` before training on it"
        )
    if fmt == "tokens":
        summary.trainer = trainer
        config_path = side_file(out_path, *config_name(trainer))
        finals.append(config_path)
        summary.supervise_think_start = (
            TRAINERS[trainer].supervise_think_start
            if supervise_think_start is None
            else supervise_think_start
        )
    reg = None
    if fmt == "conversations":
        info = tokens.info
        stops = [tokens.tok.convert_ids_to_tokens(i) for i in info.eos_ids]
        think = tokens.tok.convert_ids_to_tokens(info.think_start_id)
        try:
            reg = registration(
                tokens.tok,
                think,
                [s for s in stops if isinstance(s, str)],
                name=plan.spec.name,
                think_end=tokens.tok.convert_ids_to_tokens(info.think_end_id),
                kwargs=dict(plan.spec.model.chat_template_kwargs),
            )
        except Exception as e:  # noqa: BLE001 - a template that refuses the probe conversation
            reg = Registration(
                name=plan.spec.name,
                assistant_header="",
                end_of_turn_token=None,
                parser_type="thinking",
                enable_thinking=True,
            )
            summary.warnings.append(
                f"the chat template refuses a probe conversation ({type(e).__name__}: {e}): no "
                "SpecForge registration could be read from it; the round trip assumes its "
                "thinking parser"
            )
        trip_path = side_file(out_path, "roundtrip", ".jsonl")
        reg_path = side_file(out_path, "specforge_template", ".py")
        summary.roundtrip_file, summary.registration_file = str(trip_path), str(reg_path)
        finals += [trip_path, reg_path]
        summary.warnings += builtin_problems(reg, writes_default_system(tokens.tok))
    tmps = [p.with_name(f".{p.name}.{os.getpid()}.tmp") for p in finals]
    tmp, skipped_tmp, summary_tmp = tmps[:3]
    try:
        with open(skipped_tmp, "wb") as skipped_out:
            acc = _Account(
                plan, run.prompts(), select, include, include_failed, tokens, summary, skipped_out
            )
            if fmt == "parquet":
                summary.rows = _export_parquet(path, plan, tmp, acc, tokens, found)
            elif fmt == "conversations":
                stub_note = f"# {STUB_EXPORT}\n" if plan.synthetic else ""
                tmps[4].write_text(stub_note + reg.python())
                with open(tmp, "wb") as out, open(tmps[3], "wb") as trip_out:
                    every = 1 if check_sample is None else -(-summary.planned // check_sample)
                    summary.roundtrip_sample = check_sample
                    acc.checks = _Checks(tokens, reg, trip_out, max(every, 1))
                    summary.rows = _export_conversations(path, plan, out, acc, tokens, found)
            else:
                with open(tmp, "wb") as out:
                    summary.rows = _TEXT_WRITERS[fmt](path, plan, out, acc, tokens, found)
            acc.finish()
            if fmt in TRAINING_FORMATS:
                summary.lengths = acc.lengths.figures()
            if fmt == "tokens":
                figs = summary.lengths
                length = select.max_length or figs.needed or figs.default_length
                write_config(tmps[3], trainer, plan.spec.model.path, out_path, length)
                summary.trainer_config = str(finals[3])
            if fmt == "conversations":
                summary.roundtrip_rows, summary.roundtrip_identical = (
                    acc.checks.trip.rows,
                    acc.checks.trip.identical,
                )
                summary.arguments_reformatted = acc.checks.reformatted
        if found.count and not force:
            raise FailedError(
                f"{found.summary()}; nothing exported. `toolkit audit {rd.root}` names them: "
                f"generate them again (`toolkit retry {rd.root} --ids FILE`), or export them "
                "anyway with --force"
            )
        if found.count:
            log.warning("exporting them anyway (--force): %s", found.summary())
        summary_tmp.write_bytes(msgspec.json.format(msgspec.json.encode(summary)) + b"\n")
        for t, final in zip(tmps, finals):
            os.replace(t, final)
    except CorruptShard as e:
        _unlink(tmps)
        raise _damaged(rd, e) from None
    except OSError as e:  # a full disk, say
        _unlink(tmps)
        raise FailedError(io_problem(e, out_path, "export again")) from None
    except BaseException:
        _unlink(tmps)
        raise
    return summary


def _unlink(paths: list[Path]) -> None:
    for p in paths:
        p.unlink(missing_ok=True)


def _damaged(rd: RunDir, e: CorruptShard) -> ExportError:
    return ExportError(
        f"{rd.merged_file} is damaged ({e.why} at byte {e.offset}): nothing exported; run "
        f"`toolkit merge {rd.root}` again"
    )
